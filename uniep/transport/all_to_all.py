"""torch.distributed all-to-all of rows in plan order (NCCL on GPU, gloo on CPU).

Rows arrive source-major; the plan's ``row_to_arrival`` then puts them expert-major,
ordered by source rank, token and k inside each expert. Combine runs the same steps
backwards. Both are autograd functions whose backward is the other.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from uniep.plan import RoutingPlan
from uniep.rows import permute_rows


def exchange_rows(x_MD: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    """All-to-all of rows: ``in_splits[r]`` rows of ``x_MD`` go to rank r, ``out_splits[r]``
    rows come from it (rank order)."""
    out = x_MD.new_empty(sum(out_splits), *x_MD.shape[1:])
    dist.all_to_all_single(out, x_MD.contiguous(), out_splits, in_splits, group=group)
    return out


class _Exchange(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_MD, out_splits, in_splits, group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        return exchange_rows(x_MD, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, grad_MD):
        out_splits, in_splits = ctx.splits
        return exchange_rows(grad_MD, in_splits, out_splits, ctx.group), None, None, None


def gather_counts(counts_E: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """(W, E): every rank's ``counts_E`` (E,), in rank order (the plan's count table)."""
    # Flat output: gloo accepts only a 1-D (W*E,) buffer here.
    table = counts_E.new_empty(dist.get_world_size(group) * counts_E.numel())
    dist.all_gather_into_tensor(table, counts_E.contiguous(), group=group)
    return table.view(dist.get_world_size(group), -1)


class AllToAllTransport:
    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        self.ep_size = dist.get_world_size(group)
        self.ep_rank = dist.get_rank(group)

    def gather_counts(self, counts_E: torch.Tensor) -> torch.Tensor:
        return gather_counts(counts_E, self.group)

    def dispatch(self, rows_PD: torch.Tensor, plan: RoutingPlan) -> torch.Tensor:
        arrived = _Exchange.apply(rows_PD, plan.recv_splits, plan.send_splits, self.group)
        return permute_rows(arrived, plan.row_to_arrival, plan.arrival_to_row)

    def combine(self, rows_RD: torch.Tensor, plan: RoutingPlan) -> torch.Tensor:
        return self.return_arrived(permute_rows(rows_RD, plan.arrival_to_row, plan.row_to_arrival), plan)

    def return_arrived(self, rows_AD: torch.Tensor, plan: RoutingPlan) -> torch.Tensor:
        """Rows in arrival order (source-major, as ``dispatch`` received them before its
        permutation; a GEMM can write its output rows there) back to their senders, in
        send order: ``combine`` without its permutation."""
        return _Exchange.apply(rows_AD, plan.send_splits, plan.recv_splits, self.group)
