"""Virtual ranks: the megakernel's W-rank protocol on one device, for tests and
benchmarks (not a product path: it computes one rank's work with W ranks' overheads).

The batch is split in rank order (rank r gets the next ``T // W`` tokens, one more for
the first ``T % W``) and the W ranks run in one launch: pushes, flags, remote epilogues
and waits between separate allocations of one GPU, or on the CPU under the Triton
interpreter. Outputs and gradients are bitwise those of the one-rank Triton path with
the same tiles.

    from uniep.testing import use_virtual_ranks
    use_virtual_ranks(layer, 4)           # until layer.config or layer.ep_group is set

Shape legend: W virtual ranks, T tokens, K experts per token, E experts.
"""

from __future__ import annotations

import torch

from uniep.config import UniEPConfig
from uniep.paths.megakernel import megakernel_experts, schedule_of
from uniep.plan import device_ints, local_counts
from uniep.transport.peer_buffers import DeviceAllocator, PeerBuffers


class VirtualRanksPath:
    ep_size = 1

    def __init__(self, ranks: int, config: UniEPConfig, num_experts: int, score_before_experts: bool):
        if not 1 <= ranks <= 64:
            raise ValueError(f"virtual ranks = {ranks} is not allowed; allowed values: 1..64")
        if num_experts % ranks:
            raise ValueError(f"virtual ranks = {ranks} does not divide num_experts = {num_experts}")
        self.ranks, self.schedule = ranks, schedule_of(config)
        self.num_experts, self.score_before_experts = num_experts, score_before_experts
        self.peers = PeerBuffers(DeviceAllocator(ranks))

    def __call__(self, x_TD, scores_TK, topk_TK, counts_E, order_2P, w1, w2, w3) -> torch.Tensor:
        W, T = self.ranks, topk_TK.shape[0]
        tokens_per_sender = [T // W + (r < T % W) for r in range(W)]
        sender_T = torch.repeat_interleave(
            torch.arange(W, device=x_TD.device), device_ints(tokens_per_sender, x_TD.device), output_size=T
        )
        pair_keys = (sender_T[:, None] * self.num_experts + topk_TK).reshape(-1)
        count_table_WE = local_counts(pair_keys, W * self.num_experts).view(W, self.num_experts)
        return megakernel_experts(
            x_TD, scores_TK, topk_TK, tokens_per_sender, count_table_WE, w1, w2, w3, self.peers, self.schedule,
            score_before_experts=self.score_before_experts,
        )


def use_virtual_ranks(layer, ranks: int, config: UniEPConfig | None = None) -> VirtualRanksPath:
    """Run ``layer``'s (a ``UniEPMoE`` of expert-parallel degree 1) routed experts on
    ``ranks`` virtual ranks with ``config``'s tiles and megakernel knobs (default: the
    layer's config). Returns the path (its ``peers`` hold the wait errors)."""
    if layer.ep_group is not None:
        raise ValueError("use_virtual_ranks: the layer has an expert-parallel group; virtual ranks need EP 1")
    path = VirtualRanksPath(ranks, config or layer.config, layer.num_experts, layer.score_before_experts)
    layer.install_path(path)
    return path
