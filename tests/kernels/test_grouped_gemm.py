"""Grouped GEMM (PLAIN mode) and weight-gradient GEMM against fp32 PyTorch references.
On CPU they run in the Triton interpreter, in fp32 and fp16 (its bf16 dot is wrong)."""

import pytest
import torch

from tests.kernels.routing import make_routing
from uniep.kernels.grouped_gemm import PLAIN, GemmTiles, grouped_gemm, grouped_gemm_reference, tile_offsets
from uniep.kernels.wgrad import grouped_wgrad, grouped_wgrad_reference

TILES = GemmTiles(block_m=16, block_n=16, block_k=16, num_programs=3)
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=2e-3, atol=2e-3)}


@pytest.mark.parametrize(
    "T, K, E, Kd, N, kind, dtype",
    [
        (13, 2, 4, 24, 40, "random", torch.float32),  # odd sizes, not multiples of the tiles
        (9, 3, 6, 32, 16, "skewed", torch.float16),  # empty experts
        (1, 1, 3, 16, 20, "random", torch.float32),  # one token
        (20, 1, 5, 17, 33, "one_expert", torch.float32),  # every row on one expert
    ],
)
@pytest.mark.parametrize("transpose_w", [True, False])
def test_plain_gemm_with_gather_scale_scatter(T, K, E, Kd, N, kind, dtype, transpose_w):
    gen = torch.Generator().manual_seed(T + K + E)
    _, order, counts = make_routing(T, K, E, kind, gen)
    P = T * K
    x = torch.randn(T, Kd, generator=gen).to(dtype)
    w = torch.randn(E, N, Kd, generator=gen).to(dtype) if transpose_w else torch.randn(E, Kd, N, generator=gen).to(dtype)
    a_row = (order // K).to(torch.int32)
    scale = torch.rand(P, generator=gen)
    c_row = order.to(torch.int32)
    out = grouped_gemm(
        x, w, tile_offsets(counts, TILES.block_m), P, transpose_w=transpose_w, tiles=TILES,
        mode=PLAIN, a_row=a_row, a_scale=scale, c_row=c_row,
    )
    # reference on the scaled rows, rounded to the input dtype as the kernel does
    rows = (x[a_row.long()].float() * scale[:, None]).to(dtype)
    ref = grouped_gemm_reference(rows, w, counts.tolist(), transpose_w=transpose_w)
    expected = torch.empty_like(ref)
    expected[order] = ref  # scattered to (token, k) order
    torch.testing.assert_close(out.float(), expected, **TOL[dtype])


def test_results_do_not_depend_on_the_number_of_programs():
    gen = torch.Generator().manual_seed(0)
    _, order, counts = make_routing(11, 2, 4, "random", gen)
    x = torch.randn(22, 32, generator=gen)
    w = torch.randn(4, 24, 32, generator=gen)
    offsets = tile_offsets(counts, 16)
    runs = [
        grouped_gemm(x, w, offsets, 22, transpose_w=True, tiles=GemmTiles(16, 16, 16, num_programs=p))
        for p in (1, 2, 7)
    ]
    assert all(torch.equal(runs[0], r) for r in runs[1:])


@pytest.mark.parametrize(
    "T, K, E, M, N, kind, dtype",
    [
        (13, 2, 4, 24, 40, "random", torch.float32),
        (9, 3, 6, 16, 32, "skewed", torch.float16),  # experts with no rows: zero gradient
        (7, 1, 3, 20, 18, "one_expert", torch.float32),
    ],
)
def test_wgrad_matches_reference(T, K, E, M, N, kind, dtype):
    gen = torch.Generator().manual_seed(M * N)
    _, order, counts = make_routing(T, K, E, kind, gen)
    P = T * K
    a = torch.randn(P, M, generator=gen).to(dtype)  # e.g. grad rows in (token, k) order
    b = torch.randn(T, N, generator=gen).to(dtype)  # e.g. tokens
    a_row, b_row = order.to(torch.int32), (order // K).to(torch.int32)
    scale = torch.rand(P, generator=gen)
    expert_offsets, _ = tile_offsets(counts, 16)
    out = grouped_wgrad(a, b, expert_offsets, E, tiles=TILES, out_dtype=torch.float32, a_row=a_row, b_row=b_row, b_scale=scale)
    b_scaled = (b[b_row.long()].float() * scale[:, None]).to(dtype)
    ref = grouped_wgrad_reference(a, b_scaled, counts.tolist(), a_row=a_row)
    torch.testing.assert_close(out, ref, **TOL[dtype])
    empty = (counts == 0).nonzero().flatten()
    assert torch.count_nonzero(out[empty]) == 0
    # a scale on the gathered A rows (the down projection's output gradient w * g)
    out = grouped_wgrad(a, b, expert_offsets, E, tiles=TILES, out_dtype=torch.float32, a_row=a_row, a_scale=scale, b_row=b_row)
    a_scaled = (a[a_row.long()].float() * scale[:, None]).to(dtype)
    ref = grouped_wgrad_reference(a_scaled, b, counts.tolist(), b_row=b_row)
    torch.testing.assert_close(out, ref, **TOL[dtype])


def test_wgrad_with_two_inputs_shares_the_b_rows():
    gen = torch.Generator().manual_seed(5)
    _, order, counts = make_routing(10, 2, 4, "skewed", gen)
    a, a2 = torch.randn(20, 24, generator=gen), torch.randn(20, 24, generator=gen)
    b = torch.randn(10, 40, generator=gen)
    b_row = (order // 2).to(torch.int32)
    expert_offsets, _ = tile_offsets(counts, 16)
    c, c2 = grouped_wgrad(a, b, expert_offsets, 4, tiles=TILES, out_dtype=torch.float32, b_row=b_row, a2=a2)
    assert torch.equal(c, grouped_wgrad(a, b, expert_offsets, 4, tiles=TILES, out_dtype=torch.float32, b_row=b_row))
    torch.testing.assert_close(c2, grouped_wgrad_reference(a2, b, counts.tolist(), b_row=b_row), rtol=1e-5, atol=1e-5)
