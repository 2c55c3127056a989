"""Megakernel 1: token dispatch fused with the first grouped GEMM of the experts.

Shape legend: W expert-parallel ranks, T_cap tokens per rank (capacity), D model dim,
K experts per token, Q sends, R rows (expert-major, the plan's order), H hidden dim.

One persistent launch; programs take tasks from an atomic counter:

- tasks ``[0, n_push)`` push rows. A *send* is one (token, owner rank) pair: the token
  crosses to its owner once, however many of the owner's experts it was routed to
  (relay dedup), into the owner's landing buffer at slot ``src * T_cap + token``. With
  the token the sender writes, for each of its rows on the owner, the row's landing
  slot, its score and its origin (``src * P_cap + t*K + k``), then raises the row's
  ready flag (the call's epoch). Sends are ordered by the owner's lowest expert first,
  so the GEMM tiles of low experts can start early;
- tasks ``[n_push, n_push + tiles)`` are tiles of the grouped GEMM over this launch's
  owner rows. A tile waits for the ready flags of its rows, gathers its A rows from the
  landing buffer (a deduplicated token feeds all of its rows: the relay copy is the
  GEMM's own gather) and runs the tile exactly as ``grouped_gemm`` does, so its bits
  equal the sequential dispatch-then-GEMM.

Pushes precede tiles in counter order, so programs that run one after another (the
Triton interpreter) never wait for work not yet done, and on a GPU a waiting tile only
ever waits for pushes already taken by running programs (or by peers).

Forward: mode SWIGLU_FWD, pushes x and the row metadata. Backward: mode SWIGLU_BWD,
pushes the output gradient only (the metadata was saved by the owner in the forward).

A launch covers the ranks ``[rank0, rank0 + local_ranks)``: one real rank (its peers'
buffers reached through per-region offsets) or W virtual ranks on one device.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from uniep.kernels.flags import _STAGE_DISPATCH, publish_flags, wait_flags
from uniep.kernels.grouped_gemm import (
    SWIGLU_BWD,
    SWIGLU_FWD,
    GemmTiles,
    _num_programs,
    _tile_accumulate,
    _tile_store,
    _weight_view,
    dot_precision,
    pair_buffer,
    programs_per_sm,
)
from uniep.kernels.launch import cdiv, launcher, next_power_of_2
from uniep.kernels.row_tiles import tile_coords


@triton.jit
def _push_rows(
    chunk, x_ptr, tok_base_ptr,
    send_src_ptr, send_token_ptr, send_dest_ptr, send_rows_ptr, send_pairs_ptr, send_scale_ptr,
    land_ptr, meta_a_row_ptr, meta_scale_ptr, meta_origin_ptr, row_flag_ptr,
    land_delta_ptr, a_row_delta_ptr, scale_delta_ptr, origin_delta_ptr, row_flag_delta_ptr,
    n_sends, D, T_cap, P_cap, rank0, epoch,
    K: tl.constexpr, KP: tl.constexpr, PUSH_META: tl.constexpr,
    SENDS_PER_TASK: tl.constexpr, BLOCK_D: tl.constexpr, SCOPE: tl.constexpr,
):
    """Push sends ``[chunk * SENDS_PER_TASK, ...)``: token rows, row metadata, row flags.
    Rank ``dest``'s copy of a region is at ``region_ptr + region_delta[dest]`` (elements)."""
    idx = chunk * SENDS_PER_TASK + tl.arange(0, SENDS_PER_TASK)
    mask_s = idx < n_sends
    src = tl.load(send_src_ptr + idx, mask=mask_s, other=0)
    token = tl.load(send_token_ptr + idx, mask=mask_s, other=0)
    dest = tl.load(send_dest_ptr + idx, mask=mask_s, other=0)
    x_rows = (tl.load(tok_base_ptr + src - rank0, mask=mask_s, other=0) + token).to(tl.int64)
    slot = src * T_cap + token
    # The landing regions start 16-element aligned (checked on the host): vector stores.
    land_rows = tl.multiple_of(tl.load(land_delta_ptr + dest, mask=mask_s, other=0), 16) + slot.to(tl.int64) * D
    for d0 in range(0, D, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)
        mask = mask_s[:, None] & (cols < D)[None, :]
        v = tl.load(x_ptr + x_rows[:, None] * D + cols[None, :], mask=mask)
        tl.store(land_ptr + land_rows[:, None] + cols[None, :], v, mask=mask)

    kk = tl.arange(0, KP)
    mask_k = mask_s[:, None] & (kk < K)[None, :]
    at = idx[:, None] * K + kk[None, :]
    rows = tl.load(send_rows_ptr + at, mask=mask_k, other=-1)
    mask_r = mask_k & (rows >= 0)
    if PUSH_META:
        a_row_at = tl.load(a_row_delta_ptr + dest, mask=mask_s, other=0)[:, None] + rows
        tl.store(meta_a_row_ptr + a_row_at, tl.broadcast_to(slot[:, None], (SENDS_PER_TASK, KP)), mask=mask_r)
        pairs = tl.load(send_pairs_ptr + at, mask=mask_r, other=0)
        origin_at = tl.load(origin_delta_ptr + dest, mask=mask_s, other=0)[:, None] + rows
        tl.store(meta_origin_ptr + origin_at, src[:, None] * P_cap + pairs, mask=mask_r)
        scale = tl.load(send_scale_ptr + at, mask=mask_r, other=0.0)
        scale_at = tl.load(scale_delta_ptr + dest, mask=mask_s, other=0)[:, None] + rows
        tl.store(meta_scale_ptr + scale_at, scale, mask=mask_r)
    flag_at = tl.load(row_flag_delta_ptr + dest, mask=mask_s, other=0)[:, None] + rows
    publish_flags(row_flag_ptr + flag_at, mask_r, epoch, False, SCOPE)


# The epoch changes every call: specializing on it (divisibility by 16) would recompile.
@triton.jit(do_not_specialize=["epoch", "max_spins"])
def _dispatch_gemm_kernel(
    counter_ptr, error_ptr,
    # push side (this launch's sources)
    x_ptr, tok_base_ptr,
    send_src_ptr, send_token_ptr, send_dest_ptr, send_rows_ptr, send_pairs_ptr, send_scale_ptr,
    meta_a_row_ptr, meta_scale_ptr, meta_origin_ptr,  # this launch's row-metadata regions
    land_delta_ptr, a_row_delta_ptr, scale_delta_ptr, origin_delta_ptr, row_flag_delta_ptr,  # (W,) int64
    num_sends_ptr, D, T_cap, P_cap, rank0, epoch, max_spins,
    # GEMM side (this launch's owners; rows concatenated over them)
    land_ptr,  # (local_ranks * W * T_cap, D) landing buffers of this launch's owners
    a_row_ptr, a_scale_ptr,  # (R,) landing slot and score of each row (read by the tiles)
    row_flag_ptr,  # (R,) ready flag of each row
    b_ptr, b2_ptr, c_ptr, c2_ptr, aux1_ptr, aux3_ptr,
    tile_offsets_ptr, table_ptr,
    N, Kd, num_experts, experts_per_rank, land_rows_per_rank,
    stride_be, stride_bk, stride_bn, stride_cm, stride_auxm,
    MODE: tl.constexpr, PUSH_META: tl.constexpr, HAS_SCALE: tl.constexpr,
    K: tl.constexpr, KP: tl.constexpr, SENDS_PER_TASK: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SCOPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    n_tiles = tl.cdiv(N, BLOCK_N)
    n_sends = tl.load(num_sends_ptr)
    n_push = tl.cdiv(n_sends, SENDS_PER_TASK)
    total = n_push + tl.load(tile_offsets_ptr + num_experts) * n_tiles
    task = tl.atomic_add(counter_ptr, 1)
    while task < total:
        if task < n_push:
            _push_rows(
                task, x_ptr, tok_base_ptr,
                send_src_ptr, send_token_ptr, send_dest_ptr, send_rows_ptr, send_pairs_ptr, send_scale_ptr,
                land_ptr, meta_a_row_ptr, meta_scale_ptr, meta_origin_ptr, row_flag_ptr,
                land_delta_ptr, a_row_delta_ptr, scale_delta_ptr, origin_delta_ptr, row_flag_delta_ptr,
                n_sends, D, T_cap, P_cap, rank0, epoch,
                K, KP, PUSH_META, SENDS_PER_TASK, BLOCK_D, SCOPE,
            )
        else:
            e, _, _, rows, mask_m, cols, mask_n = tile_coords(task - n_push, n_tiles, N, table_ptr, BLOCK_M, BLOCK_N)
            owner = e // experts_per_rank
            wait_flags(row_flag_ptr, rows, mask_m, epoch, max_spins, error_ptr, rank0 + owner, _STAGE_DISPATCH, SCOPE)
            a_rows = tl.load(a_row_ptr + rows, mask=mask_m, other=0).to(tl.int64) + owner.to(tl.int64) * land_rows_per_rank
            scale = tl.load(a_scale_ptr + rows, mask=mask_m & HAS_SCALE, other=0.0)
            acc, acc3 = _tile_accumulate(
                e, a_rows, mask_m, cols, mask_n, scale, land_ptr, land_ptr, b_ptr, b2_ptr,
                Kd, D, stride_be, stride_bk, stride_bn, MODE, HAS_SCALE, BLOCK_M, BLOCK_N, BLOCK_K,
                DOT_PRECISION,
            )
            _tile_store(acc, acc3, rows, mask_m, cols, mask_n, rows.to(tl.int64),
                        c_ptr, c2_ptr, aux1_ptr, aux3_ptr, stride_cm, stride_auxm, MODE)
        task = tl.atomic_add(counter_ptr, 1)


def dispatch_gemm(
    sends,
    peers,
    owner_rows,
    x_TD: torch.Tensor,
    w_E: torch.Tensor,
    w3_E: torch.Tensor | None,
    *,
    mode: int,
    epoch: int,
    tiles: GemmTiles,
    sends_per_task: int,
    max_spins: int,
    counter: torch.Tensor,
    error: torch.Tensor,
    a_row: torch.Tensor,
    a_scale: torch.Tensor,
    scale_rows: bool,
    aux: tuple[torch.Tensor, torch.Tensor] | None = None,
):
    """Launch megakernel 1 for one EP launch (see the module docstring).

    ``sends`` (:class:`uniep.transport.sends.Sends`) and ``x_TD`` (this launch's
    tokens, sources concatenated) are the push side; ``peers``
    (:class:`~uniep.transport.peer_buffers.PeerBuffers`) the landing and flag buffers of
    every rank; ``owner_rows`` (:class:`~uniep.transport.sends.OwnerRows`) this
    launch's rows. Forward (SWIGLU_FWD, ``w_E`` = w1, ``w3_E`` = w3): pushes the
    metadata (slot, score, origin of every row) into the owners' buffers, reads
    ``a_row`` / ``a_scale`` (this launch's views of them) and returns (h, a1, a3)
    (R, H). Backward (SWIGLU_BWD, ``w_E`` = w2, ``aux`` = (a1, a3)): pushes rows only,
    reads the saved ``a_row`` / ``a_scale`` and returns (d_a1, d_a3) (R, H).
    ``scale_rows``: multiply each gathered row by its score before the dot.
    ``counter`` (1,) int32 zero: the task counter; ``error`` (4,) int32: the error word
    (``uniep.kernels.flags``), read by the caller.
    """
    transpose = mode == SWIGLU_FWD
    tiles = tiles.fitted(x_TD.dtype, x_TD.device, b_tiles=2 if mode == SWIGLU_FWD else 1)
    Kd, N, s_be, s_bk, s_bn = _weight_view(w_E, transpose)
    R = owner_rows.num_rows
    if mode == SWIGLU_FWD:
        aux = (x_TD.new_empty(R, N), x_TD.new_empty(R, N))
    c, c2 = pair_buffer(x_TD, R, N) if mode == SWIGLU_BWD else (x_TD.new_empty(R, N),) * 2
    n_push = cdiv(sends.capacity, sends_per_task)  # upper bound, for the grid
    upper_tiles = (cdiv(R, tiles.block_m) + w_E.shape[0]) * cdiv(N, tiles.block_n)
    programs = _num_programs(tiles, x_TD.device, n_push + upper_tiles,
                             programs_per_sm(tiles, x_TD.element_size(), x_TD.device, mode))
    D = x_TD.shape[1]
    K = sends.rows.shape[1]
    push_meta = mode == SWIGLU_FWD
    launcher(_dispatch_gemm_kernel)[(programs,)](
        counter, error,
        x_TD, sends.token_base,
        sends.src, sends.token, sends.dest, sends.rows, sends.pairs,
        sends.scale,
        peers.local("a_row"), peers.local("scale"), peers.local("origin"),
        *(peers.deltas[name] for name in ("land", "a_row", "scale", "origin", "row_flag")),
        sends.num_sends, D, peers.tokens_cap, peers.pairs_cap, peers.rank0, epoch, max_spins,
        peers.local("land"), a_row, a_scale, peers.local("row_flag"),
        w_E, w_E if w3_E is None else w3_E, c, c2, aux[0], aux[1],
        owner_rows.schedule.tile_offsets, owner_rows.schedule.table,
        N, Kd, w_E.shape[0], owner_rows.experts_per_rank, peers.world * peers.tokens_cap,
        s_be, s_bk, s_bn, c.stride(0), aux[0].stride(0),
        MODE=mode, PUSH_META=push_meta, HAS_SCALE=scale_rows,
        K=K, KP=next_power_of_2(K), SENDS_PER_TASK=sends_per_task,
        BLOCK_D=min(256, next_power_of_2(D)),
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
        SCOPE=peers.flag_scope, DOT_PRECISION=dot_precision(x_TD.dtype),
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )
    if mode == SWIGLU_FWD:
        return c, aux[0], aux[1]
    return c, c2
