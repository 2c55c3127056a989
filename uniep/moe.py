"""UniEPMoE: a drop-in, deterministic replacement for TorchTitan's MoE block.

Shape legend: B batch, S sequence, T = B*S local tokens, D model dim, H expert hidden
dim, E experts, K experts per token, P = T*K (token, k) pairs, R rows on this rank.

Data flows one way: router -> plan -> dispatch -> expert MLPs -> combine -> output.
The plan fixes every row's place (see ``uniep.plan``); the combine sums each token's K
expert outputs in fp32 in the order k = 0..K-1. Parameter and buffer names, shapes and
initialisation match ``torchtitan.models.moe.MoE`` so checkpoints move between the two.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor

from uniep.batch_invariant import in_fixed_row_blocks
from uniep.config import UniEPConfig
from uniep.experts import FeedForward, GroupedExperts, expert_mlp_torch
from uniep.plan import build_plan, device_ints, local_counts
from uniep.router import TopKRouter
from uniep.rows import permute_rows, replicate_topk, sum_topk_fp32
from uniep.transport import build_transport

logger = logging.getLogger("uniep")

# Router settings read from a TorchTitan MoE by name (duck typing: no torchtitan import).
_ROUTER_ATTRS = (
    "top_k",
    "score_func",
    "route_norm",
    "route_scale",
    "num_expert_groups",
    "num_limited_groups",
)


class UniEPMoE(nn.Module):
    def __init__(
        self,
        dim: int,
        hidden_dim: int,
        num_experts: int,
        top_k: int,
        *,
        num_shared_experts: int = 0,
        score_func: Literal["softmax", "sigmoid"] = "sigmoid",
        route_norm: bool = False,
        route_scale: float = 1.0,
        gate_bias: bool = False,
        score_before_experts: bool = True,
        num_expert_groups: int | None = None,
        num_limited_groups: int | None = None,
        load_balance_coeff: float | None = 1e-3,
        force_load_balance: bool = False,
        config: UniEPConfig | None = None,
    ):
        super().__init__()
        if load_balance_coeff is not None and load_balance_coeff <= 0:
            raise ValueError(f"load_balance_coeff = {load_balance_coeff} must be > 0 or None")
        self.config = config or UniEPConfig()
        self.experts = GroupedExperts(dim, hidden_dim, num_experts)
        self.router = TopKRouter(
            dim,
            num_experts,
            top_k,
            score_func=score_func,
            route_norm=route_norm,
            route_scale=route_scale,
            gate_bias=gate_bias,
            num_expert_groups=num_expert_groups,
            num_limited_groups=num_limited_groups,
            force_load_balance=force_load_balance,
        )
        self.shared_experts = (
            FeedForward(dim, hidden_dim * num_shared_experts) if num_shared_experts > 0 else None
        )
        self.score_before_experts = score_before_experts
        # Aux-loss-free load balancing: TorchTitan's optimizer pre-step hook reads
        # tokens_per_expert and updates expert_bias; the forward only accumulates counts.
        self.load_balance_coeff = load_balance_coeff
        if load_balance_coeff is not None:
            self.register_buffer("expert_bias", torch.zeros(num_experts), persistent=True)
        else:
            self.expert_bias = None
        self.register_buffer("tokens_per_expert", torch.zeros(num_experts), persistent=False)
        self.ep_group: dist.ProcessGroup | None = None
        self._auto_configs: dict[tuple, UniEPConfig] = {}

    @property
    def num_experts(self) -> int:
        return self.experts.num_experts

    @property
    def top_k(self) -> int:
        return self.router.top_k

    # construction -----------------------------------------------------------------

    @classmethod
    def from_torchtitan(
        cls,
        moe: nn.Module,
        config: UniEPConfig | None = None,
        ep_group: dist.ProcessGroup | None = None,
    ) -> "UniEPMoE":
        """Take over the parameters and buffers of a ``torchtitan.models.moe.MoE``.

        The new layer shares the parameter objects (no copy). With ``ep_group`` it keeps
        only this rank's contiguous slice of experts (rank r owns experts
        ``[r*E/W, (r+1)*E/W)``).
        """
        w1 = moe.experts.w1
        num_experts, hidden_dim, dim = w1.shape
        shared = moe.shared_experts
        layer = cls(
            dim,
            hidden_dim,
            num_experts,
            moe.router.top_k,
            num_shared_experts=0 if shared is None else shared.w1.weight.shape[0] // hidden_dim,
            gate_bias=moe.router.gate.bias is not None,
            score_before_experts=moe.score_before_experts,
            load_balance_coeff=moe.load_balance_coeff,
            force_load_balance=getattr(moe.router, "_debug_force_load_balance", False),
            config=config,
            **{name: getattr(moe.router, name) for name in _ROUTER_ATTRS[1:]},
        )
        # Share the module objects themselves: same parameters, same names.
        layer.router.gate = moe.router.gate
        if shared is not None:
            layer.shared_experts = shared
        for name in ("w1", "w2", "w3"):
            setattr(layer.experts, name, getattr(moe.experts, name))
        for name in ("expert_bias", "tokens_per_expert"):
            if getattr(moe, name, None) is not None:
                setattr(layer, name, getattr(moe, name))
        if ep_group is not None:
            layer.keep_local_experts(ep_group)
        return layer

    def keep_local_experts(self, ep_group: dist.ProcessGroup) -> None:
        """Keep this rank's slice of experts as plain parameters and route over ``ep_group``."""
        world, rank = dist.get_world_size(ep_group), dist.get_rank(ep_group)
        self._check_ep_degree(world)
        per_rank = self.num_experts // world
        for name in ("w1", "w2", "w3"):
            full = getattr(self.experts, name)
            local = full.detach()[rank * per_rank : (rank + 1) * per_rank].clone()
            setattr(self.experts, name, nn.Parameter(local, requires_grad=full.requires_grad))
        self.ep_group = ep_group

    def shard_experts(self, ep_mesh: DeviceMesh) -> None:
        """Shard the routed experts over a 1-D ``ep_mesh`` as ``Shard(0)`` DTensors (as
        TorchTitan's expert parallelism does, so FSDP and DCP checkpoints work) and route
        over its process group. Works on meta tensors."""
        self._check_ep_degree(ep_mesh.size())
        for name in ("w1", "w2", "w3"):
            param = getattr(self.experts, name)
            setattr(self.experts, name, nn.Parameter(distribute_tensor(param, ep_mesh, [Shard(0)])))
        self.ep_group = ep_mesh.get_group()

    def _check_ep_degree(self, ep_size: int) -> None:
        if self.num_experts % ep_size != 0:
            raise ValueError(
                f"expert-parallel degree {ep_size} does not divide num_experts = {self.num_experts}"
            )

    def init_weights(self, init_std: float, buffer_device: torch.device | None = None) -> None:
        """Same order of random draws as TorchTitan's ``MoE.init_weights``."""
        self.experts.init_weights(init_std)
        self.router.init_weights(init_std)
        if self.shared_experts is not None:
            self.shared_experts.init_weights(init_std)
        device = buffer_device or self.tokens_per_expert.device
        self.tokens_per_expert = torch.zeros(self.num_experts, device=device)
        if self.load_balance_coeff is not None:
            self.expert_bias = torch.zeros(self.num_experts, device=device)

    # forward ----------------------------------------------------------------------

    def forward(self, x: torch.Tensor, topk_idx: torch.Tensor | None = None) -> torch.Tensor:
        """``x`` (B, S, D) -> (B, S, D). ``topk_idx`` (B*S, K), if given, replaces the
        router's expert choice (to replay a routing; the scores still come from ``x``)."""
        if x.dim() != 3:
            raise ValueError(f"UniEPMoE expects x of shape (batch, seq, dim); got {tuple(x.shape)}")
        B, S, D = x.shape
        x_TD = x.reshape(B * S, D)

        top_scores_TK, topk_idx_TK = self.router(x_TD, self.expert_bias, topk_idx)
        counts_E = local_counts(topk_idx_TK, self.num_experts)
        with torch.no_grad():
            self.tokens_per_expert.add_(counts_E)

        transport = build_transport(self.config.transport, self.ep_group)
        config = self._schedule(x_TD.shape[0], x.device, transport.ep_size)
        backend = config.resolved_backend(x.device.type, transport.ep_size)
        if backend == "megakernel":
            out_TD = self._experts_megakernel(x_TD, top_scores_TK, topk_idx_TK, counts_E, config, transport)
        elif backend == "triton" and transport.ep_size > 1:
            out_TD = self._experts_all_to_all_triton(x_TD, top_scores_TK, topk_idx_TK, counts_E, config, transport)
        elif backend == "triton":
            out_TD = self._experts_triton(x_TD, top_scores_TK, topk_idx_TK, counts_E, config)
        else:
            out_TD = self._experts_torch(x_TD, top_scores_TK, topk_idx_TK, counts_E, transport)
        if self.shared_experts is not None:
            out_TD = in_fixed_row_blocks(self.shared_experts, x_TD) + out_TD
        return out_TD.view(B, S, D)

    def _experts_torch(self, x_TD, top_scores_TK, topk_idx_TK, counts_E, transport) -> torch.Tensor:
        """(T, D) routed-expert output on the plain-PyTorch path (any EP degree)."""
        T, D = x_TD.shape
        K = self.top_k
        plan = build_plan(
            topk_idx_TK, self.num_experts, transport.gather_counts(counts_E), transport.ep_rank
        )
        # shape (P, D): one row per (token, k) pair, in send order (expert, token, k)
        rows_PD = permute_rows(replicate_topk(x_TD, K), plan.send_order, plan.send_order_inverse)
        if self.score_before_experts:
            scores_P1 = permute_rows(
                top_scores_TK.reshape(-1, 1), plan.send_order, plan.send_order_inverse
            )
            rows_PD = (rows_PD.float() * scores_P1).to(x_TD.dtype)

        # shape (R, D): this rank's rows, expert-major
        rows_RD = transport.dispatch(rows_PD, plan)
        out_RD = expert_mlp_torch(rows_RD, plan.rows_per_local_expert, *self.experts.local_weights())
        back_PD = transport.combine(out_RD, plan)

        # shape (T, K, D): expert outputs back in (token, k) order
        out_TKD = permute_rows(back_PD, plan.send_order_inverse, plan.send_order).view(T, K, D)
        weights_TK = None if self.score_before_experts else top_scores_TK
        return sum_topk_fp32(out_TKD, weights_TK).to(x_TD.dtype)

    def _schedule(self, tokens: int, device: torch.device, ep_size: int) -> UniEPConfig:
        """The concrete config for this call: ``self.config``, or with ``config = "auto"``
        the tuner's choice for this shape and 4096-token bucket (resolved once, logged)."""
        if self.config.config != "auto":
            return self.config
        from uniep.tune import MoEShape, device_spec, resolve, token_bucket
        from uniep.tune.space import KNOBS

        key = (token_bucket(tokens), ep_size, str(device))
        if key not in self._auto_configs:
            w1 = self.experts.w1
            shape = MoEShape(dim=w1.shape[2], hidden=w1.shape[1], experts=self.num_experts, top_k=self.top_k)
            config, source = resolve(self.config, shape, tokens, device_spec(device), ep_size)
            knobs = {k: getattr(config, k) for k in KNOBS}
            logger.info(f"UniEP config = 'auto' for {shape.key()}, {key[0]} tokens, EP {ep_size}: {source} -> {knobs}")
            self._auto_configs[key] = config
        return self._auto_configs[key]

    def _experts_triton(self, x_TD, top_scores_TK, topk_idx_TK, counts_E, c: UniEPConfig) -> torch.Tensor:
        """(T, D) routed-expert output on the fused Triton kernels (one rank)."""
        from uniep.kernels.fused_experts import fused_experts

        # Stable sort: rows of an expert stay in (token, k) order, as in the plan.
        send_order = torch.argsort(topk_idx_TK.reshape(-1), stable=True)
        gemm, up, wgrad, wgrad_up = _tiles(c)
        return fused_experts(
            x_TD, top_scores_TK, send_order, counts_E, *self.experts.local_weights(),
            score_before_experts=self.score_before_experts,
            tiles=gemm, up_tiles=up, wgrad_tiles=wgrad, wgrad_up_tiles=wgrad_up,
        )

    def _experts_all_to_all_triton(self, x_TD, top_scores_TK, topk_idx_TK, counts_E, c: UniEPConfig, transport):
        """(T, D) routed-expert output over the all_to_all transport, experts on the
        Triton kernels (EP > 1; the same bits as one rank)."""
        from uniep.transport.all_to_all_fused import all_to_all_fused_experts

        plan = build_plan(topk_idx_TK, self.num_experts, transport.gather_counts(counts_E), transport.ep_rank)
        return all_to_all_fused_experts(
            x_TD, top_scores_TK, plan, transport, *self.experts.local_weights(),
            tiles=_tiles(c), score_before_experts=self.score_before_experts,
        )

    def _experts_megakernel(self, x_TD, top_scores_TK, topk_idx_TK, counts_E, c: UniEPConfig, transport) -> torch.Tensor:
        """(T, D) routed-expert output on the two megakernels: over the real EP group,
        or over ``c.virtual_ranks`` virtual ranks on this device (batch split in rank order)."""
        from uniep.transport.hierarchical import HierarchicalTransport, hierarchical_megakernel_experts
        from uniep.transport.megakernel import (
            Schedule,
            megakernel_experts,
            virtual_peers,
        )

        gemm, up, wgrad, wgrad_up = _tiles(c)
        schedule = Schedule(gemm, up, wgrad, wgrad_up, c.megakernel_sends_per_task,
                            c.megakernel_tokens_per_task, c.megakernel_max_spins, c.megakernel_relay_dedup)
        if isinstance(transport, HierarchicalTransport):
            return hierarchical_megakernel_experts(
                x_TD, top_scores_TK, topk_idx_TK, *self.experts.local_weights(), transport, schedule,
                score_before_experts=self.score_before_experts,
            )
        T = topk_idx_TK.shape[0]
        if transport.ep_size > 1:
            peers, tokens_per_sender = transport.peers, [T]
            count_table = transport.gather_counts(counts_E)
        else:
            W = c.virtual_ranks
            peers, tokens_per_sender = virtual_peers(W, x_TD.device), [T // W + (r < T % W) for r in range(W)]
            sender = torch.repeat_interleave(
                torch.arange(W, device=x_TD.device), device_ints(tokens_per_sender, x_TD.device), output_size=T
            )
            pair_keys = (sender[:, None] * self.num_experts + topk_idx_TK).reshape(-1)
            count_table = torch.bincount(pair_keys, minlength=W * self.num_experts).view(W, self.num_experts)
        return megakernel_experts(
            x_TD, top_scores_TK, topk_idx_TK, tokens_per_sender, count_table, *self.experts.local_weights(),
            peers, schedule,
            score_before_experts=self.score_before_experts,
        )

    def extra_repr(self) -> str:
        return (
            f"num_experts={self.num_experts}, top_k={self.top_k}, "
            f"score_before_experts={self.score_before_experts}, config={self.config}"
        )



def _tiles(c: UniEPConfig):
    """(gemm, up, wgrad, wgrad_up) tile settings of a config."""
    from uniep.kernels.grouped_gemm import GemmTiles

    programs = c.num_programs or None
    gemm = GemmTiles(c.gemm_block_m, c.gemm_block_n, c.gemm_block_k, c.gemm_num_warps, c.gemm_num_stages, programs)
    wgrad = GemmTiles(c.wgrad_block_m, c.wgrad_block_n, c.wgrad_block_k, c.wgrad_num_warps, c.wgrad_num_stages, programs)
    return (gemm, dataclasses.replace(gemm, block_n=c.gemm_up_block_n),
            wgrad, dataclasses.replace(wgrad, block_n=c.wgrad_up_block_n))
