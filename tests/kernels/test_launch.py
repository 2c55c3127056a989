"""uniep.kernels.launch: the direct launch of a compiled kernel, on a stand-in for
Triton 3.6's JIT (its binder, per-device caches and compiled kernels' launchers), so the
branch that runs only on a GPU is exercised on the CPU; the GPU test
``test_direct_launch_matches_the_jit`` runs it on the real Triton."""

from __future__ import annotations

import pytest
import torch
import triton

from uniep.kernels import launch


class FakeCompiled:
    def __init__(self, name):
        self.name, self.function, self.packed_metadata = name, f"function:{name}", f"meta:{name}"
        self.runs = []

    def run(self, *args):
        self.runs.append(args)


class FakeJIT:
    """Triton 3.6's JITFunction as CachedLaunch sees it: ``[grid](...)`` compiles (one kernel
    per specialization) and launches; ``device_caches[device][4]`` is the binder, made at
    the first launch. The specialization of an integer is whether it is divisible by 16."""

    def __init__(self):
        self.device_caches = {}
        self.jit_launches = []
        self.kernels = {}

    def _bind(self, x, n, BLOCK):
        spec = [("*fp32", "D"), ("i32", "D" if n % 16 == 0 else None), ("constexpr", BLOCK)]
        return {"x": x, "n": n, "BLOCK": BLOCK}, spec, {}

    def binder(self, *args, **kwargs):
        return self._bind(*args, **kwargs)

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.device_caches.setdefault(0, (None, None, None, None, self.binder))
            _, spec, _ = self._bind(*args, **kwargs)
            kernel = self.kernels.setdefault(str(spec), FakeCompiled(str(spec)))
            self.jit_launches.append((grid, args, kwargs))
            return kernel
        return run


@pytest.fixture
def on_fake_device(monkeypatch):
    monkeypatch.setattr(launch, "_device_and_stream", lambda: (0, 1234))


def test_repeat_launches_skip_the_jit_and_pass_the_bound_arguments(on_fake_device):
    fn = FakeJIT()
    cached = launch.CachedLaunch(fn, direct=True)
    cached[(5,)]("x0", 32, BLOCK=64)  # creates the binder
    cached[(5,)]("x1", 48, BLOCK=64)  # same specialization: compiled kernel kept
    assert len(fn.jit_launches) == 2
    cached[(7, 2)]("x2", 64, BLOCK=64)
    assert len(fn.jit_launches) == 2
    (kernel,) = fn.kernels.values()
    assert kernel.runs == [(7, 2, 1, 1234, kernel.function, kernel.packed_metadata, None, None, None, "x2", 64, 64)]


def test_another_specialization_gets_its_own_kernel(on_fake_device):
    fn = FakeJIT()
    cached = launch.CachedLaunch(fn, direct=True)
    for n in (32, 32, 33, 33, 64, 17):
        cached[(1,)]("x", n, BLOCK=16)
    aligned, unaligned = fn.kernels[str(fn._bind("x", 32, 16)[1])], fn.kernels[str(fn._bind("x", 33, 16)[1])]
    # 32 (binder made), 32 (kept), 33 (new kernel): through the JIT; 33, 64, 17 direct
    assert len(fn.jit_launches) == 3
    assert [r[-2] for r in aligned.runs] == [64] and [r[-2] for r in unaligned.runs] == [33, 17]
    cached[(1,)]("x", 32, BLOCK=32)  # a constexpr is part of the specialization too
    assert len(fn.jit_launches) == 4


def test_a_key_without_the_specialization_would_launch_the_wrong_kernel(on_fake_device, monkeypatch):
    """Negative control: keyed by device alone, the 33-row launch reuses the kernel
    compiled for rows divisible by 16, the error the key exists to prevent."""
    fn = FakeJIT()
    cached = launch.CachedLaunch(fn, direct=True)
    real_bind = fn.binder
    monkeypatch.setattr(fn, "binder", lambda *a, **k: (real_bind(*a, **k)[0], [], {}))
    fn.device_caches[0] = (None, None, None, None, fn.binder)
    for n in (32, 33):
        cached[(1,)]("x", n, BLOCK=16)
    aligned = fn.kernels[str(fn._bind("x", 32, 16)[1])]
    assert [r[-2] for r in aligned.runs] == [33]


def test_the_stages_of_a_direct_launch_each_do_their_part(on_fake_device):
    """``stages`` (what ``host_time.py --launch-costs`` times): None until the arguments'
    kernel is compiled and for a specialization not compiled; then the native launch
    passes the bound values, or the tensors' addresses as integers; the direct launch
    skips the JIT and the JIT's own launch does not."""
    fn = FakeJIT()
    cached = launch.CachedLaunch(fn, direct=True)
    x = torch.zeros(4)
    for _ in range(2):
        assert cached.stages((5,), x, 32, BLOCK=64) is None
        cached[(5,)](x, 32, BLOCK=64)  # the binder, then the compiled kernel kept
    stages = cached.stages((5,), x, 32, BLOCK=64)
    assert list(stages) == ["bind", "key", "native", "native, int addresses", "direct", "jit"]
    assert cached.stages((5,), x, 33, BLOCK=64) is None
    (kernel,) = fn.kernels.values()
    stages["native"]()
    stages["native, int addresses"]()
    assert kernel.runs[0][-3] is x and kernel.runs[1][-3:] == (x.data_ptr(), 32, 64)
    assert stages["bind"]()[1] == fn._bind(x, 32, 64)[1] and stages["key"]() is not None
    jit_launches = len(fn.jit_launches)
    stages["direct"]()
    assert len(fn.jit_launches) == jit_launches and len(kernel.runs) == 3
    stages["jit"]()
    assert len(fn.jit_launches) == jit_launches + 1


def test_launch_hooks_and_unsupported_tritons_take_the_jit_path(on_fake_device):
    fn = FakeJIT()
    cached = launch.CachedLaunch(fn, direct=True)
    for _ in range(2):
        cached[(1,)]("x", 32, BLOCK=16)
    hook = lambda metadata: None  # noqa: E731
    launch.knobs.runtime.launch_enter_hook.add(hook)
    try:
        assert launch._launch_hooks_set()
        cached[(1,)]("x", 32, BLOCK=16)
    finally:
        launch.knobs.runtime.launch_enter_hook.remove(hook)
    assert not launch._launch_hooks_set()
    assert len(fn.jit_launches) == 3
    jit_only = launch.CachedLaunch(FakeJIT(), direct=False)
    for _ in range(3):
        jit_only[(1,)]("x", 32, BLOCK=16)
    assert len(jit_only.fn.jit_launches) == 3


def test_direct_launch_only_for_compiled_kernels_of_checked_tritons():
    assert launch._direct_launch_supported(FakeJIT(), "3.6.0")
    assert not launch._direct_launch_supported(FakeJIT(), "3.9.0")
    assert not launch._direct_launch_supported(object(), "3.6.0")  # e.g. the interpreter's kernels


def test_one_launcher_per_kernel_object():
    fn = FakeJIT()
    assert launch.launcher(fn) is launch.launcher(fn)
    assert launch.launcher(fn) is not launch.launcher(FakeJIT())


def test_cdiv_and_next_power_of_2_match_tritons():
    assert [launch.cdiv(a, 16) for a in (0, 1, 16, 17, 4096)] == [triton.cdiv(a, 16) for a in (0, 1, 16, 17, 4096)]
    sizes = (1, 2, 3, 7, 8, 9, 128, 129, 768, 2048, 7168)
    assert [launch.next_power_of_2(n) for n in sizes] == [triton.next_power_of_2(n) for n in sizes]
    assert launch.next_power_of_2(0) == 1


class FakeCudaLauncher:
    """Triton 3.6's CudaLauncher as the direct launch reads it: its settings and its
    native ``launch``; calling the object itself is what the direct launch skips."""

    def __init__(self, global_scratch=0, profile_scratch=0):
        self.launch_cooperative_grid, self.launch_pdl, self.num_ctas = False, True, 2
        self.global_scratch_size, self.global_scratch_align = global_scratch, 128
        self.profile_scratch_size, self.profile_scratch_align = profile_scratch, 64
        self.launches = []

    def launch(self, *args):
        self.launches.append(args)

    def __call__(self, *args):
        raise AssertionError("the direct launch calls the native launch function, not the launcher object")


def _compiled_with(run):
    kernel = FakeCompiled("k")
    kernel.run = run
    return kernel


def test_direct_call_passes_the_launchers_arguments_in_its_order():
    run = FakeCudaLauncher()
    call = launch.direct_call(_compiled_with(run))
    assert isinstance(call, launch.DirectCall)
    call((5, 3), 0, 1234, ["x", 64])
    call((7,), 0, 1234, ["y", 32])
    # grid, stream, function, cooperative, pdl, global and profile scratch, packed
    # metadata, launch metadata, enter and exit hooks, then the kernel's arguments
    assert run.launches == [(5, 3, 1, 1234, "function:k", False, True, None, None, "meta:k", None, None, None, "x", 64),
                            (7, 1, 1, 1234, "function:k", False, True, None, None, "meta:k", None, None, None, "y", 32)]


def test_direct_call_allocates_each_scratch_for_every_program(monkeypatch):
    allocations = []

    def allocate(size, align, stream):
        allocations.append((size, align, stream))
        return f"buffer{len(allocations)}"

    monkeypatch.setattr(launch._allocation, "_profile_allocator", launch._allocation._AllocatorWrapper(allocate))
    token = launch._allocation._allocator.set(allocate)  # what triton.set_allocator sets
    try:
        run = FakeCudaLauncher(global_scratch=256, profile_scratch=16)
        launch.direct_call(_compiled_with(run))((3, 2), 0, 99, ["x"])
    finally:
        launch._allocation._allocator.reset(token)
    # 3 x 2 programs of 2 CTAs each; the global scratch first, then the profile scratch
    assert allocations == [(3 * 2 * 2 * 256, 128, 99), (3 * 2 * 2 * 16, 64, 99)]
    assert run.launches[0][7:9] == ("buffer1", "buffer2")


def test_global_scratch_is_one_buffer_per_stream_unless_launches_overlap(monkeypatch):
    """Without programmatic dependent launch, launches on one stream share one global
    scratch, grown when a launch needs more; another stream or device gets its own; a
    kernel launched with PDL, or any launch while a CUDA graph is being captured
    (negative controls), allocates its own every launch."""
    allocations = []

    def allocate(size, align, stream):
        allocations.append((size, stream))
        return f"buffer{len(allocations)}"

    monkeypatch.setattr(launch, "_STREAM_SCRATCH", {})
    capturing = [False]
    monkeypatch.setattr(launch, "_capturing", lambda: capturing[0])
    token = launch._allocation._allocator.set(allocate)
    try:
        run = FakeCudaLauncher(global_scratch=128)
        run.launch_pdl = False
        call = launch.direct_call(_compiled_with(run))
        for grid, device, stream in [((4,), 0, 7), ((2,), 0, 7), ((4,), 0, 7), ((8,), 0, 7), ((4,), 0, 8),
                                     ((4,), 1, 7), ((3,), 0, 7)]:
            call(grid, device, stream, ["x"])
        pdl_run = FakeCudaLauncher(global_scratch=128)
        pdl = launch.direct_call(_compiled_with(pdl_run))
        pdl((4,), 0, 7, ["x"])
        pdl((4,), 0, 7, ["x"])
        capturing[0] = True
        call((4,), 0, 7, ["x"])
    finally:
        launch._allocation._allocator.reset(token)
    assert [args[7] for args in run.launches] == ["buffer1", "buffer1", "buffer1", "buffer2", "buffer3", "buffer4",
                                                  "buffer2", "buffer7"]
    assert allocations[:4] == [(4 * 2 * 128, 7), (8 * 2 * 128, 7), (4 * 2 * 128, 8), (4 * 2 * 128, 7)]
    assert [args[7] for args in pdl_run.launches] == ["buffer5", "buffer6"]


def test_a_launcher_without_cuda_fields_is_called_as_the_jit_would():
    """Negative control of the fields check: a launcher lacking the native launch
    function is called itself, with the JIT's arguments."""
    kernel = FakeCompiled("k")
    call = launch.direct_call(kernel)
    assert not isinstance(call, launch.DirectCall)
    call((4,), 0, 1234, ["x", 8])
    assert kernel.runs == [(4, 1, 1, 1234, "function:k", "meta:k", None, None, None, "x", 8)]
