"""The routing's expert order in two launches: how many (token, k) pairs each expert
gets, and the pair ids stably sorted by expert (the plan's send order).

Shape legend: T tokens, K experts per token, P = T*K pairs, E experts, S segments of
``_SEGMENT`` consecutive pairs.

A counting sort over segments. The first launch counts each segment's pairs per expert
(a table (S, E)). In the second, segment s places its pairs: expert e's pairs start
after all pairs of lower experts and after e's pairs in segments before s; inside the
segment, a pair goes after the earlier pairs of its expert (a prefix sum over its
blocks of pairs). Each output has one writer and no atomics, and a stable sort's order
is a function of the ids alone, so the result is bitwise that of
``uniep.plan.expert_order``, its PyTorch reference (a radix sort, a search and a
difference: what runs under torch.compile and on the PyTorch backend). On a GPU those
are a dozen device launches and four host ops, issued while the device waits for the
layer's first large kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from uniep.kernels.launch import cdiv, launcher

_SEGMENT = 1024
"""Pairs per program (each program of the second launch reads the whole table)."""
_BLOCK_ELEMENTS = 8192
"""Elements of a block of pairs against all experts (32 per thread at 8 warps)."""
_MIN_SUB = 16
"""Fewest pairs per block (the blocks of a segment are unrolled)."""


@triton.jit
def _one_hot(ids_ptr, p0, num_pairs, experts, SUB: tl.constexpr):
    """Pairs ``p0 .. p0 + SUB`` and their (SUB, BLOCK_E) one-hot expert rows (zero rows past the end)."""
    pairs = p0 + tl.arange(0, SUB)
    ids = tl.load(ids_ptr + pairs, mask=pairs < num_pairs, other=-1)
    return pairs, (ids[:, None] == experts[None, :]).to(tl.int32)


@triton.jit
def _segment_counts_kernel(ids_ptr, table_ptr, num_pairs, SEGMENT: tl.constexpr, SUB: tl.constexpr,
                           BLOCK_E: tl.constexpr):
    s = tl.program_id(0)
    experts = tl.arange(0, BLOCK_E)
    counts = tl.zeros((BLOCK_E,), tl.int32)
    for p0 in tl.static_range(0, SEGMENT, SUB):
        _, one_hot = _one_hot(ids_ptr, s * SEGMENT + p0, num_pairs, experts, SUB)
        counts += tl.sum(one_hot, axis=0)
    tl.store(table_ptr + s * BLOCK_E + experts, counts)


@triton.jit
def _place_pairs_kernel(ids_ptr, table_ptr, counts_ptr, order_ptr, num_pairs, num_experts, num_segments,
                        SEGMENT: tl.constexpr, SUB: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_S: tl.constexpr):
    s = tl.program_id(0)
    experts = tl.arange(0, BLOCK_E)
    total = tl.zeros((BLOCK_E,), tl.int32)
    before = tl.zeros((BLOCK_E,), tl.int32)  # the expert's pairs in segments before s
    for s0 in range(0, num_segments, BLOCK_S):
        rows = s0 + tl.arange(0, BLOCK_S)
        part = tl.load(table_ptr + rows[:, None] * BLOCK_E + experts[None, :], mask=(rows < num_segments)[:, None],
                       other=0)
        total += tl.sum(part, axis=0)
        before += tl.sum(tl.where((rows < s)[:, None], part, 0), axis=0)
    if s == 0:
        tl.store(counts_ptr + experts, total.to(tl.int64), mask=experts < num_experts)
    place = tl.cumsum(total, axis=0) - total + before  # where each expert's next pair goes
    for p0 in tl.static_range(0, SEGMENT, SUB):
        pairs, one_hot = _one_hot(ids_ptr, s * SEGMENT + p0, num_pairs, experts, SUB)
        at = tl.sum(one_hot * (place[None, :] + tl.cumsum(one_hot, axis=0)), axis=1) - 1
        tl.store(order_ptr + at, pairs.to(tl.int64), mask=pairs < num_pairs)
        place += tl.sum(one_hot, axis=0)


def expert_order_triton(topk_idx_TK: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(counts_E, order_P)`` int64, as ``uniep.plan.expert_order``, in two launches:
    ``topk_idx_TK`` integer expert ids in [0, E), any shape."""
    ids_P = topk_idx_TK.reshape(-1).contiguous()
    P = ids_P.numel()
    if P >= 2**31:
        raise ValueError(f"expert_order_triton: {P} pairs; at most 2**31 - 1 (int32 positions)")
    block_e = triton.next_power_of_2(num_experts)
    sub = min(_SEGMENT, max(_MIN_SUB, _BLOCK_ELEMENTS // block_e))
    S = max(1, cdiv(P, _SEGMENT))  # one segment even without pairs: it writes the zero counts
    device = ids_P.device
    table_SE = torch.empty(S, block_e, dtype=torch.int32, device=device)
    counts_E = torch.empty(num_experts, dtype=torch.int64, device=device)
    order_P = torch.empty(P, dtype=torch.int64, device=device)
    launcher(_segment_counts_kernel)[(S,)](ids_P, table_SE, P, SEGMENT=_SEGMENT, SUB=sub, BLOCK_E=block_e,
                                           num_warps=8)
    launcher(_place_pairs_kernel)[(S,)](ids_P, table_SE, counts_E, order_P, P, num_experts, S, SEGMENT=_SEGMENT,
                                        SUB=sub, BLOCK_E=block_e, BLOCK_S=max(1, _BLOCK_ELEMENTS // block_e),
                                        num_warps=8)
    return counts_E, order_P
