"""Fixed-order top-k combine and its backward.

Shape legend: T tokens, K experts per token, D model dim; ``rows`` is (T*K, D) in
(token, k) order, so each token's K rows are contiguous.

    out[t] = sum_{k=0..K-1} w[t, k] * rows[t*K + k]        (fp32, in that order)

backward, for an upstream gradient g (T, D):

    grad_rows[t*K + k] = w[t, k] * g[t]      grad_w[t, k] = <g[t], rows[t*K + k]>  (fp32)

(``grad_rows`` optionally written in another row order, e.g. the plan's, so the GEMMs
that read it next load contiguous rows; ``rows`` optionally read in another row order,
e.g. as the expert-parallel exchange returns them, so that no copy puts them in (token,
k) order first: ``rows_row_of_pair``.)

``replicate_rows`` copies each token's row to its K pairs' rows (in the plan's order):
one read of the token's row, K writes, where a gather of the pairs' rows reads each
token's row K times (from memory, once the tokens' rows outgrow the L2 cache).

No atomics: every output element is written by exactly one program.
Grid: (T, cdiv(D, BLOCK_D)) for the forward and the replication, (T,) for the backward.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from uniep.kernels.launch import cdiv, launcher, next_power_of_2


@triton.jit
def _topk_combine_kernel(
    rows_ptr,  # (T*K, D)
    w_ptr,  # (T, K) fp32 (HAS_W)
    rows_row_of_pair_ptr,  # (T*K,) int64: rows row of pair t*K + k (MAP_READS)
    out_ptr,  # (T, D)
    D,
    K: tl.constexpr, HAS_W: tl.constexpr, MAP_READS: tl.constexpr, BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = cols < D
    acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for k in tl.static_range(K):
        if MAP_READS:
            row = tl.load(rows_row_of_pair_ptr + t * K + k).to(tl.int64)
        else:
            row = t * K + k
        term = tl.load(rows_ptr + row * D + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_W:
            term = term * tl.load(w_ptr + t * K + k)
        acc += term
    tl.store(out_ptr + t * D + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _topk_combine_bwd_kernel(
    grad_ptr,  # (T, D)
    rows_ptr,  # (T*K, D) (HAS_W)
    w_ptr,  # (T, K) fp32 (HAS_W)
    grad_rows_ptr,  # (T*K, D)
    row_of_pair_ptr,  # (T*K,) int64: grad_rows row of pair t*K + k (MAP_WRITES)
    rows_row_of_pair_ptr,  # (T*K,) int64: rows row of pair t*K + k (MAP_READS)
    grad_w_ptr,  # (T, K) fp32 (HAS_W)
    D,
    K: tl.constexpr, HAS_W: tl.constexpr, WRITE_ROWS: tl.constexpr, MAP_WRITES: tl.constexpr,
    MAP_READS: tl.constexpr, BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    for k in tl.static_range(K):
        if HAS_W:
            w = tl.load(w_ptr + t * K + k)
        if MAP_WRITES:
            out_row = tl.load(row_of_pair_ptr + t * K + k).to(tl.int64)
        else:
            out_row = t * K + k
        if MAP_READS:
            in_row = tl.load(rows_row_of_pair_ptr + t * K + k).to(tl.int64)
        else:
            in_row = t * K + k
        dot = tl.zeros((BLOCK_D,), dtype=tl.float32)
        for d in range(0, D, BLOCK_D):
            cols = d + tl.arange(0, BLOCK_D)
            mask = cols < D
            g = tl.load(grad_ptr + t * D + cols, mask=mask, other=0.0).to(tl.float32)
            if HAS_W:
                r = tl.load(rows_ptr + in_row * D + cols, mask=mask, other=0.0).to(tl.float32)
                dot += g * r
                g = g * w
            if WRITE_ROWS:
                tl.store(grad_rows_ptr + out_row * D + cols, g.to(grad_rows_ptr.dtype.element_ty), mask=mask)
        if HAS_W:
            tl.store(grad_w_ptr + t * K + k, tl.sum(dot))


@triton.jit
def copy_token_row(t, col_block, x_ptr, row_of_pair_ptr, scale_ptr, out_ptr, D, K: tl.constexpr,
                   HAS_SCALE: tl.constexpr, BLOCK_D: tl.constexpr):
    """Columns block ``col_block`` of token ``t``'s row, read once, written to its K pairs'
    rows (a program of ``_replicate_rows_kernel`` or of ``uniep.kernels.plan_rows``)."""
    t = t.to(tl.int64)
    cols = col_block * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = cols < D
    row = tl.load(x_ptr + t * D + cols, mask=mask)
    for k in tl.static_range(K):
        out_row = tl.load(row_of_pair_ptr + t * K + k).to(tl.int64)
        copy = row
        if HAS_SCALE:  # in fp32, rounded to the rows' dtype
            copy = (row.to(tl.float32) * tl.load(scale_ptr + t * K + k)).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + out_row * D + cols, copy, mask=mask)


@triton.jit
def _replicate_rows_kernel(
    x_ptr,  # (T, D)
    row_of_pair_ptr,  # (T*K,) int64: output row of pair t*K + k
    scale_ptr,  # (T, K) fp32: pair t*K + k's scale (HAS_SCALE)
    out_ptr,  # (T*K, D)
    D,
    K: tl.constexpr, HAS_SCALE: tl.constexpr, BLOCK_D: tl.constexpr,
):
    copy_token_row(tl.program_id(0), tl.program_id(1), x_ptr, row_of_pair_ptr, scale_ptr, out_ptr, D, K, HAS_SCALE,
                   BLOCK_D)


NUM_WARPS = 8
"""Warps per program of every launch here, with columns in blocks of up to 2048: on an
H100, as fast as 1024-column blocks on 4 warps at D = 2048 and faster at D = 7168 (the
combine backward 0.83 against 0.98 ms at 8192 tokens, K = 8; benchmarks/RESULTS.md)."""


def block_d(D: int) -> int:
    """Columns per program of the launches here (up to 2048)."""
    return min(2048, next_power_of_2(D))


def topk_combine(rows_PD: torch.Tensor, weights_TK: torch.Tensor | None, top_k: int,
                 *, rows_row_of_pair: torch.Tensor | None = None) -> torch.Tensor:
    """(T, D) in ``rows``' dtype: the fixed-order weighted sum of each token's K rows.
    ``rows_row_of_pair`` (T*K,) int64: the row of ``rows`` that holds pair ``t*K + k``
    (default: ``t*K + k``)."""
    P, D = rows_PD.shape
    T = P // top_k
    out = rows_PD.new_empty(T, D)
    if T == 0:
        return out
    launcher(_topk_combine_kernel)[(T, cdiv(D, block_d(D)))](
        rows_PD, rows_PD if weights_TK is None else weights_TK, rows_PD if rows_row_of_pair is None else rows_row_of_pair,
        out, D, K=top_k, HAS_W=weights_TK is not None, MAP_READS=rows_row_of_pair is not None, BLOCK_D=block_d(D),
        num_warps=NUM_WARPS,
    )
    return out


def topk_combine_bwd(
    grad_TD: torch.Tensor, rows_PD: torch.Tensor, weights_TK: torch.Tensor | None, top_k: int,
    *, write_rows: bool = True, row_of_pair: torch.Tensor | None = None,
    rows_row_of_pair: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(grad_rows (T*K, D), grad_weights (T, K) fp32 or None)``; with
    ``write_rows=False`` only the weights' gradient is computed (grad_rows is None).
    ``row_of_pair`` (T*K,) int64: the row of ``grad_rows`` that pair ``t*K + k``'s
    gradient goes to; ``rows_row_of_pair``: the row of ``rows`` that holds it (both
    default to ``t*K + k``)."""
    T, D = grad_TD.shape
    if not write_rows and weights_TK is None:
        raise ValueError("topk_combine_bwd: nothing to compute without weights and rows")
    grad_rows = rows_PD.new_empty(T * top_k if write_rows else 0, D)
    grad_w = None if weights_TK is None else torch.empty_like(weights_TK)
    if T == 0:
        return grad_rows, grad_w
    launcher(_topk_combine_bwd_kernel)[(T,)](
        grad_TD, rows_PD, grad_rows if weights_TK is None else weights_TK,
        grad_rows, grad_rows if row_of_pair is None else row_of_pair,
        grad_rows if rows_row_of_pair is None else rows_row_of_pair, grad_rows if grad_w is None else grad_w, D,
        K=top_k, HAS_W=weights_TK is not None, WRITE_ROWS=write_rows, MAP_WRITES=row_of_pair is not None,
        MAP_READS=rows_row_of_pair is not None, BLOCK_D=block_d(D), num_warps=NUM_WARPS,
    )
    return (grad_rows if write_rows else None), grad_w


def check_replicate_args(x_TD: torch.Tensor, top_k: int, row_of_pair: torch.Tensor,
                         scale_TK: torch.Tensor | None, where: str) -> None:
    """Raise unless ``row_of_pair`` has a row per pair and ``scale_TK`` is None or (T, K) fp32."""
    if row_of_pair.shape != (x_TD.shape[0] * top_k,):
        raise ValueError(f"{where}: row_of_pair has shape {tuple(row_of_pair.shape)}; "
                         f"expected ({x_TD.shape[0] * top_k},) for {x_TD.shape[0]} tokens and top_k = {top_k}")
    if scale_TK is not None and (scale_TK.shape != (x_TD.shape[0], top_k) or scale_TK.dtype != torch.float32):
        raise ValueError(f"{where}: scale_TK must be float32 of shape ({x_TD.shape[0]}, {top_k}); got "
                         f"{scale_TK.dtype} {tuple(scale_TK.shape)}")


def replicate_rows(x_TD: torch.Tensor, top_k: int, row_of_pair: torch.Tensor,
                   scale_TK: torch.Tensor | None = None) -> torch.Tensor:
    """(T*K, D): token ``t``'s row copied to row ``row_of_pair[t*K + k]`` for each k,
    i.e. ``x.index_select(0, order // K)`` where ``row_of_pair`` is the inverse of the
    permutation ``order`` (pair ids in the output's row order); with ``scale_TK`` (T, K)
    fp32, each copy times its pair's scale in fp32, rounded to x's dtype (the scores
    applied before the experts, as TorchTitan scales its permuted copy)."""
    check_replicate_args(x_TD, top_k, row_of_pair, scale_TK, "replicate_rows")
    x_TD = x_TD.contiguous()
    T, D = x_TD.shape
    out = x_TD.new_empty(T * top_k, D)
    if T:
        columns = block_d(D)
        launcher(_replicate_rows_kernel)[(T, cdiv(D, columns))](
            x_TD, row_of_pair, None if scale_TK is None else scale_TK.contiguous(), out, D, K=top_k,
            HAS_SCALE=scale_TK is not None, BLOCK_D=columns, num_warps=NUM_WARPS)
    return out


def tokens_input_grad(d_rows_PD: torch.Tensor, x_TD: torch.Tensor, scores_TK: torch.Tensor, score_before: bool,
                      *, rows_row_of_pair: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(grad x (T, D), grad scores (T, K) fp32 or None)`` from the gradients of the
    tokens' K expert input rows, in (token, k) order (else pair ``t*K + k``'s at row
    ``rows_row_of_pair[t*K + k]``): summed in fixed order per token, scaled by the
    scores when they were applied before the experts, whose gradient is then
    ``<x[t], d rows[t*K + k]>``; None when the scores came after the experts (the
    combine backward gives theirs)."""
    K = scores_TK.shape[1]
    if not score_before:
        return topk_combine(d_rows_PD, None, K, rows_row_of_pair=rows_row_of_pair), None
    _, grad_scores = topk_combine_bwd(x_TD, d_rows_PD, scores_TK, K, write_rows=False,
                                      rows_row_of_pair=rows_row_of_pair)
    return topk_combine(d_rows_PD, scores_TK, K, rows_row_of_pair=rows_row_of_pair), grad_scores
