"""The routed-expert block on Triton kernels, forward and backward (one rank).

Shape legend: T tokens, K experts per token, P = T*K rows, D model dim, H expert hidden
dim, E experts. Rows are expert-major in the plan's order (expert, token, k).

Forward (3 launches):
  1. gate/up grouped GEMM, x rows gathered in the kernel, w1 and w3 in one pass,
     SwiGLU in the epilogue            -> h (P, H), a1, a3 (P, H) kept for backward
  2. down grouped GEMM, output rows scattered to (token, k) order   -> y (P, D)
  3. fixed-order top-k combine, scores applied in fp32              -> out (T, D)
Backward (6 launches): combine backward; down dgrad with the SwiGLU backward in the
epilogue; the w2 weight gradient; up dgrad (w1 and w3 in one accumulator) scattered to
(token, k) order; fixed-order sum of each token's K input gradients; the w1 and w3
weight gradients in one launch. Each weight-gradient tile sums its expert's rows in
plan order inside one program.

Registered as the custom ops ``uniep::fused_experts_fwd`` / ``uniep::fused_experts_bwd``
with fake (meta) implementations and autograd, so ``torch.compile`` traces through them
without graph breaks and activation checkpointing sees ordinary ops.

``score_before_experts`` scales each gathered x row by its score (fp32, rounded to the
input dtype) inside the GEMM loads, as TorchTitan scales its permuted copy.
"""

from __future__ import annotations

import torch

from uniep.kernels.combine import topk_combine, topk_combine_bwd
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

# Tile settings travel through the custom ops as a flat list of ints: for each of the
# four tile sets (tiles, up_tiles, wgrad_tiles, wgrad_up_tiles), these fields in order.
_TILE_FIELDS = ("block_m", "block_n", "block_k", "num_warps", "num_stages", "num_programs", "descriptors")


def _pack_tiles(*tile_sets: GemmTiles) -> list[int]:
    return [int(getattr(t, f) or 0) for t in tile_sets for f in _TILE_FIELDS]


def _unpack_tiles(packed: list[int]) -> list[GemmTiles]:
    n = len(_TILE_FIELDS)
    sets = [dict(zip(_TILE_FIELDS, packed[i : i + n])) for i in range(0, len(packed), n)]
    return [GemmTiles(**{**s, "num_programs": s["num_programs"] or None, "descriptors": bool(s["descriptors"])})
            for s in sets]


@torch.library.custom_op("uniep::fused_experts_fwd", mutates_args=())
def _fused_experts_fwd(
    x_TD: torch.Tensor, scores_TK: torch.Tensor, send_order_P: torch.Tensor, rows_per_expert_E: torch.Tensor,
    w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor, score_before: bool, tiles: list[int],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (out (T, D), h, a1, a3 (P, H), y (P, D), expert_offsets, tile_offsets (E+1,))."""
    gemm, up, _, _ = _unpack_tiles(tiles)
    T, K = scores_TK.shape
    P = T * K
    w1, w2, w3 = (w.to(x_TD.dtype) for w in (w1, w2, w3))
    offsets = tile_offsets(rows_per_expert_E, gemm.block_m)
    pair_of_row = send_order_P.to(torch.int32)
    token_of_row = (send_order_P // K).to(torch.int32)
    row_scale = scores_TK.reshape(-1)[send_order_P].contiguous() if score_before else None

    # w1 is (E, H, D): B[e] = w1[e]^T is (D, H)
    h, a1, a3 = grouped_gemm(
        x_TD, w1, offsets, P, transpose_w=True, tiles=up, mode=SWIGLU_FWD,
        w2_E=w3, a_row=token_of_row, a_scale=row_scale,
    )
    # w2 is (E, D, H): B[e] = w2[e]^T is (H, D)
    y_PD = grouped_gemm(h, w2, offsets, P, transpose_w=True, tiles=gemm, mode=PLAIN, c_row=pair_of_row)
    out = topk_combine(y_PD, None if score_before else scores_TK, K)
    return out, h, a1, a3, y_PD, *offsets


@_fused_experts_fwd.register_fake
def _(x_TD, scores_TK, send_order_P, rows_per_expert_E, w1, w2, w3, score_before, tiles):
    T, K = scores_TK.shape
    E, H, D = w1.shape
    rows = x_TD.new_empty(T * K, H)
    offsets = torch.empty(E + 1, dtype=torch.int32, device=x_TD.device)
    return (x_TD.new_empty(T, D), rows, torch.empty_like(rows), torch.empty_like(rows),
            x_TD.new_empty(T * K, D), offsets, torch.empty_like(offsets))


@torch.library.custom_op("uniep::fused_experts_bwd", mutates_args=())
def _fused_experts_bwd(
    grad_out_TD: torch.Tensor, x_TD: torch.Tensor, scores_TK: torch.Tensor, send_order_P: torch.Tensor,
    w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor,
    h: torch.Tensor, a1: torch.Tensor, a3: torch.Tensor, y_PD: torch.Tensor,
    expert_offsets: torch.Tensor, tile_offs: torch.Tensor, score_before: bool, tiles: list[int],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (grad_x, grad_scores (fp32), grad_w1, grad_w2, grad_w3 (the weights' dtypes))."""
    gemm, up, wgrad, wgrad_up = _unpack_tiles(tiles)
    T, K = scores_TK.shape
    P = T * K
    E = w1.shape[0]
    dt1, dt2, dt3 = w1.dtype, w2.dtype, w3.dtype
    w1, w2, w3 = (w.to(x_TD.dtype) for w in (w1, w2, w3))
    offsets = (expert_offsets, tile_offs)
    pair_of_row = send_order_P.to(torch.int32)
    token_of_row = (send_order_P // K).to(torch.int32)
    row_scale = scores_TK.reshape(-1)[send_order_P].contiguous() if score_before else None
    grad_out_TD = grad_out_TD.contiguous()

    # grad of y in (token, k) order; grad of the scores when applied after the experts
    grad_y_PD, grad_scores = topk_combine_bwd(grad_out_TD, y_PD, None if score_before else scores_TK, K)
    # B[e] = w2[e] is (D, H): d h = grad_y @ w2[e], then SwiGLU backward
    d_a1, d_a3 = grouped_gemm(
        grad_y_PD, w2, offsets, P, transpose_w=False, tiles=up, mode=SWIGLU_BWD,
        a_row=pair_of_row, aux=(a1, a3),
    )
    # Weight gradients: one program per output tile walks its expert's rows in order,
    # written straight from the fp32 accumulators in the parameters' dtypes. The order
    # of the launches below keeps at most two (P, .) temporaries alive at a time.
    grad_w2 = grouped_wgrad(grad_y_PD, h, expert_offsets, E, tiles=wgrad, out_dtype=dt2, a_row=pair_of_row)
    del grad_y_PD
    # B[e] = w1[e] is (H, D): d rows = d_a1 @ w1[e] + d_a3 @ w3[e], to (token, k) order
    d_rows_PD = grouped_gemm(
        d_a1, w1, offsets, P, transpose_w=False, tiles=gemm, mode=DUAL,
        a2=d_a3, w2_E=w3, c_row=pair_of_row,
    )
    if score_before:
        grad_x = topk_combine(d_rows_PD, scores_TK, K)
        # d score[t, k] = <x[t], d rows[t*K + k]>: the combine backward's weight gradient
        _, grad_scores = topk_combine_bwd(x_TD, d_rows_PD, scores_TK, K, write_rows=False)
    else:
        grad_x = topk_combine(d_rows_PD, None, K)
    del d_rows_PD
    grad_w1, grad_w3 = grouped_wgrad(
        d_a1, x_TD, expert_offsets, E, tiles=wgrad_up, out_dtype=dt1,
        b_row=token_of_row, b_scale=row_scale, a2=d_a3,
    )
    return grad_x, grad_scores, grad_w1, grad_w2, grad_w3.to(dt3)


@_fused_experts_bwd.register_fake
def _(grad_out_TD, x_TD, scores_TK, send_order_P, w1, w2, w3, h, a1, a3, y_PD, expert_offsets, tile_offs, score_before, tiles):
    return (torch.empty_like(x_TD), torch.empty_like(scores_TK, dtype=torch.float32),
            torch.empty_like(w1), torch.empty_like(w2), torch.empty_like(w3))


def _setup_context(ctx, inputs, output):
    x_TD, scores_TK, send_order_P, _, w1, w2, w3, score_before, tiles = inputs
    _, h, a1, a3, y_PD, expert_offsets, tile_offs = output
    ctx.save_for_backward(x_TD, scores_TK, send_order_P, w1, w2, w3, h, a1, a3, y_PD, expert_offsets, tile_offs)
    ctx.score_before, ctx.tiles = score_before, tiles
    # Only ``out`` is differentiable: no zero gradients get built for the saved outputs
    # (that cost about 1 GiB and 0.5 ms at the Qwen3-30B-A3B shape on an H200).
    ctx.mark_non_differentiable(h, a1, a3, y_PD, expert_offsets, tile_offs)
    ctx.set_materialize_grads(False)


def _backward(ctx, grad_out, *unused_grads):
    x_TD, scores_TK, send_order_P, w1, w2, w3, h, a1, a3, y_PD, expert_offsets, tile_offs = ctx.saved_tensors
    grad_x, grad_scores, grad_w1, grad_w2, grad_w3 = _fused_experts_bwd(
        grad_out, x_TD, scores_TK, send_order_P, w1, w2, w3, h, a1, a3, y_PD,
        expert_offsets, tile_offs, ctx.score_before, ctx.tiles,
    )
    return grad_x, grad_scores, None, None, grad_w1, grad_w2, grad_w3, None, None


_fused_experts_fwd.register_autograd(_backward, setup_context=_setup_context)


def fused_experts(
    x_TD: torch.Tensor,
    scores_TK: torch.Tensor,
    send_order_P: torch.Tensor,
    rows_per_expert_E: torch.Tensor,
    w1_EHD: torch.Tensor,
    w2_EDH: torch.Tensor,
    w3_EHD: torch.Tensor,
    *,
    score_before_experts: bool,
    tiles: GemmTiles,
    wgrad_tiles: GemmTiles,
    up_tiles: GemmTiles | None = None,
    wgrad_up_tiles: GemmTiles | None = None,
) -> torch.Tensor:
    """(T, D): sum over k of score[t, k] * expert_{idx[t, k]}(x[t]) (see module docstring).

    ``send_order_P`` (P,) int64 is the plan's row order (pair ids ``t*K + k`` sorted by
    expert); ``rows_per_expert_E`` (E,) int64 its per-expert counts, on the device.
    ``up_tiles`` (default: ``tiles``) are used by the two SwiGLU launches (gate/up forward
    with two accumulators, down dgrad with the SwiGLU backward epilogue: both hold twice a
    plain tile's registers), ``wgrad_up_tiles`` (default: ``wgrad_tiles``) by the w1/w3
    gradient; ``up_tiles.block_m`` must equal ``tiles.block_m``.
    """
    _check_inputs(x_TD, scores_TK, w1_EHD, w2_EDH, w3_EHD)
    if up_tiles is not None:
        check_row_tiles(tiles, up_tiles, "fused_experts")
    packed = _pack_tiles(tiles, up_tiles or tiles, wgrad_tiles, wgrad_up_tiles or wgrad_tiles)
    return _fused_experts_fwd(
        x_TD.contiguous(), scores_TK.float().contiguous(), send_order_P, rows_per_expert_E,
        w1_EHD, w2_EDH, w3_EHD, score_before_experts, packed,
    )[0]


def _check_inputs(x_TD, scores_TK, w1, w2, w3) -> None:
    if x_TD.dim() != 2:
        raise ValueError(f"fused_experts: x must be (tokens, dim); got shape {tuple(x_TD.shape)}")
    T, D = x_TD.shape
    E, H, D1 = w1.shape
    if D1 != D or w3.shape != w1.shape or w2.shape != (E, D, H):
        raise ValueError(
            f"fused_experts: weight shapes w1 {tuple(w1.shape)}, w2 {tuple(w2.shape)}, w3 {tuple(w3.shape)} "
            f"do not fit x of dim {D}: expected w1, w3 (E, H, {D}) and w2 (E, {D}, H)"
        )
    if scores_TK.shape[0] != T:
        raise ValueError(f"fused_experts: scores have {scores_TK.shape[0]} rows for {T} tokens")
    devices = {t.device for t in (x_TD, scores_TK, w1, w2, w3)}
    if len(devices) != 1:
        raise ValueError(f"fused_experts: inputs on several devices: {sorted(map(str, devices))}")
    if x_TD.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"fused_experts: x dtype {x_TD.dtype}; allowed: bfloat16, float16, float32")
