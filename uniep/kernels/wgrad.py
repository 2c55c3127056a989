"""Weight-gradient grouped GEMM: ``C[e] = A_e^T @ B_e`` over each expert's rows.

With a second input ``A2`` (same rows) it also writes ``C2[e] = A2_e^T @ B_e`` in the
same launch (the w1 and w3 gradients share the token rows), as the transposes of
``B_e^T @ [A_e | A2_e]``: one accumulator per tile, the wide tiles of a single gradient.

Shape legend: R rows (expert-major), E experts, M and N the gradient's dims.
``A_e`` is rows ``[offsets[e], offsets[e+1])`` of A (optionally gathered through
``a_row``, scaled by ``a_scale``), ``B_e`` likewise (``b_row``, ``b_scale``). A scaled row is
rounded to the input dtype before the dot, the bits of a separately scaled copy.

Each output tile of ``C[e]`` is computed by one program that walks the expert's rows in
plan order, accumulating in fp32: no atomics and no split over rows, so the result is
bitwise the same for any number of programs. An expert with no rows gets zeros.

Grid: persistent, ``NUM_PROGRAMS`` programs over E * cdiv(M, BLOCK_M) * (1 or 2) * cdiv(N, BLOCK_N)
tiles, as many per SM as fit (``programs_per_sm``): dealt round-robin, or in runs of
consecutive tiles of one expert (``GemmTiles.expert_run``), whose descriptors end at the
expert's last row so that its partial last chunk of rows joins the pipelined loop. The
bits are the same either way.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from uniep.kernels.grouped_gemm import (
    GemmTiles,
    _num_programs,
    dot_precision,
    programs_per_sm,
    tma_readable,
    use_descriptor_scratch,
)
from uniep.kernels.launch import cdiv, launcher


@triton.jit
def _row_tile(ptr, desc, row_ptr, scale_ptr, plan_rows, mask_r, r, shift, cols, c0, mask_c, stride,
              HAS_ROW: tl.constexpr, HAS_SCALE: tl.constexpr, DESC: tl.constexpr, HALVES_DESC: tl.constexpr = False):
    """(BLOCK_K, columns) tile of a row operand at plan rows ``plan_rows``, its source rows
    moved down by ``shift`` (the second operand of a stacked pair): through the descriptor
    at rows ``r + shift...`` (a chunk not gathered; with ``HALVES_DESC`` a (halves, rows,
    columns) descriptor at half ``shift``), or through pointers (gathered by ``row_ptr``;
    rows past the expert's end read 0); scaled rows are rounded back to the operand's dtype."""
    if DESC:
        if HALVES_DESC:
            t = desc.load([shift, r, c0])
            t = t.reshape(t.shape[1], t.shape[2])
        else:
            t = desc.load([r + shift, c0])
    else:
        if HAS_ROW:
            src = tl.load(row_ptr + plan_rows, mask=mask_r, other=0).to(tl.int64)
        else:
            src = plan_rows.to(tl.int64)
        src += shift
        t = tl.load(ptr + src[:, None] * stride + cols[None, :], mask=mask_r[:, None] & mask_c[None, :], other=0.0)
    if HAS_SCALE:
        scale = tl.load(scale_ptr + plan_rows, mask=mask_r, other=0.0)
        t = (t.to(tl.float32) * scale[:, None]).to(ptr.dtype.element_ty)
    return t


@triton.jit
def _accumulate_rows(
    acc, r_begin, r_end, row_end, b_shift, m0, cols_m, mask_m, n0, cols_n, mask_n,
    a_ptr, a_desc, a_row_ptr, a_scale_ptr, b_ptr, b_desc, b_row_ptr, b_scale_ptr, stride_am, stride_bm,
    HAS_A_ROW: tl.constexpr, HAS_A_SCALE: tl.constexpr, HAS_B_ROW: tl.constexpr, HAS_B_SCALE: tl.constexpr,
    A_DESC: tl.constexpr, B_DESC: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
    LOOP_STAGES: tl.constexpr, B_HALVES_DESC: tl.constexpr = False,
):
    """acc += A^T B over plan rows [r_begin, r_end) in BLOCK_K chunks, software-pipelined
    ``LOOP_STAGES`` deep (``B_HALVES_DESC``: B's descriptor is (halves, rows, N) and
    ``b_shift`` the half)."""
    for r in tl.range(r_begin, r_end, BLOCK_K, num_stages=LOOP_STAGES):
        rows = r + tl.arange(0, BLOCK_K)
        mask_r = rows < row_end
        b = _row_tile(b_ptr, b_desc, b_row_ptr, b_scale_ptr, rows, mask_r, r, b_shift, cols_n, n0, mask_n, stride_bm,
                      HAS_B_ROW, HAS_B_SCALE, B_DESC, B_HALVES_DESC)
        a = _row_tile(a_ptr, a_desc, a_row_ptr, a_scale_ptr, rows, mask_r, r, 0, cols_m, m0, mask_m, stride_am,
                      HAS_A_ROW, HAS_A_SCALE, A_DESC)
        acc = tl.dot(tl.trans(a), b, acc, input_precision=DOT_PRECISION)
    return acc


@triton.jit
def _wgrad_tile(
    e, j, row_start, row_end, m_tiles, n_tiles, a_desc, b_desc, c_desc, c2_desc,
    a_ptr, a_row_ptr, a_scale_ptr, b_ptr, b_row_ptr, b_scale_ptr, c_ptr, c2_ptr,
    M, N, rows_b, stride_am, stride_bm, stride_ce, stride_cm,
    HAS_A_ROW: tl.constexpr, HAS_A_SCALE: tl.constexpr, HAS_B_ROW: tl.constexpr, HAS_B_SCALE: tl.constexpr,
    HALVES: tl.constexpr, A_DESC: tl.constexpr, B_DESC: tl.constexpr, A_ENDS_AT_EXPERT: tl.constexpr,
    C_DESC: tl.constexpr, NUM_STAGES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Tile ``j`` (modulo the expert's tiles) of expert ``e``'s gradient (its row tiles of
    A, within each B's and then B2's column tiles), summed over the expert's rows
    ``[row_start, row_end)`` in BLOCK_K chunks and stored. ``A_ENDS_AT_EXPERT``:
    ``a_desc`` ends at ``row_end``, and so does ``b_desc`` where B comes through it (then
    a (halves, rows, N) descriptor), so the copy engine reads zeros past the expert's end
    and the partial last chunk runs in the pipelined loop (the next expert's rows, even
    non-finite ones, do not reach this gradient). ``C_DESC``: the tile is stored through
    ``c_desc``, (E M, N), or with two halves C^T and C2^T through ``c_desc`` and
    ``c2_desc``, (E N, M) each."""
    stacked_tiles = HALVES * n_tiles
    m0 = (j // stacked_tiles % m_tiles) * BLOCK_M
    n_stacked = j % stacked_tiles
    half = n_stacked // n_tiles
    n0 = (n_stacked % n_tiles) * BLOCK_N
    cols_m = m0 + tl.arange(0, BLOCK_M)
    cols_n = n0 + tl.arange(0, BLOCK_N)
    mask_m = cols_m < M
    mask_n = cols_n < N
    b_shift = half * rows_b  # int32: descriptor coordinates are 32-bit
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if A_ENDS_AT_EXPERT:
        chunks_end = row_start + tl.cdiv(row_end - row_start, BLOCK_K) * BLOCK_K
        # B's (halves, rows, N) descriptor takes the half as a coordinate; B's pointers the row shift
        b_half_or_shift = half if B_DESC else b_shift
        acc = _accumulate_rows(
            acc, row_start, chunks_end, row_end, b_half_or_shift, m0, cols_m, mask_m, n0, cols_n, mask_n,
            a_ptr, a_desc, a_row_ptr, a_scale_ptr, b_ptr, b_desc, b_row_ptr, b_scale_ptr, stride_am, stride_bm,
            HAS_A_ROW, HAS_A_SCALE, HAS_B_ROW, HAS_B_SCALE, A_DESC, B_DESC, BLOCK_K, DOT_PRECISION, NUM_STAGES,
            B_HALVES_DESC=B_DESC,
        )
    else:
        # Full chunks first (descriptor loads where the operand is not gathered), then the
        # partial last chunk through masked pointers, unpipelined (no second set of
        # shared-memory stages): the same chunks in the same order.
        full_end = row_start + (row_end - row_start) // BLOCK_K * BLOCK_K
        acc = _accumulate_rows(
            acc, row_start, full_end, row_end, b_shift, m0, cols_m, mask_m, n0, cols_n, mask_n,
            a_ptr, a_desc, a_row_ptr, a_scale_ptr, b_ptr, b_desc, b_row_ptr, b_scale_ptr, stride_am, stride_bm,
            HAS_A_ROW, HAS_A_SCALE, HAS_B_ROW, HAS_B_SCALE, A_DESC, B_DESC, BLOCK_K, DOT_PRECISION, NUM_STAGES,
        )
        acc = _accumulate_rows(
            acc, full_end, row_end, row_end, b_shift, m0, cols_m, mask_m, n0, cols_n, mask_n,
            a_ptr, a_desc, a_row_ptr, a_scale_ptr, b_ptr, b_desc, b_row_ptr, b_scale_ptr, stride_am, stride_bm,
            HAS_A_ROW, HAS_A_SCALE, HAS_B_ROW, HAS_B_SCALE, False, False, BLOCK_K, DOT_PRECISION, 1,
        )
    c_mask = mask_m[:, None] & mask_n[None, :]
    if C_DESC:
        # the experts' gradients stacked as rows (a whole number of row tiles each, so a
        # tile never reaches the next one's); the copy engine clips the last columns
        if HALVES == 1:
            c_desc.store([e * M + m0, n0], acc.to(c_ptr.dtype.element_ty))
        elif half == 0:
            c_desc.store([e * N + n0, m0], tl.trans(acc.to(c_ptr.dtype.element_ty)))
        else:
            c2_desc.store([e * N + n0, m0], tl.trans(acc.to(c_ptr.dtype.element_ty)))
    elif HALVES == 1:
        c_offs = e.to(tl.int64) * stride_ce + cols_m[:, None] * stride_cm + cols_n[None, :]
        tl.store(c_ptr + c_offs, acc.to(c_ptr.dtype.element_ty), mask=c_mask)
    else:
        c_offs = e.to(tl.int64) * stride_ce + cols_n[None, :] * stride_cm + cols_m[:, None]
        # one store, its base pointer selected by the half
        c_half = tl.where(half == 0, c_ptr, c2_ptr)
        tl.store(c_half + c_offs, acc.to(c_ptr.dtype.element_ty), mask=c_mask)


@triton.jit
def _grouped_wgrad_kernel(
    a_ptr,  # (rows, M)
    a_row_ptr,  # (R,) int32 (HAS_A_ROW)
    a_scale_ptr,  # (R,) fp32 (HAS_A_SCALE)
    b_ptr,  # (halves * rows_b, N): B, or B and B2 stacked (HALVES = 2)
    b_row_ptr,  # (R,) int32 (HAS_B_ROW)
    b_scale_ptr,  # (R,) fp32 (HAS_B_SCALE)
    c_ptr, c2_ptr,  # (E, M, N) each; with HALVES = 2, (E, N, M): C^T and C2^T
    expert_offsets_ptr,  # (E+1,) int32
    M, N, num_experts, rows_a, rows_b,
    stride_am, stride_bm, stride_ce, stride_cm,
    HAS_A_ROW: tl.constexpr, HAS_A_SCALE: tl.constexpr, HAS_B_ROW: tl.constexpr, HAS_B_SCALE: tl.constexpr,
    HALVES: tl.constexpr, A_DESC: tl.constexpr, B_DESC: tl.constexpr, C_DESC: tl.constexpr,
    EXPERT_RUN: tl.constexpr, NUM_PROGRAMS: tl.constexpr, NUM_STAGES: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    pid = tl.program_id(0)
    # A and B (all halves) as tensor descriptors, built once per program (see
    # ``grouped_gemm``), blocks (BLOCK_K, BLOCK_M) and (BLOCK_K, BLOCK_N)
    a_desc = a_ptr
    b_desc = b_ptr
    if A_DESC:
        a_desc = tl.make_tensor_descriptor(a_ptr, [rows_a, M], [stride_am, 1], [BLOCK_K, BLOCK_M])
    if B_DESC:
        b_desc = tl.make_tensor_descriptor(b_ptr, [HALVES * rows_b, N], [stride_bm, 1], [BLOCK_K, BLOCK_N])
    c_desc = c_ptr
    c2_desc = c2_ptr
    if C_DESC:  # C as (E M, N); with two halves C^T and C2^T, each (E N, M)
        if HALVES == 1:
            c_desc = tl.make_tensor_descriptor(c_ptr, [num_experts * M, N], [stride_cm, 1], [BLOCK_M, BLOCK_N])
        else:
            c_desc = tl.make_tensor_descriptor(c_ptr, [num_experts * N, M], [stride_cm, 1], [BLOCK_N, BLOCK_M])
            c2_desc = tl.make_tensor_descriptor(c2_ptr, [num_experts * N, M], [stride_cm, 1], [BLOCK_N, BLOCK_M])
    m_tiles = tl.cdiv(M, BLOCK_M)
    n_tiles = tl.cdiv(N, BLOCK_N)
    # An expert's tiles in order: its row tiles of A, within each the tiles of B, then
    # B2's: one accumulator per tile, and the programs running at once share the
    # expert's rows in L2.
    expert_tiles = m_tiles * HALVES * n_tiles
    if EXPERT_RUN == 0:
        for tile in range(pid, num_experts * expert_tiles, NUM_PROGRAMS):
            e = tile // expert_tiles
            _wgrad_tile(
                e, tile, tl.load(expert_offsets_ptr + e), tl.load(expert_offsets_ptr + e + 1),
                m_tiles, n_tiles, a_desc, b_desc, c_desc, c2_desc, a_ptr, a_row_ptr, a_scale_ptr, b_ptr, b_row_ptr,
                b_scale_ptr, c_ptr, c2_ptr, M, N, rows_b, stride_am, stride_bm, stride_ce, stride_cm,
                HAS_A_ROW, HAS_A_SCALE, HAS_B_ROW, HAS_B_SCALE, HALVES, A_DESC, B_DESC, False, C_DESC,
                NUM_STAGES, BLOCK_M, BLOCK_N, BLOCK_K, DOT_PRECISION,
            )
    else:
        # Runs of EXPERT_RUN consecutive tiles of one expert per program, A (and B, where
        # it is not gathered) read through descriptors that end at the expert's last row
        # (built once per run; B's over its halves).
        runs_per_expert = tl.cdiv(expert_tiles, EXPERT_RUN)
        for run in range(pid, num_experts * runs_per_expert, NUM_PROGRAMS):
            e = run // runs_per_expert
            first = run % runs_per_expert * EXPERT_RUN
            row_start = tl.load(expert_offsets_ptr + e)
            row_end = tl.load(expert_offsets_ptr + e + 1)
            expert_rows = tl.maximum(row_end, 1)
            expert_a = tl.make_tensor_descriptor(a_ptr, [expert_rows, M], [stride_am, 1], [BLOCK_K, BLOCK_M])
            expert_b = b_ptr
            if B_DESC:
                expert_b = tl.make_tensor_descriptor(b_ptr, [HALVES, expert_rows, N], [rows_b * stride_bm, stride_bm, 1],
                                                     [1, BLOCK_K, BLOCK_N])
            for j in range(first, tl.minimum(first + EXPERT_RUN, expert_tiles)):
                _wgrad_tile(
                    e, j, row_start, row_end, m_tiles, n_tiles, expert_a, expert_b, c_desc, c2_desc,
                    a_ptr, a_row_ptr, a_scale_ptr, b_ptr, b_row_ptr, b_scale_ptr,
                    c_ptr, c2_ptr, M, N, rows_b, stride_am, stride_bm, stride_ce, stride_cm,
                    HAS_A_ROW, HAS_A_SCALE, HAS_B_ROW, HAS_B_SCALE, HALVES, True, B_DESC, True, C_DESC,
                    NUM_STAGES, BLOCK_M, BLOCK_N, BLOCK_K, DOT_PRECISION,
                )


def stacked(a: torch.Tensor, a2: torch.Tensor) -> torch.Tensor:
    """(2 * rows, cols): ``a`` and ``a2`` as one tensor; a view where ``a2`` directly follows
    ``a`` in memory (as ``pair_buffer`` lays them out), else a copy."""
    if (a2.shape == a.shape and a.is_contiguous() and a2.is_contiguous()
            and a2.data_ptr() == a.data_ptr() + a.numel() * a.element_size()
            and a.untyped_storage().data_ptr() == a2.untyped_storage().data_ptr()):
        return a.as_strided((2 * a.shape[0], a.shape[1]), (a.shape[1], 1))
    return torch.cat([a, a2])


def grouped_wgrad(
    a: torch.Tensor,
    b: torch.Tensor,
    expert_offsets: torch.Tensor,
    num_experts: int,
    *,
    tiles: GemmTiles,
    out_dtype: torch.dtype,
    a_row: torch.Tensor | None = None,
    a_scale: torch.Tensor | None = None,
    b_row: torch.Tensor | None = None,
    b_scale: torch.Tensor | None = None,
    a2: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """(E, M, N): ``A_e^T @ B_e`` for each expert (see the module docstring); with
    ``a2``, the pair ``(A_e^T @ B_e, A2_e^T @ B_e)`` (``a2`` laid out right after ``a``,
    as ``pair_buffer`` does, is read in place; otherwise the two are copied together)."""
    if not (a.is_contiguous() and b.is_contiguous()):
        raise ValueError("grouped_wgrad: A and B must be contiguous")
    if a2 is not None and a2.shape != a.shape:
        raise ValueError(f"grouped_wgrad: A2 must have A's shape {tuple(a.shape)}; got {tuple(a2.shape)}")
    M, N = a.shape[1], b.shape[1]
    c = torch.empty(num_experts, M, N, device=a.device, dtype=out_dtype)
    if a2 is None:
        _launch(a, a_row, a_scale, b, b_row, b_scale, c, c, expert_offsets, num_experts, tiles, halves=1)
        return c
    # (C, C2) = ((B^T A)^T, (B^T A2)^T): A and A2 stacked as the second operand, C's and
    # C2's tiles side by side, stored transposed. For w1/w3 the gathered token rows then
    # fill the narrow tile and the stacked gradients the wide one, through a descriptor.
    c2 = torch.empty_like(c)
    _launch(b, b_row, b_scale, stacked(a, a2), a_row, a_scale, c, c2, expert_offsets, num_experts, tiles, halves=2)
    return c, c2


# Runs of one expert's tiles (``GemmTiles.expert_run`` -1) where an expert averages at
# most this many rows. On an H200 at the power limit (benchmarks/RESULTS.md), runs of 4
# made the w1/w3 and w2 gradients 6-8% faster at 256 rows per expert (Qwen3, 4096
# tokens) and up to 14% slower at 1024 and 1536 (16384 tokens; more experts' rows in L2
# at once).
RUNS_UP_TO_ROWS_PER_EXPERT = 384


def expert_run_for(tiles: GemmTiles, rows: int, num_experts: int) -> int:
    """The weight-gradient tiles per run of one expert (0: round-robin tiles): as the tiles
    say, or where they say -1, 4 up to ``RUNS_UP_TO_ROWS_PER_EXPERT`` rows per expert on
    average, else 0. The bits are the same either way."""
    if tiles.expert_run >= 0:
        return tiles.expert_run
    if rows <= RUNS_UP_TO_ROWS_PER_EXPERT * num_experts:
        return 4
    return 0


def stores_through_descriptor(tiles: GemmTiles, c: torch.Tensor, c2: torch.Tensor, halves: int) -> bool:
    """Whether a launch stores its tiles through one descriptor over the experts'
    gradients stacked as rows (``tiles.store_descriptors``; with two halves one each
    for C and C2): where each expert's is a whole number of tiles high (C's rows: the
    kernel's ``block_m``, or with two halves, stored as C^T, its ``block_n``), so that no
    tile reaches the next expert's."""
    tile_rows = tiles.block_m if halves == 1 else tiles.block_n
    return (tiles.store_descriptors and c.shape[1] % tile_rows == 0
            and all(t.is_contiguous() and tma_readable(t) for t in ((c,) if halves == 1 else (c, c2))))


def _launch(a, a_row, a_scale, b, b_row, b_scale, c, c2, expert_offsets, num_experts, tiles, halves):
    """C = A^T B per expert (halves = 1), or C^T, C2^T from B's two stacked halves."""
    M, N = a.shape[1], b.shape[1]
    tiles = tiles.fitted(a.dtype, a.device)  # A tiles are (block_k, block_m), B (block_k, block_n)
    dummy = expert_offsets
    a_desc = tiles.descriptors and a_row is None and tma_readable(a)
    b_desc = tiles.descriptors and b_row is None and tma_readable(b)
    expert_run = expert_run_for(tiles, a.shape[0], num_experts) if a_desc else 0
    c_desc = stores_through_descriptor(tiles, c, c2, halves)
    per_sm = programs_per_sm(tiles, a.element_size(), a.device)
    upper_tiles = halves * num_experts * cdiv(M, tiles.block_m) * cdiv(N, tiles.block_n)
    programs = _num_programs(tiles, a.device, upper_tiles, per_sm)
    if a_desc or b_desc or c_desc:
        use_descriptor_scratch(a.device)
    launcher(_grouped_wgrad_kernel)[(programs,)](
        a, dummy if a_row is None else a_row, dummy if a_scale is None else a_scale,
        b, dummy if b_row is None else b_row, dummy if b_scale is None else b_scale,
        c, c2, expert_offsets,
        M, N, num_experts, a.shape[0], b.shape[0] // halves,
        a.stride(0), b.stride(0), c.stride(0), c.stride(1),
        HAS_A_ROW=a_row is not None, HAS_A_SCALE=a_scale is not None, HAS_B_ROW=b_row is not None, HAS_B_SCALE=b_scale is not None,
        HALVES=halves, A_DESC=a_desc, B_DESC=b_desc, C_DESC=c_desc, EXPERT_RUN=expert_run,
        NUM_PROGRAMS=programs, NUM_STAGES=tiles.num_stages,
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
        DOT_PRECISION=dot_precision(a.dtype),
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )


def grouped_wgrad_reference(a, b, rows_per_expert, *, a_row=None, a_scale=None, b_row=None, b_scale=None):
    """fp32 PyTorch version of ``grouped_wgrad``."""
    a = (a if a_row is None else a[a_row.long()]).float()
    if a_scale is not None:
        a = a * a_scale[:, None]
    b = (b if b_row is None else b[b_row.long()]).float()
    if b_scale is not None:
        b = b * b_scale[:, None]
    return torch.stack([ae.t() @ be for ae, be in zip(torch.split(a, rows_per_expert), torch.split(b, rows_per_expert))])
