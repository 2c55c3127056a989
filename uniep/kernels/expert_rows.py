"""The SwiGLU expert MLP over rows that are already expert-major (the rows an
expert-parallel transport delivered to their owner), forward and backward on the
Triton kernels.

Shape legend: R rows (expert-major, the plan's order), D model dim, H hidden dim,
E local experts.

    h = silu(s * rows @ w1[e]^T) * (s * rows @ w3[e]^T)        y = h @ w2[e]^T

where ``s`` is each row's score when scores are applied before the experts (rounded to
the rows' dtype after scaling, as ``fused_experts`` does), else 1. The launches are the
single-rank fused path's with its row gathers and scatters taken out: the same tiles
over the same rows in the same order, so the bits equal that path's.
The plain-PyTorch reference is ``uniep.experts.expert_mlp_torch``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from uniep.kernels.grouped_gemm import (
    DUAL,
    PLAIN,
    SWIGLU_BWD,
    SWIGLU_FWD,
    GemmTiles,
    check_row_tiles,
    grouped_gemm,
    tile_offsets,
)
from uniep.kernels.wgrad import grouped_wgrad


@dataclass
class ExpertRowsState:
    """What the backward needs from the forward."""

    rows_RD: torch.Tensor
    scale_R: torch.Tensor | None
    weights: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    weight_dtypes: tuple[torch.dtype, torch.dtype, torch.dtype]
    h: torch.Tensor
    a1: torch.Tensor
    a3: torch.Tensor
    offsets: tuple[torch.Tensor, torch.Tensor]


def expert_rows_forward(
    rows_RD: torch.Tensor,
    scale_R: torch.Tensor | None,
    rows_per_expert_E: torch.Tensor,
    w1_EHD: torch.Tensor,
    w2_EDH: torch.Tensor,
    w3_EHD: torch.Tensor,
    tiles: tuple[GemmTiles, GemmTiles, GemmTiles, GemmTiles],
) -> tuple[torch.Tensor, ExpertRowsState]:
    """(y (R, D), state). ``rows_per_expert_E`` (E,) int64 on the device; ``tiles`` =
    (gemm, up, wgrad, wgrad_up) as in ``fused_experts``."""
    gemm, up, _, _ = tiles
    check_row_tiles(gemm, up, "expert rows")
    R = rows_RD.shape[0]
    dtypes = (w1_EHD.dtype, w2_EDH.dtype, w3_EHD.dtype)
    w1, w2, w3 = (w.to(rows_RD.dtype) for w in (w1_EHD, w2_EDH, w3_EHD))
    offsets = tile_offsets(rows_per_expert_E, gemm.block_m)
    h, a1, a3 = grouped_gemm(rows_RD, w1, offsets, R, transpose_w=True, tiles=up, mode=SWIGLU_FWD,
                             w2_E=w3, a_scale=scale_R)
    y = grouped_gemm(h, w2, offsets, R, transpose_w=True, tiles=gemm, mode=PLAIN)
    return y, ExpertRowsState(rows_RD, scale_R, (w1, w2, w3), dtypes, h, a1, a3, offsets)


def expert_rows_backward(
    grad_y_RD: torch.Tensor, state: ExpertRowsState, tiles: tuple[GemmTiles, GemmTiles, GemmTiles, GemmTiles],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(grad of the (scaled) rows (R, D), grad w1, grad w2, grad w3 in the weights' dtypes)."""
    gemm, up, wgrad, wgrad_up = tiles
    w1, w2, w3 = state.weights
    dt1, dt2, dt3 = state.weight_dtypes
    R, E = grad_y_RD.shape[0], w1.shape[0]
    grad_y_RD = grad_y_RD.contiguous()
    expert_offsets = state.offsets[0]
    d_a1, d_a3 = grouped_gemm(grad_y_RD, w2, state.offsets, R, transpose_w=False, tiles=up, mode=SWIGLU_BWD,
                              aux=(state.a1, state.a3))
    d_rows = grouped_gemm(d_a1, w1, state.offsets, R, transpose_w=False, tiles=gemm, mode=DUAL, a2=d_a3, w2_E=w3)
    grad_w2 = grouped_wgrad(grad_y_RD, state.h, expert_offsets, E, tiles=wgrad, out_dtype=dt2)
    grad_w1, grad_w3 = grouped_wgrad(d_a1, state.rows_RD, expert_offsets, E, tiles=wgrad_up, out_dtype=dt1,
                                     b_scale=state.scale_R, a2=d_a3)
    return d_rows, grad_w1, grad_w2, grad_w3.to(dt3)
