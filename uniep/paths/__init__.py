"""The routed-expert computation of a UniEP layer: one expert path, chosen once.

Shape legend: T local tokens, K experts per token, P = T*K (token, k) pairs, E experts
(El on this rank), D model dim, H expert hidden dim.

An expert path is called as ``path(x_TD, scores_TK, topk_TK, counts_E, order_2P, w1, w2,
w3)`` with ``counts_E`` (E,) this rank's pairs per expert, ``order_2P`` (2, T*K) its pairs
stably sorted by expert and that order's inverse (``uniep.plan.expert_order``) and this
rank's experts w1, w3 (El, H, D), w2 (El, D, H); it returns the (T, D) routed output,
differentiable in x, the scores and the weights, and knows its ``ep_size``. It runs
eagerly (the layer calls it through ``uniep.routed_op``, which torch.compile does not
trace into). Every path gives the bits of the one-rank path of its backend.

:func:`build_expert_path` is the one place that reads ``backend``, ``transport``, the
processes per node and ``TRITON_INTERPRET``; a config that cannot run on the device
fails there, when the layer is built or moved, not at its first forward.
"""

from __future__ import annotations

import os
from typing import Protocol

import torch
import torch.distributed as dist

from uniep.config import UniEPConfig, UniEPConfigError
from uniep.paths.schedules import Schedules
from uniep.transport import row_transport

__all__ = ["ExpertPath", "build_expert_path", "ranks_per_node"]


class ExpertPath(Protocol):
    ep_size: int

    def __call__(self, x_TD: torch.Tensor, scores_TK: torch.Tensor, topk_TK: torch.Tensor, counts_E: torch.Tensor,
                 order_2P: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor) -> torch.Tensor: ...


def ranks_per_node() -> int | None:
    """Processes per node: torchrun's ``LOCAL_WORLD_SIZE``, else the number of GPUs here
    (one process per GPU), else None."""
    value = os.environ.get("LOCAL_WORLD_SIZE")
    if value:
        return int(value)
    return torch.cuda.device_count() or None


def runs_triton(device_type: str) -> bool:
    """Whether Triton kernels run on ``device_type``: CUDA, or any device under the
    Triton interpreter (``TRITON_INTERPRET=1``: the CPU tests)."""
    return device_type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def on_triton(config: UniEPConfig, device_type: str) -> bool:
    """Whether ``config``'s backend is Triton on ``device_type`` (``auto``: on CUDA)."""
    return config.backend == "triton" or (config.backend == "auto" and device_type == "cuda")


def build_expert_path(config: UniEPConfig, ep_group: dist.ProcessGroup | None, num_experts: int,
                      score_before_experts: bool, device_type: str) -> ExpertPath:
    """The path ``config`` names over ``ep_group`` (None: one rank) on ``device_type``.
    Raises :class:`UniEPConfigError` for a backend or transport the device cannot run."""
    ep_size = 1 if ep_group is None else dist.get_world_size(ep_group)
    if num_experts % ep_size:
        raise UniEPConfigError(f"expert-parallel degree {ep_size} does not divide num_experts = {num_experts}")
    schedules = Schedules(config, num_experts)
    if ep_size > 1 and config.transport == "megakernel" and config.backend != "torch":
        if not runs_triton(device_type):
            raise UniEPConfigError(
                f"transport = 'megakernel' runs on CUDA GPUs; got device {device_type!r} "
                "(use transport = 'all_to_all', or backend = 'torch')"
            )
        per_node = ranks_per_node()
        if per_node is not None and ep_size > per_node:
            from uniep.paths.hierarchical import HierarchicalPath

            return HierarchicalPath(ep_group, per_node, schedules, num_experts, score_before_experts)
        from uniep.paths.megakernel import MegakernelPath

        return MegakernelPath(ep_group, schedules, num_experts, score_before_experts)

    transport = row_transport(ep_group)
    if not on_triton(config, device_type):
        from uniep.paths.torch_path import TorchPath

        return TorchPath(transport, schedules, num_experts, score_before_experts)
    if not runs_triton(device_type):
        raise UniEPConfigError(f"backend = 'triton' runs on CUDA; got device {device_type!r} (use 'auto' or 'torch')")
    from uniep.paths.triton_path import TritonAllToAllPath, TritonPath

    if ep_size == 1:
        return TritonPath(schedules, score_before_experts)
    return TritonAllToAllPath(transport, schedules, num_experts, score_before_experts)
