"""recipes.cpu: TorchTitan's device module answered for the CPU."""

import os

import pytest
import torch

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU shims apply only without CUDA")


def test_step_memory_is_the_peak_resident_set_and_resets():
    from torchtitan.components.metrics import build_device_memory_monitor

    from recipes.cpu import apply_cpu_shims

    assert apply_cpu_shims()
    monitor = build_device_memory_monitor()
    before = monitor.get_peak_stats()
    assert before.max_reserved_gib > 0.05 and 0 < before.max_reserved_pct < 100  # was -0.00 GiB (-100 %)
    block = torch.ones(256 << 18)  # 256 MiB, touched
    grown = monitor.get_peak_stats().max_reserved_gib
    assert grown - before.max_reserved_gib > 0.2
    del block
    if not os.access("/proc/self/clear_refs", os.W_OK):
        pytest.skip("this system does not let a process reset its peak resident set")
    monitor.reset_peak_stats()
    assert monitor.get_peak_stats().max_reserved_gib < grown - 0.2  # the peak counts from the reset
