"""The plain-PyTorch path: the reference every other path matches, on any device and
expert-parallel degree, over a row-moving transport (local or all_to_all).

Shape legend: T local tokens, K experts per token, P = T*K (token, k) pairs, D model
dim, R rows on this rank.
"""

from __future__ import annotations

import torch

from uniep.experts import expert_mlp_torch
from uniep.plan import build_plan
from uniep.rows import permute_rows, replicate_topk, sum_topk_fp32
from uniep.transport import AllToAllTransport, LocalTransport


class TorchPath:
    def __init__(self, transport: AllToAllTransport | LocalTransport, schedules, num_experts: int,
                 score_before_experts: bool):
        self.transport, self.schedules = transport, schedules
        self.ep_size = transport.ep_size
        self.num_experts, self.score_before_experts = num_experts, score_before_experts

    def __call__(self, x_TD, scores_TK, topk_TK, counts_E, order_2P, w1, w2, w3) -> torch.Tensor:
        T, D = x_TD.shape
        K = topk_TK.shape[1]
        # No tiles here; resolved anyway so that config = "auto" logs its choice on every
        # backend (CPU runs show what a GPU run of the same job would pick).
        self.schedules.config_for(x_TD, w1, K, self.ep_size)
        transport = self.transport
        plan = build_plan(topk_TK, self.num_experts, transport.gather_counts(counts_E), transport.ep_rank, order_2P)
        # shape (P, D): one row per (token, k) pair, in send order (expert, token, k)
        rows_PD = permute_rows(replicate_topk(x_TD, K), plan.send_order, plan.send_order_inverse)
        if self.score_before_experts:
            scores_P1 = permute_rows(scores_TK.reshape(-1, 1), plan.send_order, plan.send_order_inverse)
            rows_PD = (rows_PD.float() * scores_P1).to(x_TD.dtype)

        # shape (R, D): this rank's rows, expert-major
        rows_RD = transport.dispatch(rows_PD, plan)
        out_RD = expert_mlp_torch(rows_RD, plan.rows_per_local_expert, w1, w2, w3)
        back_PD = transport.combine(out_RD, plan)

        # shape (T, K, D): expert outputs back in (token, k) order
        out_TKD = permute_rows(back_PD, plan.send_order_inverse, plan.send_order).view(T, K, D)
        weights_TK = None if self.score_before_experts else scores_TK
        return sum_topk_fp32(out_TKD, weights_TK).to(x_TD.dtype)
