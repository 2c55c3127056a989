"""Expert weights (routed and shared) and the plain-PyTorch expert MLP.

Shape legend: E experts (El on this rank), D model dim, H expert hidden dim, R rows.
Parameter names and shapes match TorchTitan 0.2.2 (``experts.w1/w2/w3``,
``shared_experts.w1/w2/w3.weight``) so state dicts and checkpoints are interchangeable.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from uniep.init import trunc_normal_
from uniep.routed_op import routed_experts


class Routing:
    """Where a batch's tokens go: ``scores_TK`` (T, K) fp32 router scores, ``topk_TK``
    (T, K) expert ids, ``counts_E`` (E,) pairs per expert, ``order_2P`` (2, T*K) the pair
    ids ``t*K + k`` stably sorted by expert and that order's inverse
    (``uniep.plan.expert_order``).

    A plain class on purpose: FSDP casts the floating-point tensors among a module's
    arguments to its parameter dtype, looking into tuples, dicts and dataclasses, and
    the scores must stay fp32 (TorchTitan applies them outside its experts). Cast, they
    were bf16 in the forward and fp32 when activation checkpointing recomputed it.
    """

    __slots__ = ("scores_TK", "topk_TK", "counts_E", "order_2P")

    def __init__(self, scores_TK: torch.Tensor, topk_TK: torch.Tensor, counts_E: torch.Tensor,
                 order_2P: torch.Tensor):
        self.scores_TK, self.topk_TK, self.counts_E, self.order_2P = scores_TK, topk_TK, counts_E, order_2P


class GroupedExperts(nn.Module):
    """Routed experts: ``w1`` (E, H, D), ``w2`` (E, D, H), ``w3`` (E, H, D).

    ``num_experts`` is the global count even when only a slice is stored locally.
    The routed-expert computation runs in this module's ``forward`` (as TorchTitan's
    does), so that FSDP, which wraps this module on its own mesh under expert
    parallelism, gathers the weights before it and frees them after.
    """

    def __init__(self, dim: int, hidden_dim: int, num_experts: int):
        super().__init__()
        self.num_experts = num_experts
        self.path_id = -1
        """The ``uniep.routed_op`` path that ``forward`` runs (set by the owning layer)."""
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))

    def forward(self, x_TD: torch.Tensor, routing: Routing) -> torch.Tensor:
        """(T, D) routed-expert output of tokens ``x_TD`` (T, D)."""
        return routed_experts(
            x_TD, routing.scores_TK, routing.topk_TK, routing.counts_E, routing.order_2P, *self.local_weights(),
            self.path_id,
        )

    def local_weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """This rank's (El, ...) slices as plain tensors (expert-parallel shards are DTensors)."""
        return tuple(w.to_local() if isinstance(w, DTensor) else w for w in (self.w1, self.w2, self.w3))

    def init_weights(self, init_std: float) -> None:
        trunc_normal_(self.w1, std=0.02)
        trunc_normal_(self.w2, std=init_std)
        trunc_normal_(self.w3, std=init_std)


class FeedForward(nn.Module):
    """SwiGLU MLP used for the shared experts: ``w2(silu(w1 x) * w3 x)``."""

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))

    def init_weights(self, init_std: float) -> None:
        trunc_normal_(self.w1.weight, std=0.02)
        trunc_normal_(self.w2.weight, std=init_std)
        trunc_normal_(self.w3.weight, std=init_std)


def expert_mlp_torch(
    rows_RD: torch.Tensor,
    rows_per_expert: list[int],
    w1_EHD: torch.Tensor,
    w2_EDH: torch.Tensor,
    w3_EHD: torch.Tensor,
) -> torch.Tensor:
    """(R, D): SwiGLU MLP of each expert over its contiguous block of rows.

    One matmul per expert over all of its rows: the weight gradient of an expert sums its
    rows in plan order inside one GEMM, never split across launches.
    """
    outputs = []
    # unbind, not w[e]: the backward of E selects would build E full-size zero gradients.
    per_expert = zip(*(w.to(rows_RD.dtype).unbind(0) for w in (w1_EHD, w2_EDH, w3_EHD)))
    for rows, (w1, w2, w3) in zip(torch.split(rows_RD, rows_per_expert), per_expert):
        h = F.silu(rows @ w1.t()) * (rows @ w3.t())
        outputs.append(h @ w2.t())
    if not outputs:
        return rows_RD.new_empty(0, w2_EDH.shape[1])
    return torch.cat(outputs)
