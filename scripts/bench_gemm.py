"""Where UniEP's routed-expert time goes, launch by launch, and which tile settings win.

    python scripts/bench_gemm.py [--shapes qwen3,dsv3_16b,dsv3_671b] [--variants default,pointer_loads,...]
                                 [--warmup 5 --iters 20] [--rounds 3] [--sustained 1.5] [--routing balanced]
                                 [--json out.json]

For each shape (``bench_moe.py``'s): one random top-k routing, then the steps of the
Triton path as the models use it, scores applied after the experts (forward: the copy
of the token rows in plan order, gate/up with SwiGLU, down; backward: the down input
gradient with the SwiGLU backward (two launches), the up input gradient, the weight
gradients of w2 and of w1/w3), each timed alone (median of CUDA events after warm-up)
under every variant, with its TFLOP/s: ``--rounds`` rounds that take every launch of every
variant in turn, and the median of the rounds.
Correctness first: each launch of the default settings against an fp32 PyTorch
computation of the same rows, and every variant against the default: bitwise where it
only changes the schedule (warps, stages, programs, descriptor loads, fused or separate
SwiGLU backward, where rows are gathered), within bf16
rounding where it changes the tiles. A variant that fails, or cannot launch (e.g. out of registers), is reported and
not timed.
``--sustained S`` also runs each timed launch back to back for S seconds at the GPU's
power limit (``gpu_energy.py``), with its energy: GFLOP per joule beside that of one
dense cuBLAS matmul of the same M, N and K (``dense_references``, run after the first
variant's launches), the power roofline of that launch's work.
Runs on the CPU too (the Triton interpreter, ``--device cpu``, tiny shapes) so its
logic is tested.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_moe import SHAPES, format_or_dash  # noqa: E402
from gpu_energy import EnergyMeter, sustained  # noqa: E402
from tile_variants import VARIANTS  # noqa: E402

from uniep.config import UniEPConfig  # noqa: E402
from uniep.kernels.grouped_gemm import (  # noqa: E402
    DUAL,
    PLAIN,
    SWIGLU_BWD,
    SWIGLU_FWD,
    ExpertTiles,
    grouped_gemm,
    grouped_gemm_reference,
)
from uniep.kernels.launch import compiled_kernels  # noqa: E402
from uniep.kernels.row_tiles import row_tiles  # noqa: E402
from uniep.kernels.swiglu import swiglu_backward  # noqa: E402
from uniep.kernels.wgrad import grouped_wgrad, grouped_wgrad_reference  # noqa: E402

LAUNCHES = ("gather_rows", "gate_up", "down", "down_dgrad", "up_dgrad", "wgrad_down", "wgrad_up")
# knobs whose change keeps the bits (schedule only): their variants are checked bitwise,
# the others as close
SCHEDULE_KNOBS = {"gemm_num_warps", "gemm_num_stages", "gemm_few_rows_num_stages", "wgrad_num_warps", "wgrad_num_stages",
                  "num_programs", "descriptor_loads", "descriptor_stores", "gemm_half_tiles", "gemm_prefetch_steps",
                  "swiglu_bwd_fused", "gather_in_kernel", "wgrad_expert_run", "wgrad_descriptor_stores"}
ROUTINGS = ("random", "balanced")


def make_problem(shape: str, device: str, seed: int = 0, routing: str = "random") -> dict:
    """Inputs of the six launches at ``shape``: bf16 (fp32 on the CPU, whose
    interpreter's bf16 dot is wrong) rows and weights; a uniformly random top-k routing,
    or a ``balanced`` one (pair ``p`` to expert ``p mod E``: every expert gets the same
    rows, so where E divides T*K evenly into whole tiles no tile or row chunk is partial)."""
    T, D, H, E, K = SHAPES[shape][:5]
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    gen = torch.Generator(device=device).manual_seed(seed)
    P = T * K
    if routing == "balanced":
        topk = torch.arange(P, device=device).reshape(T, K) % E
    else:
        topk = torch.rand(T, E, device=device, generator=gen).topk(K, dim=1).indices
    order = torch.argsort(topk.reshape(-1), stable=True)
    counts = torch.bincount(topk.reshape(-1), minlength=E)

    def rand(*size, scale=1.0):
        return (torch.randn(*size, device=device, generator=gen) * scale).to(dtype)

    return dict(
        T=T, D=D, H=H, E=E, K=K, P=P, dtype=dtype, counts=counts,
        token_of_row=(order // K).to(torch.int32), pair_of_row=order.to(torch.int32),
        x=rand(T, D), w1=rand(E, H, D, scale=D**-0.5), w3=rand(E, H, D, scale=D**-0.5), w2=rand(E, D, H, scale=H**-0.5),
        grad_y=rand(P, D),  # in plan order, as the combine backward writes it
    )


def flops(p: dict) -> dict[str, float]:
    P, D, H = p["P"], p["D"], p["H"]
    one = 2 * P * D * H
    return dict(gather_rows=0, gate_up=2 * one, down=one, down_dgrad=one, up_dgrad=2 * one, wgrad_down=one,
                wgrad_up=2 * one)


def launches(p: dict, knobs: dict) -> dict:
    """name -> zero-argument callable of each launch with a variant's ``knobs``, as
    ``uniep.kernels.expert_rows`` runs them. The forward outputs that later launches
    read are computed once here."""
    knobs = dict(knobs)
    fused, gather_in_kernel = knobs.pop("swiglu_bwd_fused", False), knobs.pop("gather_in_kernel", False)
    tiles = ExpertTiles.from_config(dataclasses.replace(UniEPConfig(), **knobs))
    gemm, up, wgrad, wgrad_up = tiles.gemm, tiles.up, tiles.wgrad, tiles.wgrad_up
    P, E, x, token_of_row = p["P"], p["E"], p["x"], p["token_of_row"]
    schedule = row_tiles(p["counts"], gemm.block_m, P)

    def gather_rows():
        return x if gather_in_kernel else x.index_select(0, token_of_row)

    rows, row_index = gather_rows(), (token_of_row if gather_in_kernel else None)

    def gate_up():
        return grouped_gemm(rows, p["w1"], schedule, P, transpose_w=True, tiles=up, mode=SWIGLU_FWD, w2_E=p["w3"],
                            a_row=row_index)

    h, a1, a3 = gate_up()

    def down_dgrad():
        if fused:
            return grouped_gemm(p["grad_y"], p["w2"], schedule, P, transpose_w=False, tiles=up, mode=SWIGLU_BWD,
                                aux=(a1, a3))
        pair = p["grad_y"].new_empty(2, *a1.shape)
        grouped_gemm(p["grad_y"], p["w2"], schedule, P, transpose_w=False, tiles=gemm, mode=PLAIN, out=pair[0])
        return swiglu_backward(pair[0], a1, a3, pair[0], pair[1])

    d_a1, d_a3 = down_dgrad()
    return dict(
        **({} if gather_in_kernel else dict(gather_rows=gather_rows)),
        gate_up=gate_up,
        down=lambda: grouped_gemm(h, p["w2"], schedule, P, transpose_w=True, tiles=gemm, mode=PLAIN,
                                  c_row=p["pair_of_row"]),
        down_dgrad=down_dgrad,
        up_dgrad=lambda: grouped_gemm(d_a1, p["w1"], schedule, P, transpose_w=False, tiles=gemm, mode=DUAL,
                                      a2=d_a3, w2_E=p["w3"], c_row=p["pair_of_row"]),
        wgrad_down=lambda: grouped_wgrad(p["grad_y"], h, schedule.expert_offsets, E, tiles=wgrad, out_dtype=p["dtype"]),
        wgrad_up=lambda: grouped_wgrad(d_a1, rows, schedule.expert_offsets, E, tiles=wgrad_up, out_dtype=p["dtype"],
                                       b_row=row_index, a2=d_a3),
    )


def dense_references(p: dict) -> dict:
    """name -> one dense matmul (cuBLAS through ``torch.mm``) with the launch's M, N and K
    and so its FLOPs: what the same work costs without experts, on random bf16 data."""
    P, D, H, dtype, device = p["P"], p["D"], p["H"], p["dtype"], p["x"].device
    gen = torch.Generator(device=device).manual_seed(1)

    def mm(m, k, n):
        a = torch.randn(m, k, device=device, generator=gen).to(dtype)
        b = torch.randn(k, n, device=device, generator=gen).to(dtype)
        return lambda: torch.mm(a, b)

    return dict(gate_up=mm(P, D, 2 * H), down=mm(P, H, D), down_dgrad=mm(P, D, H), up_dgrad=mm(P, 2 * H, D),
                wgrad_down=mm(D, P, H), wgrad_up=mm(2 * H, P, D))


def sustained_rows(shape: str, timed: list[tuple[dict, object]], p: dict, fl: dict, seconds: float) -> None:
    """``--sustained``: each timed launch back to back at the power limit, and after each
    launch of the first variant its dense reference; adds ``sustained_ms``,
    ``gflop_per_joule``, ``watts``, ``min_sm_clock_mhz`` (and the reference's, prefixed
    ``dense_``) to its row."""
    meter = EnergyMeter.open(torch.cuda.current_device())
    references = dense_references(p)
    first_variant = timed[0][0]["variant"] if timed else None
    for row, fn in timed:
        name = row["launch"]
        with_reference = name in references and row["variant"] == first_variant
        runs = [("", fn)] + ([("dense_", references[name])] if with_reference else [])
        for prefix, step in runs:
            s = sustained(step, seconds, meter, torch.cuda.synchronize, heat_seconds=0.5)
            row[f"{prefix}sustained_ms"] = s.ms_per_call
            row[f"{prefix}gflop_per_joule"] = (None if s.joules_per_call is None or not fl[name]
                                               else fl[name] / s.joules_per_call / 1e9)
            row[f"{prefix}watts"] = s.watts
            row[f"{prefix}min_sm_clock_mhz"] = s.min_sm_clock_mhz
        print(f"{shape} {row['variant']} {name} at the power limit: " + "; ".join(
            f"{label} {row[f'{prefix}sustained_ms']:.3f} ms"
            + (f" ({fl[name] / row[f'{prefix}sustained_ms'] / 1e9:.0f} TFLOP/s)" if fl[name] else "")
            + f", {format_or_dash(row[f'{prefix}gflop_per_joule'], '.0f')} GFLOP/J, {format_or_dash(row[f'{prefix}watts'], '.0f')} W, "
            f"SM clock down to {format_or_dash(row[f'{prefix}min_sm_clock_mhz'], 'd')} MHz"
            for label, prefix in (("UniEP", ""), ("dense cuBLAS", "dense_")) if f"{prefix}sustained_ms" in row),
            flush=True)


def first(out):
    return out[0] if isinstance(out, tuple) else out


def reference_errors(p: dict, outs: dict) -> dict[str, float]:
    """Relative error of the default launches' first outputs (those with a PLAIN
    structure) against fp32 PyTorch on the same rows."""
    counts = p["counts"].tolist()
    rows = p["x"][p["token_of_row"].long()]
    h = first(outs["gate_up"])
    refs = dict(
        down=grouped_gemm_reference(h, p["w2"], counts, transpose_w=True),
        wgrad_down=grouped_wgrad_reference(p["grad_y"], h, counts),
        gate_up_a1=grouped_gemm_reference(rows, p["w1"], counts, transpose_w=True),
    )
    down = torch.empty_like(refs["down"])
    down[p["pair_of_row"].long()] = refs["down"]

    def err(a, ref):
        return ((a.float() - ref).norm() / ref.norm()).item()

    return dict(down=err(outs["down"], down), wgrad_down=err(outs["wgrad_down"], refs["wgrad_down"]),
                gate_up=err(outs["gate_up"][1], refs["gate_up_a1"]))


def median_ms(fn, warmup: int, iters: int, device: str) -> float:
    if device != "cuda":
        return float("nan")
    from uniep.tune.measure import median_cuda_ms

    return median_cuda_ms(fn, warmup, iters)


def run_shape(shape: str, names: list[str], args) -> list[dict]:
    p = make_problem(shape, args.device, routing=args.routing)
    counts = p["counts"]
    print(f"{shape}: {args.routing} routing, rows per expert {int(counts.min())}..{int(counts.max())}", flush=True)
    fl = flops(p)
    base = launches(p, {})
    base_outs = {name: fn() for name, fn in base.items()}
    errs = reference_errors(p, base_outs)
    print(f"{shape}: default launches vs fp32: " + ", ".join(f"{k} {v:.1e}" for k, v in errs.items()), flush=True)
    if not all(e < 2e-2 for e in errs.values()):
        raise SystemExit(f"{shape}: default launches disagree with fp32 {errs}; not timing")
    rows, timed = [], []
    for variant in names:
        knobs = VARIANTS[variant]
        known = set(compiled_kernels())
        fns = launches(p, knobs)
        bitwise = set(knobs) <= SCHEDULE_KNOBS
        for name, fn in fns.items():
            try:
                out = fn()
            except Exception as e:  # e.g. ptxas out of registers: the variant cannot run here
                print(f"{shape} {variant} {name}: cannot launch: {type(e).__name__}: "
                      f"{str(e).strip().splitlines()[0][:200]}", flush=True)
                rows.append(dict(shape=shape, variant=variant, launch=name, checked="launch", ok=False,
                                 ms=float("nan"), tflops=float("nan"), rounds_ms=[]))
                continue
            pairs = list(zip(out, base_outs[name])) if isinstance(out, tuple) else [(out, base_outs[name])]
            same_bits = all(torch.equal(a, b) for a, b in pairs)
            if bitwise:
                ok = same_bits
            else:
                ok = all(((a.float() - b.float()).norm() / b.float().norm()).item() < 2e-2 for a, b in pairs)
            row = dict(shape=shape, variant=variant, launch=name, checked="bitwise" if bitwise else "close", ok=ok,
                       same_bits=same_bits, ms=float("nan"), tflops=float("nan"), rounds_ms=[])
            if ok:
                timed.append((row, fn))
            else:
                print(f"{shape} {variant} {name}: differs from the default; not timed", flush=True)
            rows.append(row)
        for key, resources in compiled_kernels().items():
            if key not in known:
                print(f"{shape} {variant}: compiled {resources}", flush=True)
    # Every launch of every variant once per round, in turns, the order reversed every
    # other round: a GPU runs the first launches timed in a call slower (seen: 10%), and
    # the median over the rounds keeps that from one variant's column.
    for r in range(args.rounds):
        for row, fn in (timed if r % 2 == 0 else timed[::-1]):
            row["rounds_ms"].append(median_ms(fn, args.warmup, args.iters, args.device))
    for row, _ in timed:
        row["ms"] = statistics.median(row["rounds_ms"])
        row["tflops"] = fl[row["launch"]] / row["ms"] / 1e9
        print(f"{shape} {row['variant']} {row['launch']}: {row['ms']:.3f} ms ({row['tflops']:.0f} TFLOP/s)"
              + (" (same bits as the default)" if row["same_bits"] and row["checked"] == "close" else "")
              + (f"  rounds {'/'.join(f'{t:.3f}' for t in row['rounds_ms'])}" if len(row["rounds_ms"]) > 1 else ""),
              flush=True)
    if args.sustained:
        sustained_rows(shape, timed, p, fl, args.sustained)
    return rows


def print_table(rows: list[dict]) -> None:
    for shape in dict.fromkeys(r["shape"] for r in rows):
        sub = [r for r in rows if r["shape"] == shape]
        variants = list(dict.fromkeys(r["variant"] for r in sub))
        print(f"\n{shape}: ms (TFLOP/s) per launch; X = differs from the default (not timed), - = no such launch")
        print("| variant | " + " | ".join(LAUNCHES) + " | total ms |")
        print("|---" * (len(LAUNCHES) + 2) + "|")
        for v in variants:
            cells, total = [], 0.0
            for name in LAUNCHES:
                r = next((r for r in sub if r["variant"] == v and r["launch"] == name), None)
                if r is None:  # not a launch of this variant
                    cells.append("-")
                    continue
                timed = f"{r['ms']:.3f}" + (f" ({r['tflops']:.0f})" if r["tflops"] else "")
                cells.append(timed if r["ok"] else "X")
                total += r["ms"] if r["ok"] else float("nan")
            print(f"| {v} | " + " | ".join(cells) + f" | {total:.3f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default="qwen3,dsv3_16b,dsv3_671b")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3,
                        help="timing rounds over all variants' launches, in turns; the median is reported")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--routing", default="random", choices=ROUTINGS,
                        help="random top-k, or balanced (every expert the same rows: no partial tiles where they divide)")
    parser.add_argument("--sustained", type=float, default=0.0, metavar="SECONDS",
                        help="also run each launch at the power limit this long, with its energy (0: off; CUDA only)")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    if args.rounds < 1:
        sys.exit(f"--rounds = {args.rounds}: allowed values: 1 or more")
    if args.sustained < 0 or (args.sustained and args.device != "cuda"):
        sys.exit(f"--sustained = {args.sustained}: allowed values: 0 (off), or seconds > 0 with --device cuda")
    shapes, names = args.shapes.split(","), args.variants.split(",")
    for field, given, allowed in (("--shapes", shapes, SHAPES), ("--variants", names, VARIANTS)):
        unknown = [g for g in given if g not in allowed]
        if unknown:
            sys.exit(f"{field}: unknown {unknown}; allowed: {', '.join(allowed)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("bench_gemm.py: no CUDA GPU here (--device cpu runs the logic in the Triton interpreter)")
    rows = []
    for shape in shapes:
        shape_rows = run_shape(shape, names, args)
        print_table(shape_rows)
        rows += shape_rows
    bad = [f"{r['shape']}/{r['variant']}/{r['launch']}" for r in rows if not r["ok"]]
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    if bad:
        sys.exit(f"variants that changed the result: {bad}")


if __name__ == "__main__":
    main()
