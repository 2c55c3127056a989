"""Grouped GEMM (PLAIN mode) and weight-gradient GEMM against fp32 PyTorch references.
On CPU they run in the Triton interpreter, in fp32 and fp16 (its bf16 dot is wrong)."""

import pytest
import torch

from tests.kernels.routing import make_routing
from uniep.kernels.grouped_gemm import PLAIN, SWIGLU_FWD, GemmTiles, grouped_gemm, grouped_gemm_reference
from uniep.kernels.row_tiles import row_tiles
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
        x, w, row_tiles(counts, TILES.block_m, P), P, transpose_w=transpose_w, tiles=TILES,
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
    offsets = row_tiles(counts, 16, 22)
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
    expert_offsets = row_tiles(counts, 16, P).expert_offsets
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
    expert_offsets = row_tiles(counts, 16, 20).expert_offsets
    c, c2 = grouped_wgrad(a, b, expert_offsets, 4, tiles=TILES, out_dtype=torch.float32, b_row=b_row, a2=a2)
    # The stacked launch computes (B^T A)^T: the same products, summed in the same row
    # chunks, but the interpreter's float32 matmul may round a transposed product
    # differently (seen with numpy 2.4 on OpenBLAS), so equal up to float32 rounding.
    single = grouped_wgrad(a, b, expert_offsets, 4, tiles=TILES, out_dtype=torch.float32, b_row=b_row)
    torch.testing.assert_close(c, single, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(c, grouped_wgrad_reference(a, b, counts.tolist(), b_row=b_row), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(c2, grouped_wgrad_reference(a2, b, counts.tolist(), b_row=b_row), rtol=1e-5, atol=1e-5)


def _all_launches(x, w1, w2, w3, grad_y, counts, K, tiles):
    """Every launch of the Triton expert path (forward, input and weight gradients)."""
    from uniep.kernels.grouped_gemm import DUAL, SWIGLU_BWD, SWIGLU_FWD

    P, E = grad_y.shape[0], w1.shape[0]
    gen = torch.Generator().manual_seed(5)
    order = torch.randperm(P, generator=gen)
    token, pair = (order // K).to(torch.int32), order.to(torch.int32)
    scale = torch.rand(P, generator=gen)
    off = row_tiles(counts, tiles.block_m, P)
    h, a1, a3 = grouped_gemm(x, w1, off, P, transpose_w=True, tiles=tiles, mode=SWIGLU_FWD, w2_E=w3,
                             a_row=token, a_scale=scale)
    y = grouped_gemm(h, w2, off, P, transpose_w=True, tiles=tiles, mode=PLAIN, c_row=pair)
    d1, d3 = grouped_gemm(grad_y, w2, off, P, transpose_w=False, tiles=tiles, mode=SWIGLU_BWD, a_row=pair,
                          aux=(a1, a3))
    d_rows = grouped_gemm(d1, w1, off, P, transpose_w=False, tiles=tiles, mode=DUAL, a2=d3, w2_E=w3, c_row=pair)
    gw2 = grouped_wgrad(grad_y, h, off.expert_offsets, E, tiles=tiles, out_dtype=torch.float32, a_row=pair)
    gw1, gw3 = grouped_wgrad(d1, x, off.expert_offsets, E, tiles=tiles, out_dtype=torch.float32, b_row=token, b_scale=scale, a2=d3)
    gw2_contiguous = grouped_wgrad(h, d1, off.expert_offsets, E, tiles=tiles, out_dtype=torch.float32)  # both through descriptors
    return h, a1, a3, y, d1, d3, d_rows, gw2, gw1, gw3, gw2_contiguous


@pytest.mark.parametrize("kind, dtype", [("skewed", torch.float32), ("random", torch.float16)])
def test_descriptor_loads_give_the_bits_of_pointer_loads(kind, dtype):
    """Sizes off the tiles (partial row chunks, edges the descriptors fill with zeros),
    empty experts (skewed), rows of the next expert inside a tile."""
    import dataclasses

    gen = torch.Generator().manual_seed(3)
    T, K, E, D, H = 13, 2, 5, 24, 40
    _, _, counts = make_routing(T, K, E, kind, gen)
    x = torch.randn(T, D, generator=gen).to(dtype)
    w1, w3 = (torch.randn(E, H, D, generator=gen).to(dtype) for _ in range(2))
    w2 = torch.randn(E, D, H, generator=gen).to(dtype)
    grad_y = torch.randn(T * K, D, generator=gen).to(dtype)
    pointers = _all_launches(x, w1, w2, w3, grad_y, counts, K, TILES)
    descriptors = _all_launches(x, w1, w2, w3, grad_y, counts, K, dataclasses.replace(TILES, descriptors=True))
    assert [torch.equal(a, b) for a, b in zip(pointers, descriptors)] == [True] * len(pointers)


def _expert_inputs(counts, K, gen, D=24, H=40):
    """(x, w1, w2, w3, grad_y) of an expert MLP: counts.sum() / K tokens, fp32."""
    E, P = counts.numel(), int(counts.sum())
    x = torch.randn(P // K, D, generator=gen)
    w1, w3 = (torch.randn(E, H, D, generator=gen) for _ in range(2))
    w2 = torch.randn(E, D, H, generator=gen)
    return x, w1, w2, w3, torch.randn(P, D, generator=gen)


@pytest.mark.parametrize("descriptors", [False, True])
def test_half_tiles_give_the_bits_of_full_tiles(descriptors):
    """Experts whose last row tile holds at most half a tile's rows (1, 5, 15 of 32),
    one exactly full, one just over half, one empty: every launch the same bits with the
    half-size dots as without, and the gate/up pre-activations those of fp32 PyTorch."""
    import dataclasses

    gen = torch.Generator().manual_seed(4)
    counts = torch.tensor([5, 32, 0, 33, 17, 47])  # last tiles of 5, 32, -, 1, 17, 15 rows
    K, P = 2, int(counts.sum())
    x, w1, w2, w3, grad_y = _expert_inputs(counts, K, gen)
    full = dataclasses.replace(TILES, block_m=32, descriptors=descriptors)
    half = dataclasses.replace(full, half_tiles=True)
    assert half.half_tiles and not full.half_tiles
    full_runs = _all_launches(x, w1, w2, w3, grad_y, counts, K, full)
    half_runs = _all_launches(x, w1, w2, w3, grad_y, counts, K, half)
    assert [torch.equal(a, b) for a, b in zip(full_runs, half_runs)] == [True] * len(full_runs)
    # the launch with no scale or gather: gate/up's a1 against fp32 (a wrong half tile,
    # e.g. rows of the next expert, would differ here too)
    off = row_tiles(counts, 32, P)
    rows = torch.randn(P, x.shape[1], generator=gen)
    _, a1, _ = grouped_gemm(rows, w1, off, P, transpose_w=True, tiles=half, mode=SWIGLU_FWD, w2_E=w3)
    torch.testing.assert_close(a1, grouped_gemm_reference(rows, w1, counts.tolist(), transpose_w=True),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("half_tiles", [False, True])
def test_descriptor_stores_give_the_bits_of_pointer_stores(half_tiles):
    """Full row tiles stored through descriptors, partial ones (an expert's last) through
    pointers: every launch the same bits as pointer stores, the plain-order GEMM too, and
    none of an expert's partial tile written past its rows (a next expert's rows, or the
    rows after the last expert, keep what the pointer stores wrote)."""
    import dataclasses

    gen = torch.Generator().manual_seed(6)
    counts = torch.tensor([16, 5, 0, 33, 32, 8])  # full, partial, empty, full + 1, full x 2, partial
    K, P = 2, int(counts.sum())
    x, w1, w2, w3, grad_y = _expert_inputs(counts, K, gen)
    H = w1.shape[1]
    pointer = dataclasses.replace(TILES, descriptors=True, half_tiles=half_tiles)
    stores = dataclasses.replace(pointer, store_descriptors=True)
    off = row_tiles(counts, TILES.block_m, P)

    def launches(tiles):
        plain_order = torch.full((P + 3, H), 7.0)  # rows past the plan's must stay 7
        grouped_gemm(grad_y, w2, off, P, transpose_w=False, tiles=tiles, mode=PLAIN, out_rows=P + 3,
                     out=plain_order)
        return (*_all_launches(x, w1, w2, w3, grad_y, counts, K, tiles), plain_order)

    by_pointer, by_descriptor = launches(pointer), launches(stores)
    assert [torch.equal(a, b) for a, b in zip(by_pointer, by_descriptor)] == [True] * len(by_pointer)
    assert torch.equal(by_descriptor[-1][P:], torch.full((3, H), 7.0))
    torch.testing.assert_close(by_descriptor[-1][:P], grouped_gemm_reference(grad_y, w2, counts.tolist(),
                                                                             transpose_w=False),
                               rtol=1e-5, atol=1e-5)


def test_descriptors_only_where_the_copy_engine_can_read():
    from uniep.kernels.grouped_gemm import tma_readable

    w = torch.randn(3, 8, 16)
    assert tma_readable(w) and tma_readable(None)
    assert not tma_readable(w.transpose(1, 2))  # last dim not contiguous
    assert not tma_readable(torch.randn(4, 6))  # rows of 24 bytes: not 16-byte aligned
    assert not tma_readable(torch.randn(65)[1:].view(4, 16))  # base 4 bytes off
    assert not tma_readable(torch.randn(0, 16))  # a rank that received no rows


def test_descriptor_launches_give_triton_an_allocator_in_the_launching_thread():
    """Kernels that build tensor descriptors need scratch memory from Triton's allocator,
    which Triton keeps per thread context; a backward launches from the autograd engine's
    thread. On CUDA the launcher sets it in whatever thread launches."""
    import threading

    from triton.runtime import _allocation

    from uniep.kernels.grouped_gemm import use_descriptor_scratch

    seen = {}

    def launch_in_new_thread(device):
        use_descriptor_scratch(torch.device(device))
        seen[device] = _allocation._allocator.get()

    for device in ("cpu", "cuda"):  # cpu: the control (the interpreter needs none; nothing is set)
        thread = threading.Thread(target=launch_in_new_thread, args=(device,))
        thread.start()
        thread.join()
    assert isinstance(seen["cpu"], _allocation.NullAllocator)
    allocate = seen["cuda"]
    assert not isinstance(allocate, _allocation.NullAllocator)
    if torch.cuda.is_available():
        buffer = allocate(384, 128, None)
        assert buffer.numel() == 384 and buffer.is_cuda and buffer.data_ptr() % 128 == 0


def test_the_swiglu_backward_pair_is_read_in_place_by_the_w1_w3_gradient():
    from uniep.kernels.grouped_gemm import pair_buffer
    from uniep.kernels.wgrad import stacked

    d_a1, d_a3 = pair_buffer(torch.empty(0), 5, 3)
    d_a1.copy_(torch.randn(5, 3))
    d_a3.copy_(torch.randn(5, 3))
    both = stacked(d_a1, d_a3)
    assert both.data_ptr() == d_a1.data_ptr() and torch.equal(both, torch.cat([d_a1, d_a3]))
    apart = torch.randn(5, 3), torch.randn(5, 3)
    copy = stacked(*apart)
    assert copy.data_ptr() not in (apart[0].data_ptr(), apart[1].data_ptr())
    assert torch.equal(copy, torch.cat(apart))


def test_a_second_operand_of_another_shape_is_refused_before_launch():
    """DUAL mode reads A2 with A's rows and strides (one descriptor shape for both)."""
    from uniep.kernels.grouped_gemm import DUAL

    counts = torch.tensor([3, 2])
    w = torch.randn(2, 8, 16)
    a = torch.randn(5, 8)
    offsets = row_tiles(counts, TILES.block_m, 5)
    out = grouped_gemm(a, w, offsets, 5, transpose_w=False, tiles=TILES, mode=DUAL, a2=a.clone(), w2_E=w)
    assert torch.allclose(out, 2 * grouped_gemm(a, w, offsets, 5, transpose_w=False, tiles=TILES), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="A2 must have A's shape and strides"):
        grouped_gemm(a, w, offsets, 5, transpose_w=False, tiles=TILES, mode=DUAL, a2=torch.randn(6, 8), w2_E=w)


@pytest.mark.parametrize("halves", [1, 2])
@pytest.mark.parametrize("run", [1, 3])
@pytest.mark.parametrize("scaled", [False, True])
def test_wgrad_expert_runs_give_the_bits_of_round_robin_tiles(halves, run, scaled):
    """Runs of consecutive tiles of one expert per program, both operands read through
    descriptors ending at the expert's last row (the partial last chunk in the pipelined
    loop): the bits of tiles dealt round-robin with the last chunk after the loop, at
    experts with partial chunks, an empty one (also the first, whose descriptor would end
    at row 0), a last one; also with both operands scaled and the second gathered (pointer
    loads in the loop). An expert's gradient ignores the next expert's rows (changing them,
    even to NaN, leaves it as it was) but not its own (control)."""
    import dataclasses

    gen = torch.Generator().manual_seed(6)
    counts = torch.tensor([0, 5, 32, 0, 33, 17, 47])  # last chunks of -, 5, 16, -, 1, 1, 15 rows (block_k 16)
    E, P = counts.numel(), int(counts.sum())
    a, a2 = torch.randn(P, 40, generator=gen), torch.randn(P, 40, generator=gen)
    b = torch.randn(P, 24, generator=gen)
    offsets = row_tiles(counts, 16, P).expert_offsets
    round_robin = dataclasses.replace(TILES, descriptors=True, expert_run=0)
    runs = dataclasses.replace(round_robin, expert_run=run)
    extra = {}
    if scaled:
        extra = dict(a_scale=torch.rand(P, generator=gen) + 0.5, b_scale=torch.rand(P, generator=gen) + 0.5,
                     b_row=torch.randperm(P, generator=gen).to(torch.int32))

    def launch(tiles, a, a2, b):
        out = grouped_wgrad(a, b, offsets, E, tiles=tiles, out_dtype=torch.float32, a2=a2 if halves == 2 else None,
                            **extra)
        return out if halves == 2 else (out,)

    expected, got = launch(round_robin, a, a2, b), launch(runs, a, a2, b)
    assert [torch.equal(x, y) for x, y in zip(expected, got)] == [True] * halves
    torch.testing.assert_close(got[0], grouped_wgrad_reference(a, b, counts.tolist(), **extra), **TOL[torch.float32])
    assert torch.count_nonzero(got[0][0]) == 0 and torch.count_nonzero(got[0][3]) == 0  # the empty experts
    if scaled:
        return
    # expert 1 (rows 0..4): rows 5.. belong to expert 2; every operand there changed
    a_next, a2_next, b_next = (t.clone() for t in (a, a2, b))
    for t in (a_next, a2_next, b_next):
        t[5:16] += 100.0
    assert torch.equal(launch(runs, a_next, a2_next, b_next)[0][1], got[0][1])
    for t in (a_next, a2_next, b_next):  # not even non-finite ones (NaN propagates per expert)
        t[5:16] = float("nan")
    assert torch.equal(launch(runs, a_next, a2_next, b_next)[0][1], got[0][1])
    assert torch.count_nonzero(launch(runs, a_next, a2_next, b_next)[0][0]) == 0  # nor the empty one before
    b_own = b.clone()
    b_own[4] += 1.0
    assert not torch.equal(launch(runs, a, a2, b_own)[0][1], got[0][1])


def test_wgrad_expert_runs_by_rows_per_expert():
    """-1 picks runs of 4 up to the threshold of rows per expert, round-robin tiles above
    it; a number given is used as given."""
    import dataclasses

    from uniep.kernels.wgrad import RUNS_UP_TO_ROWS_PER_EXPERT, expert_run_for

    auto = dataclasses.replace(TILES, expert_run=-1)
    limit = RUNS_UP_TO_ROWS_PER_EXPERT
    assert expert_run_for(auto, 4096 * 8, 128) == 4  # Qwen3, 4096 tokens: 256 rows per expert
    assert expert_run_for(auto, 16384 * 8, 128) == 0  # Qwen3, 16384 tokens: 1024
    assert [expert_run_for(auto, limit * 10 + d, 10) for d in (0, 1)] == [4, 0]
    assert expert_run_for(dataclasses.replace(TILES, expert_run=0), 16, 10) == 0
    assert expert_run_for(dataclasses.replace(TILES, expert_run=2), 10**6, 10) == 2


def test_row_gemms_run_deeper_where_experts_have_few_rows(monkeypatch):
    """``few_rows_stages`` replaces ``num_stages`` up to FEW_ROWS_PER_EXPERT rows per
    expert on average, in the launch itself; above it, or unset, the tiles' own depth.
    The defaults: 4 stages at Qwen3's 4096 tokens, 3 at 16384, on gate/up and the plain GEMMs."""
    import dataclasses

    import uniep.kernels.grouped_gemm as gg
    from uniep.config import UniEPConfig
    from uniep.kernels.grouped_gemm import FEW_ROWS_PER_EXPERT, ExpertTiles, stages_for_rows

    deep = dataclasses.replace(TILES, num_stages=2, few_rows_stages=5)
    limit = FEW_ROWS_PER_EXPERT
    assert [stages_for_rows(deep, limit * 10 + d, 10).num_stages for d in (0, 1)] == [5, 2]
    assert stages_for_rows(dataclasses.replace(deep, few_rows_stages=0), 16, 10).num_stages == 2
    tiles = ExpertTiles.from_config(UniEPConfig())
    for t in (tiles.gemm, tiles.up):
        assert stages_for_rows(t, 4096 * 8, 128).num_stages == 4  # 256 rows per expert
        assert stages_for_rows(t, 16384 * 8, 128).num_stages == 3  # 1024
    assert ExpertTiles.from_config(UniEPConfig(gemm_few_rows_num_stages=0)).gemm.few_rows_stages == 0

    launched = []

    class Launch:  # records the launch's pipelining depth instead of launching
        def __getitem__(self, grid):
            return lambda *args, **kwargs: launched.append(kwargs["num_stages"])

    monkeypatch.setattr(gg, "launcher", lambda fn: Launch())
    E, D, N = 4, 16, 32
    w = torch.zeros(E, N, D)
    for rows in (limit * E, limit * E + 1):
        counts = torch.full((E,), rows // E, dtype=torch.int64)
        counts[0] += rows % E
        grouped_gemm(torch.zeros(rows, D), w, row_tiles(counts, deep.block_m, rows), rows, transpose_w=True,
                     tiles=deep)
    assert launched == [5, 2]


def test_l2_prefetch_only_where_its_requests_can_be_made(monkeypatch):
    """``gemm_prefetch_steps`` reaches the gate/up and plain GEMMs' tiles (not the weight
    gradients'); a launch asks L2 ahead only on CUDA, with 16-bit operands and blocks a
    whole number of 128-byte lines wide; elsewhere (the interpreter runs no inline
    assembly) and by default, PREFETCH is 0."""
    import dataclasses

    import uniep.kernels.grouped_gemm as gg
    from uniep.config import UniEPConfig
    from uniep.kernels.grouped_gemm import ExpertTiles, prefetch_steps_for

    tiles = ExpertTiles.from_config(UniEPConfig(gemm_prefetch_steps=6))
    assert (tiles.gemm.prefetch_steps, tiles.up.prefetch_steps, tiles.wgrad.prefetch_steps) == (6, 6, 0)
    assert ExpertTiles.from_config(UniEPConfig()).gemm.prefetch_steps == 0

    class OnCuda:  # what the check reads of a CUDA tensor
        is_cuda = True

        def __init__(self, element_size):
            self.element_size = lambda: element_size

    assert prefetch_steps_for(tiles.gemm, OnCuda(2)) == 6
    assert prefetch_steps_for(tiles.gemm, OnCuda(4)) == 0  # float32: not one line per 64 elements
    assert prefetch_steps_for(dataclasses.replace(tiles.gemm, block_k=32), OnCuda(2)) == 0
    assert prefetch_steps_for(dataclasses.replace(tiles.gemm, block_n=32), OnCuda(2)) == 0
    assert prefetch_steps_for(tiles.gemm, torch.zeros(2, dtype=torch.bfloat16)) == 0  # CPU

    launched = []

    class Launch:  # records the launch's PREFETCH instead of launching
        def __getitem__(self, grid):
            return lambda *args, **kwargs: launched.append(kwargs["PREFETCH"])

    monkeypatch.setattr(gg, "launcher", lambda fn: Launch())
    monkeypatch.setattr(gg, "prefetch_steps_for", lambda t, a: t.prefetch_steps)  # as on CUDA
    counts = torch.tensor([3, 5])
    for t in (tiles.gemm, dataclasses.replace(tiles.gemm, prefetch_steps=0)):
        grouped_gemm(torch.zeros(8, 16), torch.zeros(2, 32, 16), row_tiles(counts, t.block_m, 8), 8, transpose_w=True,
                     tiles=t)
    assert launched == [6, 0]


@pytest.mark.parametrize("halves", [1, 2])
@pytest.mark.parametrize("run", [0, 2])
def test_wgrad_descriptor_stores_give_the_pointer_stores_bits(halves, run):
    """Tiles stored through a descriptor over the experts' gradients stacked as rows:
    the bits of the pointer stores, with columns past the tiles' edge (24 of 16-wide
    tiles) clipped and an empty expert's zeros."""
    import dataclasses

    gen = torch.Generator().manual_seed(11)
    counts = torch.tensor([5, 0, 33, 17])
    E, P = counts.numel(), int(counts.sum())
    a, a2 = torch.randn(P, 32, generator=gen), torch.randn(P, 32, generator=gen)
    b = torch.randn(P, 24, generator=gen)
    offsets = row_tiles(counts, 16, P).expert_offsets
    pointers = dataclasses.replace(TILES, descriptors=True, expert_run=run)
    stored = dataclasses.replace(pointers, store_descriptors=True)

    def launch(tiles):
        out = grouped_wgrad(a, b, offsets, E, tiles=tiles, out_dtype=torch.float32, a2=a2 if halves == 2 else None)
        return out if halves == 2 else (out,)

    from uniep.kernels.wgrad import stores_through_descriptor

    expected = launch(pointers)
    assert stores_through_descriptor(stored, expected[0], expected[-1], halves)  # (E, 32, 24): two 16-row tiles
    assert [torch.equal(x, y) for x, y in zip(launch(stored), expected)] == [True] * halves
    torch.testing.assert_close(expected[0], grouped_wgrad_reference(a, b, counts.tolist()), **TOL[torch.float32])
    assert torch.count_nonzero(expected[0][1]) == 0


def test_wgrad_descriptor_store_choice():
    """The descriptor stores need each expert's gradient a whole number of tiles high
    and contiguous outputs (controls: each missing one turns them off)."""
    import dataclasses

    from uniep.kernels.wgrad import stores_through_descriptor

    tiles = dataclasses.replace(TILES, store_descriptors=True)
    c = torch.zeros(2, 3, 32, 48)
    assert stores_through_descriptor(tiles, c[0], c[0], halves=1)
    assert stores_through_descriptor(tiles, c[0], c[1], halves=2)
    assert not stores_through_descriptor(tiles, c[0], c[1].transpose(1, 2), halves=2)  # C2 not contiguous
    assert not stores_through_descriptor(tiles, torch.zeros(3, 40, 48), None, halves=1)  # 40 rows: 2.5 tiles
    assert not stores_through_descriptor(TILES, c[0], c[0], halves=1)  # not asked
