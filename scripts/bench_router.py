"""The launches before a layer's first expert GEMM, alone, under tile settings: the
router's gate launch (``router_gate_select``: logits, scores and choice) and the expert
order launch (``expert_order_triton``), which a 4096-token call runs while the host is
still issuing (back to back, their device time counts).

    python scripts/bench_router.py [--shapes qwen3_4k,qwen3,dsv3_671b] [--rows 16,32,64]
                                   [--block-k 64,128] [--warps 4,8] [--stages 3,4]
                                   [--order-blocks 2048,4096,8192] [--order-warps 4,8,16] [--iters 50]

For each shape (``bench_moe.py``'s; its router's score function, route norm, top-k):
random tokens and gate weights, then every combination of the gate settings and of the
expert order's, each launch's device time (the median of ``--iters`` launches, each
queued behind a sleep kernel so that the host's time to issue it is not counted).
Correctness first, against the default settings (``GATE_TILES``): the logits' largest
difference from an fp32 GEMM, whether their bits and the chosen experts equal the
default's (other steps over the model dim round differently: same bits are not
required there), and for the expert order, which is exact, that the counts and the
order equal the default's (else the row says WRONG). A setting that cannot launch is
reported and not timed. For comparison, the gate as two launches (cuBLAS's GEMM on
fixed row blocks, then the choice launch): the path the fused gate replaced, and the
one a layer with shared experts takes. ``--device cpu`` runs the Triton interpreter on
the tiny shape (tests the script; its times say nothing).
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_moe import SHAPES  # noqa: E402

from uniep.batch_invariant import blocked_mm, padded_to_blocks, rows_per_block  # noqa: E402
from uniep.kernels.expert_order import BLOCK, MAX_PAIRS, NUM_WARPS, expert_order_triton  # noqa: E402
from uniep.kernels.router_select import GATE_TILES, GateTiles, router_gate_select, router_select_forward  # noqa: E402

SLEEP_CYCLES = 200_000
"""The sleep kernel before each timed launch: about 0.1 ms, longer than the host takes
to issue the launch."""


def device_us(launch, iters: int, device: str) -> float:
    """Median device microseconds of ``launch()`` (on the CPU: wall time, meaningless)."""
    launch()
    if device != "cuda":
        start = time.perf_counter()
        launch()
        return (time.perf_counter() - start) * 1e6
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        torch.cuda._sleep(SLEEP_CYCLES)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        launch()
        end.record()
        times.append((start, end))
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in times) * 1e3


def gate_rows(shape: str, args) -> list[str]:
    T, D, _, E, K, _, score_func, route_norm = SHAPES[shape]
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    gen = torch.Generator(device=args.device).manual_seed(0)
    x = torch.randn(T, D, device=args.device, dtype=dtype, generator=gen)
    w = (torch.randn(E, D, device=args.device, generator=gen) * 0.02).to(dtype)
    settings = dict(sigmoid=score_func == "sigmoid", route_norm=route_norm, route_scale=1.0)

    def gate(tiles):
        return router_gate_select(x, w, None, K, tiles=tiles, **settings)

    _, base_idx, base_logits = gate(GATE_TILES)
    fp32 = x.float() @ w.float().t()
    lines = [f"{shape}: {T} tokens, D {D}, {E} experts, top {K}; gate launch, us on the device"]
    variants = [GateTiles(r, bk, w_, s) for r, bk, w_, s in itertools.product(args.rows, args.block_k, args.warps,
                                                                              args.stages)]
    for tiles in [GATE_TILES] + [v for v in variants if v != GATE_TILES]:
        name = f"rows {tiles.rows or 'auto':>4} block_k {tiles.block_k:3d} warps {tiles.num_warps} stages {tiles.num_stages}"
        try:
            _, idx, logits = gate(tiles)
            us = device_us(lambda: gate(tiles), args.iters, args.device)
        except Exception as e:  # noqa: BLE001  (e.g. out of shared memory: report, go on)
            lines.append(f"  {name}: cannot launch: {type(e).__name__}: {str(e)[:80]}")
            continue
        err = (logits.float() - fp32).abs().max().item()
        lines.append(f"  {name}: {us:8.1f} us  logits max |err| {err:.2e}, bits as default {torch.equal(logits, base_logits)}, "
                     f"experts as default {torch.equal(idx, base_idx)}{'  (default)' if tiles == GATE_TILES else ''}")
    lines.append(two_launches_row(x, w, K, settings, base_idx, args))
    if T * K <= MAX_PAIRS:
        lines += order_rows(base_idx, E, args)
    return lines


def two_launches_row(x, w, top_k: int, settings: dict, base_idx: torch.Tensor, args) -> str:
    """The gate as two launches, for comparison: cuBLAS's GEMM on the fixed row blocks of
    ``uniep.batch_invariant`` (what the shared experts' launch computes the logits with),
    then the choice launch (``router_select_forward``)."""
    block = rows_per_block(x.device)
    x_pad = padded_to_blocks(x, block)
    logits_pad = x_pad.new_empty(x_pad.shape[0], w.shape[0])

    def two_launches():
        logits = blocked_mm(x_pad, w.t(), logits_pad, block)[:x.shape[0]]
        return router_select_forward(logits, top_k, **settings)

    _, idx = two_launches()
    us = device_us(two_launches, args.iters, args.device)
    return (f"  two launches (GEMM on {block}-row blocks, then the choice): {us:8.1f} us  "
            f"experts as default {torch.equal(idx, base_idx)}")


def order_rows(idx: torch.Tensor, num_experts: int, args) -> list[str]:
    base = expert_order_triton(idx, num_experts)
    lines = [f"  expert order of {idx.numel()} pairs, us on the device"]
    for block, warps in itertools.product(args.order_blocks, args.order_warps):
        name = f"block {block:5d} warps {warps:2d}"
        try:
            counts, order = expert_order_triton(idx, num_experts, block=block, num_warps=warps)
            us = device_us(lambda: expert_order_triton(idx, num_experts, block=block, num_warps=warps), args.iters,
                           args.device)
        except Exception as e:  # noqa: BLE001
            lines.append(f"    {name}: cannot launch: {type(e).__name__}: {str(e)[:80]}")
            continue
        same = torch.equal(counts, base[0]) and torch.equal(order, base[1])
        default = "  (default)" if (block, warps) == (BLOCK, NUM_WARPS) else ""
        lines.append(f"    {name}: {us:8.1f} us  {'same result' if same else 'WRONG: not the default result'}{default}")
    return lines


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default="qwen3_4k,qwen3,dsv3_671b")
    parser.add_argument("--rows", type=_ints, default=[16, 32, 64])
    parser.add_argument("--block-k", type=_ints, default=[64, 128])
    parser.add_argument("--warps", type=_ints, default=[4, 8])
    parser.add_argument("--stages", type=_ints, default=[3, 4])
    parser.add_argument("--order-blocks", type=_ints, default=[2048, 4096, 8192])
    parser.add_argument("--order-warps", type=_ints, default=[4, 8, 16])
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    args = parser.parse_args()
    shapes = args.shapes.split(",")
    bad = [s for s in shapes if s not in SHAPES]
    if bad:
        sys.exit(f"bench_router.py: unknown shape(s) {bad}; allowed: {', '.join(SHAPES)}")
    powers = {"--rows": args.rows, "--block-k": args.block_k, "--order-blocks": args.order_blocks}
    for flag, values in powers.items():
        if not values or any(v < 16 or v & (v - 1) for v in values):
            sys.exit(f"bench_router.py: {flag} = {values}: allowed values: powers of 2, 16 or more")
    if args.iters < 1 or not all(v >= 1 for v in args.warps + args.stages + args.order_warps):
        sys.exit("bench_router.py: --iters, --warps, --stages and --order-warps must be 1 or more")
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("bench_router.py: no CUDA GPU here (--device cpu runs the Triton interpreter on the tiny shape)")
    for shape in shapes:
        for line in gate_rows(shape, args):
            print(line, flush=True)


if __name__ == "__main__":
    main()
