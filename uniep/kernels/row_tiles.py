"""The row-tile schedule of the grouped GEMMs: which expert and rows each row tile covers.

Shape legend: E experts, R rows (expert-major), T row tiles of ``block_m`` rows (an upper
bound, ``cdiv(R, block_m) + E``: every expert ends in at most one partial tile).

Expert ``e`` owns rows ``[expert_offsets[e], expert_offsets[e+1])`` and row tiles
``[tile_offsets[e], tile_offsets[e+1])``; row tiles never cross experts. ``table[m]`` is
(expert, first row, the expert's end row) of row tile ``m``, so a GEMM program finds
its tile with one load instead of a search over ``tile_offsets`` (a chain of dependent
loads at the start of every tile), and can load its next tile's entry while it
computes the current one. Everything is computed on the device in one
launch: no host sync.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from uniep.kernels.launch import cdiv, launcher, next_power_of_2


class RowTiles(NamedTuple):
    """A row-tile schedule (see the module docstring); int32 tensors on the device."""

    expert_offsets: torch.Tensor
    """(E+1,) first row of each expert; the last entry is R."""
    tile_offsets: torch.Tensor
    """(E+1,) first row tile of each expert; the last entry is the number of row tiles."""
    table: torch.Tensor
    """(T, 3): expert, first row and the expert's end row of each row tile (entries past
    the last row tile are unused)."""
    block_m: int
    """Rows per row tile."""

    def check(self, block_m: int, num_rows: int, where: str) -> None:
        """Raise unless a launch of ``num_rows`` rows in tiles of ``block_m`` rows can walk
        this schedule."""
        need = cdiv(num_rows, block_m) + self.tile_offsets.numel() - 1
        if block_m != self.block_m or self.table.shape[0] < need:
            raise ValueError(f"{where}: the row-tile schedule has {self.table.shape[0]} tiles of {self.block_m} rows; "
                             f"this launch needs {need} tiles of {block_m} rows: build it with "
                             f"row_tiles(rows_per_expert, {block_m}, {num_rows})")


@triton.jit
def write_row_tiles(block, rows_per_expert_ptr, expert_offsets_ptr, tile_offsets_ptr, table_ptr, num_experts,
                    table_rows, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_T: tl.constexpr):
    """Table rows ``[block * BLOCK_T, (block + 1) * BLOCK_T)`` of the schedule; block 0 also
    writes the offsets. (A program of ``_row_tiles_kernel``, or of a launch that writes the
    schedule beside its own work, ``uniep.kernels.plan_rows``.)"""
    es = tl.arange(0, BLOCK_E)
    real = es < num_experts
    counts = tl.load(rows_per_expert_ptr + es, mask=real, other=0).to(tl.int32)
    tiles = (counts + BLOCK_M - 1) // BLOCK_M
    row_end = tl.cumsum(counts, 0)
    tile_end = tl.cumsum(tiles, 0)
    row_start = row_end - counts
    tile_start = tile_end - tiles
    if block == 0:
        tl.store(expert_offsets_ptr + es, row_start, mask=real)
        tl.store(tile_offsets_ptr + es, tile_start, mask=real)
        last = es == num_experts - 1
        tl.store(expert_offsets_ptr + es + 1, row_end, mask=last)
        tl.store(tile_offsets_ptr + es + 1, tile_end, mask=last)
    ms = block * BLOCK_T + tl.arange(0, BLOCK_T)
    # Tile m's expert: the number of experts whose tiles end at or before m (empty
    # experts end where they start, so they are skipped); past the last tile, the last.
    ended = real[None, :] & (tile_end[None, :] <= ms[:, None])
    e = tl.minimum(tl.sum(ended.to(tl.int32), axis=1), num_experts - 1)
    mine = es[None, :] == e[:, None]
    first_row = tl.sum(tl.where(mine, row_start[None, :] - tile_start[None, :] * BLOCK_M, 0), axis=1) + ms * BLOCK_M
    end_row = tl.sum(tl.where(mine, row_end[None, :], 0), axis=1)
    inside = ms < table_rows
    tl.store(table_ptr + ms * 3, e, mask=inside)
    tl.store(table_ptr + ms * 3 + 1, first_row, mask=inside)
    tl.store(table_ptr + ms * 3 + 2, end_row, mask=inside)


@triton.jit
def _row_tiles_kernel(rows_per_expert_ptr, expert_offsets_ptr, tile_offsets_ptr, table_ptr, num_experts, table_rows,
                      BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_T: tl.constexpr):
    write_row_tiles(tl.program_id(0), rows_per_expert_ptr, expert_offsets_ptr, tile_offsets_ptr, table_ptr,
                    num_experts, table_rows, BLOCK_M, BLOCK_E, BLOCK_T)


class ScheduleLaunch(NamedTuple):
    """An empty schedule of ``num_experts`` experts and ``table_rows`` row tiles, and how
    ``write_row_tiles`` fills it: ``programs`` blocks of ``block_t`` table rows, experts
    padded to ``block_e``."""

    schedule: RowTiles
    num_experts: int
    table_rows: int
    programs: int
    block_e: int
    block_t: int

    def args(self, rows_per_expert_E: torch.Tensor) -> tuple:
        """``write_row_tiles``' tensor and integer arguments, from ``rows_per_expert``."""
        s = self.schedule
        return rows_per_expert_E, s.expert_offsets, s.tile_offsets, s.table, self.num_experts, self.table_rows


def empty_schedule(num_experts: int, block_m: int, num_rows: int, device: torch.device) -> ScheduleLaunch:
    """The buffers of the schedule of ``num_experts`` experts and ``num_rows`` rows (R or a
    host-side upper bound of it) in tiles of ``block_m`` rows, and its launch sizes."""
    E = num_experts
    T = cdiv(num_rows, block_m) + E
    buffer = torch.empty(2 * (E + 1) + 3 * T, dtype=torch.int32, device=device)
    expert_offsets, tile_offsets, table = buffer.split_with_sizes([E + 1, E + 1, 3 * T])  # one op, three views
    block_e = next_power_of_2(E)
    # (BLOCK_T, BLOCK_E) tiles of 4096 entries: 32 per thread (16384 spilled at 64 experts)
    block_t = max(16, min(256, 4096 // block_e))
    return ScheduleLaunch(RowTiles(expert_offsets, tile_offsets, table.view(T, 3), block_m), E, T, cdiv(T, block_t),
                          block_e, block_t)


def row_tiles(rows_per_expert_E: torch.Tensor, block_m: int, num_rows: int) -> RowTiles:
    """The schedule of ``rows_per_expert_E`` (E,) integer rows per expert on the device in
    tiles of ``block_m`` rows; ``num_rows``: R or a host-side upper bound of it (sizes
    the table)."""
    launch = empty_schedule(rows_per_expert_E.numel(), block_m, num_rows, rows_per_expert_E.device)
    launcher(_row_tiles_kernel)[(launch.programs,)](
        *launch.args(rows_per_expert_E), BLOCK_M=block_m, BLOCK_E=launch.block_e, BLOCK_T=launch.block_t,
        num_warps=4,
    )
    return launch.schedule


def row_tiles_reference(rows_per_expert: list[int], block_m: int) -> tuple[list[int], list[int], list[tuple]]:
    """Plain-Python schedule: (expert offsets, tile offsets, the table's used rows)."""
    expert_offsets, tile_offsets, table = [0], [0], []
    for e, count in enumerate(rows_per_expert):
        start = expert_offsets[-1]
        for t in range(cdiv(count, block_m)):
            table.append((e, start + t * block_m, start + count))
        expert_offsets.append(start + count)
        tile_offsets.append(len(table))
    return expert_offsets, tile_offsets, table


@triton.jit
def row_block(table_ptr, m_tile, valid=True):
    """(expert, first row, the expert's end row) of row tile ``m_tile`` (0s where not ``valid``)."""
    at = table_ptr + m_tile * 3
    return (tl.load(at, mask=valid, other=0), tl.load(at + 1, mask=valid, other=0),
            tl.load(at + 2, mask=valid, other=0))


@triton.jit
def tile_span(row0, row_end, n0, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Rows (BLOCK_M,), row mask, columns (BLOCK_N,) and column mask of the tile at
    (row0, n0) of an expert whose rows end at ``row_end``."""
    rows = row0 + tl.arange(0, BLOCK_M)
    cols = n0 + tl.arange(0, BLOCK_N)
    return rows, rows < row_end, cols, cols < N


@triton.jit
def tile_coords(tile, n_tiles, N, table_ptr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Tile ``tile`` of the schedule (row tile ``tile // n_tiles``) -> (expert, first row,
    first column, rows, row mask, columns, column mask)."""
    e, row0, row_end = row_block(table_ptr, tile // n_tiles)
    n0 = (tile % n_tiles) * BLOCK_N
    rows, mask_m, cols, mask_n = tile_span(row0, row_end, n0, N, BLOCK_M, BLOCK_N)
    return e, row0, n0, rows, mask_m, cols, mask_n
