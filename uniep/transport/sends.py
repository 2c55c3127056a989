"""The megakernel's work lists: who pushes which token where (``Sends``), and the rows
each owner computes (``OwnerRows``), from the all-gathered count table.

Shape legend: W ranks, El experts per rank, T tokens of a launch's senders, K experts
per token, P = T*K pairs (every pair a candidate send), R rows of a launch's owners.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from uniep.kernels.row_tiles import RowTiles, row_tiles
from uniep.plan import algorithm1_rows, device_ints, exclusive_cumsum


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
    # Every pair is a candidate send; the others sort to the end (no host sync for Q).
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
    schedule: RowTiles
    """The row tiles of ``block_m`` rows of the launch's local_ranks * El experts."""
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
    local = rows_per_owner[rank0 : rank0 + local_ranks]
    schedule = row_tiles(mine, block_m, sum(local))
    landing_row = torch.repeat_interleave(
        torch.arange(local_ranks, device=mine.device) * landing_rows,
        device_ints(local, mine.device), output_size=sum(local),
    )
    return OwnerRows(mine, schedule, rows_per_owner, landing_row, El)


