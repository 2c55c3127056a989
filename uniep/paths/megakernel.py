"""The megakernel path: dispatch, expert MLP and combine in two fused launches.

Shape legend: W expert-parallel ranks, El experts per rank, T tokens of a rank (T_cap
the largest), K experts per token, P = T*K pairs, D model dim, H hidden dim, R rows
of an owner (expert-major, Algorithm 1's order).

A *launch* covers a contiguous range of ranks ``[rank0, rank0 + local_ranks)``: one
real rank per process (the peers in symmetric memory, one node), or W ranks on one
device (``uniep.testing``'s virtual ranks); see ``uniep.transport.peer_buffers``.
*Legs* carry the tokens to the launch's senders and the pair rows back: here the
identity (:class:`NodeLegs`, one node); the hierarchical path's inter-node legs wrap
the same launch (``uniep.paths.hierarchical``).

Forward: ``dispatch_gemm`` (pushes + gate/up GEMM with SwiGLU), ``gemm_combine``
(down GEMM into the senders' return buffers + fixed-order combine). Backward:
``dispatch_gemm`` (pushes the output gradient + down dgrad with SwiGLU backward),
``gemm_combine`` (up dgrad of w1 and w3 + fixed-order sum into grad x), then the
owners' weight gradients (``grouped_wgrad``, rows in plan order). Every GEMM uses the
same tiles and row order as the single-rank fused path, so outputs and gradients are
bitwise those of the sequential execution for any schedule and any W.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist

from uniep.kernels.combine import topk_combine, topk_combine_bwd
from uniep.kernels.dispatch_gemm import dispatch_gemm
from uniep.kernels.gemm_combine import gemm_combine
from uniep.kernels.grouped_gemm import DUAL, PLAIN, SWIGLU_BWD, SWIGLU_FWD, ExpertTiles
from uniep.kernels.wgrad import grouped_wgrad
from uniep.transport.all_to_all import gather_counts
from uniep.transport.peer_buffers import PeerBuffers, SymmetricAllocator
from uniep.transport.sends import OwnerRows, Sends, build_sends, owner_rows


@dataclass(frozen=True)
class Schedule:
    """How a launch runs. Only the tiles' ``block_*`` change bits; everything else is
    a schedule knob (programs, warps, stages, task sizes)."""

    tiles: ExpertTiles
    sends_per_task: int = 16
    tokens_per_task: int = 16
    max_spins: int = 1 << 24
    relay_dedup: bool = True

    @classmethod
    def from_config(cls, c) -> "Schedule":
        """The schedule a ``UniEPConfig`` names."""
        return cls(ExpertTiles.from_config(c), c.megakernel_sends_per_task, c.megakernel_tokens_per_task,
                   c.megakernel_max_spins, c.megakernel_relay_dedup)


class Legs(Protocol):
    """How a launch's tokens reach its senders and their pair rows come home."""

    owners_combine: bool
    """True: the owners sum each token's K rows into its sender's output in the down
    GEMM's epilogue (the senders are the tokens' ranks). False: the pair rows go home
    and are summed there."""
    pair_slots: torch.Tensor | None
    """Each sender pair's slot in its return region; None: ``t*K + k``."""

    def to_senders(self, t_TD: torch.Tensor) -> torch.Tensor: ...

    def returned_rows(self, peers: PeerBuffers, sends: Sends, top_k: int) -> torch.Tensor: ...

    def describe(self, direction: str) -> str: ...


class NodeLegs:
    """One node: the senders are the tokens' own ranks; nothing moves around the launch."""

    owners_combine = True
    pair_slots = None

    def to_senders(self, t_TD: torch.Tensor) -> torch.Tensor:
        return t_TD

    def returned_rows(self, peers: PeerBuffers, sends: Sends, top_k: int) -> torch.Tensor:
        """(P, D): the pair rows of the launch's senders, from their return regions, in
        (token, k) order."""
        region = peers.local("ret")
        per_sender = region.view(-1, peers.pairs_cap, region.shape[-1])
        return torch.cat([per_sender[i, : t * top_k] for i, t in enumerate(sends.tokens_per_sender)])

    def describe(self, direction: str) -> str:
        return f"megakernel {direction}"


@dataclass
class Launch:
    """Everything one call needs: who is in the launch, where the buffers are, how to run."""

    peers: PeerBuffers
    sends: Sends
    rows: OwnerRows
    schedule: Schedule
    score_before_experts: bool
    legs: Legs
    row_base: torch.Tensor | None = None
    """Owners that share one row space: where this call's owners' rows start
    (``PeerBuffers.prepare``)."""


schedule_of = functools.cache(Schedule.from_config)
"""The schedule of a config, built once per config."""


def _launch_state(device: torch.device) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    """Zeroed task counters of the two launches of a call and their shared error word."""
    state = torch.zeros(6, dtype=torch.int32, device=device)
    return (state[0:1], state[1:2]), state[2:]


class _MegakernelExperts(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TD, scores_TK, w1, w2, w3, launch: Launch):
        peers, sends, rows, sched, legs = launch.peers, launch.sends, launch.rows, launch.schedule, launch.legs
        tiles, before = sched.tiles, launch.score_before_experts
        peers.point_rows(launch.row_base)
        K = scores_TK.shape[1]
        dtypes = (w1.dtype, w2.dtype, w3.dtype)
        w1, w2, w3 = (w.to(x_TD.dtype) for w in (w1, w2, w3))
        R = rows.num_rows
        a_row, scale, origin = (peers.local(name)[:R] for name in ("a_row", "scale", "origin"))
        counters, error = _launch_state(x_TD.device)
        h, a1, a3 = dispatch_gemm(
            sends, peers, rows, legs.to_senders(x_TD), w1, w3, mode=SWIGLU_FWD, epoch=peers.next_epoch(),
            tiles=tiles.up, sends_per_task=sched.sends_per_task, max_spins=sched.max_spins, counter=counters[0],
            error=error, a_row=a_row, a_scale=scale, scale_rows=before,
        )
        # The owners' buffers serve the next layer too: keep this call's metadata and rows.
        a_row, scale, origin = a_row.clone(), scale.clone(), origin.clone()
        x_rows_RD = peers.local("land").index_select(0, a_row.long() + rows.landing_row)
        out_TD = gemm_combine(
            sends, peers, rows, h, None, w2, None, scores_TK if legs.owners_combine and not before else None,
            mode=PLAIN, origin=origin, tiles=tiles.gemm, tokens_per_task=sched.tokens_per_task,
            max_spins=sched.max_spins, counter=counters[1], error=error, pair_slots=legs.pair_slots,
        )
        peers.record_errors(error, legs.describe("forward"))
        # the pair rows: for the score gradient (scores after the experts), or to sum at home
        y_PD = None if before and legs.owners_combine else legs.returned_rows(peers, sends, K)
        if not legs.owners_combine:
            out_TD = topk_combine(y_PD, None if before else scores_TK, K)
            y_PD = None if before else y_PD
        ctx.save_for_backward(x_TD, scores_TK, w1, w2, w3, h, a1, a3, x_rows_RD, a_row, scale, origin, y_PD)
        ctx.launch, ctx.dtypes = launch, dtypes
        return out_TD

    @staticmethod
    def backward(ctx, grad_out_TD):
        x_TD, scores_TK, w1, w2, w3, h, a1, a3, x_rows_RD, a_row, scale, origin, y_PD = ctx.saved_tensors
        launch = ctx.launch
        peers, sends, rows, sched, legs = launch.peers, launch.sends, launch.rows, launch.schedule, launch.legs
        tiles, before = sched.tiles, launch.score_before_experts
        peers.point_rows(launch.row_base)  # later layers' calls moved them
        K = scores_TK.shape[1]
        E_local = w1.shape[0]
        grad_out_TD = grad_out_TD.contiguous()
        counters, error = _launch_state(grad_out_TD.device)
        d_a1, d_a3 = dispatch_gemm(
            sends, peers, rows, legs.to_senders(grad_out_TD), w2, None, mode=SWIGLU_BWD, epoch=peers.next_epoch(),
            tiles=tiles.up, sends_per_task=sched.sends_per_task, max_spins=sched.max_spins, counter=counters[0],
            error=error, a_row=a_row, a_scale=scale, scale_rows=not before, aux=(a1, a3),
        )
        # w2's gradient now, while this rank's landing buffer still holds the output
        # gradient (peers may refill it once this rank's combine below is done); the
        # score scale is applied per row and rounded, as the sequential path does
        dt1, dt2, dt3 = ctx.dtypes
        land_index = (a_row.long() + rows.landing_row).to(torch.int32)
        grad_w2 = grouped_wgrad(
            peers.local("land"), h, rows.schedule.expert_offsets, E_local, tiles=tiles.wgrad, out_dtype=dt2,
            a_row=land_index, a_scale=None if before else scale,
        )
        grad_x = gemm_combine(
            sends, peers, rows, d_a1, d_a3, w1, w3, scores_TK if before and legs.owners_combine else None,
            mode=DUAL, origin=origin, tiles=tiles.gemm, tokens_per_task=sched.tokens_per_task,
            max_spins=sched.max_spins, counter=counters[1], error=error, pair_slots=legs.pair_slots,
        )
        peers.record_errors(error, legs.describe("backward"))
        d_rows_PD = legs.returned_rows(peers, sends, K) if before or not legs.owners_combine else None
        if not legs.owners_combine:
            grad_x = topk_combine(d_rows_PD, scores_TK if before else None, K)
        if before:
            _, grad_scores = topk_combine_bwd(x_TD, d_rows_PD, scores_TK, K, write_rows=False)
        else:
            _, grad_scores = topk_combine_bwd(grad_out_TD, y_PD, scores_TK, K, write_rows=False)
        grad_w1, grad_w3 = grouped_wgrad(
            d_a1, x_rows_RD, rows.schedule.expert_offsets, E_local, tiles=tiles.wgrad_up, out_dtype=dt1,
            b_scale=scale if before else None, a2=d_a3,
        )
        return grad_x, grad_scores, grad_w1, grad_w2, grad_w3.to(dt3), None


def megakernel_experts(
    x_TD: torch.Tensor,
    scores_TK: torch.Tensor,
    topk_TK: torch.Tensor,
    tokens_per_sender: list[int],
    count_table_WE: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor,
    peers: PeerBuffers,
    schedule: Schedule,
    *,
    score_before_experts: bool,
) -> torch.Tensor:
    """(T, D) routed-expert output of a launch's tokens (its senders' tokens
    concatenated in rank order), differentiable in x, scores and the weights.

    ``topk_TK`` (T, K): the routing of those tokens, ``tokens_per_sender`` rows per
    sender of the launch; ``count_table_WE`` (W, E): every
    rank's pair counts per expert; w1, w3 (local_ranks * El, H, D) and w2
    (local_ranks * El, D, H): the launch owners' experts.
    """
    W, E = count_table_WE.shape
    if W != peers.world:
        raise ValueError(f"megakernel: count table has {W} ranks, the buffers {peers.world}")
    if E % W:
        raise ValueError(f"megakernel: num_experts = {E} is not divisible by the expert-parallel degree {W}")
    El = E // W
    if w1.shape[0] != El * peers.local_ranks:
        raise ValueError(
            f"megakernel: w1 has {w1.shape[0]} experts; the launch's {peers.local_ranks} owner(s) hold "
            f"{El * peers.local_ranks} of the {E} experts"
        )
    K = scores_TK.shape[1]
    table = count_table_WE.tolist()  # the call's one host sync
    peers.raise_pending_errors(synchronize=False)
    tokens_per_rank = [sum(counts) // K for counts in table]
    rows_per_owner = [sum(sum(counts[d * El:(d + 1) * El]) for counts in table) for d in range(W)]
    row_base = peers.prepare(max(tokens_per_rank), K, rows_per_owner, x_TD.shape[1], x_TD.dtype, x_TD.device)
    scores_TK = scores_TK.float().contiguous()
    sends = build_sends(topk_TK, scores_TK, tokens_per_sender, count_table_WE, peers.rank0, peers.tokens_cap,
                        schedule.relay_dedup)
    rows = owner_rows(count_table_WE, rows_per_owner, peers.rank0, peers.local_ranks, schedule.tiles.gemm.block_m,
                      peers.world * peers.tokens_cap)
    launch = Launch(peers, sends, rows, schedule, score_before_experts, NodeLegs(), row_base=row_base)
    return _MegakernelExperts.apply(x_TD.contiguous(), scores_TK, w1, w2, w3, launch)


class MegakernelPath:
    """The expert path of an expert-parallel group inside one node: this rank's peer
    buffers in symmetric memory, owned by the path and shared by its layers."""

    def __init__(self, group: dist.ProcessGroup, schedules, num_experts: int, score_before_experts: bool):
        self.group, self.schedules = group, schedules
        self.ep_size = dist.get_world_size(group)
        self.num_experts, self.score_before_experts = num_experts, score_before_experts
        self.peers = PeerBuffers(SymmetricAllocator(group))

    def __call__(self, x_TD, scores_TK, topk_TK, counts_E, order_2P, w1, w2, w3) -> torch.Tensor:
        config = self.schedules.config_for(x_TD, w1, topk_TK.shape[1], self.ep_size)
        return megakernel_experts(
            x_TD, scores_TK, topk_TK, [x_TD.shape[0]], gather_counts(counts_E, self.group), w1, w2, w3,
            self.peers, schedule_of(config), score_before_experts=self.score_before_experts,
        )
