"""How rows move between the ranks of an expert-parallel group.

A transport has three calls, each differentiable where rows are involved:

- ``gather_counts(counts_E) -> (W, E)``: the all-gathered count table of the plan;
- ``dispatch(rows_PD, plan) -> (R, D)``: rows in send order to the owners, expert-major;
- ``combine(rows_RD, plan) -> (P, D)``: expert outputs back to their senders, send order.

The backward of dispatch is a combine and vice versa.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from uniep.transport.all_to_all import AllToAllTransport
from uniep.transport.local import LocalTransport

__all__ = ["AllToAllTransport", "LocalTransport", "MegakernelTransport", "build_transport", "ranks_per_node"]

# Megakernel transports (their symmetric-memory buffers) are built once per process group.
_MEGAKERNEL_TRANSPORTS: dict = {}


def ranks_per_node() -> int | None:
    """Processes per node: torchrun's ``LOCAL_WORLD_SIZE``, else the number of GPUs here
    (one process per GPU), else None."""
    value = os.environ.get("LOCAL_WORLD_SIZE")
    if value:
        return int(value)
    return torch.cuda.device_count() or None


class MegakernelTransport(AllToAllTransport):
    """A group inside one node. Counts are all-gathered like ``all_to_all``'s (and its
    dispatch/combine serve the PyTorch backend); the fused path reaches the peers through
    ``peers``. One set of peer buffers per group, shared by every layer (the layers run
    one after another, and each launch has its own epoch)."""

    def __init__(self, group: dist.ProcessGroup):
        from uniep.transport.megakernel import PeerBuffers

        super().__init__(group)
        self.peers = PeerBuffers.symmetric(group)


def build_transport(name: str, group: dist.ProcessGroup | None):
    """The transport called ``name`` over ``group`` (None or a group of one: local).
    ``megakernel`` over a group larger than a node (:func:`ranks_per_node`) is
    the hierarchical transport: the megakernel inside each node, all-to-all between."""
    if group is None or dist.get_world_size(group) == 1:
        return LocalTransport()
    if name == "all_to_all":
        return AllToAllTransport(group)
    if name == "megakernel":
        if group not in _MEGAKERNEL_TRANSPORTS:
            from uniep.transport.hierarchical import HierarchicalTransport

            per_node = ranks_per_node()
            if per_node is not None and dist.get_world_size(group) > per_node:
                _MEGAKERNEL_TRANSPORTS[group] = HierarchicalTransport(group, per_node)
            else:
                _MEGAKERNEL_TRANSPORTS[group] = MegakernelTransport(group)
        return _MEGAKERNEL_TRANSPORTS[group]
    raise ValueError(f"transport = {name!r}; allowed values: 'all_to_all', 'megakernel'")
