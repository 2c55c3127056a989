"""The routing's expert order in one launch: how many (token, k) pairs each expert gets,
the pair ids stably sorted by expert (the plan's send order) and that order's inverse
(each pair's row in the plan).

Shape legend: T tokens, K experts per token, P = T*K pairs, E experts.

A counting sort, one program per expert. Program ``e`` reads the pairs' expert ids
twice: first it counts the pairs of lower experts (where its pairs start) and its own;
then it writes the ids of its pairs in ascending order, each at the start plus the
number of its pairs before it (a prefix sum over each block of pairs), and that place at
each of its pairs (the inverse, which the row copy needs: a host op and a launch fewer).
Each output has one writer and no atomics, and a stable sort's order is a function of
the ids alone, so the result is bitwise that of ``uniep.plan.expert_order``, its
PyTorch reference (a radix sort, a search and a difference: four host ops and a dozen
device launches).

Each program reads every id, so the launch's time grows with P where the sort's hardly
does: on an H100 in the twenty-eighth session's profile, 25 us at 32768 pairs (the ops
it replaces: 34 us) and 97 us at 131072 (they: 39 us). ``expert_order_on_triton``
therefore takes it up to ``MAX_PAIRS`` pairs, where it is faster on the device too, and
the sort above; the host saves the four ops (0.2 ms of a forward's host time at 32768
pairs, ``benchmarks/RESULTS.md``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from uniep.kernels.launch import launcher
from uniep.plan import expert_order

BLOCK = 8192
"""Pair ids per step: 32 int64 per thread at ``NUM_WARPS`` warps (on an H100 at 32768
pairs: 28.7 us against 31.6 at 4096, ``benchmarks/RESULTS.md``, forty-first session)."""
NUM_WARPS = 8
MAX_PAIRS = 2**15
"""The most pairs ``expert_order_on_triton`` orders in the launch (above: the sort)."""


@triton.jit
def _expert_order_kernel(ids_ptr, counts_ptr, order_ptr, num_pairs, num_experts, BLOCK: tl.constexpr):
    # order_ptr: (2, num_pairs), the order, then its inverse
    e = tl.program_id(0)
    offsets = tl.arange(0, BLOCK)
    # per-lane tallies, summed across the block once (not a reduction per step)
    below = tl.zeros((BLOCK,), tl.int32)
    of_e = tl.zeros((BLOCK,), tl.int32)
    for p0 in range(0, num_pairs, BLOCK):
        # past the end: an id no expert has (counted neither below nor as e)
        ids = tl.load(ids_ptr + p0 + offsets, mask=p0 + offsets < num_pairs, other=num_experts)
        below += (ids < e).to(tl.int32)
        of_e += (ids == e).to(tl.int32)
    start = tl.sum(below, axis=0)
    tl.store(counts_ptr + e, tl.sum(of_e, axis=0).to(tl.int64))
    place = start
    for p0 in range(0, num_pairs, BLOCK):
        ids = tl.load(ids_ptr + p0 + offsets, mask=p0 + offsets < num_pairs, other=num_experts)
        mine = (ids == e).to(tl.int32)
        at = place + tl.cumsum(mine, axis=0) - mine
        tl.store(order_ptr + at, (p0 + offsets).to(tl.int64), mask=mine != 0)
        tl.store(order_ptr + num_pairs + p0 + offsets, at.to(tl.int64), mask=mine != 0)
        place += tl.sum(mine, axis=0)


def expert_order_triton(topk_idx_TK: torch.Tensor, num_experts: int, *, block: int = BLOCK,
                        num_warps: int = NUM_WARPS) -> tuple[torch.Tensor, torch.Tensor]:
    """``(counts_E, order_2P)`` int64, as ``uniep.plan.expert_order``, in one launch:
    ``topk_idx_TK`` integer expert ids in [0, E), any shape. ``block`` (a power of 2) pair
    ids per step and ``num_warps`` change the time, not the result
    (``scripts/bench_router.py``)."""
    ids_P = topk_idx_TK.reshape(-1).contiguous()
    P = ids_P.numel()
    if P >= 2**31:
        raise ValueError(f"expert_order_triton: {P} pairs; at most 2**31 - 1 (int32 positions)")
    counts_E = torch.empty(num_experts, dtype=torch.int64, device=ids_P.device)
    order_2P = torch.empty(2, P, dtype=torch.int64, device=ids_P.device)
    launcher(_expert_order_kernel)[(num_experts,)](ids_P, counts_E, order_2P, P, num_experts, BLOCK=block,
                                                   num_warps=num_warps)
    return counts_E, order_2P


def expert_order_on_triton(topk_idx_TK: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The expert order of a layer whose experts run on Triton: the launch up to
    ``MAX_PAIRS`` pairs, the sort above (the same bits either way)."""
    order_of = expert_order_triton if topk_idx_TK.numel() <= MAX_PAIRS else expert_order
    return order_of(topk_idx_TK, num_experts)
