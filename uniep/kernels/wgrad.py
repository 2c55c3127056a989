"""Weight-gradient grouped GEMM: ``C[e] = A_e^T @ B_e`` over each expert's rows.

With a second input ``A2`` (same rows) it also writes ``C2[e] = A2_e^T @ B_e`` from the
same loads of ``B`` (the w1 and w3 gradients share the token rows).

Shape legend: R rows (expert-major), E experts, M and N the gradient's dims.
``A_e`` is rows ``[offsets[e], offsets[e+1])`` of A (optionally gathered through
``a_row``, scaled by ``a_scale``), ``B_e`` likewise (``b_row``, ``b_scale``). A scaled row is
rounded to the input dtype before the dot, the bits of a separately scaled copy.

Each output tile of ``C[e]`` is computed by one program that walks the expert's rows in
plan order, accumulating in fp32: no atomics and no split over rows, so the result is
bitwise the same for any number of programs. An expert with no rows gets zeros.

Grid: persistent, ``NUM_PROGRAMS`` programs over E * cdiv(M, BLOCK_M) * cdiv(N, BLOCK_N) tiles.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from uniep.kernels.grouped_gemm import GemmTiles, _num_programs, dot_precision


@triton.jit
def _grouped_wgrad_kernel(
    a_ptr,  # (rows_a, M)
    a2_ptr,  # (rows_a, M) (DUAL_A)
    a_row_ptr,  # (R,) int32 (HAS_A_ROW)
    a_scale_ptr,  # (R,) fp32 (HAS_A_SCALE)
    b_ptr,  # (rows_b, N)
    b_row_ptr,  # (R,) int32 (HAS_B_ROW)
    b_scale_ptr,  # (R,) fp32 (HAS_B_SCALE)
    c_ptr, c2_ptr,  # (E, M, N)
    expert_offsets_ptr,  # (E+1,) int32
    M, N, num_experts,
    stride_am, stride_bm, stride_ce, stride_cm,
    HAS_A_ROW: tl.constexpr, HAS_A_SCALE: tl.constexpr, HAS_B_ROW: tl.constexpr, HAS_B_SCALE: tl.constexpr,
    DUAL_A: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    pid = tl.program_id(0)
    m_tiles = tl.cdiv(M, BLOCK_M)
    n_tiles = tl.cdiv(N, BLOCK_N)
    offs_r = tl.arange(0, BLOCK_K)
    for tile in range(pid, num_experts * m_tiles * n_tiles, NUM_PROGRAMS):
        e = tile // (m_tiles * n_tiles)
        cols_m = (tile // n_tiles % m_tiles) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols_n = (tile % n_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_m = cols_m < M
        mask_n = cols_n < N
        row_start = tl.load(expert_offsets_ptr + e)
        row_end = tl.load(expert_offsets_ptr + e + 1)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if DUAL_A:
            acc2 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for r in range(row_start, row_end, BLOCK_K):
            rows = r + offs_r
            mask_r = rows < row_end
            if HAS_A_ROW:
                a_rows = tl.load(a_row_ptr + rows, mask=mask_r, other=0).to(tl.int64)
            else:
                a_rows = rows.to(tl.int64)
            if HAS_B_ROW:
                b_rows = tl.load(b_row_ptr + rows, mask=mask_r, other=0).to(tl.int64)
            else:
                b_rows = rows.to(tl.int64)
            a_offs = a_rows[:, None] * stride_am + cols_m[None, :]
            a_mask = mask_r[:, None] & mask_m[None, :]
            a = tl.load(a_ptr + a_offs, mask=a_mask, other=0.0)  # (BLOCK_K, BLOCK_M)
            if HAS_A_SCALE:
                a_scale = tl.load(a_scale_ptr + rows, mask=mask_r, other=0.0)
                a = (a.to(tl.float32) * a_scale[:, None]).to(a_ptr.dtype.element_ty)
            b = tl.load(b_ptr + b_rows[:, None] * stride_bm + cols_n[None, :],
                        mask=mask_r[:, None] & mask_n[None, :], other=0.0)  # (BLOCK_K, BLOCK_N)
            if HAS_B_SCALE:
                scale = tl.load(b_scale_ptr + rows, mask=mask_r, other=0.0)
                b = (b.to(tl.float32) * scale[:, None]).to(b_ptr.dtype.element_ty)
            acc = tl.dot(tl.trans(a), b, acc, input_precision=DOT_PRECISION)
            if DUAL_A:
                acc2 = tl.dot(tl.trans(tl.load(a2_ptr + a_offs, mask=a_mask, other=0.0)), b, acc2,
                              input_precision=DOT_PRECISION)
        c_offs = e.to(tl.int64) * stride_ce + cols_m[:, None] * stride_cm + cols_n[None, :]
        c_mask = mask_m[:, None] & mask_n[None, :]
        tl.store(c_ptr + c_offs, acc.to(c_ptr.dtype.element_ty), mask=c_mask)
        if DUAL_A:
            tl.store(c2_ptr + c_offs, acc2.to(c2_ptr.dtype.element_ty), mask=c_mask)


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
    ``a2``, the pair ``(A_e^T @ B_e, A2_e^T @ B_e)``."""
    if not (a.is_contiguous() and b.is_contiguous()):
        raise ValueError("grouped_wgrad: A and B must be contiguous")
    M, N = a.shape[1], b.shape[1]
    if a2 is not None and (a2.shape != a.shape or not a2.is_contiguous()):
        raise ValueError(f"grouped_wgrad: A2 must be contiguous with A's shape {tuple(a.shape)}")
    # the reduction runs over token rows: A tiles are (block_k, block_m), B (block_k, block_n)
    tiles = tiles.fitted(a.dtype, a.device, a_tiles=2 if a2 is not None else 1)
    c = torch.empty(num_experts, M, N, device=a.device, dtype=out_dtype)
    c2 = torch.empty_like(c) if a2 is not None else c
    upper_tiles = num_experts * triton.cdiv(M, tiles.block_m) * triton.cdiv(N, tiles.block_n)
    programs = _num_programs(tiles, a.device, upper_tiles)
    dummy = expert_offsets
    _grouped_wgrad_kernel[(programs,)](
        a, a if a2 is None else a2, dummy if a_row is None else a_row, dummy if a_scale is None else a_scale,
        b, dummy if b_row is None else b_row, dummy if b_scale is None else b_scale,
        c, c2, expert_offsets,
        M, N, num_experts,
        a.stride(0), b.stride(0), c.stride(0), c.stride(1),
        HAS_A_ROW=a_row is not None, HAS_A_SCALE=a_scale is not None, HAS_B_ROW=b_row is not None, HAS_B_SCALE=b_scale is not None,
        DUAL_A=a2 is not None, NUM_PROGRAMS=programs,
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
        DOT_PRECISION=dot_precision(a.dtype),
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )
    return c if a2 is None else (c, c2)


def grouped_wgrad_reference(a, b, rows_per_expert, *, a_row=None, a_scale=None, b_row=None, b_scale=None):
    """fp32 PyTorch version of ``grouped_wgrad``."""
    a = (a if a_row is None else a[a_row.long()]).float()
    if a_scale is not None:
        a = a * a_scale[:, None]
    b = (b if b_row is None else b[b_row.long()]).float()
    if b_scale is not None:
        b = b * b_scale[:, None]
    return torch.stack([ae.t() @ be for ae, be in zip(torch.split(a, rows_per_expert), torch.split(b, rows_per_expert))])
