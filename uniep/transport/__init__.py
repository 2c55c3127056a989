"""How rows move between the ranks of an expert-parallel group.

A transport has three calls, each differentiable where rows are involved:

- ``gather_counts(counts_E) -> (W, E)``: the all-gathered count table of the plan;
- ``dispatch(rows_PD, plan) -> (R, D)``: rows in send order to the owners, expert-major;
- ``combine(rows_RD, plan) -> (P, D)``: expert outputs back to their senders, send order.

The backward of dispatch is a combine and vice versa.
"""

from __future__ import annotations

import torch.distributed as dist

from uniep.transport.all_to_all import AllToAllTransport
from uniep.transport.local import LocalTransport

__all__ = ["AllToAllTransport", "LocalTransport", "build_transport"]


def build_transport(name: str, group: dist.ProcessGroup | None):
    """The transport called ``name`` over ``group`` (None or a group of one: local)."""
    if group is None or dist.get_world_size(group) == 1:
        return LocalTransport()
    if name == "all_to_all":
        return AllToAllTransport(group)
    raise ValueError(f"transport = {name!r}; allowed values: 'all_to_all'")
