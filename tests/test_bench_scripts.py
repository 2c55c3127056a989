"""The benchmark scripts' own logic on the CPU: the cross-GPU byte count against a
brute-force count, and bench_ep.py end to end as a smoke test (gloo, the Triton kernels
under the interpreter, the megakernel left out)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

from bench_moe import SWEEP, cross_rank_bytes, sweep_layers  # noqa: E402


class RoutedLayer:
    """Stands in for a UniEP layer whose router returns a fixed routing."""

    def __init__(self, topk, num_experts):
        self.topk, self.num_experts, self.expert_bias = topk, num_experts, None

    def router(self, x, bias):
        return None, self.topk


def test_cross_rank_bytes_against_brute_force():
    gen = torch.Generator().manual_seed(0)
    T, K, E, D, ranks = 12, 3, 8, 5, 4
    topk = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)])
    x = torch.randn(1, T, D, dtype=torch.bfloat16)
    dispatch, combine = cross_rank_bytes(RoutedLayer(topk, E), x, ranks)
    sends = returns = 0
    for t in range(T):
        src = t * ranks // T
        owners = [int(e) // (E // ranks) for e in topk[t]]
        sends += len({o for o in owners if o != src})
        returns += sum(o != src for o in owners)
    assert (dispatch, combine) == (sends * D * 2, returns * D * 2)


def test_sweep_layers_share_weights_not_paths():
    """Each --sweep layer runs its own tile settings on the default layer's parameter
    objects, so it can be timed in the same rounds without changing the default's path."""
    from uniep import UniEPConfig, UniEPMoE

    torch.manual_seed(0)
    default = UniEPMoE(16, 8, 4, 2, num_shared_experts=1, config=UniEPConfig(backend="triton"))
    path = default.expert_path
    labels = list(SWEEP)[:2]
    made = list(sweep_layers(default, labels))
    assert [label for label, _ in made] == labels
    for label, layer in made:
        assert layer.experts.w1 is default.experts.w1 and layer.router.gate is default.router.gate
        assert layer.shared_experts is default.shared_experts
        assert layer.config != default.config and layer.expert_path is not path
    assert default.expert_path is path


def test_bench_moe_rounds_alternate_the_order(monkeypatch):
    """Round 1 is each layer's first measurement; the later rounds take the layers in
    reverse order every other round, and each row keeps the median of its rounds."""
    import bench_moe

    order = []
    times = iter(range(100))

    def fake_times(layer, x, grad, warmup, iters):
        order.append(layer)
        t = float(next(times))
        return t, t + 0.5

    monkeypatch.setattr(bench_moe, "fwd_bwd_times", fake_times)
    rows = [bench_moe.Row("s", name, 0.0, 0.0, 1.0, 100.0, 0.0, 0.0, 100.5, [100.0], [100.5]) for name in "abc"]
    bench_moe.more_rounds(list(zip(rows, "abc")), None, None, 4, 0, 1, flops=2e9)
    assert "".join(order) == "cba" "abc" "cba"
    assert rows[0].fwd_bwd_rounds_ms == [100.0, 2.0, 3.0, 8.0]
    assert rows[2].back_to_back_rounds_ms == [100.5, 0.5, 5.5, 6.5]
    assert rows[0].fwd_bwd_ms == 5.5 and rows[2].fwd_bwd_back_to_back_ms == 6.0
    assert rows[0].tflops_fwd_bwd == 2e9 / 5.5 / 1e9


def test_bench_ep_smoke_on_cpu(tmp_path):
    out = tmp_path / "ep.json"
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(ROOT / "scripts" / "bench_ep.py"), "--device", "cpu", "--shapes", "tiny", "--tokens-per-gpu", "24,40",
         "--warmup", "1", "--iters", "2", "--json", str(out)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "uniep[all_to_all] EP=2 vs one GPU, bitwise: out True, grad x True, grad w1 True" in result.stdout
    rows = json.loads(out.read_text())
    assert [(r["tokens_per_gpu"], r["layer"]) for r in rows] == [
        (t, name) for t in (24, 40)
        for name in ("uniep[all_to_all]", "uniep[one GPU, own tokens]", "torchtitan[ExpertParallel]")
    ]
    a2a = [r for r in rows if r["layer"] == "uniep[all_to_all]"]
    assert all(r["bitwise_vs_one_gpu"] and r["cross_gpu_bytes_per_gpu"] > 0 for r in a2a)
    assert all(r["fwd_ms"] > 0 and r["speedup_fwd_bwd"] > 0 for r in rows)


def _bench_gemm_args(**kw):
    import argparse

    return argparse.Namespace(**{"device": "cpu", "warmup": 1, "iters": 1, "rounds": 1, "sustained": 0,
                                 "routing": "random", **kw})


def test_bench_gemm_checks_every_variant_against_the_default(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    import bench_gemm

    variants = ["default", "pointer_loads", "wgrad_bk128_s2", "swiglu_bwd_fused", "gather_in_kernel"]
    rows = bench_gemm.run_shape("tiny", variants, _bench_gemm_args())
    assert {(r["variant"], r["launch"]) for r in rows} == {
        (v, name) for v in variants for name in bench_gemm.LAUNCHES if (v, name) != ("gather_in_kernel", "gather_rows")
    }
    assert all(r["ok"] for r in rows)
    checks = {r["variant"]: r["checked"] for r in rows}
    assert checks == {"default": "bitwise", "pointer_loads": "bitwise", "wgrad_bk128_s2": "close",
                      "swiglu_bwd_fused": "bitwise", "gather_in_kernel": "bitwise"}


def test_bench_gemm_balanced_routing_gives_every_expert_the_same_rows():
    import bench_gemm

    T, _, _, E, K = bench_gemm.SHAPES["tiny"][:5]
    p = bench_gemm.make_problem("tiny", "cpu", routing="balanced")
    assert p["counts"].tolist() == [T * K // E] * E
    # each token's K experts differ (a valid top-k routing)
    expert_of_pair = torch.empty(T * K, dtype=torch.long)
    expert_of_pair[p["pair_of_row"].long()] = torch.arange(E).repeat_interleave(p["counts"])
    assert all(len(set(row)) == K for row in expert_of_pair.reshape(T, K).tolist())
    # the random routing (control) is not balanced
    random_counts = bench_gemm.make_problem("tiny", "cpu")["counts"]
    assert random_counts.sum() == T * K and random_counts.max() > random_counts.min()


def test_bench_gemm_rounds_take_the_launches_in_turns(monkeypatch):
    """Each round times every checked launch of every variant once, the order reversed
    every other round, and a row reports the median of its rounds."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    import bench_gemm

    calls = []

    def fake_median_ms(fn, warmup, iters, device):
        calls.append(fn)
        return float(len(calls))

    monkeypatch.setattr(bench_gemm, "median_ms", fake_median_ms)
    rows = bench_gemm.run_shape("tiny", ["default", "pointer_loads"], _bench_gemm_args(rounds=3))
    n = len(rows)
    assert n == 2 * len(bench_gemm.LAUNCHES) and len(calls) == 3 * n
    assert calls[n:2 * n] == calls[:n][::-1] and calls[2 * n:] == calls[:n]
    for i, row in enumerate(rows):  # the i-th launch timed i+1, 2n-i and 2n+i+1
        assert row["rounds_ms"] == [i + 1, 2 * n - i, 2 * n + i + 1] and row["ms"] == 2 * n - i


def test_bench_gemm_refuses_to_time_a_variant_that_changes_the_bits(monkeypatch):
    """Negative control: a schedule-only variant whose w1/w3 gradient is off by one part
    in 10^4 is caught by the bitwise check."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    import bench_gemm

    real = bench_gemm.launches

    def wrong_with_pointers(p, knobs):
        fns = real(p, knobs)
        if knobs.get("descriptor_loads") is False:
            right = fns["wgrad_up"]
            fns["wgrad_up"] = lambda: tuple(g * (1 + 1e-4) for g in right())
        return fns

    monkeypatch.setattr(bench_gemm, "launches", wrong_with_pointers)
    rows = bench_gemm.run_shape("tiny", ["default", "pointer_loads"], _bench_gemm_args())
    failed = {(r["variant"], r["launch"]) for r in rows if not r["ok"]}
    assert failed == {("pointer_loads", "wgrad_up")}


def test_bench_gemm_reports_a_variant_that_cannot_launch(monkeypatch, capsys):
    """A variant the compiler refuses (on an H200: 16 warps, out of registers) is a
    row marked as not run, and the other variants are still timed."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    import bench_gemm

    real = bench_gemm.launches

    def refuses_pointer_loads(p, knobs):
        fns = real(p, knobs)
        if knobs.get("descriptor_loads") is False:
            fns["down"] = lambda: (_ for _ in ()).throw(RuntimeError("Insufficient registers (128)"))
        return fns

    monkeypatch.setattr(bench_gemm, "launches", refuses_pointer_loads)
    rows = bench_gemm.run_shape("tiny", ["default", "pointer_loads"], _bench_gemm_args())
    refused = [r for r in rows if r["checked"] == "launch"]
    assert [(r["variant"], r["launch"], r["ok"]) for r in refused] == [("pointer_loads", "down", False)]
    assert sum(r["ok"] for r in rows) == 2 * len(bench_gemm.LAUNCHES) - 1
    assert "pointer_loads down: cannot launch: RuntimeError: Insufficient registers" in capsys.readouterr().out


def test_host_time_reports_every_part_and_restores_the_layer():
    """host_time.py on the CPU (Triton interpreter, tiny shape): every wrapped part was
    called once per forward+backward, the launches are counted per kernel, the inclusive
    times nest (a part is not longer than the part containing it), and the wrappers are
    gone afterwards. Negative control: a part that is never called reports 0 calls."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "host_time.py"), "--device", "cpu", "--shape", "tiny",
                          "--calls", "1", "--launch-costs", "2"], capture_output=True, text=True, env=env, timeout=600,
                         check=True).stdout
    parts = {}
    for line in out.splitlines():
        fields = line.split()
        if len(fields) >= 4 and fields[-1] == "ms" and fields[-3] == "calls":
            parts[" ".join(fields[:-4])] = (float(fields[-4]), float(fields[-2]))
    for name in ("layer forward", "router", "routed-expert call", "expert autograd forward",
                 "layer backward (.backward())", "expert autograd backward"):
        assert parts[name][0] == 1.0, (name, out)
    assert parts["expert autograd forward"][1] <= parts["routed-expert call"][1] <= parts["layer forward"][1]
    assert parts["expert autograd backward"][1] <= parts["layer backward (.backward())"][1]
    assert parts["_grouped_gemm_kernel"][0] == 4.0 and parts["_grouped_wgrad_kernel"][0] == 2.0
    # the tiny shape's shared expert: its SwiGLU forward and backward are launches too;
    # so are the router's choice and its backward
    assert parts["_swiglu_forward_kernel"][0] == 1.0 and parts["_swiglu_backward_kernel"][0] == 2.0
    assert parts["_router_select_kernel"][0] == parts["_router_select_backward_kernel"][0] == 1.0
    assert parts["_expert_order_kernel"][0] == 1.0  # the routing's counts and send order
    # the token rows copied to plan order and the row-tile schedule, in one launch
    assert parts["_plan_rows_kernel"][0] == 1.0
    assert "_row_tiles_kernel" not in parts and "_replicate_rows_kernel" not in parts
    assert "Triton launches, 16.0 per call" in out
    assert "launch costs: no direct launches here" in out  # the interpreter launches through the JIT

    import host_time
    import triton.runtime.jit as jit

    from uniep.moe import UniEPMoE

    forward, run = UniEPMoE.forward, jit.JITFunction.run
    timers = host_time.HostTimers()
    timers.wrap(UniEPMoE, "forward", "layer forward")
    timers.wrap(jit.JITFunction, "run", lambda kernel: kernel.fn.__name__)
    assert UniEPMoE.forward is not forward
    timers.unwrap()
    assert UniEPMoE.forward is forward and jit.JITFunction.run is run
    assert timers.calls["layer forward"] == 0


def test_host_time_launch_costs_times_every_stage_of_each_direct_launch(monkeypatch):
    """``--launch-costs``: a row per direct launch of one call, each stage timed, the
    call's tensors counted; a kernel launched through the JIT only has none. On a
    stand-in for Triton 3.6's JIT (``tests/kernels/test_launch.py``)."""
    import host_time

    from tests.kernels.test_launch import FakeJIT
    from uniep.kernels import launch

    monkeypatch.setattr(launch, "_device_and_stream", lambda: (0, 1234))
    fn = FakeJIT()
    cached = launch.CachedLaunch(fn, direct=True)
    x = torch.zeros(4)
    jit_only = launch.CachedLaunch(FakeJIT(), direct=False)

    def step():
        cached[(2,)](x, 32, BLOCK=16)
        jit_only[(2,)](x, 32, BLOCK=16)
        cached[(2,)](x, 7, BLOCK=16)

    step()
    step()  # both specializations compiled and kept
    rows = host_time.launch_costs(step, repeats=3, sync=lambda: None)
    assert [(name, tensors) for name, tensors, _ in rows] == [("FakeJIT", 1), ("FakeJIT", 1)]
    assert all(list(times) == ["bind", "key", "native", "native, int addresses", "direct", "jit"]
               and all(t >= 0 for t in times.values()) for _, _, times in rows)


def test_host_time_python_profile_per_call():
    """``--python``'s profile: a function called twice per step counts 2 calls per call,
    its inclusive time at least its self time; rows by self time, at most ``top`` of
    them; a step's backward is profiled too (here a custom autograd function's)."""
    import host_time

    def marker():
        return sum(range(2000))

    class Twice(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return 2 * x

        @staticmethod
        def backward(ctx, grad):
            marker()
            return 2 * grad

    def step():
        marker()
        Twice.apply(torch.ones(3, requires_grad=True)).sum().backward()

    rows = host_time.python_profile(step, calls=3, top=1000)
    by_name = {where: (self_us, total_us, count) for where, self_us, total_us, count in rows}
    marker_row = next(v for k, v in by_name.items() if k.endswith("(marker)"))
    assert marker_row[2] == 2.0 and marker_row[1] >= marker_row[0] >= 0
    assert any(k.endswith("(backward)") and "test_bench_scripts" in k for k in by_name)
    assert [r[1] for r in rows] == sorted((r[1] for r in rows), reverse=True)
    assert len(host_time.python_profile(step, calls=1, top=2)) == 2


def _trace(*events):
    return {"traceEvents": [dict(ph="X", **e) for e in events]}


def test_device_gaps_finds_the_idle_gap_its_issuer_and_the_blocking_call():
    """Three kernels; the device idles 100 us before the third, which was launched 2 us
    before it started from a Python line inside ``layer.py``, 126 us after the second's
    launch, with a 55 us ``cudaMalloc`` in between; one stream synchronize.
    Negative control: the same kernels back to back have no gap."""
    from device_gaps import analyze_trace

    kernels = [dict(cat="kernel", name="gemm", ts=0, dur=50, args=dict(correlation=1)),
               dict(cat="kernel", name="combine", ts=40, dur=20, args=dict(correlation=2)),  # overlaps
               dict(cat="kernel", name="wgrad", ts=160, dur=40, args=dict(correlation=3))]
    host = [dict(cat="cuda_driver", name="cuLaunchKernelEx", ts=158, dur=1, tid=7, args=dict(correlation=3)),
            dict(cat="cuda_driver", name="cuLaunchKernelEx", ts=30, dur=2, tid=8, args=dict(correlation=2)),
            dict(cat="cuda_runtime", name="cudaMalloc", ts=100, dur=55, tid=7, args=dict(correlation=10)),
            dict(cat="python_function", name="uniep/layer.py(10): forward", ts=100, dur=70, tid=7),
            dict(cat="python_function", name="uniep/moe.py(5): __call__", ts=90, dur=100, tid=7),
            dict(cat="python_function", name="uniep/other.py(1): elsewhere", ts=100, dur=70, tid=8),
            dict(cat="cuda_runtime", name="cudaStreamSynchronize", ts=60, dur=30, tid=7, args=dict(correlation=9))]
    a = analyze_trace(_trace(*kernels, *host))
    assert (a["span_us"], a["busy_us"], a["idle_us"], a["gap_count"]) == (200, 100, 100, 1)
    gap = a["gaps"][0]
    assert (gap["before"], gap["after"], gap["launch_lead_us"]) == ("combine", "wgrad", 2)
    assert gap["issued_by"] == ["uniep/layer.py(10): forward", "uniep/moe.py(5): __call__"]
    assert (gap["host_since_previous_launch_us"], gap["slow_host_calls"]) == (126, ["cudaMalloc 55 us (thread 7)"])
    assert a["slow_host_calls"] == [dict(name="cudaMalloc", count=1, total_us=55, max_us=55)]
    assert [(b["name"], b["dur_us"]) for b in a["blocking"]] == [("cudaStreamSynchronize", 30)]
    assert [(b["count"], b["idle_us"]) for b in a["gap_buckets"]] == [(0, 0)] * 4 + [(1, 100), (0, 0)]
    assert [op["start_us"] for op in a["ops"]] == [0, 40, 160]

    packed = [dict(k) for k in kernels]
    packed[2]["ts"] = 60
    a = analyze_trace(_trace(*packed, host[0]))
    assert (a["idle_us"], a["gap_count"], a["gaps"], a["blocking"]) == (0, 0, [], [])


def test_device_gaps_sums_device_time_by_kind(capsys):
    """UniEP's and TorchTitan's (CUTLASS) grouped GEMMs count as the experts' GEMMs,
    cuBLAS kernels as other GEMMs, and the rest as the rest: TorchTitan's helper that
    prepares its grouped GEMM's arguments names CUTLASS types but is not a GEMM (control),
    nor is a Triton kernel whose name merely contains "gemm". Printed per call."""
    from device_gaps import analyze_trace, kind_of, print_analysis

    names = {
        "_grouped_gemm_kernel": "expert GEMMs",
        "_grouped_wgrad_kernel": "expert GEMMs",
        "_ZN7cutlass13device_kernelIN2at4cuda6detail25enable_3x_kernel_for_sm9x": "expert GEMMs",
        "nvjet_sm90_tst_64x64_64x13_2x1_v_bz_TNT": "other GEMMs",
        "sm80_xmma_gemm_f32f32_f32f32_f32_nt_n_tilesize32x64x8": "other GEMMs",
        "void gemv2N_kernel<int, int, float, float, float, float, 128, 1, 2, 4, 1, false, cublasGemv": "other GEMMs",
        "void at::cuda::detail::prepare_grouped_gemm_data<cutlass::bfloat16_t, cutlass::bfloat16_t>": "the rest",
        "_topk_combine_kernel": "the rest",
        "triton_poi_fused_index_put_7": "the rest",
        "_gemm_prologue_copy_kernel": "the rest",
    }
    assert {n: kind_of(n) for n in names} == names
    kernels = [dict(cat="kernel", name="_grouped_gemm_kernel", ts=0, dur=50),
               dict(cat="kernel", name="nvjet_sm90_tst", ts=50, dur=10),
               dict(cat="kernel", name="_topk_combine_kernel", ts=60, dur=5),
               dict(cat="kernel", name="_grouped_wgrad_kernel", ts=65, dur=30)]
    a = analyze_trace(_trace(*kernels))
    assert a["by_kind"] == {"expert GEMMs": (80, 2), "other GEMMs": (10, 1), "the rest": (5, 1)}
    print_analysis("one call", a, calls=1)
    assert ("device time by kind: expert GEMMs 0.080 ms (2 ops), other GEMMs 0.010 ms (1 ops), "
            "the rest 0.005 ms (1 ops) per call") in capsys.readouterr().out


class _FakeMeter:
    """An energy counter that grows 2000 mJ per call of the step it counts, and an SM
    clock that falls with each read."""

    def __init__(self):
        self.mj, self.clock = 0, 2000

    def millijoules(self):
        return self.mj

    def sm_clock_mhz(self):
        self.clock -= 10
        return self.clock


def test_sustained_measures_time_and_energy_per_call():
    """Calls of 2 ms counted by a fake meter at 2 J each: about 2 ms and exactly 2 J per
    timed call, though the meter also counted the heating calls before the timed start
    (counting them, or dividing by the wrong number of calls, gives another value); the
    lowest clock read. Without a meter: time only. A missing NVML library: no meter."""
    import time

    from gpu_energy import EnergyMeter, sustained

    meter = _FakeMeter()

    def step():
        time.sleep(0.002)
        meter.mj += 2000

    s = sustained(step, seconds=0.05, meter=meter, synchronize=lambda: None, heat_seconds=0.02)
    assert s.joules_per_call == 2.0
    assert 2.0 <= s.ms_per_call < 4.0
    assert 500 < s.watts <= 1000
    assert s.min_sm_clock_mhz == meter.clock
    assert meter.mj > 2000 * round(0.05 / 0.002) * 0.9  # the heating calls ran too
    s = sustained(step, seconds=0.01, meter=None, synchronize=lambda: None, heat_seconds=0)
    assert s.joules_per_call is None and s.watts is None and s.min_sm_clock_mhz is None
    assert EnergyMeter.open(library="libno-such-nvml.so") is None


def test_bench_moe_rows_print_the_sustained_columns():
    """A row with sustained numbers prints them (and their ratios); one without, dashes."""
    from bench_moe import Row, _sustained_text

    row = Row("qwen3", "uniep", 0.0, 0.0, 1.0, 2.0, 100.0, 1.0, 2.0, sustained_ms=8.0, sustained_joules=5.6,
              sustained_min_clock_mhz=1140, vs_compiled_sustained=1.5, vs_compiled_energy=1.52)
    assert _sustained_text(row) == ("; sustained 8.00 ms x1.50 compiled, 5.60 J per call x1.52 compiled, "
                                    "700 W, SM clock down to 1140 MHz")
    assert _sustained_text(Row("qwen3", "uniep", 0.0, 0.0, 1.0, 2.0, 100.0, 1.0, 2.0)) == ""


def test_bench_gemm_sustained_rows_and_their_dense_references(monkeypatch):
    """Each dense reference multiplies the launch's M x K by K x N (its FLOPs); at the
    power limit every timed launch gets its time, GFLOP per joule and watts, and each GEMM
    launch of the first variant its reference's too (the row copy has none)."""
    import bench_gemm
    from gpu_energy import Sustained

    p = bench_gemm.make_problem("tiny", "cpu")
    fl = bench_gemm.flops(p)
    shapes = []
    real_mm = torch.mm
    monkeypatch.setattr(torch, "mm", lambda a, b: shapes.append((a.shape, b.shape)) or real_mm(a, b))
    for name, ref in bench_gemm.dense_references(p).items():
        shapes.clear()
        ref()
        ((m, k), (k2, n)), = shapes
        assert k == k2 and 2 * m * n * k == fl[name], name
    monkeypatch.setattr(torch, "mm", real_mm)

    runs = []
    monkeypatch.setattr(bench_gemm, "sustained", lambda step, *a, **kw: runs.append(step) or Sustained(2.0, 0.5, 1500))
    monkeypatch.setattr(bench_gemm.EnergyMeter, "open", staticmethod(lambda index: None))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    rows = [dict(launch=name, variant="default") for name in bench_gemm.LAUNCHES]
    other = [dict(launch=name, variant="pointer_loads") for name in bench_gemm.LAUNCHES]
    bench_gemm.sustained_rows("tiny", [(row, object()) for row in rows + other], p, fl, 1.0)
    assert len(runs) == 3 * len(rows) - 1  # the references after the first variant's launches only
    assert all("dense_sustained_ms" not in row and row["sustained_ms"] == 2.0 for row in other)
    for row in rows:
        assert row["sustained_ms"] == 2.0 and row["watts"] == 250.0 and row["min_sm_clock_mhz"] == 1500
        if row["launch"] == "gather_rows":
            assert row["gflop_per_joule"] is None and "dense_sustained_ms" not in row
        else:
            assert row["gflop_per_joule"] == fl[row["launch"]] / 0.5 / 1e9 == row["dense_gflop_per_joule"]


def _ab_row(shape, tree, sync, b2b, bits):
    rounds = [dict(synchronized_ms=sync, back_to_back_ms=b2b, host_issue_ms=1.0, bits=bits)]
    return dict(shape=shape, tree=tree, synchronized_ms=sync, back_to_back_ms=b2b, host_issue_ms=1.0,
                rounds=rounds, bits=bits)


def test_ab_trees_table_gives_the_second_tree_over_the_first():
    import ab_trees

    same, other = {"out": "a", "grad x": "b"}, {"out": "a", "grad x": "c"}
    text = ab_trees.table([_ab_row("qwen3", "old", 10.0, 8.0, same), _ab_row("qwen3", "new", 9.0, 8.8, same),
                           _ab_row("tiny", "old", 2.0, 2.0, same), _ab_row("tiny", "new", 2.0, 2.0, other)])
    assert "qwen3: new / old: synchronized 0.900, back to back 1.100; the same bits" in text
    assert "tiny: new / old: synchronized 1.000, back to back 1.000; other bits" in text  # one digest differs


def test_ab_trees_runs_each_tree_in_its_own_process_on_cpu(tmp_path):
    """Two trees (this one, and a copy whose router scales every score by 0.98) at the
    tiny shape, in the Triton interpreter: each process imports its own tree (the
    planted change gives other bits), and every time is measured. Negative control: a
    folder without uniep is refused before any run."""
    import shutil

    planted = tmp_path / "planted"
    for part in ("uniep", "scripts"):
        shutil.copytree(ROOT / part, planted / part, ignore=shutil.ignore_patterns("__pycache__"))
    with open(planted / "uniep" / "__init__.py", "a") as f:
        f.write("\nfrom uniep.router import TopKRouter as _Router\n_forward = _Router.forward\n"
                "_Router.forward = lambda self, *a, **k: (lambda s, i: (s * 0.98, i))(*_forward(self, *a, **k))\n")
    script, rows = str(ROOT / "scripts" / "ab_trees.py"), tmp_path / "rows.json"
    out = subprocess.run([sys.executable, script, str(ROOT), str(planted), "--device", "cpu", "--shapes", "tiny",
                          "--rounds", "1", "--calls", "1", "--warmup", "0", "--json", str(rows)],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "other bits" in out.stdout
    got = json.loads(rows.read_text())
    assert [row["tree"] for row in got] == [str(ROOT), str(planted)]
    assert all(row["synchronized_ms"] > 0 and row["back_to_back_ms"] > 0 for row in got)
    refused = subprocess.run([sys.executable, script, str(ROOT), str(tmp_path), "--device", "cpu", "--shapes", "tiny"],
                             capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "lacks uniep/__init__.py" in refused.stderr


def test_bench_router_checks_and_times_every_setting(monkeypatch):
    """bench_router.py on the CPU (tiny shape): a row per gate setting, the default's
    bits equal to themselves, the two-launch gate's row, one row per expert-order
    setting with the default's result; negative control: an expert order that differs
    is called WRONG; a setting that is not a power of 2 is refused before any work."""
    import argparse

    import bench_router

    args = argparse.Namespace(rows=[16, 32], block_k=[16], warps=[4], stages=[2], order_blocks=[64, 128],
                              order_warps=[4], iters=1, device="cpu")
    lines = bench_router.gate_rows("tiny", args)
    gate = [line for line in lines if "logits max |err|" in line]
    assert len(gate) == 3  # the default and the two settings asked for
    assert "(default)" in gate[0] and "bits as default True, experts as default True" in gate[0]
    assert all(float(line.split("|err| ")[1].split(",")[0]) < 1e-4 for line in gate)  # fp32 logits on the CPU
    two = [line for line in lines if "two launches" in line]
    assert len(two) == 1 and "experts as default True" in two[0]  # fp32: the GEMM's logits choose alike
    order = [line for line in lines if line.strip().startswith("block ")]
    assert len(order) == 2 and all("same result" in line for line in order)

    real = bench_router.expert_order_triton

    def wrong_for_big_blocks(idx, num_experts, block=bench_router.BLOCK, num_warps=bench_router.NUM_WARPS):
        counts, order_2P = real(idx, num_experts, block=block, num_warps=num_warps)
        return counts, (order_2P.flip(1) if block == 128 else order_2P)

    monkeypatch.setattr(bench_router, "expert_order_triton", wrong_for_big_blocks)
    idx = torch.randint(0, 8, (64, 3))
    rows = bench_router.order_rows(idx, 8, args)
    assert "same result" in rows[1] and "WRONG" in rows[2]
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_router.py"), "--device", "cpu", "--shapes",
                          "tiny", "--rows", "24"], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "--rows = [24]: allowed values: powers of 2" in out.stderr
