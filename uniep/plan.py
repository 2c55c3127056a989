"""Deterministic routing plan (UniEP's Algorithm 1).

Shape legend: T local tokens, K experts per token, P = T*K (token, k) pairs,
E experts, W expert-parallel ranks, El = E / W experts per rank, R rows received.

Every (token, k) pair becomes one row. On the rank that owns expert ``e`` rows are
expert-major; inside an expert they are ordered by source rank, then token index, then
k. A row's place is therefore a pure function of the all-gathered count table
``C[rank][expert]``:

    dest(e, src, i) = base(e) + sum_{s < src} C[s][e] + i

where ``base(e)`` is the number of rows of the owner's lower experts and ``i`` the rank
of the pair among src's pairs for ``e``. No arrival order, atomic or schedule enters
it, which is what makes every later stage bitwise reproducible.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RoutingPlan:
    num_experts: int
    top_k: int
    ep_size: int
    ep_rank: int
    send_order: torch.Tensor
    """(P,) int64: pair id ``t*K + k`` of each sent row; sorted by (expert, t, k)."""
    send_order_inverse: torch.Tensor
    """(P,) int64: position in ``send_order`` of pair ``t*K + k``."""
    count_table: torch.Tensor
    """(W, E) int64: pairs each rank routes to each expert."""
    dest_rows: torch.Tensor
    """(P,) int64: row on the owner rank of each sent row (Algorithm 1)."""
    arrival_to_row: torch.Tensor
    """(R,) int64: expert-major row of each received row; rows arrive source-major
    (all of rank 0's rows first), expert-major inside a source."""
    row_to_arrival: torch.Tensor
    """(R,) int64: inverse of ``arrival_to_row``."""
    send_splits: list[int]
    """(W,) rows sent to each rank."""
    recv_splits: list[int]
    """(W,) rows received from each rank."""
    rows_per_local_expert: list[int]
    """(El,) rows each local expert processes."""

    @property
    def experts_per_rank(self) -> int:
        return self.num_experts // self.ep_size

    @property
    def num_rows(self) -> int:
        return int(self.arrival_to_row.numel())


def local_counts(topk_idx_TK: torch.Tensor, num_experts: int) -> torch.Tensor:
    """(E,) int64: pairs routed to each expert (any shape of expert ids)."""
    return counts_in_sorted(sort_keys(topk_idx_TK, num_experts).sort().values, num_experts)


def expert_order(topk_idx_TK: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(counts_E, order_2P)``: pairs routed to each expert, and in ``order_2P`` (2, P)
    int64 the pair ids ``t*K + k`` stably sorted by expert (row 0, the plan's send order)
    and its inverse (row 1, each pair's position in it), from one sort. Where the experts
    run on Triton the layer takes the same bits from ``kernels.expert_order`` up to its
    ``MAX_PAIRS`` pairs (one launch instead of the host ops here)."""
    expert_P, order_P = sort_keys(topk_idx_TK, num_experts).sort(stable=True)
    order_2P = torch.stack((order_P, inverse_permutation(order_P)))
    return counts_in_sorted(expert_P, num_experts), order_2P


def sort_keys(topk_idx_TK: torch.Tensor, num_experts: int) -> torch.Tensor:
    """The expert ids, flat, as int16 where that holds 0..E (else int64): a GPU radix
    sort makes one pass per key byte, 2 instead of 8, and a stable sort's order is a
    function of the keys' values, so it is the same order."""
    narrow = torch.int16 if num_experts < torch.iinfo(torch.int16).max else torch.int64
    return topk_idx_TK.reshape(-1).to(narrow)


def counts_in_sorted(sorted_values: torch.Tensor, n: int) -> torch.Tensor:
    """(n,) int64: how often each of 0..n-1 occurs in the ascending ``sorted_values``.
    No host sync, unlike ``torch.bincount`` on CUDA (it reads the maximum back to size
    its output): a layer's forward must not stall the host behind the device."""
    # (made once, outside torch.compile; traced, torch.compile makes its own)
    make = torch.arange if torch.compiler.is_compiling() else cached_range
    bounds = torch.searchsorted(sorted_values, make(n + 1, device=sorted_values.device, dtype=sorted_values.dtype))
    return bounds[1:] - bounds[:-1]


@functools.lru_cache(maxsize=64)
def cached_range(n: int, *, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """0..n-1, made once per (n, device, dtype): each layer call needs it, and every op
    costs host time. Read only."""
    return torch.arange(n, device=device, dtype=dtype)


def inverse_permutation(order: torch.Tensor, *, size_varies: bool = False) -> torch.Tensor:
    """The inverse of the permutation ``order`` of 0..n-1: ``inverse[order[i]] = i``.
    The range 0..n-1 is made once per n (``cached_range``), unless ``size_varies``: n
    changes from call to call (as the rows a rank receives), and a cached range per n
    would hold device memory for sizes that do not come back."""
    make = torch.arange if size_varies or torch.compiler.is_compiling() else cached_range
    return torch.empty_like(order).index_copy_(0, order, make(order.numel(), device=order.device, dtype=order.dtype))


def exclusive_cumsum(x: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """Sums of the elements before each one along ``dim`` (0 for the first)."""
    return torch.cumsum(x, dim=dim) - x


def algorithm1_rows(topk_TK: torch.Tensor, count_table_WE: torch.Tensor, rank0: int,
                    order: torch.Tensor | None = None) -> torch.Tensor:
    """(T, K) int64: each pair's row on its owner (Algorithm 1) for the consecutive
    senders ``rank0, rank0 + 1, ...`` whose routings are concatenated in ``topk_TK``
    (one sender: a rank's plan). ``order``: the pairs stably sorted by expert, if known."""
    T, K = topk_TK.shape
    W, E = count_table_WE.shape
    El = E // W
    device = topk_TK.device
    # The senders are consecutive ranks, so a stable sort by expert orders each
    # expert's pairs by (sender, token, k).
    table = count_table_WE.to(device=device, dtype=torch.int64)
    flat = topk_TK.reshape(-1)
    if order is None:
        order = torch.argsort(flat, stable=True)
    launch_counts_E = counts_in_sorted(flat[order], E)
    place_in_expert = torch.empty_like(order)
    place_in_expert[order] = torch.arange(flat.numel(), device=device) - exclusive_cumsum(launch_counts_E)[flat[order]]
    # base(e): rows of the owner's lower experts, summed over all senders
    base_E = exclusive_cumsum(table.sum(0).view(W, El), 1).reshape(-1)
    lower_senders_E = table[:rank0].sum(0)
    return (base_E[flat] + lower_senders_E[flat] + place_in_expert).view(T, K)


def build_plan(
    topk_idx_TK: torch.Tensor,
    num_experts: int,
    count_table_WE: torch.Tensor | None = None,
    ep_rank: int = 0,
    order_2P: torch.Tensor | None = None,
) -> RoutingPlan:
    """Plan of one rank. ``count_table_WE`` is the all-gathered table of every rank's
    ``local_counts`` (None with one rank); ``order_2P``, if known, the pairs stably
    sorted by expert and that order's inverse (``expert_order``)."""
    T, K = topk_idx_TK.shape
    device = topk_idx_TK.device
    if count_table_WE is None:
        count_table_WE = local_counts(topk_idx_TK, num_experts).unsqueeze(0)
    count_table_WE = count_table_WE.to(device=device, dtype=torch.int64)
    W = count_table_WE.shape[0]
    if num_experts % W != 0:
        raise ValueError(f"num_experts = {num_experts} is not divisible by ep_size = {W}")
    if not 0 <= ep_rank < W:
        raise ValueError(f"ep_rank = {ep_rank} must be in [0, {W})")
    El = num_experts // W

    # Stable sort keeps pairs of one expert in (t, k) order: pair id t*K+k increases.
    if order_2P is None:
        send_order = torch.argsort(topk_idx_TK.reshape(-1), stable=True)
        send_order_inverse = inverse_permutation(send_order)
    else:
        send_order, send_order_inverse = order_2P.unbind()

    counts_E = count_table_WE[ep_rank]
    dest_rows = algorithm1_rows(topk_idx_TK, count_table_WE, ep_rank, send_order).reshape(-1)[send_order]
    base_E = exclusive_cumsum(count_table_WE.sum(0).view(W, El), dim=1).reshape(-1)
    src_prefix_WE = exclusive_cumsum(count_table_WE, dim=0)

    mine = slice(ep_rank * El, (ep_rank + 1) * El)
    seg_counts = count_table_WE[:, mine].reshape(-1)  # source-major, then local expert
    seg_dest_start = (base_E[mine].unsqueeze(0) + src_prefix_WE[:, mine]).reshape(-1)
    seg_arrival_start = exclusive_cumsum(seg_counts, 0)
    R = int(seg_counts.sum())
    arrival_to_row = torch.repeat_interleave(
        seg_dest_start - seg_arrival_start, seg_counts, output_size=R
    ) + torch.arange(R, device=device)
    row_to_arrival = inverse_permutation(arrival_to_row, size_varies=True)

    return RoutingPlan(
        num_experts=num_experts,
        top_k=K,
        ep_size=W,
        ep_rank=ep_rank,
        send_order=send_order,
        send_order_inverse=send_order_inverse,
        count_table=count_table_WE,
        dest_rows=dest_rows,
        arrival_to_row=arrival_to_row,
        row_to_arrival=row_to_arrival,
        send_splits=counts_E.view(W, El).sum(1).tolist(),
        recv_splits=count_table_WE[:, mine].sum(1).tolist(),
        rows_per_local_expert=count_table_WE[:, mine].sum(0).tolist(),
    )


PINNED_COPY_DEVICES = ("cuda",)
"""Device types whose small host lists go through pinned memory (the CPU tests add
"cpu" to run that branch)."""


def device_ints(values: list[int], device: torch.device) -> torch.Tensor:
    """(n,) int64 on ``device`` without waiting for the device: a plain
    ``torch.tensor(values, device="cuda")`` copies from pageable memory, which blocks
    until the GPU has drained its queue."""
    host = torch.tensor(values, dtype=torch.int64)
    if torch.device(device).type not in PINNED_COPY_DEVICES:
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
