"""The hierarchical path: an expert-parallel group that spans nodes.

Shape legend: W ranks of the group = Nd nodes x L ranks per node (consecutive ranks share
a node), E experts, El = E / W per rank, T tokens of this rank, K experts per token,
D model dim, T_r tokens this rank relays.

A token crosses the inter-node network at most once per destination node: to its *rail
peer* there (the rank with the same local index), in one all-to-all over the group (no
rows to the other ranks). With the token go, for each of its pairs on that node, the
owner, the owner's expert, the pair's row on the owner (Algorithm 1 over the whole
group) and the score. On the node the rail peer is a sender of the intra-node megakernel
launch (symmetric memory over the node's L ranks): it pushes the token once per owner
(relay dedup), the owners run the expert GEMMs at the rows the plan gave, and write each
pair's output row into the relay's return buffer. The relay sends the pair rows back:
rows, not partial sums, because the source sums its K rows in the order k = 0..K-1 in
fp32 like every other path. The owners' rows are in the global plan's order (source
rank, token, k), so the weight gradients' sums are the one-rank sums too: outputs and
gradients are bitwise those of one rank whatever the node layout.

The backward takes the same legs: the output gradient goes out to the relays, the
rows' input gradients come back to their sources and are summed there.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from uniep.paths.megakernel import Launch, Schedule, _MegakernelExperts, schedule_of
from uniep.plan import algorithm1_rows, inverse_permutation, local_counts
from uniep.transport.all_to_all import exchange_rows, gather_counts
from uniep.transport.peer_buffers import PeerBuffers, SymmetricAllocator
from uniep.transport.sends import Sends, owner_rows, sends_to_owners


class NodeLayout:
    """The nodes of an expert-parallel group. ``group``'s ranks ``[n*L, (n+1)*L)`` must
    be the processes of node n (torchrun numbers the ranks of a node consecutively, and
    TorchTitan's EP groups are consecutive ranks)."""

    def __init__(self, group: dist.ProcessGroup, ranks_per_node: int):
        self.group = group
        self.ep_size, self.ep_rank = dist.get_world_size(group), dist.get_rank(group)
        global_ranks = dist.get_process_group_ranks(group)
        self.check_layout(self.ep_size, ranks_per_node, global_ranks)
        L = ranks_per_node
        self.ranks_per_node, self.nodes = L, self.ep_size // L
        self.node, self.local_rank = divmod(self.ep_rank, L)
        # Only the node's ranks take part in creating its group.
        node_ranks = global_ranks[self.node * L : (self.node + 1) * L]
        self.node_group = dist.new_group(node_ranks, use_local_synchronization=True)

    @staticmethod
    def check_layout(ep_size: int, ranks_per_node: int, global_ranks: list[int]) -> None:
        """Raise ValueError unless each block of ``ranks_per_node`` consecutive group
        ranks is one node's processes (``global_ranks``: the group's ranks in the world)."""
        L = ranks_per_node
        if L < 1 or ep_size % L:
            raise ValueError(
                f"hierarchical transport: the expert-parallel degree {ep_size} is not a multiple of the "
                f"{L} processes per node"
            )
        for n in range(ep_size // L):
            block = global_ranks[n * L : (n + 1) * L]
            if len({r // L for r in block}) != 1:
                raise ValueError(
                    f"hierarchical transport: expert-parallel ranks {block} should share a node, but the "
                    f"world's nodes are consecutive blocks of {L} ranks"
                )


class RelayLegs:
    """The inter-node legs of one call, seen from one rank: as a source (its tokens out
    to their nodes' rail peers, its pair rows back) and as a relay (the tokens it
    received and their pairs on its node: the senders of the node's launch). Built from
    the all-gathered table, so every split is known on the host without another sync.
    The megakernel's ``Legs``: the pair rows go home and are summed there."""

    owners_combine = False

    def __init__(self, layout: NodeLayout, topk_TK: torch.Tensor, goes_NdT: torch.Tensor,
                 scores_TK: torch.Tensor, dest_row_TK: torch.Tensor, table: list[list[int]], num_experts: int):
        """``goes_NdT`` (Nd, T) bool: whether token t has a pair on node n."""
        W, L, Nd = layout.ep_size, layout.ranks_per_node, layout.nodes
        E, El = num_experts, num_experts // W
        me, node, local = layout.ep_rank, layout.node, layout.local_rank
        T, K = topk_TK.shape
        self.group, self.node = layout.group, node

        # table[s][E + n]: tokens rank s sends to node n.
        rail = [n * L + local for n in range(Nd)]
        self._to_relays = _splits(W, {r: table[me][E + n] for n, r in enumerate(rail)})
        self._from_sources = _splits(W, {r: table[r][E + node] for r in rail})
        self._pairs_back = _splits(W, {r: _pairs_on_node(table, r, node, L * El) for r in rail})
        self._pairs_home = _splits(W, {r: _pairs_on_node(table, me, n, L * El) for n, r in enumerate(rail)})

        # Source side: node-major, then token; a mask's first entries without a host sync.
        owner_TK = topk_TK // El
        node_TK = owner_TK // L
        sent = _first_true(goes_NdT.reshape(-1), sum(self._to_relays))
        send_node, self._send_token = sent // T, sent % T
        on_node = node_TK[self._send_token] == send_node[:, None]
        meta_QK4 = torch.stack(
            [
                torch.where(on_node, owner_TK[self._send_token] - send_node[:, None] * L, -1),
                topk_TK[self._send_token] % El,
                dest_row_TK[self._send_token],
                scores_TK.float().contiguous().view(torch.int32)[self._send_token].long(),
            ],
            dim=2,
        ).to(torch.int32)
        meta = exchange_rows(meta_QK4.reshape(-1, 4 * K), self._from_sources, self._to_relays, self.group)
        meta = meta.view(-1, K, 4)
        # Relay side: the received tokens, source-major then token, and their pairs here.
        self.owner_TK = meta[..., 0]
        self.expert_TK = meta[..., 1]
        self.dest_row_TK = meta[..., 2].long()
        self.scale_TK = meta[..., 3].contiguous().view(torch.float32)
        self.num_tokens = sum(self._from_sources)
        self.num_pairs = sum(self._pairs_back)
        """The relayed pairs that are this node's: packed first in the return region."""
        present = (self.owner_TK >= 0).reshape(-1)
        self.pair_slots = torch.where(present, torch.cumsum(present, 0) - 1, -1).to(torch.int32)
        """(T_r * K,) int32: each relayed pair's return slot, -1 for another node's pairs."""
        # Pairs come home node-major, then (token, k): put them back in (token, k) order.
        self._home_order = inverse_permutation(torch.argsort(node_TK.reshape(-1), stable=True))

    def to_senders(self, t_TD: torch.Tensor) -> torch.Tensor:
        """(T_r, D): this rank's relayed rows of a per-token tensor of every source."""
        return exchange_rows(t_TD.index_select(0, self._send_token), self._from_sources, self._to_relays, self.group)

    def returned_rows(self, peers: PeerBuffers, sends: Sends, top_k: int) -> torch.Tensor:
        """(T*K, D): the pair rows of this rank's tokens, (token, k) order: the relayed
        pairs' rows (``num_pairs``, in slot order) sent home."""
        relayed = peers.local("ret")[: self.num_pairs]
        home = exchange_rows(relayed, self._pairs_home, self._pairs_back, self.group)
        return home.index_select(0, self._home_order)

    def describe(self, direction: str) -> str:
        """What a wait error names: the ranks of a node's launch are numbered in the node."""
        return f"megakernel {direction} (node {self.node}; ranks numbered within the node)"


def _pairs_on_node(table: list[list[int]], src: int, node: int, experts_per_node: int) -> int:
    """Pairs rank ``src`` routes to the experts of ``node`` (from the count table)."""
    return sum(table[src][node * experts_per_node : (node + 1) * experts_per_node])


def _splits(world: int, nonzero: dict[int, int]) -> list[int]:
    return [nonzero.get(r, 0) for r in range(world)]


def _first_true(mask: torch.Tensor, count: int) -> torch.Tensor:
    """(count,) int64: positions of the ``count`` true entries of ``mask``, ascending
    (``count`` known on the host: no device sync, unlike ``nonzero``)."""
    return torch.argsort((~mask).to(torch.int8), stable=True)[:count]


def hierarchical_megakernel_experts(
    x_TD: torch.Tensor,
    scores_TK: torch.Tensor,
    topk_TK: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor,
    layout: NodeLayout,
    peers: PeerBuffers,
    schedule: Schedule,
    *,
    score_before_experts: bool,
) -> torch.Tensor:
    """(T, D) routed-expert output of this rank's tokens, differentiable in x, scores and
    this rank's experts w1, w3 (El, H, D) and w2 (El, D, H); ``topk_TK`` (T, K) holds
    expert ids of the whole group."""
    W, L, Nd = layout.ep_size, layout.ranks_per_node, layout.nodes
    El = w1.shape[0]
    E = El * W
    K = topk_TK.shape[1]
    node_TK = topk_TK // (El * L)
    goes_NdT = (node_TK[None] == torch.arange(Nd, device=topk_TK.device)[:, None, None]).any(2)
    counts = torch.cat([local_counts(topk_TK, E), goes_NdT.sum(1)])
    table_W = gather_counts(counts, layout.group)  # (W, E + Nd): pair counts, then tokens per node
    table = table_W.tolist()  # the call's one host sync
    peers.raise_pending_errors(synchronize=False)
    count_table_WE = table_W[:, :E]
    # Every rank sizes the node's buffers alike: by the busiest relay of any node.
    rails = [(n, [m * L + local for m in range(Nd)]) for n in range(Nd) for local in range(L)]
    relayed_tokens = max(sum(table[r][E + n] for r in rail) for n, rail in rails)
    relayed_pairs = max(sum(_pairs_on_node(table, r, n, L * El) for r in rail) for n, rail in rails)
    rows_per_owner = [sum(sum(row[d * El : (d + 1) * El]) for row in table) for d in range(W)]
    peers.prepare(relayed_tokens, K, rows_per_owner, x_TD.shape[1], x_TD.dtype, x_TD.device, pairs=relayed_pairs)
    scores_TK = scores_TK.float().contiguous()
    legs = RelayLegs(layout, topk_TK, goes_NdT, scores_TK,
                     algorithm1_rows(topk_TK, count_table_WE, layout.ep_rank), table, E)
    sends = sends_to_owners(legs.owner_TK, legs.expert_TK, legs.dest_row_TK, legs.scale_TK, [legs.num_tokens],
                            layout.local_rank, L, El, peers.tokens_cap, schedule.relay_dedup,
                            pair_slot_TK=legs.pair_slots.view(-1, K))
    rows = owner_rows(count_table_WE, rows_per_owner, layout.ep_rank, 1, schedule.tiles.gemm.block_m,
                      L * peers.tokens_cap)
    launch = Launch(peers, sends, rows, schedule, score_before_experts, legs)
    return _MegakernelExperts.apply(x_TD.contiguous(), scores_TK, w1, w2, w3, launch)


class HierarchicalPath:
    """The expert path of a group of several nodes: the node's peer buffers in symmetric
    memory, owned by the path and shared by its layers."""

    def __init__(self, group: dist.ProcessGroup, ranks_per_node: int, schedules, num_experts: int,
                 score_before_experts: bool):
        self.layout = NodeLayout(group, ranks_per_node)
        self.ep_size, self.schedules = self.layout.ep_size, schedules
        self.num_experts, self.score_before_experts = num_experts, score_before_experts
        self.peers = PeerBuffers(SymmetricAllocator(self.layout.node_group))

    def __call__(self, x_TD, scores_TK, topk_TK, counts_E, order_2P, w1, w2, w3) -> torch.Tensor:
        config = self.schedules.config_for(x_TD, w1, topk_TK.shape[1], self.ep_size)
        return hierarchical_megakernel_experts(
            x_TD, scores_TK, topk_TK, w1, w2, w3, self.layout, self.peers, schedule_of(config),
            score_before_experts=self.score_before_experts,
        )
