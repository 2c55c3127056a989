"""How the launchers start their Triton kernels, kept cheap on the host: a layer call
issues a dozen launches or more, and at a few thousand tokens the host's time to issue
them is as long as the device's time to run them (``scripts/host_time.py``).

``launcher(kernel)`` (a ``CachedLaunch``) is launched as the ``@triton.jit`` kernel is,
``launcher(kernel)[grid](*args, **constexprs)``. Its first launch of each specialization goes
through Triton's JIT (compile or load, then launch) and keeps the compiled kernel; later
launches with the same specialization bind the arguments with the JIT's own binder
(which computes the specialization: dtypes, 16-byte alignment, integers equal to 1 or
divisible by 16, constexpr values) and call the compiled kernel's launcher directly,
without the rest of the JIT's dispatch (its cache-key string, launch metadata, empty
launch hooks, global checks; benchmarks/RESULTS.md has the measured costs).

The direct launch uses Triton internals whose layout is checked only for the versions
in ``DIRECT_LAUNCH_TRITON``; on others, under the interpreter (``TRITON_INTERPRET=1``)
and while a launch hook is set (profilers), every launch goes through the JIT. It also
calls the compiled kernel's native launch function itself, without that launcher
object's per-call closures. The global scratch (where kernels build their tensor
descriptors) is one buffer per device and stream, kept and grown as needed, not an
allocation per launch: launches on one stream run one after the other, so none can
overwrite another's descriptors (a kernel launched to overlap the one before, with
programmatic dependent launch, or one captured into a CUDA graph, whose replays may run
beside other work, gets its own, as the profile scratch always does).

Host-side sizes use ``cdiv`` and ``next_power_of_2`` here, plain integer functions:
Triton 3.6's are constexpr functions, each host call a few microseconds of argument
unwrapping.
"""

from __future__ import annotations

import functools

import torch
import triton
from triton import knobs
from triton.runtime import _allocation

DIRECT_LAUNCH_TRITON = ("3.6.",)
"""Triton versions (prefixes) whose JIT internals the direct launch was checked against."""


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for positive ``b`` (plain integers: in some Triton versions
    ``triton.cdiv`` called from the host goes through constexpr unwrapping)."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of 2 at least ``n`` (1 for ``n <= 1``), as ``triton.next_power_of_2``."""
    return 1 << max(0, n - 1).bit_length()


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """Multiprocessors of the CUDA ``device`` (asked once per device)."""
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


_LAUNCHERS: dict[int, "CachedLaunch"] = {}
"""By the kernel object's id (a JIT kernel's hash is its source's digest, taken under a
lock on every lookup); each value holds its kernel, so no id is reused while listed."""


def _direct_launch_supported(fn, version: str = triton.__version__) -> bool:
    """Whether ``fn`` is a compiled (not interpreted) JIT kernel of a checked Triton."""
    return hasattr(fn, "device_caches") and version.startswith(DIRECT_LAUNCH_TRITON)


def launcher(fn) -> "CachedLaunch":
    """The ``CachedLaunch`` of the kernel ``fn`` (one per kernel object, made at its first
    launch; looked up per launch, so a kernel swapped in a module is the one launched)."""
    cached = _LAUNCHERS.get(id(fn))
    if cached is None:
        cached = _LAUNCHERS[id(fn)] = CachedLaunch(fn)
    return cached


class CachedLaunch:
    """A Triton kernel launched as ``self[grid](*args, **kwargs)``, the JIT's dispatch
    done once per specialization (see the module docstring)."""

    def __init__(self, fn, *, direct: bool | None = None):
        self.fn = fn
        self.direct = _direct_launch_supported(fn) if direct is None else direct
        self._compiled: dict[tuple, object] = {}

    def __getitem__(self, grid: tuple[int, ...]):
        return functools.partial(self._launch, grid)

    def _launch(self, grid: tuple[int, ...], *args, **kwargs):
        if not self.direct or _launch_hooks_set():
            return self.fn[grid](*args, **kwargs)
        device, stream = _device_and_stream()
        caches = self.fn.device_caches.get(device)  # (kernels, keys, target, backend, binder), made at the first launch
        if caches is None:
            return self.fn[grid](*args, **kwargs)
        bound, specialization, options = caches[4](*args, **kwargs)
        try:
            key = _key(device, specialization, options)
            kernel = self._compiled.get(key)
        except TypeError:  # an unhashable specialization value: leave it to the JIT
            return self.fn[grid](*args, **kwargs)
        if kernel is None:
            kernel = self.fn[grid](*args, **kwargs)
            self._compiled[key] = direct_call(kernel.result() if hasattr(kernel, "result") else kernel)
            return kernel
        return kernel(grid, device, stream, bound.values())

    def stages(self, grid: tuple[int, ...], *args, **kwargs) -> dict[str, object] | None:
        """The steps of a direct launch of these arguments, each a callable of no
        arguments, to time one by one (``scripts/host_time.py --launch-costs``): the
        binder, the key's lookup, the native launch (its scratch included), the native
        launch given the tensors' addresses as integers (Triton's C launcher then skips a
        driver query per tensor), the whole direct launch and the JIT's own launch. None
        unless these arguments' kernel is launched directly (compiled, on a checked
        Triton, no launch hook)."""
        if not self.direct or _launch_hooks_set():
            return None
        device, stream = _device_and_stream()
        caches = self.fn.device_caches.get(device)
        if caches is None:
            return None
        binder = caches[4]
        bound, specialization, options = binder(*args, **kwargs)
        kernel = self._compiled.get(_key(device, specialization, options))
        if kernel is None:
            return None
        values = list(bound.values())
        addresses = [v.data_ptr() if isinstance(v, torch.Tensor) else v for v in values]
        return {
            "bind": lambda: binder(*args, **kwargs),
            "key": lambda: self._compiled.get(_key(device, specialization, options)),
            "native": lambda: kernel(grid, device, stream, values),
            "native, int addresses": lambda: kernel(grid, device, stream, addresses),
            "direct": lambda: self._launch(grid, *args, **kwargs),
            "jit": lambda: self.fn[grid](*args, **kwargs),
        }


def _key(device: int, specialization: list, options: dict) -> tuple:
    """The compiled kernel's key: the device and the binder's specialization and options."""
    return device, tuple(specialization), tuple(options.items())


class DirectCall:
    """A compiled kernel started through its launcher's native launch function: what
    Triton 3.6's ``CudaLauncher.__call__`` does, its settings read once."""

    def __init__(self, kernel):
        run = kernel.run
        self.kernel = kernel
        self._launch = run.launch
        self._function, self._cooperative, self._pdl = kernel.function, run.launch_cooperative_grid, run.launch_pdl
        self._metadata = (kernel.packed_metadata, None, None, None)  # metadata, launch metadata, enter/exit hooks
        scratch = ((run.global_scratch_size, run.global_scratch_align, _allocation._allocator),
                   (run.profile_scratch_size, run.profile_scratch_align, _allocation._profile_allocator))
        self._scratch = scratch if any(size for size, _, _ in scratch) else None
        self._ctas = run.num_ctas

    def _allocate(self, programs: int, device: int, stream: int) -> list:
        """(global scratch, profile scratch): ``size`` bytes per program, None where 0."""
        (size, align, allocator), (profile_size, profile_align, profile_allocator) = self._scratch
        ctas = programs * self._ctas
        if size == 0:
            scratch = None
        elif self._pdl or _capturing():
            scratch = allocator.get()(ctas * size, align, stream)
        else:
            scratch = _stream_scratch(ctas * size, align, device, stream)
        return [scratch, None if profile_size == 0 else profile_allocator.get()(ctas * profile_size, profile_align, stream)]

    def __call__(self, grid: tuple[int, ...], device: int, stream: int, args) -> None:
        grid_x = grid[0]
        grid_y = grid[1] if len(grid) > 1 else 1
        grid_z = grid[2] if len(grid) > 2 else 1
        scratch = _NO_SCRATCH if self._scratch is None else self._allocate(grid_x * grid_y * grid_z, device, stream)
        self._launch(grid_x, grid_y, grid_z, stream, self._function, self._cooperative, self._pdl, *scratch,
                     *self._metadata, *args)


def _capturing() -> bool:
    """Whether the current stream is being captured into a CUDA graph."""
    return torch._C._cuda_isCurrentStreamCapturing()


_STREAM_SCRATCH: dict[tuple[int, int], tuple[int, int, object]] = {}
"""(bytes, alignment, buffer) of the global scratch of each (device, stream)."""


def _stream_scratch(nbytes: int, align: int, device: int, stream: int):
    """The global scratch of ``stream`` on ``device``: the one held, or a larger one
    allocated (with the allocator set, ``triton.set_allocator``) and held from now on."""
    held = _STREAM_SCRATCH.get((device, stream))
    if held is None or held[0] < nbytes or held[1] % align:
        held = _STREAM_SCRATCH[(device, stream)] = (nbytes, align, _allocation._allocator.get()(nbytes, align, stream))
    return held[2]


_NO_SCRATCH = (None, None)


class _RunCall:
    """A compiled kernel whose launcher is not Triton 3.6's ``CudaLauncher``: started
    through ``kernel.run``, the launcher object itself."""

    def __init__(self, kernel):
        self.kernel = kernel

    def __call__(self, grid: tuple[int, ...], device: int, stream: int, args) -> None:
        k = self.kernel
        k.run(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1, stream, k.function,
              k.packed_metadata, None, None, None, *args)


_LAUNCHER_FIELDS = ("launch", "launch_cooperative_grid", "launch_pdl", "global_scratch_size", "global_scratch_align",
                    "profile_scratch_size", "profile_scratch_align", "num_ctas")


def direct_call(kernel) -> DirectCall | _RunCall:
    """How a compiled kernel is started directly: its native launch function where its
    launcher has Triton 3.6's ``CudaLauncher`` fields, else the launcher object."""
    run = kernel.run
    if all(hasattr(run, name) for name in _LAUNCHER_FIELDS):
        return DirectCall(kernel)
    return _RunCall(kernel)


def compiled_kernels() -> dict[tuple, str]:
    """Each compiled kernel the direct launches hold, by key, as a line: its name, tile
    constants, warps, stages, registers and spills per thread, shared memory (what
    decides how many programs fit an SM). Empty where launches go through the JIT."""
    lines = {}
    for cached in _LAUNCHERS.values():
        for key, call in cached._compiled.items():
            kernel = call.kernel
            meta = kernel.metadata
            constants = getattr(getattr(kernel, "src", None), "constants", {}) or {}
            names = getattr(cached.fn, "arg_names", [])
            named = {(names[k[0]] if isinstance(k, tuple) and k and k[0] < len(names) else k): v
                     for k, v in constants.items()}
            tiles = ",".join(f"{k}={v}" for k, v in named.items() if str(k).startswith(("BLOCK", "MODE")))
            lines[(cached.fn, key)] = (f"{meta.name} [{tiles}] warps {meta.num_warps} stages {meta.num_stages} "
                                       f"registers {kernel.n_regs} spills {kernel.n_spills} shared {meta.shared}")
    return lines


def _device_and_stream() -> tuple[int, int]:
    """The current device and its current stream, as the JIT launches on them (the
    functions Triton's CUDA driver calls, without its lazy-initialization checks: a
    direct launch follows a first launch through the JIT)."""
    device = torch._C._cuda_getDevice()
    return device, torch._C._cuda_getCurrentRawStream(device)


def _launch_hooks_set() -> bool:
    """Whether a launch hook is set: Triton keeps them in hook chains, empty by default
    (a hook set as a plain function, or None, counts as itself)."""
    runtime = knobs.runtime
    enter, leave = runtime.launch_enter_hook, runtime.launch_exit_hook
    return bool(getattr(enter, "calls", enter is not None) or getattr(leave, "calls", leave is not None))
