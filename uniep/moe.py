"""UniEPMoE: a drop-in, deterministic replacement for TorchTitan's MoE block.

Shape legend: B batch, S sequence, T = B*S local tokens, D model dim, H expert hidden
dim, E experts, K experts per token, P = T*K (token, k) pairs, R rows on this rank.

Data flows one way: router -> plan -> dispatch -> expert MLPs -> combine -> output.
The plan fixes every row's place (see ``uniep.plan``); the combine sums each token's K
expert outputs in fp32 in the order k = 0..K-1. Parameter and buffer names, shapes and
initialisation match ``torchtitan.models.moe.MoE`` so checkpoints move between the two.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor

from uniep.config import UniEPConfig
from uniep.experts import FeedForward, GroupedExperts, Routing
from uniep.kernels.expert_order import expert_order_on_triton
from uniep.paths import ExpertPath, build_expert_path, on_triton, runs_triton
from uniep.plan import expert_order
from uniep.routed_op import register_path, registered_path
from uniep.router import TopKRouter
from uniep.shared_experts import MODULE_SHARED_EXPERTS, FusedSharedExperts
from uniep.streams import CUDA_SIDE_STREAM, ONE_STREAM

# (config, EP group, experts, score_before_experts, device type) -> the id of their
# expert path: one path (its buffers, and one compiled graph) for all the layers of a model.
_PATH_IDS: dict[tuple, int] = {}

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
        self._use_path(config or UniEPConfig(), None)

    # The expert path is chosen from these and the weights' device; setting one, or
    # moving the layer, picks the path again.
    @property
    def config(self) -> UniEPConfig:
        return self._config

    @config.setter
    def config(self, config: UniEPConfig) -> None:
        self._use_path(config, self._ep_group)

    @property
    def ep_group(self) -> dist.ProcessGroup | None:
        return self._ep_group

    @ep_group.setter
    def ep_group(self, group: dist.ProcessGroup | None) -> None:
        self._use_path(self._config, group)

    @property
    def expert_path(self) -> ExpertPath:
        """The path the routed experts run on."""
        return registered_path(self.experts.path_id)

    def install_path(self, path: ExpertPath) -> None:
        """Run the routed experts on ``path`` (e.g. ``uniep.testing``'s virtual ranks)
        until ``config`` or ``ep_group`` is set again."""
        self.experts.path_id = register_path(path)
        self._installed = True

    def _use_path(self, config: UniEPConfig, group: dist.ProcessGroup | None) -> None:
        """Route through the path of ``config`` over ``group``; on an error (a config
        the device cannot run) the layer keeps its settings and path."""
        key = (config, group, self.num_experts, self.score_before_experts, self._device_type())
        if key not in _PATH_IDS:
            _PATH_IDS[key] = register_path(build_expert_path(*key))
        self.experts.path_id = _PATH_IDS[key]
        self._config, self._ep_group, self._installed = config, group, False
        # the shared experts and the router's choice run on Triton launches where the
        # routed experts do
        self._on_triton = on_triton(config, key[-1]) and runs_triton(key[-1])
        self.router.fused = self._on_triton
        self._expert_order = expert_order_on_triton if self._on_triton else expert_order
        side = config.shared_experts_stream and self._on_triton and key[-1] == "cuda"
        self._shared = (FusedSharedExperts(CUDA_SIDE_STREAM if side else ONE_STREAM, router_logits=not side)
                        if self._on_triton else MODULE_SHARED_EXPERTS)

    def _device_type(self) -> str:
        """Where the routed experts will run: their weights' device; for weights not
        yet materialized (meta), the GPU when there is one."""
        device = self.experts.w1.device.type
        if device == "meta":
            return "cuda" if torch.cuda.is_available() else "cpu"
        return device

    def _apply(self, fn, *args, **kwargs):
        # .to(), .cuda(), to_empty(): the weights may have moved to another kind of device
        module = super()._apply(fn, *args, **kwargs)
        if not self._installed:
            self._use_path(self._config, self._ep_group)
        return module

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
        missing = [name for name in ("experts.w1", "experts.w2", "experts.w3", "router.gate", "router.top_k")
                   if not _has_path(moe, name)]
        if missing:
            raise TypeError(
                f"UniEPMoE.from_torchtitan expects a torchtitan.models.moe.MoE (with experts.w1/w2/w3 and a "
                f"router); got {type(moe).__name__}, which lacks {', '.join(missing)}"
            )
        w1 = moe.experts.w1
        num_experts, hidden_dim, dim = w1.shape
        shared = moe.shared_experts
        with torch.device("meta"):  # every tensor is replaced below: allocate none
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
        else:
            layer._use_path(layer.config, None)  # for the device of the weights taken over
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
        if topk_idx is not None:
            self._check_routing(topk_idx, B * S)

        # The shared experts first: their GEMMs keep the device busy while the host
        # issues the router's and the routing plan's many small ops (and, on a side
        # stream, while the device runs them). The fused ones hand x on, to collect
        # the routed experts' input gradient, and compute the router's logits
        # (``uniep.shared_experts``).
        shared = self._shared_experts_now()
        logits_TE = None
        if shared is not None:
            gate = self.router.gate if self.router.fused else None
            x_TD, pending, logits_TE = shared.start(self.shared_experts, x_TD, gate)
        top_scores_TK, topk_idx_TK = self.router(x_TD, self.expert_bias, topk_idx, logits_TE)
        # (traced under torch.compile, which sees no Triton launch of ours outside a custom op)
        order_of = expert_order if torch.compiler.is_compiling() else self._expert_order
        counts_E, order_2P = order_of(topk_idx_TK, self.num_experts)
        out_TD = self.experts(x_TD, Routing(top_scores_TK, topk_idx_TK, counts_E, order_2P))
        # after the experts' launches: the device waits for their first GEMM, not for this
        with torch.no_grad():
            self.tokens_per_expert.add_(counts_E)
        if shared is not None:
            out_TD = shared.finish(self.shared_experts, pending, out_TD)
        return out_TD.view(B, S, D)

    def _shared_experts_now(self):
        """How this call runs the shared experts (None without them), each row's bits
        independent of the batch: fused launches (``uniep.shared_experts``) where the
        routed experts run on Triton, else (and under torch.compile, whose Inductor
        fuses them) the module on fixed row blocks and an add."""
        if self.shared_experts is None:
            return None
        return MODULE_SHARED_EXPERTS if torch.compiler.is_compiling() else self._shared

    def _check_routing(self, topk_idx: torch.Tensor, tokens: int) -> None:
        """A given routing: (tokens, top_k) integers in [0, E), no expert twice in a row."""
        K, E = self.top_k, self.num_experts
        if topk_idx.shape != (tokens, K) or topk_idx.dtype.is_floating_point or topk_idx.dtype == torch.bool:
            raise ValueError(
                f"topk_idx must be an integer tensor of shape (batch*seq, top_k) = ({tokens}, {K}); "
                f"got {topk_idx.dtype} of shape {tuple(topk_idx.shape)}"
            )
        if tokens == 0:
            return
        low, high = int(topk_idx.min()), int(topk_idx.max())
        if low < 0 or high >= E:
            raise ValueError(f"topk_idx holds experts {low}..{high}; allowed: 0..{E - 1} (num_experts = {E})")
        sorted_TK = topk_idx.sort(dim=1).values
        repeats = (sorted_TK[:, 1:] == sorted_TK[:, :-1]).any(dim=1)
        if bool(repeats.any()):
            t = int(repeats.nonzero()[0, 0])
            raise ValueError(
                f"topk_idx routes token {t} to expert(s) more than once: {topk_idx[t].tolist()} "
                "(each token's top_k experts must differ)"
            )

    def extra_repr(self) -> str:
        return (
            f"num_experts={self.num_experts}, top_k={self.top_k}, "
            f"score_before_experts={self.score_before_experts}, config={self.config}"
        )


def _has_path(obj, dotted: str) -> bool:
    for name in dotted.split("."):
        if not hasattr(obj, name):
            return False
        obj = getattr(obj, name)
    return True
