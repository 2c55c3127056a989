"""Token-choice top-k router with the same semantics as TorchTitan 0.2.2's router.

Shape legend: T tokens, D model dim, E experts, K experts per token, G expert groups.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from uniep.batch_invariant import in_fixed_row_blocks
from uniep.init import trunc_normal_
from uniep.kernels.router_select import select_experts_reference
from uniep.router_op import choice_of_logits, router_choice


class TopKRouter(nn.Module):
    """Scores tokens against experts and picks K experts per token.

    ``expert_bias`` (aux-loss-free load balancing) shifts the selection only; the
    returned weights come from the unbiased scores. With ``num_expert_groups`` set, only
    the ``num_limited_groups`` best groups (by the sum of their two best scores) are
    eligible (node-limited routing).

    ``fused`` (set by the layer where its experts run on Triton; not with node-limited
    groups): the gate's logits, scores and choice in one launch, their backward in one
    launch and two GEMMs, eagerly and compiled alike (``uniep.router_op``).
    Otherwise PyTorch ops in TorchTitan's order.
    """

    def __init__(
        self,
        dim: int,
        num_experts: int,
        top_k: int,
        score_func: Literal["softmax", "sigmoid"] = "sigmoid",
        route_norm: bool = False,
        route_scale: float = 1.0,
        gate_bias: bool = False,
        num_expert_groups: int | None = None,
        num_limited_groups: int | None = None,
        force_load_balance: bool = False,
    ):
        super().__init__()
        if score_func not in ("softmax", "sigmoid"):
            raise ValueError(f"score_func = {score_func!r}; allowed values: 'softmax', 'sigmoid'")
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k = {top_k} must be in [1, num_experts = {num_experts}]")
        if num_expert_groups is not None:
            if num_experts % num_expert_groups != 0 or num_experts // num_expert_groups < 2:
                raise ValueError(
                    f"num_expert_groups = {num_expert_groups} must divide num_experts = "
                    f"{num_experts} into groups of at least 2 experts"
                )
            if num_limited_groups is None or not 1 <= num_limited_groups <= num_expert_groups:
                raise ValueError(
                    f"num_limited_groups = {num_limited_groups} must be in [1, num_expert_groups = "
                    f"{num_expert_groups}] when num_expert_groups is set"
                )
        self.gate = nn.Linear(dim, num_experts, bias=gate_bias)
        self.num_experts = num_experts
        self.top_k = top_k
        self.score_func = score_func
        self.route_norm = route_norm
        self.route_scale = route_scale
        self.num_expert_groups = num_expert_groups
        self.num_limited_groups = num_limited_groups
        self.force_load_balance = force_load_balance
        self._fused = False

    @property
    def fused(self) -> bool:
        return self._fused

    @fused.setter
    def fused(self, on: bool) -> None:
        self._fused = on and self.num_expert_groups is None

    def _activate(self, logits_TE: torch.Tensor) -> torch.Tensor:
        # Scores in fp32, as TorchTitan does, to keep routing stable in bf16 training.
        if self.score_func == "sigmoid":
            return torch.sigmoid(logits_TE.float())
        return F.softmax(logits_TE.float(), dim=1)

    def _limit_groups(self, scores_for_choice_TE: torch.Tensor) -> torch.Tensor:
        grouped_TGe = scores_for_choice_TE.unflatten(-1, (self.num_expert_groups, -1))
        group_scores_TG = grouped_TGe.topk(2, dim=-1).values.sum(dim=-1)
        keep_TG = torch.zeros_like(group_scores_TG, dtype=torch.bool)
        keep_TG.scatter_(
            1, group_scores_TG.topk(self.num_limited_groups, dim=-1, sorted=False).indices, True
        )
        return grouped_TGe.masked_fill(~keep_TG.unsqueeze(-1), float("-inf")).flatten(1)

    def forward(
        self,
        x_TD: torch.Tensor,
        expert_bias_E: torch.Tensor | None = None,
        topk_idx_TK: torch.Tensor | None = None,
        logits_TE: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns ``(top_scores_TK fp32, topk_idx_TK int64)``. A given ``topk_idx_TK``
        replaces the selection (replaying another layer's routing, e.g. in an fp32
        reference); the scores are still computed from ``x``. ``logits_TE``, fused only:
        the gate's logits of ``x``, computed and differentiated elsewhere (the layer's
        shared experts, ``uniep.shared_experts``)."""
        if logits_TE is not None and not self._fused:
            raise ValueError("TopKRouter: logits_TE is taken by the fused router only")
        if topk_idx_TK is None and self.force_load_balance:
            n = x_TD.shape[0]
            topk_idx_TK = (
                torch.arange(n * self.top_k, device=x_TD.device).view(n, self.top_k) % self.num_experts
            )
        # Batch-invariant: a token's scores must not depend on the rows beside it (EP).
        if logits_TE is not None:
            return choice_of_logits(logits_TE, self.top_k, sigmoid=self.score_func == "sigmoid",
                                    route_norm=self.route_norm, route_scale=self.route_scale,
                                    expert_bias_E=expert_bias_E, topk_idx_TK=topk_idx_TK)
        if self._fused:
            return router_choice(x_TD, self.gate, self.top_k, sigmoid=self.score_func == "sigmoid",
                                 route_norm=self.route_norm, route_scale=self.route_scale,
                                 expert_bias_E=expert_bias_E, topk_idx_TK=topk_idx_TK)
        scores_TE = in_fixed_row_blocks(self.gate, x_TD, then=self._activate)
        choice_TE = None
        if topk_idx_TK is None:
            choice_TE = scores_TE if expert_bias_E is None else scores_TE + expert_bias_E
            if self.num_expert_groups is not None:
                choice_TE = self._limit_groups(choice_TE)
        return select_experts_reference(scores_TE, choice_TE, self.top_k, route_norm=self.route_norm,
                                        route_scale=self.route_scale, topk_idx_TK=topk_idx_TK)

    def init_weights(self, init_std: float) -> None:
        trunc_normal_(self.gate.weight, std=init_std)
