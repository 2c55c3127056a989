"""The megakernel transport: dispatch, expert MLP and combine in two fused launches.

Shape legend: W expert-parallel ranks, El experts per rank, T tokens of a rank (T_cap
the largest), K experts per token, P = T*K pairs, D model dim, H hidden dim, R rows
of an owner (expert-major, Algorithm 1's order), S sends.

A *launch* covers a contiguous range of ranks ``[rank0, rank0 + local_ranks)``:

- one real rank per process: its peers' buffers are ``torch.distributed``
  symmetric memory inside a node (:meth:`PeerBuffers.symmetric`);
- W *virtual* ranks on one device in one launch (:meth:`PeerBuffers.virtual`): the
  peers' buffers are other allocations on the same device. This runs the whole
  protocol (pushes, flags, remote epilogues, waits) on one GPU, and under the Triton
  interpreter on CPU.

Forward: ``dispatch_gemm`` (pushes + gate/up GEMM with SwiGLU), ``gemm_combine``
(down GEMM into the senders' return buffers + fixed-order combine). Backward:
``dispatch_gemm`` (pushes the output gradient + down dgrad with SwiGLU backward),
``gemm_combine`` (up dgrad of w1 and w3 + fixed-order sum into grad x), then the
owners' weight gradients (``grouped_wgrad``, rows in plan order). Every GEMM uses the
same tiles and row order as the single-rank fused path, so outputs and gradients are
bitwise those of the sequential execution for any schedule and any W.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from uniep.kernels.combine import topk_combine, topk_combine_bwd
from uniep.kernels.dispatch_gemm import dispatch_gemm
from uniep.kernels.flags import raise_on_error
from uniep.kernels.gemm_combine import gemm_combine
from uniep.kernels.grouped_gemm import (
    DUAL,
    PLAIN,
    SWIGLU_BWD,
    SWIGLU_FWD,
    GemmTiles,
    check_row_tiles,
    tile_offsets,
)
from uniep.kernels.wgrad import grouped_wgrad
from uniep.plan import device_ints, exclusive_cumsum

if TYPE_CHECKING:
    from uniep.transport.hierarchical import RelayLegs


@dataclass(frozen=True)
class Schedule:
    """How a launch runs. Only the tiles' ``block_*`` change bits; everything else is
    a schedule knob (programs, warps, stages, task sizes)."""

    gemm: GemmTiles
    up: GemmTiles
    wgrad: GemmTiles
    wgrad_up: GemmTiles
    sends_per_task: int = 16
    tokens_per_task: int = 16
    max_spins: int = 1 << 24
    relay_dedup: bool = True

    def __post_init__(self):
        check_row_tiles(self.gemm, self.up, "megakernel")


# Buffer regions of one rank: name -> (rows-kind, dtype or None for the activation dtype).
# "land" is (W * T_cap, D), "ret" is (P_cap, D), "ret_flag" is (P_cap,), the others (R_cap,).
_REGIONS = {
    "land": None, "ret": None, "ret_flag": torch.int32,
    "a_row": torch.int32, "scale": torch.float32, "origin": torch.int32, "row_flag": torch.int32,
}
_ROW_REGIONS = ("a_row", "scale", "origin", "row_flag")


def _round_up(n: int, multiple: int) -> int:
    return max(multiple, -(-n // multiple) * multiple)


class PeerBuffers:
    """Every rank's landing, return, metadata and flag buffers. Rank r's copy of a
    region is at ``local(name).data_ptr()`` plus ``deltas[name][r]`` elements ((W,)
    int64 on the device): kernels address peers from one base pointer, which keeps
    the compiler's alignment facts (vector loads and stores)."""

    def __init__(self, world: int, rank0: int, local_ranks: int, group: dist.ProcessGroup | None):
        self.world, self.rank0, self.local_ranks, self.group = world, rank0, local_ranks, group
        self.tokens_cap = self.pairs_cap = self.rows_cap = 0
        self.dim, self.dtype = 0, None
        self.epoch = 0
        self.deltas: dict[str, torch.Tensor] = {}
        self._pending_errors: list[tuple[torch.Tensor, str]] = []
        self._local: dict[str, torch.Tensor] = {}

    @classmethod
    def virtual(cls, world: int) -> "PeerBuffers":
        """W ranks in one process and one launch, all on one device."""
        return cls(world, 0, world, None)

    @classmethod
    def symmetric(cls, group: dist.ProcessGroup) -> "PeerBuffers":
        """This rank of ``group``; the peers' buffers through symmetric memory."""
        return cls(dist.get_world_size(group), dist.get_rank(group), 1, group)

    @property
    def flag_scope(self) -> str:
        """Memory scope of the ready flags: peers on other GPUs need "sys"."""
        return "gpu" if self.group is None else "sys"

    def local(self, name: str) -> torch.Tensor:
        """This launch's view of a region: its ranks' regions, contiguous."""
        return self._local[name]

    def record_errors(self, error_word: torch.Tensor, what: str) -> None:
        """Queue a launch's error word for checking without a host sync now."""
        host = torch.empty(4, dtype=torch.int32, pin_memory=error_word.is_cuda)
        host.copy_(error_word, non_blocking=True)
        self._pending_errors.append((host, what))

    def raise_pending_errors(self, synchronize: bool = True) -> None:
        """Raise :class:`~uniep.kernels.flags.MegakernelWaitError` if a queued launch
        timed out. Each call checks the earlier calls' words after its own host sync
        (so a timeout surfaces at the next megakernel call at the latest);
        ``synchronize=False`` is for callers that have just synchronized."""
        if synchronize and torch.cuda.is_available():
            torch.cuda.synchronize()
        pending, self._pending_errors = self._pending_errors, []
        for host, what in pending:
            raise_on_error(host, what)

    def next_epoch(self) -> int:
        self.epoch += 1
        return self.epoch

    def prepare(self, tokens: int, top_k: int, rows_per_owner: list[int], dim: int, dtype: torch.dtype,
                device: torch.device, pairs: int | None = None) -> torch.Tensor | None:
        """Make room for a call (every rank of a real group decides the same: the inputs
        come from the all-gathered count table) and point the row regions at each
        owner's rows. ``pairs``: return rows a sender needs (default ``tokens * top_k``).
        Returns the call's row bases (virtual owners share one row space, so they move
        with each call's rows; None for a real group): its backward points the row
        regions back at them with :meth:`point_rows`, after later layers' calls."""
        rows = max(rows_per_owner) if self.group is not None else sum(rows_per_owner[self.rank0:self.rank0 + self.local_ranks])
        pairs = tokens * top_k if pairs is None else pairs
        if (tokens > self.tokens_cap or pairs > self.pairs_cap or rows > self.rows_cap
                or dim != self.dim or dtype != self.dtype):
            self.tokens_cap = _round_up(max(tokens, self.tokens_cap), 1024)
            self.pairs_cap = _round_up(max(pairs, self.pairs_cap), 1024 * top_k)
            self.rows_cap = _round_up(max(rows, self.rows_cap), 4096)
            self.dim, self.dtype = dim, dtype
            self._allocate(device)
        if self.group is None:
            # Virtual owners share one row space: owner d's rows start at row_base[d].
            row_base = device_ints([sum(rows_per_owner[:d]) for d in range(self.world)], device)
            self.point_rows(row_base)
            return row_base
        return None

    def point_rows(self, row_base: torch.Tensor | None) -> None:
        """Point the row regions at a call's rows (``prepare``'s result; None: nothing to do)."""
        if row_base is not None:
            self.deltas.update({name: row_base for name in _ROW_REGIONS})

    def _shapes(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        W, D = self.world, self.dim
        shapes = {"land": (W * self.tokens_cap, D), "ret": (self.pairs_cap, D), "ret_flag": (self.pairs_cap,)}
        shapes.update({name: (self.rows_cap,) for name in _ROW_REGIONS})
        return {name: (shape, _REGIONS[name] or self.dtype) for name, shape in shapes.items()}

    def _allocate(self, device: torch.device) -> None:
        shapes = self._shapes()
        if self.group is None:
            W = self.world
            for name, (shape, dtype) in shapes.items():
                rank_rows = 1 if name in _ROW_REGIONS else W  # row regions: one shared row space
                self._local[name] = torch.zeros((rank_rows * shape[0], *shape[1:]), dtype=dtype, device=device)
                step = int(torch.Size(shape).numel()) if rank_rows > 1 else 0
                self.deltas[name] = torch.arange(W, dtype=torch.int64, device=device) * step
            return
        import torch.distributed._symmetric_memory as symm_mem

        offsets, total = {}, 0
        for name, (shape, dtype) in shapes.items():
            offsets[name] = total
            total += _round_up(int(torch.Size(shape).numel()) * dtype.itemsize, 256)
        symm_mem.enable_symm_mem_for_group(self.group.group_name)  # needed by older PyTorch; idempotent
        buffer = symm_mem.empty(total, dtype=torch.uint8, device=device)
        buffer.zero_()
        handle = symm_mem.rendezvous(buffer, self.group.group_name)
        self._buffer, self._handle = buffer, handle
        for name, (shape, dtype) in shapes.items():
            nbytes = int(torch.Size(shape).numel()) * dtype.itemsize
            self._local[name] = buffer[offsets[name] : offsets[name] + nbytes].view(dtype).view(shape)
            byte_deltas = [ptr - handle.buffer_ptrs[self.rank0] for ptr in handle.buffer_ptrs]
            if any(delta % (16 * dtype.itemsize) for delta in byte_deltas):
                raise RuntimeError(f"symmetric buffers are not 16-element aligned to each other: {byte_deltas}")
            self.deltas[name] = torch.tensor([d // dtype.itemsize for d in byte_deltas], dtype=torch.int64, device=device)
        handle.barrier()


_VIRTUAL_PEERS: dict[tuple[int, torch.device], PeerBuffers] = {}


def virtual_peers(world: int, device: torch.device) -> PeerBuffers:
    """The process's buffers for ``world`` virtual ranks on ``device`` (shared by every layer)."""
    key = (world, torch.device(device))
    if key not in _VIRTUAL_PEERS:
        _VIRTUAL_PEERS[key] = PeerBuffers.virtual(world)
    return _VIRTUAL_PEERS[key]


@dataclass
class Sends:
    """The sends of a launch's senders, in push order (owner's lowest expert first).

    The first ``num_sends[0]`` (a device scalar: no host sync) of P = T*K entries are
    sends: ``src``, ``token``, ``dest`` (P,) int32: token ``token`` of rank ``src`` goes
    to rank ``dest`` once; ``rows``, ``pairs`` (P, K) int32: its rows on ``dest`` and
    their slots in the sender's return region, ``t*K + k`` (a relay's are packed)
    (-1 where pair k goes elsewhere); ``scale`` (P, K) fp32:
    the rows' scores. ``token_base`` and ``token_count`` (local_ranks,) int32: each
    sender's tokens in the launch's x."""

    src: torch.Tensor
    token: torch.Tensor
    dest: torch.Tensor
    rows: torch.Tensor
    pairs: torch.Tensor
    scale: torch.Tensor
    num_sends: torch.Tensor
    token_base: torch.Tensor
    token_count: torch.Tensor
    tokens_per_sender: list[int]
    rank0: int
    _combine_tasks: dict = field(default_factory=dict, repr=False)

    @property
    def capacity(self) -> int:
        """Upper bound of the number of sends (one per pair)."""
        return self.src.numel()

    @property
    def num_tokens(self) -> int:
        return sum(self.tokens_per_sender)

    def combine_tasks(self, tokens_per_task: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(sender rank, first token) of every combine task, (n,) int32 each; built once
        per call (the forward and the backward launch share them)."""
        if tokens_per_task not in self._combine_tasks:
            self._combine_tasks[tokens_per_task] = self._build_combine_tasks(tokens_per_task)
        return self._combine_tasks[tokens_per_task]

    def _build_combine_tasks(self, tokens_per_task: int) -> tuple[torch.Tensor, torch.Tensor]:
        tasks = [-(-t // tokens_per_task) for t in self.tokens_per_sender]
        device = self.src.device
        first_task = device_ints([sum(tasks[:i]) for i in range(len(tasks))], device)
        sender = torch.repeat_interleave(torch.arange(len(tasks), device=device), device_ints(tasks, device),
                                         output_size=sum(tasks))
        first_token = (torch.arange(sum(tasks), device=device) - first_task[sender]) * tokens_per_task
        return (sender + self.rank0).to(torch.int32), first_token.to(torch.int32)


def build_sends(
    topk_TK: torch.Tensor,
    scores_TK: torch.Tensor,
    tokens_per_sender: list[int],
    count_table_WE: torch.Tensor,
    rank0: int,
    tokens_cap: int,
    relay_dedup: bool = True,
) -> Sends:
    """The sends of senders ``rank0, rank0 + 1, ...`` whose routings are concatenated in
    ``topk_TK`` (T, K) (``tokens_per_sender`` rows each), rows placed by Algorithm 1 over
    the all-gathered ``count_table_WE`` (W, E). Without ``relay_dedup`` every pair is
    its own send."""
    W, E = count_table_WE.shape
    El = E // W
    dest_row_TK = algorithm1_rows(topk_TK, count_table_WE, rank0)
    return sends_to_owners(topk_TK // El, topk_TK % El, dest_row_TK, scores_TK, tokens_per_sender, rank0, W, El,
                           tokens_cap, relay_dedup)


def algorithm1_rows(topk_TK: torch.Tensor, count_table_WE: torch.Tensor, rank0: int) -> torch.Tensor:
    """(T, K) int64: each pair's row on its owner (Algorithm 1) for the consecutive
    senders ``rank0, rank0 + 1, ...`` whose routings are concatenated in ``topk_TK``."""
    T, K = topk_TK.shape
    W, E = count_table_WE.shape
    El = E // W
    device = topk_TK.device
    # The senders are consecutive ranks, so a stable sort by expert orders each
    # expert's pairs by (sender, token, k).
    table = count_table_WE.to(device=device, dtype=torch.int64)
    flat = topk_TK.reshape(-1)
    order = torch.argsort(flat, stable=True)
    launch_counts_E = torch.bincount(flat, minlength=E)
    place_in_expert = torch.empty_like(order)
    place_in_expert[order] = torch.arange(flat.numel(), device=device) - exclusive_cumsum(launch_counts_E)[flat[order]]
    base_E = exclusive_cumsum(table.sum(0).view(W, El), 1).reshape(-1)
    lower_senders_E = table[:rank0].sum(0)
    return (base_E[flat] + lower_senders_E[flat] + place_in_expert).view(T, K)


def sends_to_owners(
    owner_TK: torch.Tensor,
    expert_TK: torch.Tensor,
    dest_row_TK: torch.Tensor,
    scores_TK: torch.Tensor,
    tokens_per_sender: list[int],
    rank0: int,
    world: int,
    experts_per_rank: int,
    tokens_cap: int,
    relay_dedup: bool = True,
    pair_slot_TK: torch.Tensor | None = None,
) -> Sends:
    """The sends of the launch's senders (see :class:`Sends`) given each pair's owner
    rank ``owner_TK`` (-1: the pair is not this launch's, e.g. bound for another node),
    its expert among the owner's ``expert_TK``, its row on the owner ``dest_row_TK`` and
    its slot in the sender's return region ``pair_slot_TK`` (default ``t*K + k``), all
    (T, K). ``world``: ranks the owners are numbered in."""
    T, K = owner_TK.shape
    W, El = world, experts_per_rank
    device = owner_TK.device
    counts = device_ints(tokens_per_sender, device)
    token_base = exclusive_cumsum(counts)
    sender_T = torch.repeat_interleave(torch.arange(len(tokens_per_sender), device=device), counts, output_size=T)
    token_T = torch.arange(T, device=device) - token_base[sender_T]

    # One send per (token, owner): the token's first pair for that owner carries all of them.
    present = owner_TK >= 0
    same_owner = (owner_TK[:, :, None] == owner_TK[:, None, :]) & present[:, :, None]  # (T, K, K)
    if not relay_dedup:
        same_owner = same_owner & torch.eye(K, dtype=torch.bool, device=device)
    earlier = torch.ones(K, K, dtype=torch.bool, device=device).tril(-1)
    first = (present & ~(same_owner & earlier).any(-1)).reshape(-1)
    # Every pair is a candidate send; the others sort to the end (no host sync for S).
    t_idx = torch.arange(T, device=device).repeat_interleave(K)
    k_idx = torch.arange(K, device=device).repeat(T)
    members = same_owner.reshape(T * K, K)
    rows = torch.where(members, dest_row_TK[t_idx], -1)
    if pair_slot_TK is None:
        pair_slot_TK = token_T[:, None] * K + torch.arange(K, device=device)
    pairs = torch.where(members, pair_slot_TK[t_idx], -1)
    scale = torch.where(members, scores_TK[t_idx].float(), 0.0)
    lowest_expert = torch.where(members, expert_TK[t_idx], El).amin(1)
    src, token, dest = sender_T[t_idx] + rank0, token_T[t_idx], owner_TK[t_idx, k_idx]
    # Priority: the owner's lowest expert first; owners visited starting after the
    # sender (spreads the first pushes over the owners); then sender, then token.
    key = ((lowest_expert * W + (dest - src) % W) * W + src) * tokens_cap + token
    push = torch.argsort(torch.where(first, key, torch.iinfo(torch.int64).max))
    src, token, dest, rows, pairs = (t[push].to(torch.int32).contiguous() for t in (src, token, dest, rows, pairs))
    return Sends(
        src=src, token=token, dest=dest, rows=rows, pairs=pairs, scale=scale[push].contiguous(),
        num_sends=first.sum().to(torch.int32).reshape(1), token_base=token_base.to(torch.int32),
        token_count=counts.to(torch.int32), tokens_per_sender=list(tokens_per_sender), rank0=rank0,
    )


@dataclass(frozen=True)
class OwnerRows:
    """The rows of a launch's owners, concatenated (owner-major = expert-major)."""

    rows_per_expert: torch.Tensor
    """(local_ranks * El,) int64 on the device."""
    expert_offsets: torch.Tensor
    """(local_ranks * El + 1,) int32."""
    tile_offsets: torch.Tensor
    """(local_ranks * El + 1,) int32 row tiles of ``block_m`` rows."""
    rows_per_owner: list[int]
    """(W,) rows of every rank (all owners, not only this launch's)."""
    landing_row: torch.Tensor
    """(R,) int64: first landing row of each row's owner in the launch's landing view."""
    experts_per_rank: int

    @property
    def num_rows(self) -> int:
        """R: the rows of this launch's owners."""
        return self.landing_row.numel()


def owner_rows(count_table_WE: torch.Tensor, rows_per_owner: list[int], rank0: int, local_ranks: int,
               block_m: int, landing_rows: int) -> OwnerRows:
    """The launch owners' row schedule; ``landing_rows``: rows of one owner's landing buffer."""
    W, E = count_table_WE.shape
    El = E // W
    mine = count_table_WE.sum(0)[rank0 * El : (rank0 + local_ranks) * El]
    expert_offsets, tiles = tile_offsets(mine, block_m)
    local = rows_per_owner[rank0 : rank0 + local_ranks]
    landing_row = torch.repeat_interleave(
        torch.arange(local_ranks, device=mine.device) * landing_rows,
        device_ints(local, mine.device), output_size=sum(local),
    )
    return OwnerRows(mine, expert_offsets, tiles, rows_per_owner, landing_row, El)


@dataclass
class Launch:
    """Everything one call needs: who is in the launch, where the buffers are, how to run."""

    peers: PeerBuffers
    sends: Sends
    rows: OwnerRows
    schedule: Schedule
    score_before_experts: bool
    relay: RelayLegs | None = None
    """Hierarchical transport: the inter-node legs around this (intra-node) launch,
    whose senders are then relays of other ranks' tokens
    (:class:`uniep.transport.hierarchical.RelayLegs`)."""
    row_base: torch.Tensor | None = None
    """Virtual ranks: where this call's owners' rows start (``PeerBuffers.prepare``)."""


def _senders_rows(region: torch.Tensor, sends: Sends, pairs_cap: int, top_k: int) -> torch.Tensor:
    """(P, D): the pair rows of a launch's senders, taken from their return buffers."""
    per_sender = region.view(-1, pairs_cap, region.shape[-1])
    return torch.cat([per_sender[i, : t * top_k] for i, t in enumerate(sends.tokens_per_sender)])


def _launch_state(device: torch.device) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    """Zeroed task counters of the two launches of a call and their shared error word."""
    state = torch.zeros(6, dtype=torch.int32, device=device)
    return (state[0:1], state[1:2]), state[2:]


def _returned_rows(launch: Launch, top_k: int) -> torch.Tensor:
    """(P, D): the pair rows of the launch's senders (relays: sent back to their
    sources first), in (token, k) order."""
    peers, sends, relay = launch.peers, launch.sends, launch.relay
    if relay is None:
        return _senders_rows(peers.local("ret"), sends, peers.pairs_cap, top_k)
    return relay.to_sources(peers.local("ret")[: relay.num_pairs])


def _describe(launch: Launch, direction: str) -> str:
    """What a wait error names: ranks of a hierarchical launch are numbered in their node."""
    if launch.relay is None:
        return f"megakernel {direction}"
    return f"megakernel {direction} (node {launch.relay.node}; ranks numbered within the node)"


class _MegakernelExperts(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TD, scores_TK, w1, w2, w3, launch: Launch):
        peers, sends, rows, sched, relay = launch.peers, launch.sends, launch.rows, launch.schedule, launch.relay
        before = launch.score_before_experts
        peers.point_rows(launch.row_base)
        K = scores_TK.shape[1]
        dtypes = (w1.dtype, w2.dtype, w3.dtype)
        w1, w2, w3 = (w.to(x_TD.dtype) for w in (w1, w2, w3))
        R = rows.num_rows
        a_row, scale, origin = (peers.local(name)[:R] for name in ("a_row", "scale", "origin"))
        counters, error = _launch_state(x_TD.device)
        x_in = x_TD if relay is None else relay.to_relays(x_TD)
        h, a1, a3 = dispatch_gemm(
            sends, peers, rows, x_in, w1, w3, mode=SWIGLU_FWD, epoch=peers.next_epoch(), tiles=sched.up,
            sends_per_task=sched.sends_per_task, max_spins=sched.max_spins, counter=counters[0], error=error,
            a_row=a_row, a_scale=scale, scale_rows=before,
        )
        # The owners' buffers serve the next layer too: keep this call's metadata and rows.
        a_row, scale, origin = a_row.clone(), scale.clone(), origin.clone()
        x_rows_RD = peers.local("land").index_select(0, a_row.long() + rows.landing_row)
        out_TD = gemm_combine(
            sends, peers, rows, h, None, w2, None, None if before or relay else scores_TK,
            mode=PLAIN, origin=origin, tiles=sched.gemm, tokens_per_task=sched.tokens_per_task,
            max_spins=sched.max_spins, counter=counters[1], error=error,
            pair_slots=None if relay is None else relay.pair_slots,
        )
        peers.record_errors(error, _describe(launch, "forward"))
        y_PD = None if before and relay is None else _returned_rows(launch, K)
        if relay is not None:
            out_TD = topk_combine(y_PD, None if before else scores_TK, K)
            y_PD = None if before else y_PD
        ctx.save_for_backward(x_TD, scores_TK, w1, w2, w3, h, a1, a3, x_rows_RD, a_row, scale, origin, y_PD)
        ctx.launch, ctx.dtypes = launch, dtypes
        return out_TD

    @staticmethod
    def backward(ctx, grad_out_TD):
        x_TD, scores_TK, w1, w2, w3, h, a1, a3, x_rows_RD, a_row, scale, origin, y_PD = ctx.saved_tensors
        launch = ctx.launch
        peers, sends, rows, sched, relay = launch.peers, launch.sends, launch.rows, launch.schedule, launch.relay
        before = launch.score_before_experts
        peers.point_rows(launch.row_base)  # later layers' calls moved them
        K = scores_TK.shape[1]
        E_local = w1.shape[0]
        grad_out_TD = grad_out_TD.contiguous()
        counters, error = _launch_state(grad_out_TD.device)
        grad_in = grad_out_TD if relay is None else relay.to_relays(grad_out_TD)
        d_a1, d_a3 = dispatch_gemm(
            sends, peers, rows, grad_in, w2, None, mode=SWIGLU_BWD, epoch=peers.next_epoch(), tiles=sched.up,
            sends_per_task=sched.sends_per_task, max_spins=sched.max_spins, counter=counters[0], error=error,
            a_row=a_row, a_scale=scale, scale_rows=not before, aux=(a1, a3),
        )
        # w2's gradient now, while this rank's landing buffer still holds the output
        # gradient (peers may refill it once this rank's combine below is done); the
        # score scale is applied per row and rounded, as the sequential path does
        dt1, dt2, dt3 = ctx.dtypes
        land_index = (a_row.long() + rows.landing_row).to(torch.int32)
        grad_w2 = grouped_wgrad(
            peers.local("land"), h, rows.expert_offsets, E_local, tiles=sched.wgrad, out_dtype=dt2,
            a_row=land_index, a_scale=None if before else scale,
        )
        grad_x = gemm_combine(
            sends, peers, rows, d_a1, d_a3, w1, w3, scores_TK if before and relay is None else None,
            mode=DUAL, origin=origin, tiles=sched.gemm, tokens_per_task=sched.tokens_per_task,
            max_spins=sched.max_spins, counter=counters[1], error=error,
            pair_slots=None if relay is None else relay.pair_slots,
        )
        peers.record_errors(error, _describe(launch, "backward"))
        d_rows_PD = _returned_rows(launch, K) if before or relay is not None else None
        if relay is not None:
            grad_x = topk_combine(d_rows_PD, scores_TK if before else None, K)
        if before:
            _, grad_scores = topk_combine_bwd(x_TD, d_rows_PD, scores_TK, K, write_rows=False)
        else:
            _, grad_scores = topk_combine_bwd(grad_out_TD, y_PD, scores_TK, K, write_rows=False)
        grad_w1, grad_w3 = grouped_wgrad(
            d_a1, x_rows_RD, rows.expert_offsets, E_local, tiles=sched.wgrad_up, out_dtype=dt1,
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
    rows = owner_rows(count_table_WE, rows_per_owner, peers.rank0, peers.local_ranks, schedule.gemm.block_m,
                      peers.world * peers.tokens_cap)
    launch = Launch(peers, sends, rows, schedule, score_before_experts, row_base=row_base)
    return _MegakernelExperts.apply(x_TD.contiguous(), scores_TK, w1, w2, w3, launch)
