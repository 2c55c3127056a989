"""The shared experts' fused launches (``uniep.shared_experts``, the CUDA path; here in
the Triton interpreter): the module's values and gradients with the routed output and
the rest of the layer's input gradient summed in place, each row's bits independent of
the batch, no separate adds in the layer, and the layer using them exactly where its
experts run on Triton."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from uniep import UniEPConfig, UniEPMoE
from uniep.batch_invariant import DEFAULT_ROWS_PER_BLOCK
from uniep.experts import FeedForward
from uniep.shared_experts import MODULE_SHARED_EXPERTS, FusedSharedExperts, add_shared_output, shared_hidden
from uniep.streams import ONE_STREAM


def _ffn(dim=24, hidden=40, seed=0):
    torch.manual_seed(seed)
    ffn = FeedForward(dim, hidden)
    ffn.init_weights(0.05)
    return ffn


def _fused(x, ffn, routed_of):
    """The layer's order: the hidden part, ``routed_of`` on the x handed on, the output part."""
    h_pad, logits, x_on = shared_hidden(x, ffn)
    assert logits is None
    return add_shared_output(h_pad, ffn, routed_of(x_on))


def _module(x, ffn, routed_of):
    return ffn(x) + routed_of(x)


def _fwd_bwd(fn, ffn, x, grad, routed_of):
    """Output, input gradient and the three weights' gradients."""
    xi = x.clone().requires_grad_(True)
    ffn.zero_grad(set_to_none=True)
    out = fn(xi, ffn, routed_of)
    out.backward(grad)
    return [out.detach(), xi.grad] + [getattr(ffn, name).weight.grad for name in ("w1", "w2", "w3")]


def _routed_of(x):
    """A stand-in for the router and routed experts: a fresh output, and an input
    gradient through x (exact: doubling rounds nothing, so rows stay batch-independent)."""
    return x * 2.0


@pytest.mark.parametrize("tokens", [DEFAULT_ROWS_PER_BLOCK, 2 * DEFAULT_ROWS_PER_BLOCK + 37, 5])
def test_values_and_gradients_of_the_module(tokens):
    """float32 against the module plus the routed part under autograd (float64 as the
    reference, the module in float32 as the yardstick): one full block, the padded last
    block, fewer rows than one."""
    ffn = _ffn()
    x = torch.randn(tokens, 24)
    grad = torch.randn(tokens, 24)
    got = _fwd_bwd(_fused, ffn, x, grad, _routed_of)
    module = _fwd_bwd(_module, ffn, x, grad, _routed_of)
    ref = _fwd_bwd(_module, ffn.double(), x.double(), grad.double(), _routed_of)
    ffn.float()
    assert got[0].shape == (tokens, 24)
    for g, m, r in zip(got, module, ref):
        err, module_err = (g.double() - r).abs().max(), (m.double() - r).abs().max()
        assert err <= max(4 * module_err, 1e-6 * r.abs().max()), (err, module_err)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("tokens", [DEFAULT_ROWS_PER_BLOCK, 37])
def test_the_routers_logits_and_their_gradients(tokens, bias):
    """With a gate: its logits have the bits of the gate's GEMM on fixed row blocks, and a
    loss through them (here a weighted sum) gives x, the gate (and its bias) the
    gradients of the module's (float64 reference, the module in float32 as the yardstick)."""
    from uniep.batch_invariant import blocked_mm, padded_to_blocks

    ffn = _ffn()
    torch.manual_seed(1)
    gate = torch.nn.Linear(24, 6, bias=bias)
    x, grad, grad_logits = torch.randn(tokens, 24), torch.randn(tokens, 24), torch.randn(tokens, 6)
    params = [gate.weight] + ([gate.bias] if bias else []) + [ffn.w1.weight, ffn.w2.weight, ffn.w3.weight]

    def run(fused, dtype):
        for p in params:
            p.grad = None
        xi = x.to(dtype).clone().requires_grad_(True)
        if fused:
            h_pad, logits, x_on = shared_hidden(xi, ffn, gate)
            out = add_shared_output(h_pad, ffn, _routed_of(x_on))
        else:
            logits, out = gate(xi), _module(xi, ffn, _routed_of)
        (out * grad.to(dtype)).sum().add((logits * grad_logits.to(dtype)).sum()).backward()
        return [logits.detach(), out.detach(), xi.grad] + [p.grad.clone() for p in params]

    got, module = run(True, torch.float32), run(False, torch.float32)
    with torch.no_grad():
        x_pad = padded_to_blocks(x, DEFAULT_ROWS_PER_BLOCK)
        blocked = blocked_mm(x_pad, gate.weight.t(), x_pad.new_empty(x_pad.shape[0], 6), DEFAULT_ROWS_PER_BLOCK,
                             gate.bias)
        assert torch.equal(got[0], blocked[:tokens])
    for m in (ffn, gate):
        m.double()
    ref = run(False, torch.float64)
    for m in (ffn, gate):
        m.float()
    for g, m, r in zip(got, module, ref):
        err, module_err = (g.double() - r).abs().max(), (m.double() - r).abs().max()
        assert err <= max(4 * module_err, 1e-6 * r.abs().max()), (err, module_err)
    # negative control: the logits' gradient left out of the input gradient is far off
    x_alone = x.clone().requires_grad_(True)
    h_pad, logits, x_on = shared_hidden(x_alone, ffn, gate)
    (add_shared_output(h_pad, ffn, _routed_of(x_on)) * grad).sum().backward()
    assert not torch.allclose(x_alone.grad, got[2], rtol=1e-3, atol=1e-4)


def test_the_sums_take_the_routed_parts():
    """Negative controls: the output without the routed part, and an input gradient
    without the part that came through x, are far from the module's."""
    ffn = _ffn()
    x, grad = torch.randn(40, 24), torch.randn(40, 24)
    module = _fwd_bwd(_module, ffn, x, grad, _routed_of)
    got = _fwd_bwd(_fused, ffn, x, grad, _routed_of)
    torch.testing.assert_close(got[0], module[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got[1], module[1], rtol=1e-5, atol=1e-6)
    alone = _fwd_bwd(_fused, ffn, x, grad, lambda t: torch.zeros_like(t) + 0 * t)
    assert not torch.allclose(alone[0], module[0], rtol=1e-3, atol=1e-4)
    assert not torch.allclose(alone[1], module[1], rtol=1e-3, atol=1e-4)


def test_each_row_is_independent_of_the_batch():
    """Output and input gradient of a row: the same bits in any split of the batch
    (13 and 77 rows leave a partial last block, summed on a padded copy)."""
    ffn = _ffn()
    x = torch.randn(300, 24)
    grad = torch.randn(300, 24)
    whole = _fwd_bwd(_fused, ffn, x, grad, _routed_of)[:2]
    for size in (13, 77, 256):
        parts = [_fwd_bwd(_fused, ffn, xp, gp, _routed_of)[:2] for xp, gp in zip(x.split(size), grad.split(size))]
        assert torch.equal(torch.cat([p[0] for p in parts]), whole[0]), size
        assert torch.equal(torch.cat([p[1] for p in parts]), whole[1]), size


def test_a_wrong_variant_is_caught():
    """Negative control: w1 and w3 swapped changes the values the first test checks."""
    ffn = _ffn()
    x = torch.randn(40, 24)
    swapped = _ffn()
    with torch.no_grad():
        swapped.w1.weight.copy_(ffn.w3.weight)
        swapped.w3.weight.copy_(ffn.w1.weight)
        assert not torch.allclose(_fused(x, swapped, _routed_of), _module(x, ffn, _routed_of), rtol=1e-3, atol=1e-5)
        torch.testing.assert_close(_fused(x, ffn, _routed_of), _module(x, ffn, _routed_of), rtol=1e-5, atol=1e-6)


def test_a_frozen_input_gets_no_gradient_and_the_weights_theirs():
    """x without grad: the x handed on needs none either (the rest of the layer computes
    no input gradient), and the weights' gradients are the module's."""
    ffn = _ffn()
    x, grad = torch.randn(30, 24), torch.randn(30, 24)
    h_pad, _, x_on = shared_hidden(x, ffn)
    assert not x_on.requires_grad and h_pad.requires_grad
    add_shared_output(h_pad, ffn, _routed_of(x_on)).backward(grad)
    got = [getattr(ffn, name).weight.grad for name in ("w1", "w2", "w3")]
    ref = _fwd_bwd(_module, ffn, x, grad, _routed_of)[2:]
    for g, r in zip(got, ref):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6)


def test_bad_input_is_refused():
    ffn = _ffn()
    with pytest.raises(ValueError, match="x and the weights must share a dtype; got x torch.float64"):
        shared_hidden(torch.randn(4, 24, dtype=torch.float64), ffn)
    with pytest.raises(ValueError, match="share a dtype; got x torch.float32, w1 torch.float32, .*gate torch.float64"):
        shared_hidden(torch.randn(4, 24), ffn, torch.nn.Linear(24, 4, dtype=torch.float64))
    h_pad, _, _ = shared_hidden(torch.randn(4, 24), ffn)
    with pytest.raises(ValueError, match=r"the routed output must be \(tokens, 24\) in torch.float32; got \(4, 25\)"):
        add_shared_output(h_pad, ffn, torch.randn(4, 25))


def _layer(backend="triton"):
    torch.manual_seed(0)
    layer = UniEPMoE(24, 16, 4, 2, num_shared_experts=2, config=UniEPConfig(backend=backend))
    layer.init_weights(0.05)
    return layer


def _layer_fwd_bwd(layer, x, grad):
    layer.zero_grad(set_to_none=True)
    xi = x.clone().requires_grad_(True)
    out = layer(xi)
    out.backward(grad)
    return [out.detach(), xi.grad] + [p.grad.clone() for _, p in sorted(layer.named_parameters())]


class _TokenAdds(TorchDispatchMode):
    """Counts the adds of (tokens, dim) tensors, forward and backward."""

    def __init__(self, shape):
        super().__init__()
        self.shape, self.count = shape, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket in (torch.ops.aten.add, torch.ops.aten.add_) and tuple(out.shape) == self.shape:
            self.count += 1
        return out


@pytest.mark.parametrize("fused, groups, adds", [(True, None, 0), (True, 2, 1), (False, None, 3)])
def test_the_layer_sums_its_three_parts_in_the_gemms(fused, groups, adds):
    """Fused: the output and the input gradient are summed inside the GEMMs, no (T, D)
    add is left; with node-limited groups (a router that is not fused, so it computes
    its own logits) one: autograd's, of the router's and routed experts' input
    gradients. Control: the module and an add, 3 (the output; the input gradient's three
    parts). All give the module's values."""
    torch.manual_seed(0)
    layer = UniEPMoE(24, 16, 4, 2, num_shared_experts=2, num_expert_groups=groups, num_limited_groups=groups,
                     config=UniEPConfig(backend="triton"))
    layer.init_weights(0.05)
    assert layer.router.fused == (groups is None)
    x, grad = torch.randn(2, 9, 24), torch.randn(2, 9, 24)
    reference = _layer_fwd_bwd(layer, x, grad) if fused else None
    layer._shared = FusedSharedExperts(ONE_STREAM, router_logits=True) if fused else MODULE_SHARED_EXPERTS
    counter = _TokenAdds((18, 24))
    with counter:
        got = _layer_fwd_bwd(layer, x, grad)
    assert counter.count == adds
    if fused:  # the same bits as the layer's own choice, and the module's values
        assert all(torch.equal(a, b) for a, b in zip(reference, got))
        layer._shared = MODULE_SHARED_EXPERTS
        for a, b in zip(got, _layer_fwd_bwd(layer, x, grad)):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_activation_checkpointing_recomputes_the_same_bits():
    layer = _layer()
    x, grad = torch.randn(2, 9, 24), torch.randn(2, 9, 24)
    plain = _layer_fwd_bwd(layer, x, grad)

    layer.zero_grad(set_to_none=True)
    xi = x.clone().requires_grad_(True)
    out = torch.utils.checkpoint.checkpoint(layer, xi, use_reentrant=False)
    out.backward(grad)
    checkpointed = [out.detach(), xi.grad] + [p.grad.clone() for _, p in sorted(layer.named_parameters())]
    assert len(checkpointed) == len(plain)
    assert all(torch.equal(a, b) for a, b in zip(plain, checkpointed))


@pytest.mark.parametrize("backend, fused", [("triton", True), ("torch", False), ("auto", False)])
def test_the_layer_fuses_its_shared_experts_where_its_experts_run_on_triton(monkeypatch, backend, fused):
    """backend triton (here: the interpreter) takes the fused launches; torch, and auto on
    the CPU, the module on row blocks. Both give the module's values."""
    import uniep.shared_experts as shared_experts

    calls = []
    real = shared_experts.shared_hidden
    monkeypatch.setattr(shared_experts, "shared_hidden", lambda x, *a: calls.append(x.shape) or real(x, *a))
    layer = _layer(backend)
    assert isinstance(layer._shared, FusedSharedExperts) == fused
    x = torch.randn(2, 9, 24)
    layer(x).sum().backward()
    assert (calls == [(18, 24)]) == fused
