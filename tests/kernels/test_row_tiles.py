"""The row-tile schedule (``uniep.kernels.row_tiles``): offsets and table against plain
Python, and the GEMMs read their tiles from it."""

import pytest
import torch

from tests.kernels.routing import make_routing
from uniep.kernels.grouped_gemm import GemmTiles, grouped_gemm, grouped_gemm_reference
from uniep.kernels.row_tiles import row_tiles, row_tiles_reference


@pytest.mark.parametrize(
    "counts, block_m",
    [
        ([5, 0, 17, 16, 0, 1], 16),  # empty experts, a full tile, partial tiles
        ([0, 0, 0], 16),  # no rows at all
        ([300], 128),  # one expert
        ([(e * 37) % 101 for e in range(130)], 16),  # E past a power of 2, several table blocks
    ],
)
def test_schedule_matches_plain_python(counts, block_m):
    rows = sum(counts)
    schedule = row_tiles(torch.tensor(counts), block_m, rows)
    expert_offsets, tile_offsets, table = row_tiles_reference(counts, block_m)
    assert schedule.expert_offsets.tolist() == expert_offsets
    assert schedule.tile_offsets.tolist() == tile_offsets
    assert schedule.table.shape[0] >= len(table)
    assert [tuple(t) for t in schedule.table[: len(table)].tolist()] == table


def test_the_gemm_reads_its_tiles_from_the_table():
    gen = torch.Generator().manual_seed(3)
    _, _, counts = make_routing(12, 2, 4, "random", gen)
    x, w = torch.randn(24, 32, generator=gen), torch.randn(4, 24, 32, generator=gen)
    tiles = GemmTiles(16, 16, 16, num_programs=3)
    schedule = row_tiles(counts, 16, 24)
    ref = grouped_gemm_reference(x, w, counts.tolist(), transpose_w=True)
    torch.testing.assert_close(grouped_gemm(x, w, schedule, 24, transpose_w=True, tiles=tiles), ref)
    # negative control: the first row tile said to be another expert's
    first = int((counts > 0).nonzero()[0])
    schedule.table[0, 0] = (first + 1) % 4
    wrong = grouped_gemm(x, w, schedule, 24, transpose_w=True, tiles=tiles)
    assert not torch.allclose(wrong, ref, rtol=1e-4, atol=1e-4)


def test_a_schedule_of_other_tiles_is_refused_before_launch():
    counts = torch.tensor([3, 2])
    x, w = torch.randn(5, 8), torch.randn(2, 6, 8)
    with pytest.raises(ValueError, match=r"schedule has .* tiles of 16 rows; this launch needs .* tiles of 32 rows"):
        grouped_gemm(x, w, row_tiles(counts, 16, 5), 5, transpose_w=True, tiles=GemmTiles(32, 16, 16))
    with pytest.raises(ValueError, match=r"build it with row_tiles\(rows_per_expert, 16, 40\)"):
        grouped_gemm(torch.randn(40, 8), w, row_tiles(counts, 16, 5), 40, transpose_w=True, tiles=GemmTiles(16, 16, 16))
