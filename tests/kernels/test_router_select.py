"""The router's fused choice (``uniep.kernels.router_select``, here under the Triton
interpreter) against the router's PyTorch path: the same experts, scores and gradients
(float64 inputs), each token's bits independent of the batch, a replayed routing, ties,
and a deliberately wrong backward that the comparison must catch."""

import pytest
import torch

from uniep.kernels import router_select as rs
from uniep.router import TopKRouter

CASES = [  # score_func, route_norm, route_scale, bias, E, K
    ("softmax", True, 1.0, False, 16, 4),
    ("softmax", False, 1.0, True, 128, 8),
    ("sigmoid", False, 2.5, True, 24, 3),
    ("sigmoid", True, 1.0, True, 8, 8),
]


def _router(score_func, route_norm, route_scale, E, K, dtype=torch.float64):
    torch.manual_seed(0)
    router = TopKRouter(32, E, K, score_func=score_func, route_norm=route_norm, route_scale=route_scale).to(dtype)
    torch.nn.init.normal_(router.gate.weight, std=0.3)
    return router


def _run(router, x, bias, grad_TE, fused):
    """Scores, experts, x's and the gate's gradients of ``sum(top[t, k] * grad[t, idx[t, k]])``."""
    router.fused = fused
    xi = x.clone().requires_grad_(True)
    router.gate.weight.grad = None
    top, idx = router(xi, bias)
    (top * grad_TE.gather(1, idx)).sum().backward()
    return top, idx, xi.grad, router.gate.weight.grad


def mismatches(router, x, bias, grad_TE) -> list[str]:
    """What differs between the fused choice and the PyTorch path (k in any order)."""
    top, idx, gx, gw = _run(router, x, bias, grad_TE, fused=True)
    ref_top, ref_idx, ref_gx, ref_gw = _run(router, x, bias, grad_TE, fused=False)
    order, ref_order = idx.sort(1), ref_idx.sort(1)
    wrong = []
    if not torch.equal(order.values, ref_order.values):
        wrong.append("experts")
    checks = {"scores": (top.double().gather(1, order.indices), ref_top.gather(1, ref_order.indices)),
              "grad x": (gx, ref_gx), "grad gate": (gw, ref_gw)}
    for name, (a, b) in checks.items():
        if not torch.allclose(a.double(), b.double(), rtol=1e-5, atol=1e-6):
            wrong.append(name)
    return wrong


@pytest.mark.parametrize("case", CASES)
def test_same_choice_scores_and_gradients_as_pytorch(case):
    score_func, route_norm, route_scale, with_bias, E, K = case
    router = _router(score_func, route_norm, route_scale, E, K)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(37, 32, dtype=torch.float64, generator=gen)
    bias = torch.randn(E, dtype=torch.float64, generator=gen) * 0.1 if with_bias else None
    grad = torch.randn(37, E, dtype=torch.float64, generator=gen)
    assert mismatches(router, x, bias, grad) == []


def test_a_backward_without_the_route_norm_is_caught(monkeypatch):
    """Negative control: the backward kernel told the scores were not normalized."""
    real = rs._router_select_backward_kernel

    class WithoutNorm:
        def __getitem__(self, grid):
            return lambda *args, **kw: real[grid](*args, **{**kw, "ROUTE_NORM": False})

    monkeypatch.setattr(rs, "_router_select_backward_kernel", WithoutNorm())
    router = _router("softmax", True, 1.0, 16, 4)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(37, 32, dtype=torch.float64, generator=gen)
    grad = torch.randn(37, 16, dtype=torch.float64, generator=gen)
    assert mismatches(router, x, None, grad) == ["grad x", "grad gate"]


def test_each_token_is_independent_of_the_batch():
    """Scores, experts and logits gradients of each token bit for bit the same whether
    it comes in a batch of 37, 5 or 1 tokens."""
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(37, 24, generator=gen)
    bias = torch.randn(24, generator=gen) * 0.1
    grad = torch.randn(37, 3, generator=gen)

    def run(rows):
        settings = dict(sigmoid=False, route_norm=True, route_scale=1.0)
        top, idx = rs.router_select_forward(logits[rows], 3, expert_bias_E=bias, **settings)
        return top, idx, rs.router_select_backward(logits[rows], idx, grad[rows], **settings)

    whole = run(slice(0, 37))
    for size in (5, 1):
        parts = [run(slice(i, min(i + size, 37))) for i in range(0, 37, size)]
        for a, b in zip(whole, (torch.cat(p) for p in zip(*parts))):
            assert torch.equal(a, b), size


@pytest.mark.parametrize("with_gate_bias, tiles", [(False, rs.GATE_TILES), (True, rs.GATE_TILES),
                                                   (False, rs.GateTiles(rows=16, block_k=32, num_warps=4, num_stages=2))])
def test_the_gate_launch_computes_the_linear_layer_and_each_token_alone(with_gate_bias, tiles):
    """``router_gate_select``'s logits are the gate's ``x @ W^T + b`` (float64), its choice
    that of ``router_select_forward`` on them, and every output of a token bit for bit
    the same in a batch of 70 (three programs by default), 5 or 1 tokens, with the
    default tiles and others."""
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(70, 96, dtype=torch.float64, generator=gen)
    weight = torch.randn(24, 96, dtype=torch.float64, generator=gen) * 0.2
    gate_bias = torch.randn(24, dtype=torch.float64, generator=gen) if with_gate_bias else None
    expert_bias = torch.randn(24, generator=gen) * 0.1
    settings = dict(sigmoid=True, route_norm=True, route_scale=1.5, expert_bias_E=expert_bias)

    def run(rows):
        return rs.router_gate_select(x[rows], weight, gate_bias, 3, tiles=tiles, **settings)

    top, idx, logits = whole = run(slice(0, 70))
    expected = x @ weight.t() + (0 if gate_bias is None else gate_bias)
    torch.testing.assert_close(logits, expected, rtol=1e-12, atol=1e-12)
    assert not torch.allclose(logits, x @ weight.t().flip(1))  # control: another expert order
    ref_top, ref_idx = rs.router_select_forward(logits, 3, **settings)
    assert torch.equal(idx, ref_idx) and torch.equal(top, ref_top)
    for size in (5, 1):
        parts = [run(slice(i, min(i + size, 70))) for i in range(0, 70, size)]
        for a, b in zip(whole, (torch.cat(p) for p in zip(*parts))):
            assert torch.equal(a, b), size


def test_a_replayed_routing_gives_the_choice_s_own_scores():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(20, 16, generator=gen)
    top, idx = rs.router_select_forward(logits, 4, sigmoid=True, route_norm=True, route_scale=1.0)
    again, same = rs.router_select_forward(logits, 4, sigmoid=True, route_norm=True, route_scale=1.0, topk_idx_TK=idx)
    assert torch.equal(same, idx) and torch.equal(again, top)
    flipped, _ = rs.router_select_forward(logits, 4, sigmoid=True, route_norm=True, route_scale=1.0,
                                  topk_idx_TK=idx.flip(1))
    torch.testing.assert_close(flipped, top.flip(1), rtol=1e-6, atol=0)  # (the norm's sum in another order)


def test_descending_ties_to_the_lower_expert_and_nan_first():
    nan = float("nan")
    logits = torch.tensor([[0.0, 2.0, 2.0, 1.0, 2.0], [nan] * 5, [0.0, 3.0, nan, 1.0, 2.0]])
    _, idx = rs.router_select_forward(logits, 3, sigmoid=True, route_norm=False, route_scale=1.0)
    assert idx.tolist() == [[1, 2, 4], [0, 1, 2], [2, 1, 4]]


def test_no_tokens_and_bad_input():
    top, idx = rs.router_select_forward(torch.empty(0, 8), 2, sigmoid=False, route_norm=True, route_scale=1.0)
    assert top.shape == idx.shape == (0, 2)
    with pytest.raises(ValueError, match="top_k"):
        rs.router_select_forward(torch.zeros(3, 4), 5, sigmoid=False, route_norm=False, route_scale=1.0)


def test_the_router_fuses_only_without_node_limited_groups():
    router = TopKRouter(32, 16, 2, num_expert_groups=4, num_limited_groups=2)
    router.fused = True
    assert not router.fused
    router = TopKRouter(32, 16, 2)
    router.fused = True
    assert router.fused


def _fused_router_inputs(seed):
    """A fused float32 router (sigmoid, route norm, scale 2.5; 16 experts, top 4), 21
    tokens, an expert bias, the top scores' gradient, and the generator that drew them."""
    router = _router("sigmoid", True, 2.5, 16, 4, dtype=torch.float32)
    router.fused = True
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(21, 32, generator=gen)
    bias = torch.randn(16, generator=gen) * 0.1
    return router, x, bias, torch.randn(21, 4, generator=gen), gen


def test_compiled_router_keeps_the_eager_bits():
    """Under torch.compile (fullgraph) the fused router runs as the custom ops
    ``uniep::router_choice`` / ``_bwd``: the same launches, so the eager bits, for a
    chosen and for a replayed routing."""
    router, x, bias, grad, _ = _fused_router_inputs(4)
    compiled = torch.compile(router, fullgraph=True, backend="aot_eager")

    def run(fn, given=None):
        xi = x.clone().requires_grad_(True)
        router.gate.weight.grad = None
        top, idx = fn(xi, bias, given)
        top.backward(grad)
        return top, idx, xi.grad, router.gate.weight.grad

    eager = run(router)
    for given in (None, eager[1].flip(1)):
        again = run(router, given)
        assert all(torch.equal(a, b) for a, b in zip(run(compiled, given), again))


def test_a_gate_with_bias_gets_its_gradient():
    """The gate's bias (TorchTitan's ``gate_bias``) in the fused path: values and the
    bias gradient of the PyTorch path."""
    torch.manual_seed(0)
    router = TopKRouter(32, 16, 4, score_func="softmax", route_norm=True, gate_bias=True).double()
    torch.nn.init.normal_(router.gate.bias, std=0.3)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(19, 32, dtype=torch.float64, generator=gen)
    grad = torch.randn(19, 16, dtype=torch.float64, generator=gen)
    bias_grads = []
    for fused in (True, False):
        router.gate.bias.grad = None
        _run(router, x, None, grad, fused)
        bias_grads.append(router.gate.bias.grad.clone())
    assert mismatches(router, x, None, grad) == []
    torch.testing.assert_close(bias_grads[0], bias_grads[1], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("replayed", [False, True])
def test_the_choice_of_given_logits_is_the_fused_routers(replayed):
    """Logits computed elsewhere (the shared experts' launches): given the fused router's
    own logits, its scores, choice and bits, and the logits' gradient, which the gate's
    GEMM turns into the router's input gradient. Only the fused router takes them."""
    router, x, bias, grad, gen = _fused_router_inputs(6)
    given = torch.randint(0, 16, (21, 1), generator=gen).add(torch.arange(4)).remainder(16) if replayed else None
    xi = x.clone().requires_grad_(True)
    top, idx = router(xi, bias, given)
    top.backward(grad)
    with torch.no_grad():
        logits = rs.router_gate_select(x, router.gate.weight, router.gate.bias, 4, sigmoid=router.score_func == "sigmoid",
                                       route_norm=router.route_norm, route_scale=router.route_scale)[2]
    logits.requires_grad_(True)
    top_of_logits, idx_of_logits = router(x, bias, given, logits_TE=logits)
    top_of_logits.backward(grad)
    assert torch.equal(top_of_logits, top) and torch.equal(idx_of_logits, idx)
    torch.testing.assert_close(logits.grad @ router.gate.weight.detach(), xi.grad, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(logits.grad.flip(0) @ router.gate.weight.detach(), xi.grad)  # control
    router.fused = False
    with pytest.raises(ValueError, match="logits_TE is taken by the fused router only"):
        router(x, bias, given, logits_TE=logits)


def test_the_gate_launch_refuses_mismatched_inputs():
    x = torch.randn(5, 32)
    with pytest.raises(ValueError, match="must share a dtype"):
        rs.router_gate_select(x, torch.randn(8, 32, dtype=torch.float64), None, 2, sigmoid=True, route_norm=False,
                              route_scale=1.0)
    with pytest.raises(ValueError, match=r"expected \(8, 32\)"):
        rs.router_gate_select(x, torch.randn(8, 31), None, 2, sigmoid=True, route_norm=False, route_scale=1.0)


def test_gate_tiles_fit_the_expert_count_and_shared_memory():
    """Rows per program: 64 up to 128 experts, 32 above, a given count as given; stages:
    the most up to ``num_stages`` whose tiles fit the limit, at least one."""
    from uniep.kernels.grouped_gemm import H200_SMEM_PER_BLOCK, shared_memory_bytes

    assert [rs.gate_rows(rs.GATE_TILES, e) for e in (16, 128, 256, 512)] == [64, 64, 32, 32]
    assert rs.gate_rows(rs.GateTiles(rows=16), 512) == 16
    assert rs.gate_stages(rs.GATE_TILES, 128, 2, H200_SMEM_PER_BLOCK) == rs.GATE_TILES.num_stages
    limit = 100_000
    stages = rs.gate_stages(rs.GATE_TILES, 512, 2, limit)
    assert 1 <= stages < rs.GATE_TILES.num_stages
    assert shared_memory_bytes(32, 512, 64, stages, 2) <= limit < shared_memory_bytes(32, 512, 64, stages + 1, 2)
    assert rs.gate_stages(rs.GATE_TILES, 512, 2, 1) == 1
