"""The routed-expert computation of a UniEP layer, one object per (config, EP group,
experts, score placement), shared by every layer that has the same four.

Shape legend: T local tokens, K experts per token, P = T*K (token, k) pairs, E experts
(El on this rank), D model dim, H expert hidden dim, R rows on this rank.

``ExpertPath(x_TD, scores_TK, topk_TK, counts_E, w1, w2, w3) -> (T, D)`` runs eagerly
(the layer calls it through ``uniep.routed_op``, which torch.compile does not trace
into) and picks the compute path from the config and the device: the plain-PyTorch
path over a row-moving transport, the fused Triton kernels on one rank, the Triton
experts over all_to_all, or the megakernel (one node, several nodes, or virtual ranks).
Every path gives the bits of the one-rank path of its backend.
"""

from __future__ import annotations

import dataclasses
import logging

import torch
import torch.distributed as dist

from uniep.config import UniEPConfig
from uniep.experts import expert_mlp_torch
from uniep.plan import build_plan, device_ints
from uniep.rows import permute_rows, replicate_topk, sum_topk_fp32
from uniep.transport import build_transport

logger = logging.getLogger("uniep")


class ExpertPath:
    def __init__(self, config: UniEPConfig, ep_group: dist.ProcessGroup | None, num_experts: int,
                 score_before_experts: bool):
        self.config = config
        self.ep_group = ep_group
        self.num_experts = num_experts
        self.score_before_experts = score_before_experts
        self._auto_configs: dict[tuple, UniEPConfig] = {}

    def __call__(self, x_TD, scores_TK, topk_TK, counts_E, w1, w2, w3) -> torch.Tensor:
        """(T, D) routed-expert output; ``counts_E`` (E,) this rank's pairs per expert;
        w1, w3 (El, H, D), w2 (El, D, H): this rank's experts."""
        transport = build_transport(self.config.transport, self.ep_group)
        config = self._schedule(x_TD.shape[0], x_TD.device, transport.ep_size, w1, topk_TK.shape[1])
        backend = config.resolved_backend(x_TD.device.type, transport.ep_size)
        weights = (w1, w2, w3)
        if backend == "megakernel":
            return self._megakernel(x_TD, scores_TK, topk_TK, counts_E, weights, config, transport)
        if backend == "triton" and transport.ep_size > 1:
            return self._all_to_all_triton(x_TD, scores_TK, topk_TK, counts_E, weights, config, transport)
        if backend == "triton":
            return self._triton(x_TD, scores_TK, topk_TK, counts_E, weights, config)
        return self._torch(x_TD, scores_TK, topk_TK, counts_E, weights, transport)

    def _torch(self, x_TD, scores_TK, topk_TK, counts_E, weights, transport) -> torch.Tensor:
        """The plain-PyTorch path (any EP degree)."""
        T, D = x_TD.shape
        K = topk_TK.shape[1]
        plan = build_plan(topk_TK, self.num_experts, transport.gather_counts(counts_E), transport.ep_rank)
        # shape (P, D): one row per (token, k) pair, in send order (expert, token, k)
        rows_PD = permute_rows(replicate_topk(x_TD, K), plan.send_order, plan.send_order_inverse)
        if self.score_before_experts:
            scores_P1 = permute_rows(scores_TK.reshape(-1, 1), plan.send_order, plan.send_order_inverse)
            rows_PD = (rows_PD.float() * scores_P1).to(x_TD.dtype)

        # shape (R, D): this rank's rows, expert-major
        rows_RD = transport.dispatch(rows_PD, plan)
        out_RD = expert_mlp_torch(rows_RD, plan.rows_per_local_expert, *weights)
        back_PD = transport.combine(out_RD, plan)

        # shape (T, K, D): expert outputs back in (token, k) order
        out_TKD = permute_rows(back_PD, plan.send_order_inverse, plan.send_order).view(T, K, D)
        weights_TK = None if self.score_before_experts else scores_TK
        return sum_topk_fp32(out_TKD, weights_TK).to(x_TD.dtype)

    def _schedule(self, tokens: int, device: torch.device, ep_size: int, w1: torch.Tensor, top_k: int) -> UniEPConfig:
        """The concrete config for this call: ``self.config``, or with ``config = "auto"``
        the tuner's choice for this shape and 4096-token bucket (resolved once, logged)."""
        if self.config.config != "auto":
            return self.config
        from uniep.tune import MoEShape, device_spec, resolve, token_bucket
        from uniep.tune.space import KNOBS

        shape = MoEShape(dim=w1.shape[2], hidden=w1.shape[1], experts=self.num_experts, top_k=top_k)
        key = (shape, token_bucket(tokens), ep_size, str(device))
        if key not in self._auto_configs:
            config, source = resolve(self.config, shape, tokens, device_spec(device), ep_size)
            knobs = {k: getattr(config, k) for k in KNOBS}
            logger.info(f"UniEP config = 'auto' for {shape.key()}, {key[1]} tokens, EP {ep_size}: {source} -> {knobs}")
            self._auto_configs[key] = config
        return self._auto_configs[key]

    def _triton(self, x_TD, scores_TK, topk_TK, counts_E, weights, c: UniEPConfig) -> torch.Tensor:
        """The fused Triton kernels (one rank)."""
        from uniep.kernels.fused_experts import fused_experts

        # Stable sort: rows of an expert stay in (token, k) order, as in the plan.
        send_order = torch.argsort(topk_TK.reshape(-1), stable=True)
        gemm, up, wgrad, wgrad_up = tiles_of(c)
        return fused_experts(
            x_TD, scores_TK, send_order, counts_E, *weights,
            score_before_experts=self.score_before_experts,
            tiles=gemm, up_tiles=up, wgrad_tiles=wgrad, wgrad_up_tiles=wgrad_up,
        )

    def _all_to_all_triton(self, x_TD, scores_TK, topk_TK, counts_E, weights, c: UniEPConfig, transport):
        """The all_to_all transport with the experts on the Triton kernels (EP > 1; the
        same bits as one rank)."""
        from uniep.transport.all_to_all_fused import all_to_all_fused_experts

        plan = build_plan(topk_TK, self.num_experts, transport.gather_counts(counts_E), transport.ep_rank)
        return all_to_all_fused_experts(
            x_TD, scores_TK, plan, transport, *weights,
            tiles=tiles_of(c), score_before_experts=self.score_before_experts,
        )

    def _megakernel(self, x_TD, scores_TK, topk_TK, counts_E, weights, c: UniEPConfig, transport) -> torch.Tensor:
        """The two megakernels: over the real EP group, or over ``c.virtual_ranks``
        virtual ranks on this device (batch split in rank order)."""
        from uniep.transport.hierarchical import HierarchicalTransport, hierarchical_megakernel_experts
        from uniep.transport.megakernel import Schedule, megakernel_experts, virtual_peers

        gemm, up, wgrad, wgrad_up = tiles_of(c)
        schedule = Schedule(gemm, up, wgrad, wgrad_up, c.megakernel_sends_per_task,
                            c.megakernel_tokens_per_task, c.megakernel_max_spins, c.megakernel_relay_dedup)
        if isinstance(transport, HierarchicalTransport):
            return hierarchical_megakernel_experts(
                x_TD, scores_TK, topk_TK, *weights, transport, schedule,
                score_before_experts=self.score_before_experts,
            )
        T = topk_TK.shape[0]
        if transport.ep_size > 1:
            peers, tokens_per_sender = transport.peers, [T]
            count_table = transport.gather_counts(counts_E)
        else:
            W = c.virtual_ranks
            peers, tokens_per_sender = virtual_peers(W, x_TD.device), [T // W + (r < T % W) for r in range(W)]
            sender = torch.repeat_interleave(
                torch.arange(W, device=x_TD.device), device_ints(tokens_per_sender, x_TD.device), output_size=T
            )
            pair_keys = (sender[:, None] * self.num_experts + topk_TK).reshape(-1)
            count_table = torch.bincount(pair_keys, minlength=W * self.num_experts).view(W, self.num_experts)
        return megakernel_experts(
            x_TD, scores_TK, topk_TK, tokens_per_sender, count_table, *weights, peers, schedule,
            score_before_experts=self.score_before_experts,
        )


def tiles_of(c: UniEPConfig):
    """(gemm, up, wgrad, wgrad_up) tile settings of a config."""
    from uniep.kernels.grouped_gemm import GemmTiles

    programs = c.num_programs or None
    gemm = GemmTiles(c.gemm_block_m, c.gemm_block_n, c.gemm_block_k, c.gemm_num_warps, c.gemm_num_stages, programs,
                     c.descriptor_loads)
    wgrad = GemmTiles(c.wgrad_block_m, c.wgrad_block_n, c.wgrad_block_k, c.wgrad_num_warps, c.wgrad_num_stages, programs,
                      c.descriptor_loads)
    return (gemm, dataclasses.replace(gemm, block_n=c.gemm_up_block_n),
            wgrad, dataclasses.replace(wgrad, block_n=c.wgrad_up_block_n))
