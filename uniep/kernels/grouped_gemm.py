"""Grouped GEMM over expert-major rows, with row gather/scatter and SwiGLU epilogues.

Shape legend: R rows (expert-major, the plan's order), E experts, Kd reduction dim,
N output dim. Row block ``[expert_offsets[e], expert_offsets[e+1])`` belongs to expert ``e``.

For each expert ``e`` and each of its rows ``r``::

    C[c_row[r], :] = epilogue( A[a_row[r], :] (* a_scale[r]) @ B[e] )

``a_row`` gathers the input rows inside the kernel (no permuted copy of the tokens),
``c_row`` scatters the results (e.g. straight to (token, k) order for the combine).
``B[e]`` is read through strides, so a weight and its transpose are the same launch.

Modes (``MODE``):
- ``PLAIN``:      C = A @ B
- ``SWIGLU_FWD``: a1 = A @ B, a3 = A @ B2; stores h = silu(a1) * a3 to C, a1 to AUX1, a3 to AUX3
- ``SWIGLU_BWD``: g = A @ B; reads a1, a3 from AUX1/AUX3; stores d a1 to C, d a3 to C2
- ``DUAL``:       C = A @ B + A2 @ B2 (both over the same Kd)

Grid: persistent, ``NUM_PROGRAMS`` programs; program ``p`` takes tiles
``p, p + NUM_PROGRAMS, ...`` of (row tile, column tile). Row tiles never cross experts;
each output element is one dot product accumulated in fp32 over Kd in order, so the
bits do not depend on ``NUM_PROGRAMS``. The tile schedule is read on the device (no
host sync), from a ``row_tiles`` schedule built once per plan.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from uniep.kernels.launch import cdiv, launcher, sm_count
from uniep.kernels.row_tiles import RowTiles, row_block, tile_span
from uniep.kernels.swiglu import swiglu_backward_math, swiglu_forward_math

PLAIN, SWIGLU_FWD, SWIGLU_BWD, DUAL = 0, 1, 2, 3
# Kernels may only read globals that are constexpr objects.
_SWIGLU_FWD, _SWIGLU_BWD, _DUAL = tl.constexpr(SWIGLU_FWD), tl.constexpr(SWIGLU_BWD), tl.constexpr(DUAL)


# Shared memory per block of an H200 (``shared_memory_per_block_optin``). Tiles are fitted
# to it where the device cannot be asked (the CPU interpreter), so a CPU run picks the
# tiles, and so the bits, that the GPU would.
H200_SMEM_PER_BLOCK = 232448


def shared_memory_bytes(block_m, block_n, block_k, num_stages, elem_bytes, a_tiles=1, b_tiles=1, c_tiles=0):
    """Shared memory of a pipelined tile loop: ``num_stages`` copies of its ``a_tiles``
    (block_m x block_k) and ``b_tiles`` (block_k x block_n) operand tiles, and ``c_tiles``
    output tiles staged for descriptor stores (one: Triton reuses it for each store).
    (Triton's own count for the gate/up GEMM, fp32, 128x128x64, 4 stages: 393216 bytes;
    so is this; with descriptor stores, bf16, 3 stages: 147456 + 32768 against 180280.)
    Works elementwise on numpy arrays (the tuner's feasibility filter)."""
    return (num_stages * (a_tiles * block_m * block_k + b_tiles * block_k * block_n)
            + c_tiles * block_m * block_n) * elem_bytes


@functools.lru_cache(maxsize=None)
def smem_limit(device: torch.device) -> int:
    """Shared memory one program may use on ``device``."""
    if device.type != "cuda":
        return H200_SMEM_PER_BLOCK
    props = torch.cuda.get_device_properties(device)
    return getattr(props, "shared_memory_per_block_optin", H200_SMEM_PER_BLOCK)


def dot_precision(dtype: torch.dtype) -> str:
    """``tl.dot`` input precision: float32 operands follow PyTorch's TF32 switch for CUDA
    matmuls (off by default, so float32 training is float32, as TorchTitan's is);
    16-bit operands are exact products either way."""
    if dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32:
        return "ieee"
    return "tf32"


@dataclass(frozen=True)
class GemmTiles:
    """Tile shape and launch settings of one grouped GEMM. Changing ``block_*`` may change
    the bits of bf16 results (the reduction may be blocked differently; on an H200 the
    widths did not, benchmarks/RESULTS.md); ``num_warps``, ``num_stages`` and
    ``num_programs`` do not."""

    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    num_warps: int = 8
    num_stages: int = 3
    num_programs: int | None = None
    """Persistent programs; None: as many per SM as fit (``programs_per_sm``)."""
    descriptors: bool = False
    """Load contiguous operands (the weights; A where it is not gathered) through tensor
    descriptors (TMA on Hopper) instead of pointers; the bits are the same."""
    half_tiles: bool = False
    """Row GEMMs: an expert's last row tile with at most ``block_m / 2`` rows runs a dot of
    half the rows (the row tiles stay ``block_m``; not below 32, where the half would be
    under the 16 rows a GPU dot needs); the bits are the same."""
    store_descriptors: bool = False
    """Row GEMMs whose outputs are not scattered: full row tiles are stored through
    tensor descriptors (the copy engine, TMA on Hopper), an expert's last partial tile
    through masked pointer stores (a descriptor would write into the next expert's
    rows); the bits are the same. Their staging tile counts in the shared-memory fit and
    ``programs_per_sm`` whether or not a launch stores through descriptors, so the fit
    depends on the tiles only."""
    expert_run: int = -1
    """Weight gradients: 0, each program takes tiles round-robin and sums an expert's
    full row chunks through descriptors, then its partial last chunk through masked
    pointers, unpipelined; ``J`` > 0, each program takes runs of J consecutive tiles of
    one expert and reads its operands through descriptors that end at the expert's last
    row (built once per run), so the copy engine fills the partial last chunk with zeros
    and it runs in the pipelined loop; -1, by the rows per expert of each launch
    (``wgrad.expert_run_for``). The bits are the same, and a non-finite row reaches only
    its own expert's gradient either way."""
    few_rows_stages: int = 0
    """Row GEMMs: the pipelining depth where a launch's experts average at most
    ``FEW_ROWS_PER_EXPERT`` rows (``stages_for_rows``); 0, ``num_stages`` there too."""
    prefetch_steps: int = 0
    """Row GEMMs: while the dots run step ``k``, ask L2 for the weights of step ``k +
    prefetch_steps`` (one request per 128-byte line, ``_prefetch_weights``; past the
    loop's end, the first steps of the B read next: the second loop's, or the program's
    next tile's), beyond the pipeline's own stages in shared memory; 0, off. Where
    experts have few rows each weight byte comes from DRAM for only two or three row
    tiles, and the launches wait on that stream (benchmarks/RESULTS.md). Only on CUDA,
    for 16-bit operands in 64-wide blocks (``prefetch_steps_for``); the bits are the same."""

    def fitted(self, dtype: torch.dtype, device: torch.device, a_tiles: int = 1, b_tiles: int = 1) -> "GemmTiles":
        """These tiles, made to fit ``device``'s shared memory with ``dtype`` operands
        (and, for float32 dots in IEEE precision, the registers: first a shorter
        ``block_k``, then a narrower ``block_n``, down to ``FMA_VALUES_PER_THREAD``).

        For shared memory: fewer pipeline stages first (down to 2; the bits stay), then a shorter
        ``block_k`` (down to 16), then 1 stage, then a narrower ``block_n``. ``block_m``
        never changes: callers lay out row tiles by it. The choice depends only on the
        tiles, the dtype and the device's limit, so every path that launches the same
        tiles (one rank, all_to_all, megakernel) fits them the same way and the bits
        stay path-independent (float32 also on PyTorch's TF32 switch, ``dot_precision``).
        bf16 with the default tiles fits as given on an H200.
        Cached: every launch asks again.
        """
        return _fit(self, dtype, smem_limit(torch.device(device)), a_tiles, b_tiles, dot_precision(dtype) == "ieee")


# float32 dots in IEEE precision run on the FMA units with their operand tiles in
# registers beside the accumulators. Compiled for sm_90 (Triton 3.9 on the CPU machine,
# 8 warps): the default 128x256x64 plain tiles spilled 24 KB per thread and 128x128x16
# 3 KB, while 128x64x16 (44 values per thread) and gate/up's 128x32x16 (44) did not
# spill; 128x64x32 (56) did. A float32 step of the debug model spent 240 ms in the
# spilling GEMMs on an H200 (benchmarks/RESULTS.md).
FMA_VALUES_PER_THREAD = 48


def fma_values_per_thread(t: GemmTiles, b_tiles: int = 1) -> float:
    """fp32 values per thread of an FMA dot's tiles: the accumulators (one per B tile)
    and one step's A and B tiles."""
    return (b_tiles * t.block_m * t.block_n + t.block_m * t.block_k + b_tiles * t.block_k * t.block_n) / (
        32 * t.num_warps)


@functools.lru_cache(maxsize=None)
def _fit(given: GemmTiles, dtype: torch.dtype, limit: int, a_tiles: int, b_tiles: int, fma: bool = False) -> GemmTiles:
    elem = dtype.itemsize
    tiles = given
    if fma:  # a shorter block_k first (down to 16), then a narrower block_n (down to 16)
        while fma_values_per_thread(tiles, b_tiles) > FMA_VALUES_PER_THREAD and tiles.block_k > 16:
            tiles = dataclasses.replace(tiles, block_k=tiles.block_k // 2)
        while fma_values_per_thread(tiles, b_tiles) > FMA_VALUES_PER_THREAD and tiles.block_n > 16:
            tiles = dataclasses.replace(tiles, block_n=tiles.block_n // 2)

    def fits(t: GemmTiles) -> bool:
        return shared_memory_bytes(t.block_m, t.block_n, t.block_k, t.num_stages, elem, a_tiles, b_tiles,
                                   int(t.store_descriptors)) <= limit

    while not fits(tiles) and tiles.num_stages > 2:
        tiles = dataclasses.replace(tiles, num_stages=tiles.num_stages - 1)
    while not fits(tiles) and tiles.block_k > 16:
        tiles = dataclasses.replace(tiles, block_k=tiles.block_k // 2)
    if not fits(tiles):
        tiles = dataclasses.replace(tiles, num_stages=1)
    while not fits(tiles) and tiles.block_n > 16:
        tiles = dataclasses.replace(tiles, block_n=tiles.block_n // 2)
    if not fits(tiles):
        raise ValueError(
            f"GEMM tiles {given} cannot fit {limit} bytes of shared memory with {dtype} operands "
            "even at block_k 16, block_n 16 and 1 stage: lower block_m"
        )
    return tiles


FEW_ROWS_PER_EXPERT = 512
"""Rows per expert (a launch's average) up to which the row GEMMs run
``GemmTiles.few_rows_stages`` deep: an H100 ran 4 stages faster than 3 at 256 rows per
expert and slower at 1024, an H200 a little faster at 256 (benchmarks/RESULTS.md)."""


def stages_for_rows(tiles: GemmTiles, rows: int, num_experts: int) -> GemmTiles:
    """``tiles`` with ``few_rows_stages`` stages where ``rows`` over ``num_experts``
    experts average at most ``FEW_ROWS_PER_EXPERT`` and it is set, else as given."""
    if tiles.few_rows_stages and rows <= FEW_ROWS_PER_EXPERT * num_experts:
        return _with_stages(tiles, tiles.few_rows_stages)
    return tiles


@functools.lru_cache(maxsize=None)
def _with_stages(tiles: GemmTiles, stages: int) -> GemmTiles:
    return dataclasses.replace(tiles, num_stages=stages)


@dataclass(frozen=True)
class ExpertTiles:
    """The tiles of the expert MLP's four kinds of launch: the one tile settings object
    of every Triton path (one rank, all_to_all, megakernel)."""

    gemm: GemmTiles
    """The plain GEMMs: down projection, down and up input gradients."""
    up: GemmTiles
    """The GEMMs with a SwiGLU epilogue: gate/up (two accumulators); in the megakernel
    also the down input gradient (the SwiGLU backward in its epilogue)."""
    wgrad: GemmTiles
    """The w2 gradient."""
    wgrad_up: GemmTiles
    """The w1/w3 gradient."""

    def __post_init__(self) -> None:
        # The gate/up launch and the plain ones walk one row-tile schedule (``row_tiles``).
        if self.up.block_m != self.gemm.block_m:
            raise ValueError(
                f"the gate/up tiles' block_m = {self.up.block_m} must equal the GEMM tiles' block_m = "
                f"{self.gemm.block_m} (both launches share the row tiles)"
            )

    @classmethod
    def uniform(cls, tiles: GemmTiles) -> "ExpertTiles":
        """The same tiles for every launch."""
        return cls(tiles, tiles, tiles, tiles)

    @classmethod
    def from_config(cls, c) -> "ExpertTiles":
        """The tiles a ``UniEPConfig`` names."""
        programs = c.num_programs or None
        gemm = GemmTiles(c.gemm_block_m, c.gemm_block_n, c.gemm_block_k, c.gemm_num_warps, c.gemm_num_stages,
                         programs, c.descriptor_loads, c.gemm_half_tiles, c.descriptor_stores,
                         few_rows_stages=c.gemm_few_rows_num_stages, prefetch_steps=c.gemm_prefetch_steps)
        wgrad = GemmTiles(c.wgrad_block_m, c.wgrad_block_n, c.wgrad_block_k, c.wgrad_num_warps,
                          c.wgrad_num_stages, programs, c.descriptor_loads, store_descriptors=c.wgrad_descriptor_stores,
                          expert_run=c.wgrad_expert_run)
        return cls(gemm, dataclasses.replace(gemm, block_n=c.gemm_up_block_n),
                   wgrad, dataclasses.replace(wgrad, block_n=c.wgrad_up_block_n))


@triton.jit
def _a_tile(a_ptr, a_desc, a_rows, row0, k, ks, mask_m, mask_k, stride_am, A_DESC: tl.constexpr):
    """(BLOCK_M, BLOCK_K) tile of A: rows ``row0...`` through the descriptor (rows past the
    expert's end belong to the next expert; their results are masked at the store), or
    the gathered rows ``a_rows`` through pointers."""
    if A_DESC:
        a = a_desc.load([row0, k])
    else:
        a = tl.load(a_ptr + a_rows[:, None] * stride_am + ks[None, :],
                    mask=mask_m[:, None] & mask_k[None, :], other=0.0)
    return a


@triton.jit
def _b_tile(b_base, b_desc, e, k, n0, ks, mask_k, cols, mask_n, stride_bk, stride_bn,
            B_DESC: tl.constexpr, B_TRANSPOSED: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """(BLOCK_K, BLOCK_N) tile of B[e] at (k, n0). The descriptor reads the weight in its
    stored layout, (E, N, Kd) when B[e] is its transpose, and fills past the edges with 0."""
    if B_DESC:
        if B_TRANSPOSED:
            b = tl.trans(b_desc.load([e, n0, k]).reshape(BLOCK_N, BLOCK_K))
        else:
            b = b_desc.load([e, k, n0]).reshape(BLOCK_K, BLOCK_N)
    else:
        b = tl.load(b_base + ks[:, None] * stride_bk + cols[None, :] * stride_bn,
                    mask=mask_k[:, None] & mask_n[None, :], other=0.0)
    return b


PREFETCH_LINE = 64
"""16-bit elements in one 128-byte line: what one L2 prefetch request asks for."""
_PREFETCH_LINE = tl.constexpr(PREFETCH_LINE)


@triton.jit
def _prefetch_weights(b_base, k, n0, valid, Kd, N, stride_bk, stride_bn, B_TRANSPOSED: tl.constexpr,
                      BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """Ask L2 for B[e]'s (BLOCK_K, BLOCK_N) block at (k, n0) if ``valid``: one request
    per 128-byte line of its stored layout, (N, Kd) when B[e] is the transpose, else (Kd,
    N); lanes past the edges ask for B[e]'s first line instead. A hint: nothing is loaded
    into registers, and the dots' own loads stay as they are."""
    if B_TRANSPOSED:
        cols = n0 + tl.arange(0, BLOCK_N)
        ks = k + tl.arange(0, BLOCK_K // _PREFETCH_LINE) * _PREFETCH_LINE
        inside = (cols[:, None] < N) & (ks[None, :] < Kd) & valid
        lines = b_base + cols[:, None] * stride_bn + ks[None, :] * stride_bk
    else:
        ks = k + tl.arange(0, BLOCK_K)
        cols = n0 + tl.arange(0, BLOCK_N // _PREFETCH_LINE) * _PREFETCH_LINE
        inside = (ks[:, None] < Kd) & (cols[None, :] < N) & valid
        lines = b_base + ks[:, None] * stride_bk + cols[None, :] * stride_bn
    tl.inline_asm_elementwise("prefetch.global.L2 [$1]; // $0", "=r,l", [tl.where(inside, lines, b_base)],
                              dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _prefetch_ahead(ahead, here_base, n0, there_ptr, there_e, there_n0, there_valid, Kd, N, stride_be, stride_bk,
                    stride_bn, B_TRANSPOSED: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """The weights of reduction step ``ahead`` (an offset along Kd) asked of L2: of this
    loop's B (``here_base``, columns ``n0...``) while ``ahead`` is inside it, past its end
    of the B the program reads next (expert ``there_e`` of ``there_ptr``, columns
    ``there_n0...``, if ``there_valid``): the same tile's second loop, or the program's
    next tile."""
    here = ahead < Kd
    there_base = there_ptr + there_e.to(tl.int64) * stride_be
    _prefetch_weights(tl.where(here, here_base, there_base), tl.where(here, ahead, ahead - Kd),
                      tl.where(here, n0, there_n0), here | there_valid, Kd, N, stride_bk, stride_bn,
                      B_TRANSPOSED, BLOCK_K, BLOCK_N)


@triton.jit
def _tile_accumulate(
    e, a_rows, mask_m, cols, mask_n, scale,
    a_ptr, a2_ptr, b_ptr, b2_ptr, Kd, stride_am, stride_be, stride_bk, stride_bn,
    MODE: tl.constexpr, HAS_A_SCALE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
    a_desc=None, a2_desc=None, b_desc=None, b2_desc=None, row0=0, n0=0,
    A_DESC: tl.constexpr = False, B_DESC: tl.constexpr = False, B_TRANSPOSED: tl.constexpr = False,
    N=0, PREFETCH: tl.constexpr = 0, next_e=0, next_n0=0, has_next=False,
):
    """fp32 accumulators (acc, acc3) of one tile; acc3 is only meaningful in SWIGLU_FWD.
    The reduction runs over Kd in order, so the bits depend on BLOCK_K only (not on
    whether the operands come through descriptors or pointers, nor on ``PREFETCH``:
    steps ahead whose weights are asked of L2, ``GemmTiles.prefetch_steps``, past the
    loop's end those of the program's next tile, expert ``next_e`` at column
    ``next_n0`` if ``has_next``; these and N are read only for that)."""
    offs_k = tl.arange(0, BLOCK_K)
    b_base = b_ptr + e.to(tl.int64) * stride_be
    b2_base = b2_ptr + e.to(tl.int64) * stride_be
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc3 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, Kd, BLOCK_K):
        if PREFETCH > 0:
            ahead = k + PREFETCH * BLOCK_K
            if MODE == _DUAL:  # past the end: this tile's second loop, over B2
                _prefetch_ahead(ahead, b_base, n0, b2_ptr, e, n0, True, Kd, N, stride_be, stride_bk, stride_bn,
                                B_TRANSPOSED, BLOCK_K, BLOCK_N)
            else:
                _prefetch_ahead(ahead, b_base, n0, b_ptr, next_e, next_n0, has_next, Kd, N, stride_be, stride_bk,
                                stride_bn, B_TRANSPOSED, BLOCK_K, BLOCK_N)
            if MODE == _SWIGLU_FWD:
                _prefetch_ahead(ahead, b2_base, n0, b2_ptr, next_e, next_n0, has_next, Kd, N, stride_be, stride_bk,
                                stride_bn, B_TRANSPOSED, BLOCK_K, BLOCK_N)
        ks = k + offs_k
        mask_k = ks < Kd
        a = _a_tile(a_ptr, a_desc, a_rows, row0, k, ks, mask_m, mask_k, stride_am, A_DESC)
        if HAS_A_SCALE:
            a = (a.to(tl.float32) * scale[:, None]).to(a_ptr.dtype.element_ty)
        b = _b_tile(b_base, b_desc, e, k, n0, ks, mask_k, cols, mask_n, stride_bk, stride_bn,
                    B_DESC, B_TRANSPOSED, BLOCK_K, BLOCK_N)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        if MODE == _SWIGLU_FWD:
            b3 = _b_tile(b2_base, b2_desc, e, k, n0, ks, mask_k, cols, mask_n, stride_bk, stride_bn,
                         B_DESC, B_TRANSPOSED, BLOCK_K, BLOCK_N)
            acc3 = tl.dot(a, b3, acc3, input_precision=DOT_PRECISION)
    if MODE == _DUAL:
        for k in range(0, Kd, BLOCK_K):
            if PREFETCH > 0:
                _prefetch_ahead(k + PREFETCH * BLOCK_K, b2_base, n0, b_ptr, next_e, next_n0, has_next, Kd, N,
                                stride_be, stride_bk, stride_bn, B_TRANSPOSED, BLOCK_K, BLOCK_N)
            ks = k + offs_k
            mask_k = ks < Kd
            a2 = _a_tile(a2_ptr, a2_desc, a_rows, row0, k, ks, mask_m, mask_k, stride_am, A_DESC)
            b2 = _b_tile(b2_base, b2_desc, e, k, n0, ks, mask_k, cols, mask_n, stride_bk, stride_bn,
                         B_DESC, B_TRANSPOSED, BLOCK_K, BLOCK_N)
            acc = tl.dot(a2, b2, acc, input_precision=DOT_PRECISION)
    return acc, acc3


@triton.jit
def _store(ptr, offs, mask, value, desc, row0, n0, full, C_DESC: tl.constexpr):
    """``value`` to ``ptr + offs`` where ``mask``; a full row tile through ``desc`` at
    (row0, n0) when ``C_DESC`` (the copy engine clips the columns past N)."""
    if C_DESC:
        if full:
            desc.store([row0, n0], value)
        else:
            tl.store(ptr + offs, value, mask=mask)
    else:
        tl.store(ptr + offs, value, mask=mask)


@triton.jit
def _tile_store(
    acc, acc3, rows, mask_m, cols, mask_n, c_rows,
    c_ptr, c2_ptr, aux1_ptr, aux3_ptr, stride_cm, stride_auxm, MODE: tl.constexpr,
    c_desc=None, c2_desc=None, aux1_desc=None, aux3_desc=None, row0=0, n0=0, full=False,
    C_DESC: tl.constexpr = False,
):
    """Epilogue of one tile: C rows ``c_rows`` (and the SwiGLU side outputs at ``rows``);
    with ``C_DESC`` (C in plan order) a ``full`` tile goes through the descriptors."""
    mask_c = mask_m[:, None] & mask_n[None, :]
    c_offs = c_rows[:, None] * stride_cm + cols[None, :]
    aux_offs = rows.to(tl.int64)[:, None] * stride_auxm + cols[None, :]
    out_ty = c_ptr.dtype.element_ty
    if MODE == _SWIGLU_FWD:
        # Round the pre-activations to the storage dtype first, as separate GEMM and
        # SwiGLU ops would, so forward and backward see the same a1, a3.
        a1 = acc.to(out_ty)
        a3 = acc3.to(out_ty)
        _store(aux1_ptr, aux_offs, mask_c, a1, aux1_desc, row0, n0, full, C_DESC)
        _store(aux3_ptr, aux_offs, mask_c, a3, aux3_desc, row0, n0, full, C_DESC)
        h = swiglu_forward_math(a1, a3)
        _store(c_ptr, c_offs, mask_c, h.to(out_ty), c_desc, row0, n0, full, C_DESC)
    elif MODE == _SWIGLU_BWD:
        # The gradient of h rounded to the storage dtype first, as the separate GEMM and
        # SwiGLU backward (``uniep.kernels.swiglu``) compute it: the same bits either way.
        d_a1, d_a3 = swiglu_backward_math(acc.to(out_ty).to(tl.float32),
                                          tl.load(aux1_ptr + aux_offs, mask=mask_c, other=0.0),
                                          tl.load(aux3_ptr + aux_offs, mask=mask_c, other=0.0))
        _store(c_ptr, c_offs, mask_c, d_a1.to(out_ty), c_desc, row0, n0, full, C_DESC)
        _store(c2_ptr, c_offs, mask_c, d_a3.to(out_ty), c2_desc, row0, n0, full, C_DESC)
    else:
        _store(c_ptr, c_offs, mask_c, acc.to(out_ty), c_desc, row0, n0, full, C_DESC)


@triton.jit
def _weight_descriptor(w_ptr, num_experts, N, Kd, stride_be, stride_bk, stride_bn, B_TRANSPOSED: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The weights as a descriptor in their stored layout, (E, N, Kd) when B[e] is the
    transpose, else (E, Kd, N); blocks of one expert."""
    if B_TRANSPOSED:
        desc = tl.make_tensor_descriptor(w_ptr, [num_experts, N, Kd], [stride_be, stride_bn, 1], [1, BLOCK_N, BLOCK_K])
    else:
        desc = tl.make_tensor_descriptor(w_ptr, [num_experts, Kd, N], [stride_be, stride_bk, 1], [1, BLOCK_K, BLOCK_N])
    return desc


@triton.jit
def _row_tile(
    e, row0, row_end, n0, next_e, next_n0, has_next,
    a_ptr, a2_ptr, a_row_ptr, a_scale_ptr, b_ptr, b2_ptr, c_ptr, c2_ptr, c_row_ptr,
    aux1_ptr, aux3_ptr, N, Kd, stride_am, stride_be, stride_bk, stride_bn, stride_cm, stride_auxm,
    a_desc, a2_desc, b_desc, b2_desc, c_desc, c2_desc, aux1_desc, aux3_desc,
    MODE: tl.constexpr, HAS_A_ROW: tl.constexpr, HAS_A_SCALE: tl.constexpr, HAS_C_ROW: tl.constexpr,
    A_DESC: tl.constexpr, B_DESC: tl.constexpr, B_TRANSPOSED: tl.constexpr, C_DESC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
    PREFETCH: tl.constexpr,
):
    """One (BLOCK_M, BLOCK_N) output tile at rows ``row0...`` (up to ``row_end``), columns
    ``n0...``; the program's next tile (``next_e``, ``next_n0``, ``has_next``) for the L2 prefetch."""
    rows, mask_m, cols, mask_n = tile_span(row0, row_end, n0, N, BLOCK_M, BLOCK_N)
    if HAS_A_ROW:
        a_rows = tl.load(a_row_ptr + rows, mask=mask_m, other=0).to(tl.int64)
    else:
        a_rows = rows.to(tl.int64)
    if HAS_C_ROW:
        c_rows = tl.load(c_row_ptr + rows, mask=mask_m, other=0).to(tl.int64)
    else:
        c_rows = rows.to(tl.int64)
    scale = tl.load(a_scale_ptr + rows, mask=mask_m & HAS_A_SCALE, other=0.0)
    acc, acc3 = _tile_accumulate(
        e, a_rows, mask_m, cols, mask_n, scale, a_ptr, a2_ptr, b_ptr, b2_ptr,
        Kd, stride_am, stride_be, stride_bk, stride_bn, MODE, HAS_A_SCALE, BLOCK_M, BLOCK_N, BLOCK_K,
        DOT_PRECISION, a_desc, a2_desc, b_desc, b2_desc, row0, n0, A_DESC, B_DESC, B_TRANSPOSED, N, PREFETCH,
        next_e, next_n0, has_next,
    )
    _tile_store(acc, acc3, rows, mask_m, cols, mask_n, c_rows,
                c_ptr, c2_ptr, aux1_ptr, aux3_ptr, stride_cm, stride_auxm, MODE,
                c_desc, c2_desc, aux1_desc, aux3_desc, row0, n0, row_end - row0 == BLOCK_M, C_DESC)


@triton.jit
def _grouped_gemm_kernel(
    a_ptr, a2_ptr,  # (rows_a, Kd): input rows
    a_row_ptr,  # (R,) int32 or int64: row of A for each plan row (HAS_A_ROW)
    a_scale_ptr,  # (R,) fp32: per-row scale applied to A before the dot (HAS_A_SCALE)
    b_ptr, b2_ptr,  # (E, ...) weights; element (k, n) of expert e at e*stride_be + k*stride_bk + n*stride_bn
    c_ptr, c2_ptr,  # (rows_c, N) outputs
    c_row_ptr,  # (R,) int32 or int64: output row for each plan row (HAS_C_ROW)
    aux1_ptr, aux3_ptr,  # (R, N): SwiGLU pre-activations (written in SWIGLU_FWD, read in SWIGLU_BWD)
    tile_offsets_ptr,  # (E+1,) int32 row-tile offsets
    table_ptr,  # (T, 3) int32: expert, first row, end row of each row tile (``row_tiles``)
    N, Kd, num_experts, rows_a, rows_c, rows_aux,
    stride_am, stride_be, stride_bk, stride_bn, stride_cm, stride_auxm,
    MODE: tl.constexpr,
    HAS_A_ROW: tl.constexpr, HAS_A_SCALE: tl.constexpr, HAS_C_ROW: tl.constexpr,
    A_DESC: tl.constexpr, B_DESC: tl.constexpr, B_TRANSPOSED: tl.constexpr, C_DESC: tl.constexpr,
    HALF_TILES: tl.constexpr, NUM_PROGRAMS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
    PREFETCH: tl.constexpr,
):
    pid = tl.program_id(0)
    # Descriptors built here, once per program, not on the host for every launch (that
    # cost more host time than small launches take on the device; benchmarks/RESULTS.md).
    a_desc = a_ptr
    a2_desc = a2_ptr
    a_half_desc = a_ptr
    a2_half_desc = a2_ptr
    b_desc = b_ptr
    b2_desc = b2_ptr
    if A_DESC:  # blocks (BLOCK_M, BLOCK_K), and (BLOCK_M / 2, BLOCK_K) for the half tiles
        a_desc = tl.make_tensor_descriptor(a_ptr, [rows_a, Kd], [stride_am, 1], [BLOCK_M, BLOCK_K])
        if HALF_TILES:
            a_half_desc = tl.make_tensor_descriptor(a_ptr, [rows_a, Kd], [stride_am, 1], [BLOCK_M // 2, BLOCK_K])
        if MODE == _DUAL:
            a2_desc = tl.make_tensor_descriptor(a2_ptr, [rows_a, Kd], [stride_am, 1], [BLOCK_M, BLOCK_K])
            if HALF_TILES:
                a2_half_desc = tl.make_tensor_descriptor(a2_ptr, [rows_a, Kd], [stride_am, 1],
                                                         [BLOCK_M // 2, BLOCK_K])
    if B_DESC:
        b_desc = _weight_descriptor(b_ptr, num_experts, N, Kd, stride_be, stride_bk, stride_bn, B_TRANSPOSED,
                                    BLOCK_N, BLOCK_K)
        if MODE == _SWIGLU_FWD or MODE == _DUAL:
            b2_desc = _weight_descriptor(b2_ptr, num_experts, N, Kd, stride_be, stride_bk, stride_bn, B_TRANSPOSED,
                                         BLOCK_N, BLOCK_K)
    c_desc = c_ptr
    c2_desc = c2_ptr
    aux1_desc = aux1_ptr
    aux3_desc = aux3_ptr
    if C_DESC:  # the outputs in plan order, blocks of a full tile
        c_desc = tl.make_tensor_descriptor(c_ptr, [rows_c, N], [stride_cm, 1], [BLOCK_M, BLOCK_N])
        if MODE == _SWIGLU_BWD:
            c2_desc = tl.make_tensor_descriptor(c2_ptr, [rows_c, N], [stride_cm, 1], [BLOCK_M, BLOCK_N])
        if MODE == _SWIGLU_FWD:
            aux1_desc = tl.make_tensor_descriptor(aux1_ptr, [rows_aux, N], [stride_auxm, 1], [BLOCK_M, BLOCK_N])
            aux3_desc = tl.make_tensor_descriptor(aux3_ptr, [rows_aux, N], [stride_auxm, 1], [BLOCK_M, BLOCK_N])
    n_tiles = tl.cdiv(N, BLOCK_N)
    total_tiles = tl.load(tile_offsets_ptr + num_experts) * n_tiles
    # Each tile's row block is loaded one tile ahead, so its latency hides under the
    # previous tile's loop; the scatter rows are loaded before the loop for the same reason.
    e, row0, row_end = row_block(table_ptr, pid // n_tiles, pid < total_tiles)
    for tile in range(pid, total_tiles, NUM_PROGRAMS):
        next_tile = tile + NUM_PROGRAMS
        next_e, next_row0, next_row_end = row_block(table_ptr, next_tile // n_tiles, next_tile < total_tiles)
        n0 = (tile % n_tiles) * BLOCK_N
        next_n0 = (next_tile % n_tiles) * BLOCK_N
        has_next = next_row_end > next_row0
        if HALF_TILES and row_end - row0 <= BLOCK_M // 2:
            # An expert's last tile with at most half its rows: the dot on half as many
            # rows (each row's dot product is the same, so are its bits), stored through pointers.
            _row_tile(e, row0, row_end, n0, next_e, next_n0, has_next,
                      a_ptr, a2_ptr, a_row_ptr, a_scale_ptr, b_ptr, b2_ptr, c_ptr, c2_ptr, c_row_ptr, aux1_ptr, aux3_ptr,
                      N, Kd, stride_am, stride_be, stride_bk, stride_bn, stride_cm, stride_auxm,
                      a_half_desc, a2_half_desc, b_desc, b2_desc, c_desc, c2_desc, aux1_desc, aux3_desc,
                      MODE, HAS_A_ROW, HAS_A_SCALE, HAS_C_ROW, A_DESC, B_DESC, B_TRANSPOSED, False,
                      BLOCK_M // 2, BLOCK_N, BLOCK_K, DOT_PRECISION, PREFETCH)
        else:
            _row_tile(e, row0, row_end, n0, next_e, next_n0, has_next,
                      a_ptr, a2_ptr, a_row_ptr, a_scale_ptr, b_ptr, b2_ptr, c_ptr, c2_ptr, c_row_ptr, aux1_ptr, aux3_ptr,
                      N, Kd, stride_am, stride_be, stride_bk, stride_bn, stride_cm, stride_auxm,
                      a_desc, a2_desc, b_desc, b2_desc, c_desc, c2_desc, aux1_desc, aux3_desc,
                      MODE, HAS_A_ROW, HAS_A_SCALE, HAS_C_ROW, A_DESC, B_DESC, B_TRANSPOSED, C_DESC,
                      BLOCK_M, BLOCK_N, BLOCK_K, DOT_PRECISION, PREFETCH)
        e, row0, row_end = next_e, next_row0, next_row_end


@functools.lru_cache(maxsize=None)
def programs_per_sm(tiles: GemmTiles, elem_bytes: int, device: torch.device, mode: int = PLAIN) -> int:
    """As many programs per SM as fit, up to 3: their pipeline stages in shared memory and
    their registers in the 64K-register file (per thread the fp32 accumulators, two in
    SWIGLU_FWD, and about as many again; a SWIGLU_BWD epilogue's a1 and a3 count as two
    more accumulators). On an H200, 128x256 tiles with 8 warps took 230-244 registers,
    128x128 ones 114-125, two 128x128 accumulators 181-223, and a SwiGLU-backward
    epilogue at 128x128 195. While one program runs its epilogue, the others' loads and
    dots keep the SM busy. ``mode`` PLAIN also stands for DUAL and the weight gradients."""
    accumulators = {SWIGLU_FWD: 2, SWIGLU_BWD: 3}.get(mode, 1)
    threads = 32 * tiles.num_warps
    regs = min(255, max(64, 2 * accumulators * tiles.block_m * tiles.block_n // threads))
    smem = shared_memory_bytes(tiles.block_m, tiles.block_n, tiles.block_k, tiles.num_stages, elem_bytes,
                               b_tiles=2 if mode == SWIGLU_FWD else 1, c_tiles=int(tiles.store_descriptors))
    return max(1, min(3, 65536 // (threads * regs), smem_limit(device) // smem))


def prefetch_steps_for(tiles: GemmTiles, a: torch.Tensor) -> int:
    """The launch's ``PREFETCH``: ``tiles.prefetch_steps`` where its requests can be
    made (a CUDA device; 16-bit operands, so a line is ``PREFETCH_LINE`` elements; blocks
    whole lines wide), else 0. The CPU interpreter runs no inline assembly."""
    if (tiles.prefetch_steps and a.is_cuda and a.element_size() == 2
            and tiles.block_k % PREFETCH_LINE == 0 and tiles.block_n % PREFETCH_LINE == 0):
        return tiles.prefetch_steps
    return 0


def _num_programs(tiles: GemmTiles, device: torch.device, upper_tiles: int, per_sm: int) -> int:
    """Persistent programs of a launch of at most ``upper_tiles`` tiles: ``tiles.num_programs``
    if set, else ``per_sm`` per SM (``programs_per_sm``)."""
    if tiles.num_programs is not None:
        return max(1, min(tiles.num_programs, upper_tiles))
    if device.type != "cuda":
        return max(1, min(4, upper_tiles))
    return max(1, min(sm_count(device) * per_sm, upper_tiles))


def tma_readable(t: torch.Tensor | None) -> bool:
    """Whether the copy engine can read ``t`` through a tensor descriptor (not empty, last
    dim contiguous, 16-byte aligned base and strides); None reads as True (no operand)."""
    if t is None:
        return True
    *outer, last = t.stride()
    if last != 1 or t.data_ptr() % 16 or not t.numel():
        return False
    align = 16 // t.element_size()
    for stride in outer:  # (a loop: called per launch operand, a generator costs more than the test)
        if stride % align:
            return False
    return True


def _scratch_on(device_type: str):
    def allocate(size: int, alignment: int, stream) -> torch.Tensor:  # blocks are 512-byte aligned
        return torch.empty(size, dtype=torch.int8, device=device_type)
    return allocate


_SCRATCH = {"cuda": _scratch_on("cuda")}


def use_descriptor_scratch(device: torch.device) -> None:
    """Let Triton allocate the global memory that kernels building tensor descriptors
    need (128 bytes per descriptor and program) from PyTorch's allocator. Triton keeps
    its allocator per thread context, and a backward runs on the autograd engine's
    thread, so every launch that builds descriptors calls this first."""
    if device.type in _SCRATCH:
        triton.set_allocator(_SCRATCH[device.type])


def pair_buffer(like: torch.Tensor, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two (rows, cols) tensors, halves of one buffer: the SwiGLU backward's outputs, which
    the w1/w3 weight gradient then reads as one stacked operand."""
    pair = like.new_empty(2, rows, cols)
    return pair[0], pair[1]


def _weight_view(w_E: torch.Tensor, transpose: bool) -> tuple[int, int, int, int, int]:
    """(Kd, N, stride_be, stride_bk, stride_bn) for B[e] = w[e] (transpose=False) or w[e]^T."""
    _, rows, cols = w_E.shape
    s_e, s_r, s_c = w_E.stride()
    if transpose:
        return cols, rows, s_e, s_c, s_r
    return rows, cols, s_e, s_r, s_c


def grouped_gemm(
    a: torch.Tensor,
    w_E: torch.Tensor,
    schedule: RowTiles,
    num_rows: int,
    *,
    transpose_w: bool,
    tiles: GemmTiles,
    mode: int = PLAIN,
    a2: torch.Tensor | None = None,
    w2_E: torch.Tensor | None = None,
    a_row: torch.Tensor | None = None,
    a_scale: torch.Tensor | None = None,
    c_row: torch.Tensor | None = None,
    out_rows: int | None = None,
    aux: tuple[torch.Tensor, torch.Tensor] | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """Launch the grouped GEMM (see the module docstring). ``num_rows`` = R, a host-side
    upper bound of the plan's rows (used to size outputs and the grid; no sync).
    ``out``: a contiguous (rows, N) tensor to write C into (PLAIN and DUAL).

    Returns ``C`` (PLAIN, DUAL), ``(h, a1, a3)`` (SWIGLU_FWD) or ``(d_a1, d_a3)`` (SWIGLU_BWD).
    """
    num_experts = w_E.shape[0]
    tiles = stages_for_rows(tiles, num_rows, num_experts).fitted(a.dtype, a.device, b_tiles=2 if mode == SWIGLU_FWD else 1)
    Kd, N, s_be, s_bk, s_bn = _weight_view(w_E, transpose_w)
    if a.shape[1] != Kd or not a.is_contiguous():
        raise ValueError(f"grouped_gemm: A must be contiguous (rows, {Kd}); got {tuple(a.shape)} stride {a.stride()}")
    if w2_E is not None and (w2_E.shape != w_E.shape or w2_E.stride() != w_E.stride()):
        raise ValueError("grouped_gemm: the second weight must have the first one's shape and strides")
    if a2 is not None and (a2.shape != a.shape or a2.stride() != a.stride()):
        raise ValueError("grouped_gemm: A2 must have A's shape and strides (the kernel reads both with A's)")
    schedule.check(tiles.block_m, num_rows, "grouped_gemm")
    rows_c = num_rows if out_rows is None else out_rows
    if out is not None and (mode in (SWIGLU_FWD, SWIGLU_BWD) or out.shape != (rows_c, N) or not out.is_contiguous()):
        raise ValueError(f"grouped_gemm: out must be a contiguous ({rows_c}, {N}) tensor, for PLAIN or DUAL; "
                         f"got {tuple(out.shape)} in mode {mode}")
    if mode == SWIGLU_BWD:
        c, c2 = pair_buffer(a, rows_c, N)
    else:
        c = c2 = a.new_empty(rows_c, N) if out is None else out
    if mode == SWIGLU_FWD:
        aux = (a.new_empty(num_rows, N), a.new_empty(num_rows, N))
    aux1, aux3 = aux if aux is not None else (c, c)
    dummy = schedule.tile_offsets
    a_desc = tiles.descriptors and a_row is None and tma_readable(a) and tma_readable(a2)
    b_desc = tiles.descriptors and tma_readable(w_E) and tma_readable(w2_E)
    c_desc = tiles.store_descriptors and c_row is None and all(map(tma_readable, (c, c2, aux1, aux3)))
    half_tiles = tiles.half_tiles and tiles.block_m >= 32
    per_sm = programs_per_sm(tiles, a.element_size(), a.device, mode)
    upper_tiles = (cdiv(num_rows, tiles.block_m) + num_experts) * cdiv(N, tiles.block_n)
    programs = _num_programs(tiles, a.device, upper_tiles, per_sm)
    if a_desc or b_desc or c_desc:
        use_descriptor_scratch(a.device)
    launcher(_grouped_gemm_kernel)[(programs,)](
        a, a if a2 is None else a2,
        dummy if a_row is None else a_row,
        dummy if a_scale is None else a_scale,
        w_E, w_E if w2_E is None else w2_E,
        c, c2,
        dummy if c_row is None else c_row,
        aux1, aux3,
        schedule.tile_offsets, schedule.table,
        N, Kd, num_experts, a.shape[0], c.shape[0], aux1.shape[0],
        a.stride(0), s_be, s_bk, s_bn, c.stride(0), aux1.stride(0),
        MODE=mode,
        HAS_A_ROW=a_row is not None, HAS_A_SCALE=a_scale is not None, HAS_C_ROW=c_row is not None,
        A_DESC=a_desc, B_DESC=b_desc, B_TRANSPOSED=transpose_w, C_DESC=c_desc, HALF_TILES=half_tiles,
        NUM_PROGRAMS=programs,
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
        DOT_PRECISION=dot_precision(a.dtype), PREFETCH=prefetch_steps_for(tiles, a),
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )
    if mode == SWIGLU_FWD:
        return c, aux[0], aux[1]
    if mode == SWIGLU_BWD:
        return c, c2
    return c


def grouped_gemm_reference(
    a: torch.Tensor,
    w_E: torch.Tensor,
    rows_per_expert: list[int],
    *,
    transpose_w: bool,
    a_row: torch.Tensor | None = None,
    a_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain-PyTorch ``PLAIN`` mode in fp32: row r of expert e is ``A[a_row[r]] @ B[e]``."""
    rows = a if a_row is None else a[a_row.long()]
    rows = rows.float()
    if a_scale is not None:
        rows = rows * a_scale[:, None]
    outs = []
    for e, block in enumerate(torch.split(rows, rows_per_expert)):
        w = w_E[e].float()
        outs.append(block @ (w.t() if transpose_w else w))
    return torch.cat(outs)
