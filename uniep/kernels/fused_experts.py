"""The routed-expert block on Triton kernels, forward and backward (one rank).

Shape legend: T tokens, K experts per token, P = T*K rows, D model dim, H expert hidden
dim, E experts. Rows are expert-major in the plan's order (expert, token, k).

Forward (3 launches):
  1. gate/up grouped GEMM, x rows gathered in the kernel, w1 and w3 in one pass,
     SwiGLU in the epilogue            -> h (P, H), a1, a3 (P, H) kept for backward
  2. down grouped GEMM, output rows scattered to (token, k) order   -> y (P, D)
  3. fixed-order top-k combine, scores applied in fp32              -> out (T, D)
Backward (6 launches): combine backward; down dgrad with the SwiGLU backward in the
epilogue; up dgrad (w1 and w3 in one accumulator) scattered to (token, k) order;
fixed-order sum of each token's K input gradients; two weight-gradient GEMMs (w2, and
w1 with w3 from shared token loads) that each sum an expert's rows in plan order inside
one program.

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
    grouped_gemm,
    tile_offsets,
)
from uniep.kernels.wgrad import grouped_wgrad


class FusedExpertsFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TD, scores_TK, send_order_P, rows_per_expert_E, w1, w2, w3, score_before, tiles, up_tiles, wgrad_tiles, wgrad_up_tiles):
        T, K = scores_TK.shape
        P = T * K
        param_dtypes = (w1.dtype, w2.dtype, w3.dtype)
        w1, w2, w3 = (w.to(x_TD.dtype) for w in (w1, w2, w3))
        offsets = tile_offsets(rows_per_expert_E, tiles.block_m)
        pair_of_row = send_order_P.to(torch.int32)
        token_of_row = (send_order_P // K).to(torch.int32)
        row_scale = scores_TK.reshape(-1)[send_order_P].contiguous() if score_before else None

        # w1 is (E, H, D): B[e] = w1[e]^T is (D, H)
        h, a1, a3 = grouped_gemm(
            x_TD, w1, offsets, P, transpose_w=True, tiles=up_tiles, mode=SWIGLU_FWD,
            w2_E=w3, a_row=token_of_row, a_scale=row_scale,
        )
        # w2 is (E, D, H): B[e] = w2[e]^T is (H, D)
        y_PD = grouped_gemm(h, w2, offsets, P, transpose_w=True, tiles=tiles, mode=PLAIN, c_row=pair_of_row)
        out = topk_combine(y_PD, None if score_before else scores_TK, K)

        ctx.save_for_backward(x_TD, scores_TK, pair_of_row, token_of_row, row_scale, *offsets, h, a1, a3, y_PD, w1, w2, w3)
        ctx.score_before, ctx.tiles, ctx.wgrad_tiles, ctx.num_experts = score_before, tiles, wgrad_tiles, w1.shape[0]
        ctx.wgrad_up_tiles = wgrad_up_tiles
        ctx.param_dtypes = param_dtypes
        return out

    @staticmethod
    def backward(ctx, grad_out_TD):
        x_TD, scores_TK, pair_of_row, token_of_row, row_scale, expert_offsets, tile_offs, h, a1, a3, y_PD, w1, w2, w3 = ctx.saved_tensors
        T, K = scores_TK.shape
        P = T * K
        E = ctx.num_experts
        tiles, wtiles = ctx.tiles, ctx.wgrad_tiles
        offsets = (expert_offsets, tile_offs)
        grad_out_TD = grad_out_TD.contiguous()

        # grad of y in (token, k) order; grad of the scores when applied after the experts
        grad_y_PD, grad_scores = topk_combine_bwd(grad_out_TD, y_PD, None if ctx.score_before else scores_TK, K)
        # B[e] = w2[e] is (D, H): d h = grad_y @ w2[e], then SwiGLU backward
        d_a1, d_a3 = grouped_gemm(
            grad_y_PD, w2, offsets, P, transpose_w=False, tiles=tiles, mode=SWIGLU_BWD,
            a_row=pair_of_row, aux=(a1, a3),
        )
        # B[e] = w1[e] is (H, D): d rows = d_a1 @ w1[e] + d_a3 @ w3[e], to (token, k) order
        d_rows_PD = grouped_gemm(
            d_a1, w1, offsets, P, transpose_w=False, tiles=tiles, mode=DUAL,
            a2=d_a3, w2_E=w3, c_row=pair_of_row,
        )
        if ctx.score_before:
            grad_x = topk_combine(d_rows_PD, scores_TK, K)
            grad_scores = (d_rows_PD.view(T, K, -1).float() * x_TD.float().unsqueeze(1)).sum(-1)
        else:
            grad_x = topk_combine(d_rows_PD, None, K)

        # weight gradients: one program per output tile walks its expert's rows in order
        # written straight from the fp32 accumulators in the parameters' dtypes
        dt1, dt2, dt3 = ctx.param_dtypes
        grad_w2 = grouped_wgrad(grad_y_PD, h, expert_offsets, E, tiles=wtiles, out_dtype=dt2, a_row=pair_of_row)
        grad_w1, grad_w3 = grouped_wgrad(
            d_a1, x_TD, expert_offsets, E, tiles=ctx.wgrad_up_tiles, out_dtype=dt1,
            b_row=token_of_row, b_scale=row_scale, a2=d_a3,
        )
        grad_w3 = grad_w3.to(dt3)
        return grad_x, grad_scores, None, None, grad_w1, grad_w2, grad_w3, None, None, None, None, None


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
    ``up_tiles`` / ``wgrad_up_tiles`` (default: ``tiles`` / ``wgrad_tiles``) are used by
    the two-accumulator launches (gate/up forward, w1/w3 gradient); their ``block_m``
    must equal ``tiles.block_m``.
    """
    _check_inputs(x_TD, scores_TK, w1_EHD, w2_EDH, w3_EHD)
    if up_tiles is not None and up_tiles.block_m != tiles.block_m:
        raise ValueError(
            f"fused_experts: up_tiles.block_m = {up_tiles.block_m} must equal tiles.block_m = "
            f"{tiles.block_m} (both launches share the row-tile schedule)"
        )
    return FusedExpertsFunction.apply(
        x_TD.contiguous(), scores_TK.float().contiguous(), send_order_P, rows_per_expert_E,
        w1_EHD, w2_EDH, w3_EHD, score_before_experts, tiles, up_tiles or tiles, wgrad_tiles,
        wgrad_up_tiles or wgrad_tiles,
    )


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
