"""How rows move between the ranks of an expert-parallel group.

A row-moving transport (local, all_to_all) has three calls, each differentiable where
rows are involved:

- ``gather_counts(counts_E) -> (W, E)``: the all-gathered count table of the plan;
- ``dispatch(rows_PD, plan) -> (R, D)``: rows in send order to the owners, expert-major;
- ``combine(rows_RD, plan) -> (P, D)``: expert outputs back to their senders, send order.

The backward of dispatch is a combine and vice versa. The megakernel moves rows inside
its kernels instead: its peer buffers (``peer_buffers``) and work lists (``sends``)
live here too.
"""

from __future__ import annotations

import torch.distributed as dist

from uniep.transport.all_to_all import AllToAllTransport
from uniep.transport.local import LocalTransport

__all__ = ["AllToAllTransport", "LocalTransport", "row_transport"]


def row_transport(group: dist.ProcessGroup | None) -> AllToAllTransport | LocalTransport:
    """The row-moving transport over ``group`` (None or a group of one: local)."""
    if group is None or dist.get_world_size(group) == 1:
        return LocalTransport()
    return AllToAllTransport(group)
