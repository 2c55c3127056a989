"""SwiGLU backward launch: against autograd in fp32, in place on the gradient of h (the
first half of a pair buffer) or into the column halves of a stacked (R, 2H) buffer, and
the same bits as the fused SwiGLU-backward epilogue of the grouped GEMM (the
megakernel's)."""

import pytest
import torch

from tests.kernels.routing import make_routing
from uniep.kernels.grouped_gemm import PLAIN, SWIGLU_BWD, GemmTiles, grouped_gemm
from uniep.kernels.row_tiles import row_tiles
from uniep.kernels.swiglu import swiglu_backward, swiglu_backward_reference


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-6), (torch.float16, 2e-3)])
@pytest.mark.parametrize("R, H", [(37, 24), (5, 200)])  # R * H not a multiple of the block; H of the column tile
def test_matches_autograd_in_place_and_stacked(dtype, tol, R, H):
    gen = torch.Generator().manual_seed(0)
    pair = torch.empty(2, R, H, dtype=dtype)
    g = (torch.randn(R, H, generator=gen) * 3).to(dtype)
    a1, a3 = ((torch.randn(R, H, generator=gen) * 4).to(dtype) for _ in range(2))
    pair[0] = g
    d_a1, d_a3 = swiglu_backward(pair[0], a1, a3, pair[0], pair[1])
    assert d_a1.data_ptr() == pair.data_ptr() and d_a3.data_ptr() == pair[1].data_ptr()
    ref1, ref3 = swiglu_backward_reference(g, a1, a3)
    for got, ref in ((d_a1, ref1), (d_a3, ref3)):
        assert ((got.float() - ref).norm() / ref.norm()).item() < tol
    # side by side in one (R, 2H) buffer: the same bits, g kept
    stacked = torch.full((R, 2 * H), float("nan"), dtype=dtype)
    g_kept = g.clone()
    swiglu_backward(g_kept, a1, a3, stacked[:, :H], stacked[:, H:])
    assert torch.equal(stacked[:, :H], d_a1) and torch.equal(stacked[:, H:], d_a3) and torch.equal(g_kept, g)
    # negative control: a1 and a3 swapped is far off
    pair[0] = g
    wrong, _ = swiglu_backward(pair[0], a3, a1, pair[0], pair[1])
    assert ((wrong.float() - ref1).norm() / ref1.norm()).item() > 0.1


def test_rejects_buffers_of_the_wrong_shape():
    e = torch.empty
    inputs = r"g, a1 and a3 must be contiguous \(R, H\) tensors of one dtype"
    with pytest.raises(ValueError, match=rf"{inputs}; got g \(4, 5\) torch.float32, a1 \(4, 6\)"):
        swiglu_backward(e(4, 5), e(4, 6), e(4, 5), e(4, 5), e(4, 5))
    with pytest.raises(ValueError, match=inputs):
        swiglu_backward(e(4, 5), e(4, 5), e(4, 5).half(), e(4, 5), e(4, 5))
    with pytest.raises(ValueError, match=inputs):
        swiglu_backward(e(5, 4).t(), e(4, 5), e(4, 5), e(4, 5), e(4, 5))
    outputs = r"d_a1 and d_a3 must be \(4, 5\) in torch.float32 with unit column stride and one row stride"
    with pytest.raises(ValueError, match=rf"{outputs}; got d_a1 \(4, 5\) torch.float32 strides \(1, 4\)"):
        swiglu_backward(e(4, 5), e(4, 5), e(4, 5), e(5, 4).t(), e(4, 5))
    with pytest.raises(ValueError, match=outputs):  # two row strides
        swiglu_backward(e(4, 5), e(4, 5), e(4, 5), e(4, 10)[:, :5], e(4, 5))
    with pytest.raises(ValueError, match=outputs):
        swiglu_backward(e(4, 5), e(4, 5), e(4, 5), e(4, 5), e(4, 6))
    offsets = row_tiles(torch.tensor([4]), 16, 4)
    with pytest.raises(ValueError, match=r"out must be a contiguous \(4, 6\) tensor, for PLAIN or DUAL"):
        grouped_gemm(torch.randn(4, 5), torch.randn(1, 6, 5), offsets, 4, transpose_w=True,
                     tiles=GemmTiles(16, 16, 16), out=torch.empty(4, 7))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_separate_launches_give_the_bits_of_the_fused_epilogue(dtype):
    """The down input gradient as a plain GEMM (wide tiles) plus this launch, and as one
    GEMM with the SwiGLU backward in its epilogue (the megakernel's): the gradient of h is
    rounded to the storage dtype in both, so the bits agree (fp16: the rounding matters)."""
    gen = torch.Generator().manual_seed(4)
    T, K, E, D, H = 11, 2, 4, 32, 48
    _, _, counts = make_routing(T, K, E, "skewed", gen)
    P = T * K
    grad_y = torch.randn(P, D, generator=gen).to(dtype)
    w2 = (torch.randn(E, D, H, generator=gen) * 0.3).to(dtype)
    a1, a3 = (torch.randn(P, H, generator=gen).to(dtype) for _ in range(2))
    offsets = row_tiles(counts, 16, P)
    fused = grouped_gemm(grad_y, w2, offsets, P, transpose_w=False, tiles=GemmTiles(16, 16, 16, num_programs=3),
                         mode=SWIGLU_BWD, aux=(a1, a3))
    pair = grad_y.new_empty(2, P, H)
    # the same tile width: the interpreter's float32 matmul may round a 16- and a 32-wide
    # tile's dots differently (seen with numpy 2.4 on OpenBLAS), a GPU's tensor cores not
    grouped_gemm(grad_y, w2, offsets, P, transpose_w=False, tiles=GemmTiles(16, 16, 16, num_programs=2), mode=PLAIN,
                 out=pair[0])
    separate = swiglu_backward(pair[0], a1, a3, pair[0], pair[1])
    assert torch.equal(fused[0], separate[0]) and torch.equal(fused[1], separate[1])
