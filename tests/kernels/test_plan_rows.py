"""The row copy and the row-tile schedule in one launch (``uniep.kernels.plan_rows``):
the bits of the two launches it replaces and of its PyTorch reference."""

import pytest
import torch

from tests.kernels.routing import make_routing
from uniep.kernels.combine import replicate_rows
from uniep.kernels.plan_rows import plan_rows, plan_rows_reference
from uniep.kernels.row_tiles import row_tiles
from uniep.plan import inverse_permutation


def _case(T, K, E, D, kind, seed):
    gen = torch.Generator().manual_seed(seed)
    if T == 0:
        order, counts = torch.zeros(0, dtype=torch.int64), torch.zeros(E, dtype=torch.int64)
    else:
        _, order, counts = make_routing(T, K, E, kind, gen)
    x = torch.randn(T, D, generator=gen).half()  # (the interpreter rounds to bf16 differently from a GPU)
    return x, inverse_permutation(order), counts, torch.rand(T, K, generator=gen)


@pytest.mark.parametrize("T, K, E, D, kind, block_m, scaled", [
    (9, 2, 6, 40, "random", 16, False),  # partial tiles, one column block
    (7, 3, 5, 40, "skewed", 4, True),  # empty experts, several schedule programs, scaled copies
    (3, 1, 130, 2100, "random", 16, False),  # E past a power of 2, two column blocks
    (0, 2, 4, 8, "random", 16, False),  # no tokens: the schedule alone
])
def test_plan_rows_gives_the_two_launches_bits(T, K, E, D, kind, block_m, scaled):
    x, inverse, counts, scale = _case(T, K, E, D, kind, T + E + D)
    scale = scale if scaled else None
    rows, schedule = plan_rows(x, K, inverse, counts, block_m, scale)
    alone = row_tiles(counts, block_m, T * K)
    assert torch.equal(rows, replicate_rows(x, K, inverse, scale))
    for got, want in zip(schedule[:3], alone[:3]):
        assert torch.equal(got, want)
    assert schedule.block_m == block_m
    ref_rows, (expert_offsets, tile_offsets, table) = plan_rows_reference(x, K, inverse, counts.tolist(), block_m,
                                                                         scale)
    assert torch.equal(rows, ref_rows)
    assert schedule.expert_offsets.tolist() == expert_offsets and schedule.tile_offsets.tolist() == tile_offsets
    assert [tuple(t) for t in schedule.table[: len(table)].tolist()] == table


def test_plan_rows_negative_controls():
    """A schedule of other tiles, the order itself instead of its inverse, and scales in
    the other order each give something else; a wrong map's shape is refused."""
    T, K, E, D = 8, 3, 5, 24
    x, inverse, counts, scale = _case(T, K, E, D, "random", 11)
    rows, schedule = plan_rows(x, K, inverse, counts, 4, scale)
    assert not torch.equal(row_tiles(counts, 8, T * K).table[:4], schedule.table[:4])
    wrong_rows, _ = plan_rows(x, K, inverse_permutation(inverse), counts, 4, scale)
    assert not torch.equal(wrong_rows, rows)
    swapped, _ = plan_rows(x, K, inverse, counts, 4, scale.t().contiguous().view(T, K))
    assert not torch.equal(swapped, rows)
    with pytest.raises(ValueError, match="plan_rows: row_of_pair has shape"):
        plan_rows(x, K, inverse[1:], counts, 4)
