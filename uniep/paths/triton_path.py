"""The Triton paths: the expert MLP on the Triton kernels, on one rank
(``fused_experts``: the token rows copied to plan order once, then read by the GEMMs)
or over the all_to_all transport.

Shape legend: T local tokens, K experts per token, P = T*K pairs (send order), R rows
received (expert-major), D model dim, E experts (El on this rank).

The all_to_all path is ``fused_experts`` with the row exchange in the middle, step for
step: the token rows (scaled by their scores where scores are applied before the
experts) go to the owners; the owners run the gate/up and down GEMMs
(``expert_rows_forward``), the down GEMM writing its
rows in arrival order, so they go back as they are; ``topk_combine`` sums them per
token where they land (send order), without a copy to (token, k) order. The backward
sends the combine-backward rows out, the owners return the rows' input gradients
(written in arrival order too), and the sender sums them (and computes the score
gradient) with the same kernels. Every value is computed by the same kernel from the same inputs
as on one rank, so the bits do not depend on the EP degree.
"""

from __future__ import annotations

import functools

import torch

from uniep.backward_state import hold_for_backward, take_for_backward
from uniep.kernels.combine import replicate_rows, tokens_input_grad, topk_combine, topk_combine_bwd
from uniep.kernels.expert_rows import expert_rows_backward, expert_rows_forward
from uniep.kernels.fused_experts import fused_experts
from uniep.kernels.grouped_gemm import ExpertTiles
from uniep.kernels.row_tiles import row_tiles
from uniep.plan import RoutingPlan, build_plan, device_ints
from uniep.transport import AllToAllTransport


class _AllToAllFusedExperts(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TD, scores_TK, w1, w2, w3, plan: RoutingPlan, transport, tiles, score_before: bool):
        K = scores_TK.shape[1]
        rows_PD = replicate_rows(x_TD, K, plan.send_order_inverse, scores_TK if score_before else None)
        rows_RD = transport.dispatch(rows_PD, plan)
        counts = device_ints(plan.rows_per_local_expert, x_TD.device)
        schedule = row_tiles(counts, tiles.gemm.block_m, rows_RD.shape[0])
        y_AD, state = expert_rows_forward(rows_RD, schedule, w1, w2, w3, tiles, target_row=plan.row_to_arrival)
        y_PD = transport.return_arrived(y_AD, plan)  # send order
        out_TD = topk_combine(y_PD, None if score_before else scores_TK, K, rows_row_of_pair=plan.send_order_inverse)
        ctx.save_for_backward(x_TD, scores_TK, y_PD, hold_for_backward(state))
        ctx.plan, ctx.transport, ctx.tiles, ctx.score_before = plan, transport, tiles, score_before
        return out_TD

    @staticmethod
    def backward(ctx, grad_out_TD):
        x_TD, scores_TK, y_PD, handle = ctx.saved_tensors
        plan, transport, before = ctx.plan, ctx.transport, ctx.score_before
        K = scores_TK.shape[1]
        grad_out_TD = grad_out_TD.contiguous()
        grad_y_sent_PD, grad_scores = topk_combine_bwd(grad_out_TD, y_PD, None if before else scores_TK, K,
                                                       row_of_pair=plan.send_order_inverse,
                                                       rows_row_of_pair=plan.send_order_inverse)  # send order
        state = take_for_backward(handle)
        state.grad_y = transport.dispatch(grad_y_sent_PD, plan)
        del grad_y_sent_PD

        def tokens_back(d_rows_AD):  # the rows' input gradients (arrival order) back to their senders, then to tokens
            d_rows_PD = transport.return_arrived(d_rows_AD, plan)  # send order
            return tokens_input_grad(d_rows_PD, x_TD, scores_TK, before, rows_row_of_pair=plan.send_order_inverse)

        (grad_x, grad_scores_before), grad_w1, grad_w2, grad_w3 = expert_rows_backward(state, ctx.tiles, tokens_back)
        grad_scores = grad_scores_before if before else grad_scores
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
    tiles: ExpertTiles,
    score_before_experts: bool,
) -> torch.Tensor:
    """(T, D): sum over k of score[t, k] * expert_{idx[t, k]}(x[t]) with the experts on
    their owners (``transport``: an ``AllToAllTransport``; ``plan`` its routing plan);
    w1, w3 (El, H, D), w2 (El, D, H): this rank's experts."""
    return _AllToAllFusedExperts.apply(
        x_TD.contiguous(), scores_TK.float().contiguous(), w1_EHD, w2_EDH, w3_EHD, plan, transport, tiles,
        score_before_experts,
    )


tiles_of = functools.cache(ExpertTiles.from_config)
"""The tiles of a config, built once per config."""


class TritonPath:
    """One rank: ``fused_experts``."""

    ep_size = 1

    def __init__(self, schedules, score_before_experts: bool):
        self.schedules, self.score_before_experts = schedules, score_before_experts

    def __call__(self, x_TD, scores_TK, topk_TK, counts_E, order_2P, w1, w2, w3) -> torch.Tensor:
        config = self.schedules.config_for(x_TD, w1, topk_TK.shape[1], 1)
        return fused_experts(x_TD, scores_TK, order_2P, counts_E, w1, w2, w3,
                             score_before_experts=self.score_before_experts, tiles=tiles_of(config))


class TritonAllToAllPath:
    """Expert-parallel degree > 1: the rows to their owners and back over all_to_all,
    the same bits as one rank."""

    def __init__(self, transport: AllToAllTransport, schedules, num_experts: int, score_before_experts: bool):
        self.transport, self.schedules = transport, schedules
        self.ep_size = transport.ep_size
        self.num_experts, self.score_before_experts = num_experts, score_before_experts

    def __call__(self, x_TD, scores_TK, topk_TK, counts_E, order_2P, w1, w2, w3) -> torch.Tensor:
        config = self.schedules.config_for(x_TD, w1, topk_TK.shape[1], self.ep_size)
        t = self.transport
        plan = build_plan(topk_TK, self.num_experts, t.gather_counts(counts_E), t.ep_rank, order_2P)
        return all_to_all_fused_experts(x_TD, scores_TK, plan, t, w1, w2, w3, tiles=tiles_of(config),
                                        score_before_experts=self.score_before_experts)
