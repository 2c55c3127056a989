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


class _FakeLibc:
    def __init__(self, answer: int):
        self.answer, self.calls = answer, []

    def mallopt(self, parameter: int, value: int) -> int:
        self.calls.append((parameter, value))
        return self.answer


def test_keep_freed_heap_memory_sets_both_thresholds_and_reports_a_refusal():
    from recipes.cpu import keep_freed_heap_memory

    libc = _FakeLibc(answer=1)
    assert keep_freed_heap_memory(libc)
    assert libc.calls == [(-3, 32 << 20), (-1, (1 << 31) - 1)]  # M_MMAP_THRESHOLD, M_TRIM_THRESHOLD
    assert not keep_freed_heap_memory(_FakeLibc(answer=0))  # glibc refused the value
    assert not keep_freed_heap_memory(object())  # no mallopt: not glibc


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads Linux's VmRSS")
def test_a_freed_large_block_still_goes_back_to_the_system():
    """Blocks above the shim's 32 MiB threshold are still unmapped when freed (the peak
    resident set can fall after a reset, as the memory test above relies on)."""
    from recipes.cpu import apply_cpu_shims, keep_freed_heap_memory

    assert apply_cpu_shims() and keep_freed_heap_memory()
    resident = _resident_bytes()
    block = torch.ones(64 << 18)  # 64 MiB, touched
    assert _resident_bytes() - resident > 48 << 20
    del block
    assert _resident_bytes() - resident < 16 << 20


def _resident_bytes() -> int:
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith("VmRSS:")).split()[1]) * 1024
