"""Megakernel 2: the last grouped GEMM of the experts fused with the top-k combine.

Shape legend: W expert-parallel ranks, R rows on the owners (expert-major), N = D model
dim, T tokens and K experts per token on a sender, P_cap = T_cap * K pair slots.

One persistent launch; programs take tasks from an atomic counter:

- tasks ``[0, tiles)`` are GEMM tiles over this launch's owner rows. The epilogue writes
  each output row straight into its sender's return buffer at the pair's slot
  ``t*K + k`` (the row's origin, pushed by the sender in megakernel 1), then adds one
  to the pair's flag: a pair is complete when all ``cdiv(N, BLOCK_N)`` column tiles
  have landed;
- tasks ``[tiles, tiles + n_combine)`` combine a block of a sender's tokens: wait for
  the flags of their K pairs, sum ``w[t, k] * y[t*K + k]`` in fp32 in the order
  k = 0..K-1 (the bits of ``topk_combine``), then reset the flags for the next call.
  Every pair is consumed by exactly one combine task, which is why a reset is safe.

A *relay* launch (the intra-node leg of the hierarchical transport, given
``pair_slots``) holds only its node's pairs of each token, packed in its return region:
its combine tasks wait for those pairs and reset their flags without summing; the pair
rows then travel back to their source rank, which sums all K of them in the same fixed
order.

Forward: mode PLAIN over h with w2 (y rows). Backward: mode DUAL over (d a1, d a3) with
(w1, w3) (the rows' input gradients), summed per token into grad x.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from uniep.kernels.flags import _STAGE_COMBINE, publish_flags, wait_flags
from uniep.kernels.grouped_gemm import (
    GemmTiles,
    _num_programs,
    _tile_accumulate,
    _weight_view,
    dot_precision,
    programs_per_sm,
)
from uniep.kernels.launch import cdiv, launcher, next_power_of_2
from uniep.kernels.row_tiles import tile_coords


@triton.jit
def _combine_tokens(
    task, ret_ptr, ret_flag_ptr, w_ptr, out_ptr, slot_ptr, combine_src_ptr, combine_t0_ptr, tok_base_ptr,
    tok_count_ptr, N, P_cap, rank0, n_col_tiles, max_spins, error_ptr,
    K: tl.constexpr, KP: tl.constexpr, HAS_W: tl.constexpr, RELAY: tl.constexpr, TOKENS_PER_TASK: tl.constexpr,
    BLOCK_D: tl.constexpr, SCOPE: tl.constexpr,
):
    src = tl.load(combine_src_ptr + task)
    local = src - rank0
    tokens = tl.load(combine_t0_ptr + task) + tl.arange(0, TOKENS_PER_TASK)
    mask_t = tokens < tl.load(tok_count_ptr + local)
    kk = tl.arange(0, KP)
    pairs = tokens[:, None] * K + kk[None, :]
    mask_p = mask_t[:, None] & (kk < K)[None, :]
    if RELAY:  # the node's pairs only, at their packed slots
        pairs = tl.load(slot_ptr + pairs, mask=mask_p, other=-1)
        mask_p = mask_p & (pairs >= 0)
    flags = ret_flag_ptr + local.to(tl.int64) * P_cap
    wait_flags(flags, pairs, mask_p, n_col_tiles, max_spins, error_ptr, src, _STAGE_COMBINE, SCOPE)
    rows = ret_ptr + local.to(tl.int64) * P_cap * N
    out_rows = (tl.load(tok_base_ptr + local) + tokens).to(tl.int64)
    if not RELAY:  # the relay's rows are summed on their source rank
        for d0 in range(0, N, BLOCK_D):
            cols = d0 + tl.arange(0, BLOCK_D)
            mask = mask_t[:, None] & (cols < N)[None, :]
            acc = tl.zeros((TOKENS_PER_TASK, BLOCK_D), dtype=tl.float32)
            for k in tl.static_range(K):
                term = tl.load(rows + (tokens * K + k).to(tl.int64)[:, None] * N + cols[None, :], mask=mask, other=0.0)
                term = term.to(tl.float32)
                if HAS_W:
                    term = term * tl.load(w_ptr + out_rows * K + k, mask=mask_t, other=0.0)[:, None]
                acc += term
            tl.store(out_ptr + out_rows[:, None] * N + cols[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)
    # Reads done (barrier inside): the pairs are free for the next call.
    publish_flags(flags + pairs, mask_p, 0, False, SCOPE)


# The number of combine tasks follows the batch: no specialization (recompiles) on it.
@triton.jit(do_not_specialize=["n_combine", "max_spins"])
def _gemm_combine_kernel(
    counter_ptr, error_ptr,
    # GEMM side (this launch's owners)
    a_ptr, a2_ptr, b_ptr, b2_ptr, origin_ptr,
    ret_delta_ptr, ret_flag_delta_ptr,  # (W,) int64: rank r's return region at ret_ptr + ret_delta[r]
    tile_offsets_ptr, table_ptr,
    N, Kd, num_experts, stride_am, stride_be, stride_bk, stride_bn,
    # combine side (this launch's senders)
    ret_ptr, ret_flag_ptr, w_ptr, out_ptr, slot_ptr, combine_src_ptr, combine_t0_ptr, tok_base_ptr, tok_count_ptr,
    n_combine, P_cap, rank0, max_spins,
    MODE: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, HAS_W: tl.constexpr, RELAY: tl.constexpr,
    TOKENS_PER_TASK: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SCOPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    n_tiles = tl.cdiv(N, BLOCK_N)
    gemm_tasks = tl.load(tile_offsets_ptr + num_experts) * n_tiles
    task = tl.atomic_add(counter_ptr, 1)
    while task < gemm_tasks + n_combine:
        if task < gemm_tasks:
            e, _, _, rows, mask_m, cols, mask_n = tile_coords(task, n_tiles, N, table_ptr, BLOCK_M, BLOCK_N)
            acc, _ = _tile_accumulate(
                e, rows.to(tl.int64), mask_m, cols, mask_n, mask_m, a_ptr, a2_ptr, b_ptr, b2_ptr,
                Kd, stride_am, stride_be, stride_bk, stride_bn, MODE, False, BLOCK_M, BLOCK_N, BLOCK_K,
                DOT_PRECISION,
            )
            origin = tl.load(origin_ptr + rows, mask=mask_m, other=0)
            src = origin // P_cap
            pair = (origin % P_cap).to(tl.int64)
            # The return regions start 16-element aligned (checked on the host): vector stores.
            ret_rows = tl.multiple_of(tl.load(ret_delta_ptr + src, mask=mask_m, other=0), 16) + pair * N
            tl.store(ret_ptr + ret_rows[:, None] + cols[None, :], acc.to(out_ptr.dtype.element_ty),
                     mask=mask_m[:, None] & mask_n[None, :])
            flag_at = tl.load(ret_flag_delta_ptr + src, mask=mask_m, other=0) + pair
            publish_flags(ret_flag_ptr + flag_at, mask_m, 1, True, SCOPE)
        else:
            _combine_tokens(
                task - gemm_tasks, ret_ptr, ret_flag_ptr, w_ptr, out_ptr, slot_ptr,
                combine_src_ptr, combine_t0_ptr, tok_base_ptr, tok_count_ptr,
                N, P_cap, rank0, n_tiles, max_spins, error_ptr,
                K, KP, HAS_W, RELAY, TOKENS_PER_TASK, BLOCK_D, SCOPE,
            )
        task = tl.atomic_add(counter_ptr, 1)


def gemm_combine(
    sends,
    peers,
    owner_rows,
    a: torch.Tensor,
    a2: torch.Tensor | None,
    w_E: torch.Tensor,
    w2_E: torch.Tensor | None,
    weights: torch.Tensor | None,
    *,
    mode: int,
    origin: torch.Tensor,
    tiles: GemmTiles,
    tokens_per_task: int,
    max_spins: int,
    counter: torch.Tensor,
    error: torch.Tensor,
    pair_slots: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """Launch megakernel 2 for one EP launch; returns (T, N): this launch's tokens, each
    the fixed-order sum over k of ``weights[t, k]`` (or 1) times its pair's row. A relay
    launch (``pair_slots`` (T*K,) int32: each pair's slot in its return region, -1 for
    another node's pairs) only waits for its node's pairs and returns None.

    Forward (PLAIN): ``a`` = h (R, H), ``w_E`` = w2, transposed. Backward (DUAL): ``a``,
    ``a2`` = d a1, d a3 (R, H), ``w_E``, ``w2_E`` = w1, w3. ``origin`` (R,) int32 is each
    row's ``src * P_cap + t*K + k``. The pair rows themselves stay readable in the
    senders' return buffers (``peers.local("ret")``) until the next launch.
    ``counter`` (1,) int32 zero: the task counter; ``error`` (4,) int32: the error word
    (``uniep.kernels.flags``), read by the caller.
    """
    transpose = w2_E is None
    tiles = tiles.fitted(a.dtype, a.device)  # PLAIN, or DUAL's two loops one after the other
    Kd, N, s_be, s_bk, s_bn = _weight_view(w_E, transpose)
    R = owner_rows.num_rows
    T = sends.num_tokens
    relay = pair_slots is not None
    out = a.new_empty(0 if relay else T, N)
    K = sends.rows.shape[1]
    combine_src, combine_t0 = sends.combine_tasks(tokens_per_task)
    upper_tiles = (cdiv(R, tiles.block_m) + w_E.shape[0]) * cdiv(N, tiles.block_n)
    programs = _num_programs(tiles, a.device, upper_tiles + combine_src.numel(),
                             programs_per_sm(tiles, a.element_size(), a.device))
    launcher(_gemm_combine_kernel)[(programs,)](
        counter, error,
        a, a if a2 is None else a2, w_E, w_E if w2_E is None else w2_E, origin,
        peers.deltas["ret"], peers.deltas["ret_flag"],
        owner_rows.schedule.tile_offsets, owner_rows.schedule.table,
        N, Kd, w_E.shape[0], a.stride(0), s_be, s_bk, s_bn,
        peers.local("ret"), peers.local("ret_flag"), weights if weights is not None else out, out,
        pair_slots if relay else counter, combine_src, combine_t0, sends.token_base, sends.token_count,
        combine_src.numel(), peers.pairs_cap, peers.rank0, max_spins,
        MODE=mode, K=K, KP=next_power_of_2(K), HAS_W=weights is not None, RELAY=relay,
        TOKENS_PER_TASK=tokens_per_task, BLOCK_D=min(256, next_power_of_2(N)),
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
        SCOPE=peers.flag_scope, DOT_PRECISION=dot_precision(a.dtype),
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )
    return None if relay else out
