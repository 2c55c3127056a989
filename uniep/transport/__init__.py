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

__all__ = ["AllToAllTransport", "LocalTransport", "MegakernelTransport", "build_transport"]

# One set of peer buffers per process group, shared by every layer (the layers run one
# after another, and each launch has its own epoch).
_MEGAKERNEL_TRANSPORTS: dict = {}


class MegakernelTransport(AllToAllTransport):
    """Counts are all-gathered like ``all_to_all``'s (and its dispatch/combine serve the
    PyTorch backend); the fused path reaches the peers through ``peers``."""

    def __init__(self, group: dist.ProcessGroup):
        from uniep.transport.megakernel import PeerBuffers

        super().__init__(group)
        self.peers = PeerBuffers.symmetric(group)


def build_transport(name: str, group: dist.ProcessGroup | None):
    """The transport called ``name`` over ``group`` (None or a group of one: local)."""
    if group is None or dist.get_world_size(group) == 1:
        return LocalTransport()
    if name == "all_to_all":
        return AllToAllTransport(group)
    if name == "megakernel":
        if group not in _MEGAKERNEL_TRANSPORTS:
            _MEGAKERNEL_TRANSPORTS[group] = MegakernelTransport(group)
        return _MEGAKERNEL_TRANSPORTS[group]
    raise ValueError(f"transport = {name!r}; allowed values: 'all_to_all', 'megakernel'")
