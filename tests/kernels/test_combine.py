"""Fixed-order top-k combine and its backward against PyTorch autograd."""

import pytest
import torch

from uniep.kernels.combine import replicate_rows, tokens_input_grad, topk_combine, topk_combine_bwd
from uniep.rows import sum_topk_fp32


@pytest.mark.parametrize("T, K, D", [(7, 3, 40), (1, 1, 16), (5, 8, 2100)])  # D > one block of 2048
@pytest.mark.parametrize("weighted", [True, False])
def test_combine_forward_and_backward(T, K, D, weighted):
    gen = torch.Generator().manual_seed(T * K + D)
    rows = torch.randn(T * K, D, generator=gen, requires_grad=True)
    weights = torch.rand(T, K, generator=gen, requires_grad=True) if weighted else None
    grad = torch.randn(T, D, generator=gen)

    out = topk_combine(rows.detach(), None if weights is None else weights.detach(), K)
    ref = sum_topk_fp32(rows.view(T, K, D), weights)
    assert torch.equal(out, ref)  # same fp32 ops in the same order

    ref.backward(grad)
    grad_rows, grad_w = topk_combine_bwd(grad, rows.detach(), None if weights is None else weights.detach(), K)
    torch.testing.assert_close(grad_rows, rows.grad, rtol=1e-6, atol=1e-6)
    if weighted:
        torch.testing.assert_close(grad_w, weights.grad, rtol=1e-5, atol=1e-5)
    else:
        assert grad_w is None


def test_weight_gradient_only():
    gen = torch.Generator().manual_seed(9)
    rows, weights, grad = torch.randn(12, 40, generator=gen), torch.rand(4, 3, generator=gen), torch.randn(4, 40, generator=gen)
    full = topk_combine_bwd(grad, rows, weights, 3)
    grad_rows, grad_w = topk_combine_bwd(grad, rows, weights, 3, write_rows=False)
    assert grad_rows is None and torch.equal(grad_w, full[1])


def test_backward_rows_in_another_order():
    """``row_of_pair``: pair p's gradient row lands at row row_of_pair[p], the same bits;
    the weights' gradient does not change."""
    gen = torch.Generator().manual_seed(4)
    T, K, D = 5, 3, 24
    rows, weights, grad = torch.randn(T * K, D, generator=gen), torch.rand(T, K, generator=gen), torch.randn(T, D, generator=gen)
    row_of_pair = torch.randperm(T * K, generator=gen)
    plain_rows, plain_w = topk_combine_bwd(grad, rows, weights, K)
    moved_rows, moved_w = topk_combine_bwd(grad, rows, weights, K, row_of_pair=row_of_pair)
    assert torch.equal(moved_rows[row_of_pair], plain_rows) and torch.equal(moved_w, plain_w)
    assert not torch.equal(moved_rows, plain_rows)  # the order did change


@pytest.mark.parametrize("T, K, D", [(6, 4, 40), (3, 1, 2100)])
def test_replicate_rows_is_the_gather_of_the_pairs_tokens(T, K, D):
    """Each token's row lands, bitwise, at its K pairs' rows: the gather
    ``x[order // K]`` for the permutation whose inverse is given; given ``order``
    itself (the wrong map) the rows differ."""
    gen = torch.Generator().manual_seed(T + K + D)
    x = torch.randn(T, D, generator=gen).to(torch.bfloat16)
    order = torch.randperm(T * K, generator=gen)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(T * K)
    assert torch.equal(replicate_rows(x, K, inverse), x.index_select(0, order // K))
    if K > 1:
        assert not torch.equal(replicate_rows(x, K, order), x.index_select(0, order // K))
    with pytest.raises(ValueError, match="row_of_pair has shape"):
        replicate_rows(x, K, inverse[1:])


def test_replicate_rows_scales_each_copy_by_its_pairs_score():
    """With scores: copy k of token t is ``x[t] * scale[t, k]`` in fp32, rounded to x's
    dtype (what the GEMMs read when scores come before the experts); scales given in
    the other order (k, t) give other rows; a wrong scale dtype is refused."""
    gen = torch.Generator().manual_seed(7)
    T, K, D = 6, 3, 40
    x = torch.randn(T, D, generator=gen).half()  # (the interpreter rounds to bf16 differently from a GPU)
    scale = torch.rand(T, K, generator=gen)
    order = torch.randperm(T * K, generator=gen)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(T * K)
    expected = (x.index_select(0, order // K).float() * scale.reshape(-1)[order, None]).half()
    assert torch.equal(replicate_rows(x, K, inverse, scale), expected)
    assert not torch.equal(replicate_rows(x, K, inverse, scale.t().contiguous().view(T, K)), expected)
    with pytest.raises(ValueError, match="scale_TK must be float32"):
        replicate_rows(x, K, inverse, scale.double())


@pytest.mark.parametrize("weighted", [True, False])
def test_rows_read_in_another_order(weighted):
    """``rows_row_of_pair``: pair p read from row rows_row_of_pair[p] gives the bits of
    the rows put in (token, k) order first, forward, backward and the input-gradient
    sum; read unmapped, the same rows give other sums."""
    gen = torch.Generator().manual_seed(11)
    T, K, D = 6, 3, 40
    rows, grad = torch.randn(T * K, D, generator=gen), torch.randn(T, D, generator=gen)
    weights = torch.rand(T, K, generator=gen) if weighted else None
    row_of_pair = torch.randperm(T * K, generator=gen)
    in_pair_order = rows[row_of_pair]
    assert torch.equal(topk_combine(rows, weights, K, rows_row_of_pair=row_of_pair),
                       topk_combine(in_pair_order, weights, K))
    assert not torch.equal(topk_combine(rows, weights, K), topk_combine(in_pair_order, weights, K))
    if weighted:
        mapped = topk_combine_bwd(grad, rows, weights, K, row_of_pair=row_of_pair, rows_row_of_pair=row_of_pair)
        plain = topk_combine_bwd(grad, in_pair_order, weights, K, row_of_pair=row_of_pair)
        assert torch.equal(mapped[0], plain[0]) and torch.equal(mapped[1], plain[1])
    x = torch.randn(T, D, generator=gen)
    scores = torch.rand(T, K, generator=gen)
    for before in (True, False):
        got = tokens_input_grad(rows, x, scores, before, rows_row_of_pair=row_of_pair)
        want = tokens_input_grad(in_pair_order, x, scores, before)
        assert torch.equal(got[0], want[0])
        assert (got[1] is None and want[1] is None) or torch.equal(got[1], want[1])
