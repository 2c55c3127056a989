"""The shared experts' fused launches (``uniep.shared_experts``, the CUDA path; here in
the Triton interpreter): the module's values and gradients, each row's bits independent
of the batch, and the layer using them exactly where its experts run on Triton."""

import pytest
import torch

from uniep import UniEPConfig, UniEPMoE
from uniep.batch_invariant import DEFAULT_ROWS_PER_BLOCK
from uniep.experts import FeedForward
from uniep.shared_experts import shared_swiglu


def _ffn(dim=24, hidden=40, seed=0):
    torch.manual_seed(seed)
    ffn = FeedForward(dim, hidden)
    ffn.init_weights(0.05)
    return ffn


def _fwd_bwd(fn, ffn, x, grad):
    xi = x.clone().requires_grad_(True)
    ffn.zero_grad(set_to_none=True)
    fn(xi, ffn).backward(grad)
    return [xi.grad] + [getattr(ffn, name).weight.grad for name in ("w1", "w2", "w3")]


@pytest.mark.parametrize("tokens", [DEFAULT_ROWS_PER_BLOCK, 2 * DEFAULT_ROWS_PER_BLOCK + 37, 5])
def test_values_and_gradients_of_the_module(tokens):
    """float32 against the module under autograd (float64 as the reference, the module in
    float32 as the yardstick): the padded last block, one full block, fewer rows than one."""
    ffn = _ffn()
    x = torch.randn(tokens, 24)
    grad = torch.randn(tokens, 24)
    out = shared_swiglu(x, ffn)
    ref64 = ffn.double()(x.double())
    got = _fwd_bwd(shared_swiglu, ffn.float(), x, grad)
    module = _fwd_bwd(lambda t, f: f(t), ffn, x, grad)
    ref = _fwd_bwd(lambda t, f: f(t), ffn.double(), x.double(), grad.double())
    ffn.float()
    assert out.shape == (tokens, 24)
    tol = 1e-5 * ref64.abs().max()
    assert (out.double() - ref64).abs().max() <= tol
    for g, m, r in zip(got, module, ref):
        err, module_err = (g.double() - r).abs().max(), (m.double() - r).abs().max()
        assert err <= max(4 * module_err, 1e-6 * r.abs().max()), (err, module_err)


def test_each_row_is_independent_of_the_batch():
    """Output and input gradient of a row: the same bits in any split of the batch."""
    ffn = _ffn()
    x = torch.randn(300, 24)
    grad = torch.randn(300, 24)
    whole_out = shared_swiglu(x, ffn).detach()
    whole_dx = _fwd_bwd(shared_swiglu, ffn, x, grad)[0]
    for size in (13, 77, 256):
        parts = [(shared_swiglu(xp, ffn).detach(), _fwd_bwd(shared_swiglu, ffn, xp, gp)[0])
                 for xp, gp in zip(x.split(size), grad.split(size))]
        assert torch.equal(torch.cat([p[0] for p in parts]), whole_out), size
        assert torch.equal(torch.cat([p[1] for p in parts]), whole_dx), size


def test_a_wrong_variant_is_caught():
    """Negative control: w1 and w3 swapped changes the values the first test checks."""
    ffn = _ffn()
    x = torch.randn(40, 24)
    swapped = _ffn()
    with torch.no_grad():
        swapped.w1.weight.copy_(ffn.w3.weight)
        swapped.w3.weight.copy_(ffn.w1.weight)
    assert not torch.allclose(shared_swiglu(x, swapped), ffn(x), rtol=1e-3, atol=1e-5)
    torch.testing.assert_close(shared_swiglu(x, ffn), ffn(x), rtol=1e-5, atol=1e-6)


def test_mixed_dtypes_are_refused():
    ffn = _ffn()
    with pytest.raises(ValueError, match="x and the weights must share a dtype; got x torch.float64"):
        shared_swiglu(torch.randn(4, 24, dtype=torch.float64), ffn)


@pytest.mark.parametrize("backend, fused", [("triton", True), ("torch", False), ("auto", False)])
def test_the_layer_fuses_its_shared_experts_where_its_experts_run_on_triton(monkeypatch, backend, fused):
    """backend triton (here: the interpreter) takes the fused launches; torch, and auto on
    the CPU, the module on row blocks. Both give the module's values."""
    import uniep.moe as moe

    calls = []
    real = moe.shared_swiglu
    monkeypatch.setattr(moe, "shared_swiglu", lambda x, ffn: calls.append(x.shape) or real(x, ffn))
    torch.manual_seed(0)
    layer = UniEPMoE(24, 16, 4, 2, num_shared_experts=2, config=UniEPConfig(backend=backend))
    layer.init_weights(0.05)
    x = torch.randn(2, 9, 24)
    shared = layer._shared_experts(x.view(18, 24))
    torch.testing.assert_close(shared, layer.shared_experts(x.view(18, 24)), rtol=1e-5, atol=1e-6)
    assert (calls == [(18, 24)]) == fused
    calls.clear()
    layer(x).sum().backward()
    assert (len(calls) == 1) == fused
