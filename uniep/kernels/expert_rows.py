"""The SwiGLU expert MLP over expert-major rows on the Triton kernels, forward and
backward: the one sequence of grouped-GEMM launches of every Triton path (one rank, and
the rows an expert-parallel transport delivered to their owner).

Shape legend: R rows (expert-major, the plan's order), D model dim, H hidden dim,
E local experts.

    h = silu(rows @ w1[e]^T) * (rows @ w3[e]^T)        y = h @ w2[e]^T

where scores applied before the experts are already in the rows (the caller's copy
scales them, rounded to their dtype). The input rows come in plan order (the caller
copies token rows there once: the copy engine (TMA) loads contiguous rows but cannot
gather, and the gate/up launch and the w1/w3 gradient both read them). Outputs may be
scattered (``target_row``: the plan row's row of ``y``, e.g. its (token, k) pair or its
arrival row) inside the kernels; the output gradient is read in plan order and the
input-row gradient written in ``y``'s layout. The plain-PyTorch reference is
``uniep.experts.expert_mlp_torch``.

The backward (``expert_rows_backward``) runs its launches in the order that keeps
the least memory alive, and releases each temporary once used: the down input
gradient with the SwiGLU backward, the rows' input gradient (handed to the caller at
once, who may reduce it and let it go), the w1/w3 gradient, and the w2 gradient
either first or last (``w2_grad_first``). The order does not change any result.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from uniep.kernels.grouped_gemm import (
    DUAL,
    PLAIN,
    SWIGLU_FWD,
    ExpertTiles,
    grouped_gemm,
)
from uniep.kernels.row_tiles import RowTiles
from uniep.kernels.swiglu import swiglu_backward
from uniep.kernels.wgrad import grouped_wgrad


@dataclass
class ExpertRowsState:
    """What the backward needs from the forward. The backward runs once and releases
    each field once used, so the next launches' temporaries take its place."""

    rows: torch.Tensor | None
    """The input rows in plan order (released after the w1/w3 gradient)."""
    target_row: torch.Tensor | None
    weights: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    """w1, w2, w3 as given (in their own dtypes: a compute-dtype copy is not kept
    between the forward and the backward)."""
    h: torch.Tensor | None
    a1: torch.Tensor | None
    a3: torch.Tensor | None
    """The forward activations (a1, a3 released after the SwiGLU backward, h after the
    w2 gradient)."""
    schedule: RowTiles
    num_rows: int
    dtype: torch.dtype
    """The rows' dtype, in which the GEMMs run."""
    grad_y: torch.Tensor | None = None
    """The output gradient (R, D) in plan order: the caller of the backward sets it
    and lets its own reference go, so the backward can release it after its last use."""

    def weight(self, i: int) -> torch.Tensor:
        """w1, w2 or w3 (i = 0, 1, 2) in the rows' dtype."""
        return _in_dtype(self.weights[i], self.dtype)


def _in_dtype(w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``w`` as ``dtype`` (a call to ``.to`` only where it converts: each op costs host time)."""
    return w if w.dtype == dtype else w.to(dtype)


def expert_rows_forward(
    rows: torch.Tensor,
    schedule: RowTiles,
    w1_EHD: torch.Tensor,
    w2_EDH: torch.Tensor,
    w3_EHD: torch.Tensor,
    tiles: ExpertTiles,
    *,
    target_row: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ExpertRowsState]:
    """(y, state): ``rows`` (R, D) in plan order; y has R rows (plan order, or scattered
    to ``target_row``). ``schedule``: the rows' row tiles of ``tiles.gemm.block_m`` rows
    (``row_tiles``, or ``plan_rows`` with the rows); ``target_row`` (R,) int32 or int64,
    or None (plan order)."""
    R = rows.shape[0]
    w1, w2, w3 = (_in_dtype(w, rows.dtype) for w in (w1_EHD, w2_EDH, w3_EHD))
    # w1 is (E, H, D): B[e] = w1[e]^T is (D, H)
    h, a1, a3 = grouped_gemm(rows, w1, schedule, R, transpose_w=True, tiles=tiles.up, mode=SWIGLU_FWD,
                             w2_E=w3)
    # w2 is (E, D, H): B[e] = w2[e]^T is (H, D)
    y = grouped_gemm(h, w2, schedule, R, transpose_w=True, tiles=tiles.gemm, mode=PLAIN, c_row=target_row)
    return y, ExpertRowsState(rows, target_row, (w1_EHD, w2_EDH, w3_EHD), h, a1, a3, schedule, R, rows.dtype)


def w2_grad_first(state: ExpertRowsState) -> bool:
    """Whether the w2 gradient runs right after the down input gradient: it then
    releases its inputs (grad y (R, D) and h (R, H)) early but holds its output
    (E, D, H) through the other launches; run last, the reverse. Whichever holds fewer
    bytes (many rows: first; few rows, as at 4096 tokens: last)."""
    R, H = state.h.shape
    E, D, _ = state.weights[1].shape
    return R * (D + H) * state.h.element_size() > E * D * H * state.weights[1].element_size()


def _down_input_grad(state: ExpertRowsState, tiles: ExpertTiles) -> tuple[torch.Tensor, torch.Tensor]:
    """(d_a1, d_a3 (R, H)): d h = grad_y @ w2[e] (a plain GEMM on the wide tiles, into
    the first half of the d_a1/d_a3 pair), then the SwiGLU backward in place (fused into
    the wide tiles' epilogue it ran slower at the power limit, benchmarks/RESULTS.md).
    Releases a1, a3."""
    state.grad_y = state.grad_y.contiguous()
    pair = state.grad_y.new_empty(2, *state.a1.shape)
    grouped_gemm(state.grad_y, state.weight(1), state.schedule, state.num_rows, transpose_w=False, tiles=tiles.gemm,
                 mode=PLAIN, out=pair[0])
    d_a1, d_a3 = swiglu_backward(pair[0], state.a1, state.a3, pair[0], pair[1])
    state.a1 = state.a3 = None
    return d_a1, d_a3


def _down_weight_grad(state: ExpertRowsState, tiles: ExpertTiles) -> torch.Tensor:
    """grad w2 in its dtype (one program per tile, the expert's rows in order).
    Releases grad_y and h."""
    w2 = state.weights[1]
    grad_w2 = grouped_wgrad(state.grad_y, state.h, state.schedule.expert_offsets, w2.shape[0], tiles=tiles.wgrad,
                            out_dtype=w2.dtype)
    state.grad_y = state.h = None
    return grad_w2


def _rows_input_grad(d_a1: torch.Tensor, d_a3: torch.Tensor, state: ExpertRowsState, tiles: ExpertTiles) -> torch.Tensor:
    """d rows = d_a1 @ w1[e] + d_a3 @ w3[e] (one accumulator), in ``y``'s layout: the
    gradient of the (scaled) input rows."""
    return grouped_gemm(d_a1, state.weight(0), state.schedule, state.num_rows, transpose_w=False, tiles=tiles.gemm,
                        mode=DUAL, a2=d_a3, w2_E=state.weight(2), c_row=state.target_row)


def _up_weight_grads(d_a1: torch.Tensor, d_a3: torch.Tensor, state: ExpertRowsState, tiles: ExpertTiles):
    """(grad w1, grad w3) in the weights' dtypes, from one launch. Releases the rows."""
    w1, _, w3 = state.weights
    grad_w1, grad_w3 = grouped_wgrad(d_a1, state.rows, state.schedule.expert_offsets, w1.shape[0], tiles=tiles.wgrad_up,
                                     out_dtype=w1.dtype, a2=d_a3)
    state.rows = None
    return grad_w1, grad_w3.to(w3.dtype)


def expert_rows_backward(state: ExpertRowsState, tiles: ExpertTiles, take_input_grad=None):
    """(what ``take_input_grad`` made of the rows' input gradient (the gradient itself
    when None), grad w1, grad w2, grad w3 in the weights' dtypes), from ``state.grad_y``.

    The rows' input gradient (R, D), in ``y``'s layout, is handed to
    ``take_input_grad`` as soon as it is computed, so a caller that reduces it (e.g. to
    its tokens) lets it go before the weight gradients are allocated."""
    first = w2_grad_first(state)
    d_a1, d_a3 = _down_input_grad(state, tiles)
    grad_w2 = _down_weight_grad(state, tiles) if first else None
    d_rows = _rows_input_grad(d_a1, d_a3, state, tiles)
    taken = d_rows if take_input_grad is None else take_input_grad(d_rows)
    del d_rows
    grad_w1, grad_w3 = _up_weight_grads(d_a1, d_a3, state, tiles)
    del d_a1, d_a3
    if not first:
        grad_w2 = _down_weight_grad(state, tiles)
    return taken, grad_w1, grad_w2, grad_w3
