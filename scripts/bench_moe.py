"""UniEP layer vs TorchTitan 0.2.2's MoE, side by side in one process (one GPU).

    python scripts/bench_moe.py [--shapes qwen3,dsv3_16b,...] [--rounds 3] [--json out.json] [--sweep [V,...]]
                                [--sustained 3] [--ep 2,4,8 --transport megakernel]

For each shape: same weights and inputs for both layers, each eager and under
``torch.compile``; correctness first (relative
error of output and input gradient against an fp32 computation of the same routing),
then median forward and forward+backward times (CUDA events, after warm-up), routed-
expert TFLOP/s, peak memory allocated during forward+backward, and the time ratios
against TorchTitan eager and TorchTitan under ``torch.compile`` (its best; the ratio
that counts). Forward+backward is timed two ways: one call at a time, synchronized
after each (the host's work before the call's first large kernel is counted), and
calls issued back to back, as the layers of a training step are (the host issues the
next call while the device runs this one; ``back_to_back_cuda_ms``), both with Python's
automatic garbage collection paused, as TorchTitan's trainer runs. Both are timed in
``--rounds`` rounds that take the four main layers (TorchTitan and UniEP, eager and
compiled, and the ``--sweep`` layers) in turn, every other round in reverse order (a
layer's time depended on the layer timed before it), and each row reports the median of
its rounds (a GPU's speed drifts during a run by as much as the differences measured). The
dense bf16 matmul rate measured in the same run is printed for scale. ``--sustained S``
also times each layer back to back for S seconds after a second of heating, in
``--rounds`` interleaved rounds: the GPU at its power limit, as in training, where a
call's time follows its energy (``gpu_energy.py``); with the energy per call, the mean
power and the lowest SM clock seen. ``--sweep`` also
times GEMM tile settings of UniEP (all, or those named), each a layer of its own on the
same weights. ``--ep`` adds the megakernel with that many virtual
ranks on the one GPU (the whole W-rank protocol: pushes to peer buffers, flags, remote
epilogues), checked bitwise against the one-rank UniEP layer first, with the bytes that
would cross between ranks.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_energy import EnergyMeter, sustained  # noqa: E402
from tile_variants import VARIANTS  # noqa: E402

from uniep.tune.measure import back_to_back_cuda_ms, median_cuda_ms  # noqa: E402

# shape name -> (tokens, dim, moe hidden, experts, top-k, shared experts, score func, route_norm)
SHAPES = {
    "qwen3": (16384, 2048, 768, 128, 8, 0, "softmax", True),
    "dsv3_16b": (16384, 2048, 1408, 64, 6, 2, "softmax", False),
    "dsv3_671b": (8192, 7168, 2048, 32, 8, 0, "sigmoid", True),
    "qwen3_4k": (4096, 2048, 768, 128, 8, 0, "softmax", True),
    "qwen3_32k": (32768, 2048, 768, 128, 8, 0, "softmax", True),
    "tiny": (64, 32, 16, 8, 3, 1, "softmax", True),  # smoke tests of the scripts (CPU)
}

# the --sweep settings: tile variants of bench_gemm.py's, and settings of the layer alone
SWEEP = {
    **{name: VARIANTS[name] for name in ("pointer_loads", "gemm_bn128", "wgrad_stages4", "gemm_stages4",
                                         "few_rows_stages_off", "wgrad_bn256", "half_tiles")},
    "full_tiles": dict(gemm_half_tiles=False),
    **{name: VARIANTS[name] for name in ("wgrad_bk32_s4", "wgrad_run0", "wgrad_run4", "store_descriptors",
                                         "wgrad_store_desc", "half_tiles_store_descriptors")},
    "shared_stream": dict(shared_experts_stream=True),  # the shared experts on a side stream
    "one_stream": dict(shared_experts_stream=False),
    **{name: VARIANTS[name] for name in ("program_per_tile", "gemm_bm256", "prefetch4", "prefetch8")},
}


@dataclass
class Row:
    shape: str
    layer: str
    rel_err_out: float
    rel_err_grad_x: float
    fwd_ms: float
    fwd_bwd_ms: float
    tflops_fwd_bwd: float
    peak_gib: float
    fwd_bwd_back_to_back_ms: float
    fwd_bwd_rounds_ms: list[float] = field(default_factory=list)
    """Each round's synchronized fwd+bwd time (``--rounds``; ``fwd_bwd_ms`` is their median)."""
    back_to_back_rounds_ms: list[float] = field(default_factory=list)
    vs_eager: float = 1.0
    """TorchTitan eager's fwd+bwd time over this row's (synchronized calls)."""
    vs_compiled: float = 1.0
    """TorchTitan compiled's fwd+bwd time over this row's (synchronized calls)."""
    vs_eager_back_to_back: float = 1.0
    vs_compiled_back_to_back: float = 1.0
    """The same ratios for calls issued back to back."""
    sustained_rounds: list[dict] = field(default_factory=list)
    """``--sustained``: each round's ``gpu_energy.Sustained`` as a dict."""
    sustained_ms: float | None = None
    sustained_joules: float | None = None
    """Median over the rounds, per call (None without an energy counter)."""
    sustained_min_clock_mhz: int | None = None
    vs_compiled_sustained: float | None = None
    """TorchTitan compiled's sustained time over this row's."""
    vs_compiled_energy: float | None = None
    """TorchTitan compiled's energy per call over this row's."""


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a.float() - ref.float()).norm() / ref.float().norm()).item()


def dense_tflops() -> float:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = median_cuda_ms(lambda: a @ b, 5, 20)
    return 2 * 8192**3 / ms / 1e9


def build_layers(shape, dtype=torch.bfloat16, device="cuda", config=None):
    """TorchTitan's MoE and the UniEP layer made from it (``config``: the Triton backend
    by default), same weights, and the shape's (T, D, H, E, K)."""
    from torchtitan.models.moe import MoE, MoEArgs

    from uniep import UniEPConfig, UniEPMoE

    T, D, H, E, K, S, score_func, route_norm = SHAPES[shape]
    args = MoEArgs(num_experts=E, num_shared_experts=S, top_k=K, score_func=score_func,
                   route_norm=route_norm, score_before_experts=False, load_balance_coeff=None)
    torch.manual_seed(0)
    with torch.device(device):
        titan = MoE(args, dim=D, hidden_dim=H)
        with torch.no_grad():
            titan.init_weights(0.02, torch.device(device))
    titan.to(dtype)
    uniep = UniEPMoE.from_torchtitan(copy.deepcopy(titan), config or UniEPConfig(backend="triton"))
    return titan, uniep, T, D, H, E, K


def fp32_reference(uniep, x, grad):
    """Output and input gradient of the same layer in fp32 on the PyTorch path, replaying
    the bf16 layer's expert choice (an fp32 router would flip near-tied choices)."""
    from uniep import UniEPConfig

    with torch.no_grad():
        _, topk_idx = uniep.router(x.reshape(-1, x.shape[-1]), uniep.expert_bias)
    ref = copy.deepcopy(uniep).float()
    ref.config = UniEPConfig(backend="torch")
    xr = x.detach().float().requires_grad_(True)
    out = ref(xr, topk_idx=topk_idx)
    out.backward(grad.float())
    return out.detach(), xr.grad


def measure(name, layer, x, grad, ref, flops, warmup, iters) -> Row:
    xi = x.detach().clone().requires_grad_(True)
    out = layer(xi)
    out.backward(grad)
    errs = rel_err(out, ref[0]), rel_err(xi.grad, ref[1])
    if not all(e < 5e-2 for e in errs):
        raise SystemExit(f"{name}: relative error {errs} vs fp32; not timing a wrong result")

    def fwd():
        with torch.no_grad():
            layer(x)

    fwd_ms = median_cuda_ms(fwd, warmup, iters)
    fwd_bwd_ms, back_to_back_ms = fwd_bwd_times(layer, x, grad, warmup, iters)
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fwd_bwd_step(layer, x, grad)()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30
    return Row("", name, errs[0], errs[1], fwd_ms, fwd_bwd_ms, flops / fwd_bwd_ms / 1e9, peak, back_to_back_ms,
               [fwd_bwd_ms], [back_to_back_ms])


def fwd_bwd_step(layer, x, grad):
    """One forward+backward of ``layer``, as a callable (its gradients dropped after)."""
    def fwd_bwd():
        xi = x.detach().requires_grad_(True)
        layer(xi).backward(grad)
        layer.zero_grad(set_to_none=True)

    return fwd_bwd


def fwd_bwd_times(layer, x, grad, warmup, iters) -> tuple[float, float]:
    """(synchronized, back-to-back) forward+backward milliseconds of ``layer``."""
    step = fwd_bwd_step(layer, x, grad)
    return median_cuda_ms(step, warmup, iters), back_to_back_cuda_ms(step, warmup, iters)


def more_rounds(measured: list[tuple[Row, object]], x, grad, rounds: int, warmup, iters, flops) -> None:
    """Time the layers ``rounds - 1`` more times, one after the other in each round (so a
    drift of the GPU's speed during the run reaches all of them alike), in reverse order
    every other round (a layer timed right after compiled TorchTitan ran slower back to
    back than the same layer later in the round, benchmarks/RESULTS.md), and keep each
    row's median over the rounds."""
    for r in range(1, rounds):
        for row, layer in (measured[::-1] if r % 2 else measured):
            sync, b2b = fwd_bwd_times(layer, x, grad, warmup, iters)
            row.fwd_bwd_rounds_ms.append(sync)
            row.back_to_back_rounds_ms.append(b2b)
    for row, _ in measured:
        row.fwd_bwd_ms = statistics.median(row.fwd_bwd_rounds_ms)
        row.fwd_bwd_back_to_back_ms = statistics.median(row.back_to_back_rounds_ms)
        row.tflops_fwd_bwd = flops / row.fwd_bwd_ms / 1e9


def sustained_rounds(measured: list[tuple[Row, object]], x, grad, rounds: int, seconds: float) -> None:
    """``--sustained``: ``rounds`` rounds taking the layers in turn, each layer back to back
    at the power limit for ``seconds``; each row keeps the median of its rounds."""
    meter = EnergyMeter.open(torch.cuda.current_device())
    for _ in range(rounds):
        for row, layer in measured:
            s = sustained(fwd_bwd_step(layer, x, grad), seconds, meter, torch.cuda.synchronize)
            row.sustained_rounds.append(asdict(s))
    for row, _ in measured:
        runs = row.sustained_rounds
        row.sustained_ms = statistics.median(r["ms_per_call"] for r in runs)
        joules = [r["joules_per_call"] for r in runs if r["joules_per_call"] is not None]
        row.sustained_joules = statistics.median(joules) if joules else None
        clocks = [r["min_sm_clock_mhz"] for r in runs if r["min_sm_clock_mhz"] is not None]
        row.sustained_min_clock_mhz = min(clocks) if clocks else None


def profile_kernels(name, layer, x, grad) -> None:
    """Device time per kernel of one forward+backward (where the time goes)."""
    from torch.profiler import ProfilerActivity, profile

    xi = x.detach().requires_grad_(True)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        layer(xi).backward(grad)
        torch.cuda.synchronize()
    print(f"kernels of one {name} forward+backward:")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15, max_name_column_width=60))


def cross_rank_bytes(uniep, x, ranks: int) -> tuple[int, int]:
    """(dispatch, combine) bytes that cross between ranks when the batch is split over
    ``ranks`` in rank order: a token goes once to each other rank owning one of its
    experts (relay dedup); every expert output row of another rank comes back."""
    with torch.no_grad():
        _, topk = uniep.router(x.reshape(-1, x.shape[-1]), uniep.expert_bias)
    T, K = topk.shape
    src = torch.arange(T, device=topk.device) * ranks // T
    owner = topk // (uniep.num_experts // ranks)
    remote = owner != src[:, None]
    owners_hit = torch.zeros(T, ranks, dtype=torch.bool, device=topk.device)
    owners_hit[torch.arange(T, device=topk.device)[:, None].expand(T, K)[remote], owner[remote]] = True
    row_bytes = x.shape[-1] * x.element_size()
    return int(owners_hit.sum()) * row_bytes, int(remote.sum()) * row_bytes


def megakernel_rows(uniep, x, grad, ref, flops, args) -> list[Row]:
    from uniep.testing import use_virtual_ranks

    def fwd_bwd(layer):
        xi = x.detach().clone().requires_grad_(True)
        out = layer(xi)
        out.backward(grad)
        return out, xi.grad

    one_rank = fwd_bwd(uniep)
    rows = []
    for ranks in args.ep:
        variant = copy.copy(uniep)  # shares the weights and the experts module
        use_virtual_ranks(variant, ranks)
        same = [torch.equal(a, b) for a, b in zip(fwd_bwd(variant), one_rank)]
        if not all(same):
            raise SystemExit(f"megakernel with {ranks} virtual ranks differs from one rank (out, dx): {same}")
        row = measure(f"uniep[megakernel {ranks} virtual ranks]", variant, x, grad, ref, flops, args.warmup, args.iters)
        dispatch, combine = cross_rank_bytes(uniep, x, ranks)
        print(f"  megakernel {ranks} virtual ranks: bitwise equal to one rank; cross-rank bytes per forward: "
              f"dispatch {dispatch / 2**20:.0f} MiB, combine {combine / 2**20:.0f} MiB; "
              f"{(dispatch + combine) / row.fwd_ms / 1e6:.0f} GB/s over the forward", flush=True)
        rows.append(row)
    uniep.config = uniep.config  # its own path again (the copies shared its experts module)
    return rows


def sweep_layers(uniep, labels: list[str]):
    """(label, layer) for each ``SWEEP`` setting: a layer of its own (its own expert path)
    on ``uniep``'s parameter objects, so it joins the interleaved rounds."""
    from uniep import UniEPConfig, UniEPMoE

    for label in labels:
        yield label, UniEPMoE.from_torchtitan(uniep, replace(UniEPConfig(backend="triton"), **SWEEP[label]))


def run_shape(shape, args) -> list[Row]:
    from triton.runtime.errors import OutOfResources

    titan, uniep, T, D, H, E, K = build_layers(shape)
    gen = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(1, T, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    grad = torch.randn(1, T, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    ref = fp32_reference(uniep, x, grad)
    flops = 3 * 3 * 2 * T * K * D * H  # routed-expert GEMMs: 3 forward, 6 backward
    rows = [measure("torchtitan", titan, x, grad, ref, flops, args.warmup, args.iters)]
    # TorchTitan at its best: its MoE under torch.compile (Inductor fuses the gather,
    # score scaling and combine around its grouped GEMMs)
    titan_compiled = torch.compile(titan)
    rows.append(measure("torchtitan[compiled]", titan_compiled, x, grad, ref, flops, args.warmup, args.iters))
    rows.append(measure("uniep", uniep, x, grad, ref, flops, args.warmup, args.iters))
    # UniEP as a compiled training step runs it: the routed experts behind their custom
    # op, Inductor fusing the router's and the shared experts' ops around it
    uniep_compiled = torch.compile(uniep)
    rows.append(measure("uniep[compiled]", uniep_compiled, x, grad, ref, flops, args.warmup, args.iters))
    layers = [titan, titan_compiled, uniep, uniep_compiled]
    for label, variant in sweep_layers(uniep, args.sweep):
        try:
            rows.append(measure(f"uniep[{label}]", variant, x, grad, ref, flops, args.warmup, args.iters))
            layers.append(variant)
        except OutOfResources as e:
            print(f"  {shape} uniep[{label}]: skipped ({e})", flush=True)
    more_rounds(list(zip(rows, layers)), x, grad, args.rounds, args.warmup, args.iters, flops)
    if args.sustained:
        sustained_rounds(list(zip(rows, layers)), x, grad, args.rounds, args.sustained)
    if args.ep:
        rows += megakernel_rows(uniep, x, grad, ref, flops, args)
    if args.profile:
        profile_kernels("UniEP", uniep, x, grad)
        profile_kernels("compiled TorchTitan", titan_compiled, x, grad)
    for row in rows:
        row.shape = shape
        row.vs_eager = rows[0].fwd_bwd_ms / row.fwd_bwd_ms
        row.vs_compiled = rows[1].fwd_bwd_ms / row.fwd_bwd_ms
        row.vs_eager_back_to_back = rows[0].fwd_bwd_back_to_back_ms / row.fwd_bwd_back_to_back_ms
        row.vs_compiled_back_to_back = rows[1].fwd_bwd_back_to_back_ms / row.fwd_bwd_back_to_back_ms
        if row.sustained_ms is not None:
            row.vs_compiled_sustained = rows[1].sustained_ms / row.sustained_ms
        if row.sustained_joules is not None and rows[1].sustained_joules is not None:
            row.vs_compiled_energy = rows[1].sustained_joules / row.sustained_joules
    del titan, titan_compiled, uniep
    torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default="qwen3,dsv3_16b,dsv3_671b,qwen3_4k,qwen3_32k")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3,
                        help="timing rounds of the four main layers and the --sweep layers, interleaved; the median is reported")
    parser.add_argument("--sweep", nargs="?", const=",".join(SWEEP), default="",
                        help=f"also time these tile settings (default: all of {', '.join(SWEEP)}), in the same rounds")
    parser.add_argument("--profile", action="store_true", help="print UniEP's per-kernel device time")
    parser.add_argument("--ep", default="", help="expert-parallel degrees to add, e.g. 2,4,8 (virtual ranks)")
    parser.add_argument("--transport", default="megakernel", choices=["megakernel"],
                        help="transport of the --ep rows (one process: the megakernel on virtual ranks)")
    parser.add_argument("--sustained", type=float, default=0.0, metavar="SECONDS",
                        help="also time each layer back to back at the power limit for this long per round (0: off)")
    parser.add_argument("--json", help="write the table here")
    args = parser.parse_args()
    if args.rounds < 1:
        sys.exit(f"--rounds = {args.rounds}: allowed values: 1 or more")
    if args.sustained < 0:
        sys.exit(f"--sustained = {args.sustained}: allowed values: 0 (off) or a number of seconds > 0")
    args.ep = [int(w) for w in args.ep.split(",") if w]
    args.sweep = [v for v in args.sweep.split(",") if v]
    if not torch.cuda.is_available():
        sys.exit("bench_moe.py needs a CUDA GPU")
    shapes = args.shapes.split(",")
    for option, given, allowed in (("--shapes", shapes, SHAPES), ("--sweep", args.sweep, SWEEP)):
        unknown = [g for g in given if g not in allowed]
        if unknown:
            sys.exit(f"{option}: unknown {unknown}; allowed: {', '.join(allowed)}")

    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    dense = dense_tflops()
    print(f"dense bf16 8192^3 matmul: {dense:.0f} TFLOP/s", flush=True)
    rows = []
    for shape in shapes:
        rows += run_shape(shape, args)
        for row in [r for r in rows if r.shape == shape]:
            print(f"  {row.shape:10s} {row.layer:34s} fwd {row.fwd_ms:7.2f} ms  fwd+bwd {row.fwd_bwd_ms:7.2f} ms  "
                  f"{row.tflops_fwd_bwd:5.0f} TFLOP/s  peak {row.peak_gib:5.2f} GiB  "
                  f"x{row.vs_eager:.2f} eager x{row.vs_compiled:.2f} compiled; back to back "
                  f"{row.fwd_bwd_back_to_back_ms:7.2f} ms x{row.vs_eager_back_to_back:.2f} eager "
                  f"x{row.vs_compiled_back_to_back:.2f} compiled  "
                  f"rounds {'/'.join(f'{t:.2f}' for t in row.fwd_bwd_rounds_ms)} | "
                  f"{'/'.join(f'{t:.2f}' for t in row.back_to_back_rounds_ms)} ms  "
                  f"err out {row.rel_err_out:.2e} dx {row.rel_err_grad_x:.2e}{_sustained_text(row)}", flush=True)

    header = ("| shape | layer | fwd ms | fwd+bwd ms | TFLOP/s | peak GiB | vs TorchTitan eager | "
              "vs TorchTitan compiled | back to back ms | vs eager | vs compiled | sustained ms | vs compiled | "
              "J per call | vs compiled | rel err out | rel err dx |")
    print("\n" + header + "\n|" + "---|" * 17)
    for r in rows:
        print(f"| {r.shape} | {r.layer} | {r.fwd_ms:.2f} | {r.fwd_bwd_ms:.2f} | {r.tflops_fwd_bwd:.0f} | "
              f"{r.peak_gib:.2f} | {r.vs_eager:.2f} | {r.vs_compiled:.2f} | {r.fwd_bwd_back_to_back_ms:.2f} | "
              f"{r.vs_eager_back_to_back:.2f} | {r.vs_compiled_back_to_back:.2f} | "
              + " | ".join(format_or_dash(v, f) for v, f in ((r.sustained_ms, ".2f"), (r.vs_compiled_sustained, ".2f"),
                                                            (r.sustained_joules, ".2f"), (r.vs_compiled_energy, ".2f")))
              + f" | {r.rel_err_out:.2e} | {r.rel_err_grad_x:.2e} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"dense_tflops": dense, "rows": [asdict(r) for r in rows]}, f, indent=2)


def format_or_dash(value, spec: str) -> str:
    """`value` formatted by `spec`, or "-" where it was not measured."""
    return "-" if value is None else format(value, spec)


def _sustained_text(row: Row) -> str:
    if row.sustained_ms is None:
        return ""
    watts = None if row.sustained_joules is None else row.sustained_joules / row.sustained_ms * 1e3
    return (f"; sustained {row.sustained_ms:.2f} ms x{format_or_dash(row.vs_compiled_sustained, '.2f')} compiled, "
            f"{format_or_dash(row.sustained_joules, '.2f')} J per call x{format_or_dash(row.vs_compiled_energy, '.2f')} compiled, "
            f"{format_or_dash(watts, '.0f')} W, SM clock down to {format_or_dash(row.sustained_min_clock_mhz, 'd')} MHz")


if __name__ == "__main__":
    main()
