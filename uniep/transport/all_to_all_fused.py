"""The routed-expert block over the all_to_all transport with the experts on the Triton
kernels (expert-parallel degree > 1).

Shape legend: T local tokens, K experts per token, P = T*K pairs (send order), R rows
received (expert-major), D model dim.

It is ``fused_experts`` with the row exchange in the middle, step for step: unscaled
token rows (and, with scores applied before the experts, their fp32 scores) go to the
owners; the owners run the gate/up and down GEMMs (``expert_rows_forward``, scores
applied in the GEMM loads); the output rows come back and are summed per token by
``topk_combine``. The backward sends the combine-backward rows out, the owners return
the rows' input gradients, and the sender sums them (and computes the score gradient)
with the same kernels. Every value is computed by the same kernel from the same inputs
as on one rank, so the bits do not depend on the EP degree.
"""

from __future__ import annotations

import torch

from uniep.kernels.combine import topk_combine, topk_combine_bwd
from uniep.kernels.expert_rows import expert_rows_backward, expert_rows_forward
from uniep.kernels.grouped_gemm import GemmTiles
from uniep.plan import RoutingPlan, device_ints


class _AllToAllFusedExperts(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TD, scores_TK, w1, w2, w3, plan: RoutingPlan, transport, tiles, score_before: bool):
        K = scores_TK.shape[1]
        rows_PD = x_TD.index_select(0, plan.send_order // K)
        rows_RD = transport.dispatch(rows_PD, plan)
        scale_R = None
        if score_before:
            scale_R = transport.dispatch(scores_TK.reshape(-1, 1).index_select(0, plan.send_order), plan).reshape(-1)
        counts = device_ints(plan.rows_per_local_expert, x_TD.device)
        y_RD, state = expert_rows_forward(rows_RD, scale_R, counts, w1, w2, w3, tiles)
        y_PD = transport.combine(y_RD, plan).index_select(0, plan.send_order_inverse)  # (token, k) order
        out_TD = topk_combine(y_PD, None if score_before else scores_TK, K)
        ctx.save_for_backward(x_TD, scores_TK, y_PD)
        ctx.state, ctx.plan, ctx.transport, ctx.tiles, ctx.score_before = state, plan, transport, tiles, score_before
        return out_TD

    @staticmethod
    def backward(ctx, grad_out_TD):
        x_TD, scores_TK, y_PD = ctx.saved_tensors
        plan, transport, before = ctx.plan, ctx.transport, ctx.score_before
        K = scores_TK.shape[1]
        grad_out_TD = grad_out_TD.contiguous()
        grad_y_PD, grad_scores = topk_combine_bwd(grad_out_TD, y_PD, None if before else scores_TK, K)
        grad_y_RD = transport.dispatch(grad_y_PD.index_select(0, plan.send_order), plan)
        d_rows_RD, grad_w1, grad_w2, grad_w3 = expert_rows_backward(grad_y_RD, ctx.state, ctx.tiles)
        d_rows_PD = transport.combine(d_rows_RD, plan).index_select(0, plan.send_order_inverse)
        if before:
            grad_x = topk_combine(d_rows_PD, scores_TK, K)
            _, grad_scores = topk_combine_bwd(x_TD, d_rows_PD, scores_TK, K, write_rows=False)
        else:
            grad_x = topk_combine(d_rows_PD, None, K)
        return grad_x, grad_scores, grad_w1, grad_w2, grad_w3, None, None, None, None


def all_to_all_fused_experts(
    x_TD: torch.Tensor,
    scores_TK: torch.Tensor,
    plan: RoutingPlan,
    transport,
    w1_EHD: torch.Tensor,
    w2_EDH: torch.Tensor,
    w3_EHD: torch.Tensor,
    *,
    tiles: tuple[GemmTiles, GemmTiles, GemmTiles, GemmTiles],
    score_before_experts: bool,
) -> torch.Tensor:
    """(T, D): sum over k of score[t, k] * expert_{idx[t, k]}(x[t]) with the experts on
    their owners (``transport``: an ``AllToAllTransport``; ``plan`` its routing plan);
    w1, w3 (El, H, D), w2 (El, D, H): this rank's experts; ``tiles`` = (gemm, up,
    wgrad, wgrad_up) as in ``fused_experts``."""
    return _AllToAllFusedExperts.apply(
        x_TD.contiguous(), scores_TK.float().contiguous(), w1_EHD, w2_EDH, w3_EHD, plan, transport, tiles,
        score_before_experts,
    )
