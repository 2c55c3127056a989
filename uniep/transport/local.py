"""One rank: send order is already the expert-major row order, nothing moves."""

from __future__ import annotations

import torch

from uniep.plan import RoutingPlan


class LocalTransport:
    ep_size = 1
    ep_rank = 0

    def gather_counts(self, counts_E: torch.Tensor) -> torch.Tensor:
        return counts_E.unsqueeze(0)

    def dispatch(self, rows_PD: torch.Tensor, plan: RoutingPlan) -> torch.Tensor:
        return rows_PD

    def combine(self, rows_RD: torch.Tensor, plan: RoutingPlan) -> torch.Tensor:
        return rows_RD
