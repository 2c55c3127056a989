"""The router's expert choice in one launch, forward and backward; in the forward also
the gate's logits in the same launch (``router_gate_select``), or from given logits
(``router_select_forward``).

Shape legend: T tokens, D model dim, E experts, K experts per token.

From the gate's logits (T, E), per token, in fp32:

    scores = softmax(logits) or sigmoid(logits)
    idx    = the K largest of scores + expert_bias (descending; NaN counts as the largest,
             as in torch.topk; a tie goes to the lower expert)
    top    = scores[idx], divided by their sum (+ 1e-20) if route_norm, times route_scale

and in the backward the gradient of the logits from that of ``top`` (``idx`` carries
none), rounded to the logits' dtype as the fp32 cast's backward does. The backward
recomputes the scores from the logits with the forward's code, so it keeps nothing but
the logits and ``idx``. Given indices (a replayed routing) skip the choice.

Each program owns whole rows and reduces along a row only (the gate's logits too: one
dot product per token and expert, over D in order), so a token's bits do not depend on
the rows beside it (the batch-invariance expert parallelism needs). In
PyTorch this is nine launches forward (cast, softmax, top-k, gather, sum, add, divide,
...) and a dozen backward; the top-k alone took 0.1 ms at 16384 x 128 on an H200.

``select_experts_reference`` is the PyTorch computation of the choice from scores (the
router's own path, which also handles node-limited groups). The router differentiates
these launches through ``uniep.router_op``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from uniep.kernels.grouped_gemm import dot_precision, shared_memory_bytes, smem_limit
from uniep.kernels.launch import cdiv, launcher, next_power_of_2

_ROWS = 16  # tokens per program


@triton.jit
def _activate(x, SIGMOID: tl.constexpr):
    """fp32 scores of the (ROWS, BLOCK_E) fp32 logits ``x`` (-inf in the padding columns,
    whose scores are then 0)."""
    if SIGMOID:
        return tl.sigmoid(x)
    e = tl.exp(x - tl.max(x, axis=1)[:, None])
    return e / tl.sum(e, axis=1)[:, None]


@triton.jit
def _scores(logits_ptr, rows, cols, col_ok, stride, SIGMOID: tl.constexpr):
    """(ROWS, BLOCK_E) fp32 scores of ``rows`` (in range); 0 in the padding columns."""
    x = tl.load(logits_ptr + rows[:, None] * stride + cols[None, :], mask=col_ok[None, :],
                other=float("-inf")).to(tl.float32)
    return _activate(x, SIGMOID)


@triton.jit
def _column(t, ks, k):
    """Column ``k`` of the (ROWS, KP) tensor ``t``."""
    return tl.sum(tl.where(ks[None, :] == k, t, 0), axis=1)


@triton.jit
def _gathered(s, cols, pick):
    """s[row, pick[row]] per row."""
    return tl.sum(tl.where(cols[None, :] == pick[:, None], s, 0.0), axis=1)


@triton.jit
def _choose(s, rows, row_ok, cols, col_ok, bias_ptr, idx_ptr, top_ptr, route_scale,
            K: tl.constexpr, KP: tl.constexpr, BLOCK_E: tl.constexpr, ROWS: tl.constexpr, HAS_BIAS: tl.constexpr,
            SELECT: tl.constexpr, ROUTE_NORM: tl.constexpr):
    """The choice of the rows whose scores are ``s`` (ROWS, BLOCK_E): their K experts
    (or the given ones) and top scores stored where ``row_ok``."""
    ks = tl.arange(0, KP)
    choice = s
    if HAS_BIAS:
        choice = s + tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    choice = tl.where(choice != choice, float("inf"), choice)  # NaN first, as torch.topk puts it
    choice = tl.where(col_ok[None, :], choice, float("-inf"))
    idx = tl.zeros((ROWS, KP), dtype=tl.int32)
    top = tl.zeros((ROWS, KP), dtype=tl.float32)
    for k in tl.static_range(K):
        if SELECT:
            best = tl.max(choice, axis=1)
            pick = tl.min(tl.where(choice == best[:, None], cols[None, :], BLOCK_E), axis=1)
            choice = tl.where(cols[None, :] == pick[:, None], float("-inf"), choice)
        else:
            pick = tl.load(idx_ptr + rows * K + k).to(tl.int32)
        idx = tl.where(ks[None, :] == k, pick[:, None], idx)
        top = tl.where(ks[None, :] == k, _gathered(s, cols, pick)[:, None], top)
    if ROUTE_NORM:
        top = top / (tl.sum(top, axis=1)[:, None] + 1e-20)
    top = top * route_scale
    out = rows[:, None] * K + ks[None, :]
    mask = row_ok[:, None] & (ks[None, :] < K)
    if SELECT:
        tl.store(idx_ptr + out, idx.to(tl.int64), mask=mask)
    tl.store(top_ptr + out, top, mask=mask)


@triton.jit
def _router_select_kernel(logits_ptr, bias_ptr, idx_ptr, top_ptr, T, E, stride, route_scale,
                          K: tl.constexpr, KP: tl.constexpr, BLOCK_E: tl.constexpr, ROWS: tl.constexpr,
                          SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr, SELECT: tl.constexpr,
                          ROUTE_NORM: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < T
    rows = tl.minimum(rows, T - 1).to(tl.int64)  # rows past the end recompute the last (not stored)
    cols = tl.arange(0, BLOCK_E)
    col_ok = cols < E
    s = _scores(logits_ptr, rows, cols, col_ok, stride, SIGMOID)
    _choose(s, rows, row_ok, cols, col_ok, bias_ptr, idx_ptr, top_ptr, route_scale, K, KP, BLOCK_E, ROWS,
            HAS_BIAS, SELECT, ROUTE_NORM)


@triton.jit
def _router_gate_kernel(x_ptr, w_ptr, gate_bias_ptr, logits_ptr, bias_ptr, idx_ptr, top_ptr, T, E, D, stride_x,
                        route_scale, K: tl.constexpr, KP: tl.constexpr, BLOCK_E: tl.constexpr, ROWS: tl.constexpr,
                        BLOCK_K: tl.constexpr, SIGMOID: tl.constexpr, HAS_GATE_BIAS: tl.constexpr,
                        HAS_BIAS: tl.constexpr, SELECT: tl.constexpr, ROUTE_NORM: tl.constexpr,
                        DOT_PRECISION: tl.constexpr, ACC_DTYPE: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < T
    rows = tl.minimum(rows, T - 1).to(tl.int64)  # rows past the end recompute the last (not stored)
    cols = tl.arange(0, BLOCK_E)
    col_ok = cols < E
    # each row's logits: one dot product per expert, summed over D in order (the row's
    # bits do not depend on the rows beside it)
    acc = tl.zeros((ROWS, BLOCK_E), dtype=ACC_DTYPE)
    for k0 in range(0, D, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < D
        x = tl.load(x_ptr + rows[:, None] * stride_x + ks[None, :], mask=k_ok[None, :], other=0.0)
        w = tl.load(w_ptr + cols[None, :] * D + ks[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc = tl.dot(x, w, acc, input_precision=DOT_PRECISION)
    if HAS_GATE_BIAS:
        acc += tl.load(gate_bias_ptr + cols, mask=col_ok, other=0.0).to(ACC_DTYPE)[None, :]
    logits = acc.to(logits_ptr.dtype.element_ty)  # rounded as the gate's output is
    tl.store(logits_ptr + rows[:, None] * E + cols[None, :], logits, mask=row_ok[:, None] & col_ok[None, :])
    s = _activate(tl.where(col_ok[None, :], logits.to(tl.float32), float("-inf")), SIGMOID)
    _choose(s, rows, row_ok, cols, col_ok, bias_ptr, idx_ptr, top_ptr, route_scale, K, KP, BLOCK_E, ROWS,
            HAS_BIAS, SELECT, ROUTE_NORM)


@triton.jit
def _router_select_backward_kernel(logits_ptr, idx_ptr, grad_top_ptr, grad_logits_ptr, T, E, stride, route_scale,
                                   K: tl.constexpr, KP: tl.constexpr, BLOCK_E: tl.constexpr, ROWS: tl.constexpr,
                                   SIGMOID: tl.constexpr, ROUTE_NORM: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < T
    rows = tl.minimum(rows, T - 1).to(tl.int64)
    cols = tl.arange(0, BLOCK_E)
    col_ok = cols < E
    ks = tl.arange(0, KP)
    s = _scores(logits_ptr, rows, cols, col_ok, stride, SIGMOID)
    pair = rows[:, None] * K + ks[None, :]
    k_ok = ks[None, :] < K
    idx = tl.load(idx_ptr + pair, mask=k_ok, other=0).to(tl.int32)
    d_top = tl.load(grad_top_ptr + pair, mask=k_ok, other=0.0) * route_scale
    if ROUTE_NORM:
        g = tl.zeros((ROWS, KP), dtype=tl.float32)
        for k in tl.static_range(K):
            g = tl.where(ks[None, :] == k, _gathered(s, cols, _column(idx, ks, k))[:, None], g)
        n = tl.sum(g, axis=1) + 1e-20
        # top_k = g_k / n: d g_j = d_j / n - sum_k d_k g_k / n^2
        d_top = d_top / n[:, None] - (tl.sum(d_top * g, axis=1) / (n * n))[:, None]
    d_s = tl.zeros((ROWS, BLOCK_E), dtype=tl.float32)
    for k in tl.static_range(K):
        d_s += tl.where(cols[None, :] == _column(idx, ks, k)[:, None], _column(d_top, ks, k)[:, None], 0.0)
    if SIGMOID:
        d_x = d_s * s * (1.0 - s)
    else:
        d_x = s * (d_s - tl.sum(d_s * s, axis=1)[:, None])
    tl.store(grad_logits_ptr + rows[:, None] * E + cols[None, :], d_x.to(grad_logits_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


def _meta(logits_TE: torch.Tensor, top_k: int) -> dict:
    E = logits_TE.shape[1]
    return dict(K=top_k, KP=next_power_of_2(top_k), BLOCK_E=next_power_of_2(E), ROWS=_ROWS,
                num_warps=4)


def _choice_outputs(rows: torch.Tensor, top_k: int,
                    topk_idx_TK: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(top scores (T, K) fp32, expert ids (T, K) int64) to write for the T rows of
    ``rows`` (T, ...): the ids empty, or a copy of the given ones (never an alias of them)."""
    T = rows.shape[0]
    idx_TK = (rows.new_empty(T, top_k, dtype=torch.int64) if topk_idx_TK is None
              else topk_idx_TK.to(dtype=torch.int64, memory_format=torch.contiguous_format, copy=True))
    return rows.new_empty(T, top_k, dtype=torch.float32), idx_TK


def router_select_forward(logits_TE: torch.Tensor, top_k: int, *, sigmoid: bool, route_norm: bool,
                          route_scale: float, expert_bias_E: torch.Tensor | None = None,
                          topk_idx_TK: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(top_scores_TK fp32, topk_idx_TK int64)`` from the gate's logits (see the module
    docstring); ``topk_idx_TK``, if given, replaces the choice."""
    if logits_TE.dim() != 2 or not 1 <= top_k <= logits_TE.shape[1]:
        raise ValueError(f"router_select: logits must be (tokens, experts) with 1 <= top_k <= experts; got "
                         f"{tuple(logits_TE.shape)} and top_k = {top_k}")
    logits_TE = logits_TE.contiguous()
    T, E = logits_TE.shape
    select = topk_idx_TK is None
    top_TK, idx_TK = _choice_outputs(logits_TE, top_k, topk_idx_TK)
    bias = None if expert_bias_E is None else expert_bias_E.contiguous()
    if T:
        launcher(_router_select_kernel)[(cdiv(T, _ROWS),)](
            logits_TE, bias, idx_TK, top_TK, T, E, logits_TE.stride(0), float(route_scale),
            SIGMOID=sigmoid, HAS_BIAS=bias is not None, SELECT=select, ROUTE_NORM=route_norm,
            **_meta(logits_TE, top_k))
    return top_TK, idx_TK


@dataclass(frozen=True)
class GateTiles:
    """How the gate launch (``router_gate_select``) tiles its work. Every setting keeps a
    token's bits independent of the rows beside it; ``block_k`` (the fp32 sums' order
    within a step) and ``rows`` (which dot instruction) may change the logits' last bits.
    ``scripts/bench_router.py`` times settings against each other."""

    rows: int = 0
    """Tokens per program; 0: 64 up to 128 experts, else 32 (a program's fp32 logits
    sit in registers: 64 x 256 of them spilled when compiled for sm_90)."""
    block_k: int = 64
    """Model-dim columns per step of the dot products."""
    num_warps: int = 8
    num_stages: int = 4
    """At most: fewer where the stages' tiles would not fit shared memory (many experts)."""


GATE_TILES = GateTiles()
"""Measured on an H100 (``bench_router.py``, ``benchmarks/RESULTS.md``, forty-first
session): 64 rows, 8 warps, 4 stages was the fastest setting tried at Qwen3's 4096 and
16384 tokens and faster than the previous default (32 rows, 4 warps up to 128 experts,
3 stages) at the DeepSeek-V3-671B slice (32 experts), with its bits."""


def gate_rows(tiles: GateTiles, block_e: int) -> int:
    """Tokens per program of the gate launch (``GateTiles.rows``)."""
    return tiles.rows or (64 if block_e <= 128 else 32)


@functools.lru_cache(maxsize=None)
def gate_stages(tiles: GateTiles, block_e: int, elem_bytes: int, limit: int) -> int:
    """The pipeline stages of the gate launch: ``tiles.num_stages``, or fewer where the
    stages' x and weight tiles would pass ``limit`` bytes of shared memory (at least 1;
    cached: asked at every launch)."""
    stages, rows = tiles.num_stages, gate_rows(tiles, block_e)
    while stages > 1 and shared_memory_bytes(rows, block_e, tiles.block_k, stages, elem_bytes) > limit:
        stages -= 1
    return stages


def router_gate_select(x_TD: torch.Tensor, weight_ED: torch.Tensor, bias_E: torch.Tensor | None, top_k: int, *,
                       sigmoid: bool, route_norm: bool, route_scale: float, expert_bias_E: torch.Tensor | None = None,
                       topk_idx_TK: torch.Tensor | None = None,
                       tiles: GateTiles = GATE_TILES) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(top_scores_TK fp32, topk_idx_TK int64, logits_TE)`` of the tokens ``x_TD``: the
    gate's logits ``x @ weight^T (+ bias)`` (in x's dtype, one dot product per token and
    expert, summed over D in order in fp32, float64 for float64 x) and
    ``router_select_forward``'s choice of them, in one launch: fewer host calls before
    the first expert GEMM than a GEMM and a second launch (``benchmarks/RESULTS.md``,
    thirty-eighth session). ``topk_idx_TK``, if given, replaces the choice."""
    T, D = x_TD.shape
    E = weight_ED.shape[0]
    if weight_ED.shape[1] != D or not 1 <= top_k <= E:
        raise ValueError(f"router_gate_select: gate weight {tuple(weight_ED.shape)} and top_k = {top_k} do not fit "
                         f"x of shape {tuple(x_TD.shape)}: expected ({E}, {D}) and 1 <= top_k <= {E}")
    if weight_ED.dtype != x_TD.dtype:
        raise ValueError(f"router_gate_select: x is {x_TD.dtype} and the gate weight {weight_ED.dtype}; "
                         "they must share a dtype")
    x_TD, weight_ED = x_TD.contiguous(), weight_ED.contiguous()
    logits_TE = x_TD.new_empty(T, E)
    select = topk_idx_TK is None
    top_TK, idx_TK = _choice_outputs(x_TD, top_k, topk_idx_TK)
    if T:
        block_e = max(16, next_power_of_2(E))  # a dot's tile is at least 16 wide
        rows = gate_rows(tiles, block_e)
        launcher(_router_gate_kernel)[(cdiv(T, rows),)](
            x_TD, weight_ED, bias_E, logits_TE, None if expert_bias_E is None else expert_bias_E.contiguous(),
            idx_TK, top_TK, T, E, D,
            x_TD.stride(0), float(route_scale), K=top_k, KP=next_power_of_2(top_k), BLOCK_E=block_e,
            ROWS=rows, BLOCK_K=tiles.block_k, SIGMOID=sigmoid, HAS_GATE_BIAS=bias_E is not None,
            HAS_BIAS=expert_bias_E is not None, SELECT=select, ROUTE_NORM=route_norm,
            DOT_PRECISION=dot_precision(x_TD.dtype), ACC_DTYPE=tl.float64 if x_TD.dtype == torch.float64 else tl.float32,
            num_warps=tiles.num_warps,
            num_stages=gate_stages(tiles, block_e, x_TD.element_size(), smem_limit(x_TD.device)))
    return top_TK, idx_TK, logits_TE


def router_select_backward(logits_TE: torch.Tensor, topk_idx_TK: torch.Tensor, grad_top_TK: torch.Tensor, *,
                           sigmoid: bool, route_norm: bool, route_scale: float) -> torch.Tensor:
    """(T, E) gradient of the logits, in their dtype, from that of the top scores."""
    logits_TE = logits_TE.contiguous()
    T, E = logits_TE.shape
    grad_logits = torch.empty(T, E, dtype=logits_TE.dtype, device=logits_TE.device)
    if T:
        launcher(_router_select_backward_kernel)[(cdiv(T, _ROWS),)](
            logits_TE, topk_idx_TK.contiguous(), grad_top_TK.contiguous(), grad_logits, T, E, logits_TE.stride(0),
            float(route_scale), SIGMOID=sigmoid, ROUTE_NORM=route_norm, **_meta(logits_TE, topk_idx_TK.shape[1]))
    return grad_logits


def select_experts_reference(scores_TE: torch.Tensor, choice_TE: torch.Tensor, top_k: int, *, route_norm: bool,
                             route_scale: float,
                             topk_idx_TK: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The choice in PyTorch ops, from fp32 ``scores_TE`` and the (biased, group-limited)
    ``choice_TE``: TorchTitan's order of operations."""
    if topk_idx_TK is None:
        topk_idx_TK = choice_TE.topk(top_k, dim=-1, sorted=False).indices
    top_TK = scores_TE.gather(1, topk_idx_TK)
    if route_norm:
        top_TK = top_TK / (top_TK.sum(dim=-1, keepdim=True) + 1e-20)
    if route_scale != 1.0:  # (x * 1.0 is x, bit for bit: no op to issue)
        top_TK = top_TK * route_scale
    return top_TK, topk_idx_TK
