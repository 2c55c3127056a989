"""Shims that let TorchTitan 0.2.2 train on CPU (gloo), without editing its files.

Each is applied only when no CUDA device is present, and each answers one gap:

1. TorchTitan picks its device as "cuda" when no accelerator is found; we point the
   modules that cached that choice at "cpu" and at a small stand-in for ``torch.cuda``.
   Its memory statistics are the process's peak resident set (Linux's ``VmHWM``, reset
   where TorchTitan resets its peaks) against the machine's physical memory, so the
   ``memory:`` of each step's line is this rank's real peak, not an allocator's (and
   not the ``-0.00GiB(-100.00%)`` that empty statistics print).
2. ``torch.histc`` has no CPU kernel for integer tensors; TorchTitan's router calls it on
   expert indices. We count in fp32 and cast back (exact for counts below 2**24).
3. gloo has no PREMUL_SUM reduce-scatter, which FSDP2 uses to pre-scale gradients; the
   shim makes FSDP divide after a plain SUM instead (same result up to rounding order).
4. TorchTitan's MoE uses grouped GEMMs whose padding kernel is Triton-only; on CPU its
   own for-loop expert path is selected (the baseline for parity runs). That path takes
   ``w[e]`` for each expert, and the backward of E such selections builds E full-size
   zero gradients (85 s a step for the debug Qwen3-MoE on 2 cores); the shim runs the
   same per-expert matmuls on ``unbind``-ed weights instead: same values, one gradient.
5. glibc's malloc hands every freed block above its mmap threshold back to the system,
   and the next allocation of that size faults its pages in again, zeroed. A training
   step frees and allocates the same tensors every step, and the debug Qwen3-MoE's step
   spent about 40% of its time so. The shim puts blocks up to 32 MiB (the most glibc's
   own adaptive threshold reaches) in the heap and keeps freed heap memory (the mmap
   threshold alone was no faster, the trim threshold alone slower). Values are
   unchanged; a process's peak resident set grows by what its heap keeps (about 0.5 GiB
   in the debug Qwen3-MoE runs).
"""

from __future__ import annotations

import ctypes
import importlib
import os
import types

import torch

_applied = False


_STATUS, _CLEAR_REFS = "/proc/self/status", "/proc/self/clear_refs"


def _peak_resident_bytes() -> int | None:
    """This process's peak resident set since start or the last reset (None off Linux)."""
    try:
        with open(_STATUS) as f:
            line = next(line for line in f if line.startswith("VmHWM:"))
    except (OSError, StopIteration):
        return None
    return int(line.split()[1]) * 1024  # "VmHWM:  123456 kB"


def _physical_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


class _CPUDeviceModule(types.SimpleNamespace):
    """The subset of ``torch.cuda`` that TorchTitan calls, answered for the CPU."""

    @staticmethod
    def get_device_name(device=None) -> str:
        return "cpu"

    @staticmethod
    def current_device() -> int:
        return 0

    @staticmethod
    def get_device_properties(device=None):
        return types.SimpleNamespace(total_memory=_physical_memory_bytes(), name="cpu")

    @staticmethod
    def memory_stats(device=None) -> dict:
        peak = _peak_resident_bytes()
        return {} if peak is None else {"active_bytes.all.peak": peak, "reserved_bytes.all.peak": peak}

    @staticmethod
    def set_device(device) -> None:
        pass

    @staticmethod
    def synchronize(device=None) -> None:
        pass

    @staticmethod
    def reset_peak_memory_stats(device=None) -> None:
        try:
            with open(_CLEAR_REFS, "w") as f:
                f.write("5")  # resets VmHWM to the current resident set
        except OSError:
            pass  # not Linux, or not allowed here: the peak then counts from the start

    @staticmethod
    def empty_cache() -> None:
        pass

    @staticmethod
    def manual_seed(seed: int) -> None:
        torch.manual_seed(seed)

    @staticmethod
    def is_available() -> bool:
        return True


_DEVICE_CACHING_MODULES = (
    "torchtitan.tools.utils",
    "torchtitan.components.metrics",
    "torchtitan.distributed.parallel_dims",
    "torchtitan.distributed.utils",
    "torchtitan.tools.profiling",
)


def _histc_any_dtype(histc):
    def wrapper(input, *args, **kwargs):
        if input.is_floating_point() or input.is_cuda:
            return histc(input, *args, **kwargs)
        return histc(input.float(), *args, **kwargs).to(input.dtype)

    return wrapper


def _fsdp_without_premul_sum() -> None:
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives

    original = _fsdp_collectives._get_gradient_divide_factors

    def get_factors(*args, **kwargs):
        kwargs["force_sum_reduction_for_comms"] = True
        return original(*args[:5], **kwargs)

    _fsdp_collectives._get_gradient_divide_factors = get_factors


def _experts_for_loop(w1, w2, w3, x, num_tokens_per_expert):
    """TorchTitan's for-loop expert computation (rows grouped by expert, trailing
    padding rows answered with zeros) over unbind-ed weights."""
    counts = num_tokens_per_expert.tolist()
    routed = sum(counts)
    outputs = [
        (torch.nn.functional.silu(rows @ a.t()) * (rows @ c.t())) @ b.t()
        for rows, a, b, c in zip(torch.split(x[:routed], counts), w1.unbind(0), w2.unbind(0), w3.unbind(0))
    ]
    padding = x.new_zeros(x.shape[0] - routed, w2.shape[1])
    return torch.cat([*outputs, padding])


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt parameters (glibc's malloc.h)
_MMAP_THRESHOLD = 32 << 20  # larger blocks still go back to the system when freed
_TRIM_THRESHOLD = (1 << 31) - 1  # mallopt takes an int: its largest


def keep_freed_heap_memory(libc=None) -> bool:
    """Raise glibc's mmap threshold to 32 MiB and its trim threshold to its maximum
    (shim 5); True when the C library took both (False off glibc: nothing changes)."""
    if libc is None:
        try:
            libc = ctypes.CDLL(None)
        except OSError:
            return False
    mallopt = getattr(libc, "mallopt", None)
    if mallopt is None:
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD))


def apply_cpu_shims() -> bool:
    """Apply the shims if there is no CUDA device. Returns True when they are active."""
    global _applied
    if torch.cuda.is_available():
        return False
    if _applied:
        return True
    device_module = _CPUDeviceModule()
    for name in _DEVICE_CACHING_MODULES:
        module = importlib.import_module(name)
        if hasattr(module, "device_type"):
            module.device_type = "cpu"
        if hasattr(module, "device_module"):
            module.device_module = device_module
    torch.histc = _histc_any_dtype(torch.histc)
    _fsdp_without_premul_sum()
    keep_freed_heap_memory()

    from torchtitan.models.moe import moe as titan_moe

    original_init = titan_moe.GroupedExperts.__init__

    def experts_init(self, dim, hidden_dim, num_experts, use_grouped_mm):
        original_init(self, dim, hidden_dim, num_experts, use_grouped_mm=False)

    titan_moe.GroupedExperts.__init__ = experts_init
    titan_moe._run_experts_for_loop = _experts_for_loop
    _applied = True
    return True
