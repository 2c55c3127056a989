"""Router scores and shared experts give each token the same bits whatever the number of
rows around it (what expert parallelism needs: the batch is split across ranks); the
one-buffer row blocks (``blocked_mm``) and the gate's backward on them
(``blocked_linear_backward``) against ``nn.Linear``."""

import pytest
import torch

from uniep import UniEPMoE
from uniep.batch_invariant import (
    DEFAULT_ROWS_PER_BLOCK,
    blocked_linear_backward,
    blocked_mm,
    in_fixed_row_blocks,
    padded_to_blocks,
)


def blocked_linear(x_TD, weight_ND, bias_N, block):
    """``x @ weight^T + bias`` on fixed row blocks written into one buffer (as the shared
    experts compute the router's logits)."""
    x_pad = padded_to_blocks(x_TD, block)
    return blocked_mm(x_pad, weight_ND.t(), x_pad.new_empty(x_pad.shape[0], weight_ND.shape[0]), block,
                      bias_N)[:x_TD.shape[0]]


@pytest.mark.parametrize("fused_router", [False, True])
@pytest.mark.parametrize("score_func", ["sigmoid", "softmax"])
def test_scores_and_shared_experts_do_not_depend_on_the_batch(score_func, fused_router):
    torch.manual_seed(0)
    layer = UniEPMoE(24, 40, 8, 2, num_shared_experts=1, score_func=score_func)
    layer.init_weights(0.02)
    layer.router.fused = fused_router  # (the fused choice under the Triton interpreter)
    x = torch.randn(300, 24)  # more than one block, not a multiple of it
    with torch.no_grad():
        for fn in (lambda t: layer.router(t, layer.expert_bias)[0], lambda t: in_fixed_row_blocks(layer.shared_experts, t)):
            whole = fn(x)
            for size in (1, 10, 77):
                assert torch.equal(torch.cat([fn(part) for part in x.split(size)]), whole), size


def test_blocks_keep_values_shapes_and_gradients():
    x = torch.randn(DEFAULT_ROWS_PER_BLOCK + 3, 5, requires_grad=True)
    out = in_fixed_row_blocks(lambda t: t * 3.0 + 1.0, x)
    assert out.shape == x.shape and torch.equal(out, x * 3.0 + 1.0)
    out.sum().backward()
    assert torch.equal(x.grad, torch.full_like(x, 3.0))
    assert in_fixed_row_blocks(lambda t: t + 1, torch.empty(0, 5)).shape == (0, 5)


def test_then_runs_once_on_devices_whose_elementwise_ops_need_no_blocks(monkeypatch):
    """``then`` (the router's activation) runs per block where the device needs it (CPU)
    and once on the whole output on the devices in ``ELEMENTWISE_BATCH_INVARIANT`` (CUDA;
    forced here)."""
    import uniep.batch_invariant as bi

    rows_seen = []

    def then(t):
        rows_seen.append(t.shape[0])
        return t * 2.0

    x = torch.randn(2 * DEFAULT_ROWS_PER_BLOCK + 3, 5)
    assert torch.equal(in_fixed_row_blocks(lambda t: t + 1.0, x, then=then), (x + 1.0) * 2.0)
    assert rows_seen == [DEFAULT_ROWS_PER_BLOCK] * 3  # per block, the last one padded
    rows_seen.clear()
    monkeypatch.setattr(bi, "ELEMENTWISE_BATCH_INVARIANT", ("cpu",))
    assert torch.equal(in_fixed_row_blocks(lambda t: t + 1.0, x, then=then), (x + 1.0) * 2.0)
    assert rows_seen == [x.shape[0]]


@pytest.mark.parametrize("bias", [False, True])
def test_blocked_linear_is_the_linear_layer_on_row_blocks(bias):
    """float64 values and gradients of ``nn.Linear`` under autograd (over one, two and
    three blocks, the last padded); each row's output bits the same in any split of the
    batch."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(24, 8, bias=bias).double()
    weight, bias_N = linear.weight.detach(), None if linear.bias is None else linear.bias.detach()
    block = DEFAULT_ROWS_PER_BLOCK
    for rows in (5, block, 2 * block + 37):
        x = torch.randn(rows, 24, dtype=torch.float64, requires_grad=True)
        grad = torch.randn(rows, 8, dtype=torch.float64)
        linear.zero_grad(set_to_none=True)
        out = linear(x)
        out.backward(grad)
        expected = [out, x.grad, linear.weight.grad, linear.bias.grad if bias else None]
        got = [blocked_linear(x.detach(), weight, bias_N, block), *blocked_linear_backward(grad, x.detach(), weight, bias, block)]
        for a, b in zip(got, expected):
            assert a is b is None or torch.allclose(a, b, rtol=1e-12, atol=1e-12)
    x = torch.randn(300, 24, dtype=torch.float64)
    with torch.no_grad():
        whole = blocked_linear(x, weight, bias_N, block)
        assert torch.equal(torch.cat([blocked_linear(part, weight, bias_N, block) for part in x.split(77)]), whole)
