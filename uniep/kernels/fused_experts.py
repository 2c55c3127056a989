"""The routed-expert block on Triton kernels, forward and backward (one rank).

Shape legend: T tokens, K experts per token, P = T*K rows, D model dim, H expert hidden
dim, E experts. Rows are expert-major in the plan's order (expert, token, k).

The GEMMs are ``uniep.kernels.expert_rows``' (the one launch sequence of every Triton
path), here reading a plan-order copy of x's rows and scattering to (token, k) order.

Forward (4 launches):
  1. x rows copied to plan order, each token's row read once and written to its K plan
     rows, each times its score where scores come before the experts (kept for the
     w1/w3 gradient), and in the same launch the GEMMs' row-tile schedule
     (``plan_rows``)                                   -> rows (P, D), schedule
  2. gate/up grouped GEMM, w1 and w3 in one pass, SwiGLU in the epilogue
                                       -> h (P, H), a1, a3 (P, H) kept for backward
  3. down grouped GEMM, output rows scattered to (token, k) order   -> y (P, D)
  4. fixed-order top-k combine, scores (if after) applied in fp32   -> out (T, D)
Backward (7 launches): combine backward, its rows written in plan order (so the next
launches load them contiguously, through the copy engine); down dgrad (a plain GEMM)
and the SwiGLU backward in place; up dgrad (w1 and w3 in one accumulator) scattered to
(token, k) order; fixed-order sum of each token's K input gradients; the w1 and w3
weight gradients in one launch; the w2 weight gradient first or last, whichever keeps
less memory alive (``expert_rows.w2_grad_first``). Each weight-gradient tile sums
its expert's rows in plan order inside one program.

An autograd function, which a UniEP layer calls directly, or under torch.compile inside
its ``uniep::routed_experts`` custom op (``uniep.routed_op``). The activations wait for
the backward in ``uniep.backward_state``, where activation checkpointing can drop them.

``score_before_experts`` scales each copied x row by its score (fp32, rounded to the
input dtype) in the copy, as TorchTitan scales its permuted copy: the GEMMs read plain
rows (scaling A in the gate/up GEMM's loads gave rows whose bits changed from run to
run on an H100, ``benchmarks/RESULTS.md``).
"""

from __future__ import annotations

import torch

from uniep.backward_state import hold_for_backward, take_for_backward
from uniep.kernels.combine import tokens_input_grad, topk_combine, topk_combine_bwd
from uniep.kernels.expert_rows import expert_rows_backward, expert_rows_forward
from uniep.kernels.grouped_gemm import ExpertTiles
from uniep.kernels.plan_rows import plan_rows


class _FusedExperts(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TD, scores_TK, order_2P, rows_per_expert_E, w1, w2, w3, score_before: bool,
                tiles: ExpertTiles):
        K = scores_TK.shape[1]
        send_order_P, plan_row = order_2P.unbind()  # each plan row's (token, k) pair, and each pair's plan row
        rows_PD, schedule = plan_rows(x_TD, K, plan_row, rows_per_expert_E, tiles.gemm.block_m,
                                      scores_TK if score_before else None)
        y_PD, state = expert_rows_forward(rows_PD, schedule, w1, w2, w3, tiles, target_row=send_order_P)
        out_TD = topk_combine(y_PD, None if score_before else scores_TK, K)
        # y and the GEMMs' state are held outside the saved tensors, so the backward can
        # release each once used (and activation checkpointing can drop them).
        ctx.save_for_backward(x_TD, scores_TK, plan_row, hold_for_backward((y_PD, state)))
        ctx.score_before, ctx.tiles = score_before, tiles
        return out_TD

    @staticmethod
    def backward(ctx, grad_out_TD):
        x_TD, scores_TK, plan_row, handle = ctx.saved_tensors
        (y_PD, state), score_before, tiles = take_for_backward(handle), ctx.score_before, ctx.tiles
        K = scores_TK.shape[1]
        # grad of y, written in plan order (the GEMMs load its rows contiguously); grad of
        # the scores when applied after the experts. The backward owns grad y from here
        # and releases it after its last use.
        state.grad_y, grad_scores = topk_combine_bwd(grad_out_TD.contiguous(), y_PD,
                                                     None if score_before else scores_TK, K, row_of_pair=plan_row)
        del y_PD
        (grad_x, grad_scores_before), grad_w1, grad_w2, grad_w3 = expert_rows_backward(
            state, tiles, lambda d_rows_PD: tokens_input_grad(d_rows_PD, x_TD, scores_TK, score_before))
        grad_scores = grad_scores_before if score_before else grad_scores
        return grad_x, grad_scores, None, None, grad_w1, grad_w2, grad_w3, None, None


def fused_experts(
    x_TD: torch.Tensor,
    scores_TK: torch.Tensor,
    order_2P: torch.Tensor,
    rows_per_expert_E: torch.Tensor,
    w1_EHD: torch.Tensor,
    w2_EDH: torch.Tensor,
    w3_EHD: torch.Tensor,
    *,
    score_before_experts: bool,
    tiles: ExpertTiles,
) -> torch.Tensor:
    """(T, D): sum over k of score[t, k] * expert_{idx[t, k]}(x[t]) (see module docstring).

    ``order_2P`` (2, P) int64 holds the plan's row order (pair ids ``t*K + k`` sorted by
    expert) and its inverse (``uniep.plan.expert_order``); ``rows_per_expert_E`` (E,)
    int64 the per-expert counts, on the device.
    """
    _check_inputs(x_TD, scores_TK, w1_EHD, w2_EDH, w3_EHD)
    return _FusedExperts.apply(
        x_TD.contiguous(), scores_TK.float().contiguous(), order_2P, rows_per_expert_E,
        w1_EHD, w2_EDH, w3_EHD, score_before_experts, tiles,
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
