"""The fused Triton expert block (forward and every gradient) against the plain-PyTorch
path, and the UniEP layer with backend "triton" against TorchTitan's MoE."""

import pytest
import torch

from tests.kernels.routing import make_routing, order_and_inverse
from uniep import UniEPConfig, UniEPMoE
from uniep.experts import expert_mlp_torch
from uniep.kernels.fused_experts import fused_experts
from uniep.kernels.grouped_gemm import ExpertTiles, GemmTiles
from uniep.rows import sum_topk_fp32

TILES = GemmTiles(block_m=16, block_n=16, block_k=16, num_programs=3)


def reference(x, scores, order, counts, w1, w2, w3, score_before):
    T, K = scores.shape
    rows = x.repeat_interleave(K, 0)[order]
    if score_before:
        rows = rows * scores.reshape(-1)[order][:, None]
    out = expert_mlp_torch(rows, counts.tolist(), w1, w2, w3)
    y = torch.empty_like(out)
    y[order] = out
    return sum_topk_fp32(y.view(T, K, -1), None if score_before else scores)


def fwd_bwd(fn, inputs, grad):
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
    out = fn(*leaves)
    out.backward(grad)
    return [out.detach()] + [t.grad for t in leaves]


@pytest.mark.parametrize(
    "T, K, E, D, H, kind",
    [
        (13, 3, 5, 40, 24, "random"),  # odd sizes
        (10, 2, 6, 32, 16, "skewed"),  # empty experts
        (6, 1, 4, 16, 48, "one_expert"),  # all tokens on one expert, top-1
        (4, 8, 8, 16, 16, "random"),  # top-8 of 8
    ],
)
@pytest.mark.parametrize("score_before", [False, True])
def test_fused_matches_torch_path(T, K, E, D, H, kind, score_before):
    gen = torch.Generator().manual_seed(T * 7 + K)
    _, order, counts = make_routing(T, K, E, kind, gen)
    x = torch.randn(T, D, generator=gen)
    scores = torch.rand(T, K, generator=gen)
    w1, w3 = (torch.randn(E, H, D, generator=gen) * 0.2 for _ in range(2))
    w2 = torch.randn(E, D, H, generator=gen) * 0.2
    grad = torch.randn(T, D, generator=gen)

    def fused(x, s, a, b, c):
        return fused_experts(x, s, order_and_inverse(order), counts, a, b, c, score_before_experts=score_before,
                             tiles=ExpertTiles.uniform(TILES))

    def ref(x, s, a, b, c):
        return reference(x, s, order, counts, a, b, c, score_before)

    got = fwd_bwd(fused, [x, scores, w1, w2, w3], grad)
    expected = fwd_bwd(ref, [x, scores, w1, w2, w3], grad)
    for name, g, e in zip(["out", "x", "scores", "w1", "w2", "w3"], got, expected):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")


def small_problem(seed):
    """(routing order, counts, [x, scores, w1, w2, w3], grad of the output) of a small random layer."""
    gen = torch.Generator().manual_seed(seed)
    T, K, E, D, H = 12, 2, 4, 32, 16
    _, order, counts = make_routing(T, K, E, "random", gen)
    inputs = [torch.randn(T, D, generator=gen), torch.rand(T, K, generator=gen),
              torch.randn(E, H, D, generator=gen), torch.randn(E, D, H, generator=gen), torch.randn(E, H, D, generator=gen)]
    return order, counts, inputs, torch.randn(T, D, generator=gen)


def test_bitwise_across_program_counts():
    order, counts, inputs, grad = small_problem(1)
    runs = []
    for programs in (1, 5):
        tiles = GemmTiles(16, 16, 16, num_programs=programs)
        runs.append(fwd_bwd(
            lambda x, s, a, b, c: fused_experts(x, s, order_and_inverse(order), counts, a, b, c,
                                                score_before_experts=False, tiles=ExpertTiles.uniform(tiles)),
            inputs, grad,
        ))
    assert all(torch.equal(a, b) for a, b in zip(*runs))


def test_bad_weight_shapes_are_named():
    x, s = torch.randn(4, 16), torch.rand(4, 2)
    w = torch.randn(3, 8, 16)
    with pytest.raises(ValueError, match=r"weight shapes w1 \(3, 8, 16\), w2 \(3, 8, 16\), w3 \(3, 8, 16\) do not fit x of dim 16"):
        fused_experts(x, s, torch.arange(8).repeat(2, 1), torch.tensor([8, 0, 0]), w, w, w, score_before_experts=False,
                      tiles=ExpertTiles.uniform(TILES))


SMALL_TILES = dict(gemm_block_m=16, gemm_block_n=16, gemm_block_k=16, wgrad_block_m=16, wgrad_block_n=16, wgrad_block_k=16)


def titan_and_uniep(seed, backend, *, num_experts, num_shared_experts, score_before):
    """A TorchTitan MoE (dim 32, hidden 16, top-2) and a UniEP layer sharing its parameters."""
    moe = pytest.importorskip("torchtitan.models.moe", reason="the reference layer is TorchTitan's")
    MoE, MoEArgs = moe.MoE, moe.MoEArgs
    torch.manual_seed(seed)
    args = MoEArgs(num_experts=num_experts, num_shared_experts=num_shared_experts, top_k=2, score_func="softmax",
                   route_norm=True, score_before_experts=score_before)
    titan = MoE(args, dim=32, hidden_dim=16)
    with torch.no_grad():
        titan.init_weights(0.02, torch.device("cpu"))
    return titan, UniEPMoE.from_torchtitan(titan, UniEPConfig(backend=backend, num_programs=2, **SMALL_TILES))


@pytest.mark.parametrize(
    "x, scores, message",
    [
        (torch.randn(2, 4, 16), torch.rand(8, 2), r"x must be \(tokens, dim\); got shape \(2, 4, 16\)"),
        (torch.randn(4, 16), torch.rand(5, 2), r"scores have 5 rows for 4 tokens"),
        (torch.randint(0, 3, (4, 16)), torch.rand(4, 2), r"x dtype torch.int64; allowed: bfloat16, float16, float32"),
    ],
)
def test_bad_inputs_are_named(x, scores, message):
    w1, w2 = torch.randn(3, 8, 16), torch.randn(3, 16, 8)
    with pytest.raises(ValueError, match=message):
        fused_experts(x, scores, torch.arange(8).repeat(2, 1), torch.tensor([8, 0, 0]), w1, w2, w1, score_before_experts=False,
                      tiles=ExpertTiles.uniform(TILES))


@pytest.mark.parametrize("score_before", [False, True])
def test_layer_with_triton_backend_matches_torchtitan(score_before):
    titan, layer = titan_and_uniep(4, "triton", num_experts=6, num_shared_experts=1, score_before=score_before)
    x = torch.randn(2, 5, 32)
    grad = torch.randn(2, 5, 32)
    results = []
    for module in (titan, layer):
        xi = x.clone().requires_grad_(True)
        module.zero_grad(set_to_none=True)
        module(xi).backward(grad)
        results.append([xi.grad] + [p.grad.clone() for _, p in sorted(module.named_parameters())])
    for got, expected in zip(results[1], results[0]):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nan_and_inf_propagate_like_torchtitan(backend, bad):
    """One bad element of token 2 makes exactly that token's output and input gradient
    non-finite, as in TorchTitan, and the weight gradients of the experts it reached:
    TorchTitan's own on the PyTorch path; on Triton, whose fused router breaks the tie
    of a NaN row's scores its own way (the lowest experts), those of the PyTorch path
    replaying the same routing."""
    titan, layer = titan_and_uniep(8, backend, num_experts=4, num_shared_experts=0, score_before=False)
    x = torch.randn(1, 6, 32)
    x[0, 2, 5] = bad
    grad = torch.randn(1, 6, 32)

    def masks(module, **routing):
        xi = x.clone().requires_grad_(True)
        module.zero_grad(set_to_none=True)
        out = module(xi, **routing)
        out.backward(grad)
        return [~torch.isfinite(t) for t in (out, xi.grad, module.experts.w1.grad, module.experts.w2.grad)]

    ours, titans = masks(layer), masks(titan)
    reference = titans
    if backend == "triton":
        _, topk_idx = layer.router(x.view(6, 32), layer.expert_bias)
        assert topk_idx[2].tolist() == [0, 1]
        reference = masks(UniEPMoE.from_torchtitan(titan, UniEPConfig(backend="torch")), topk_idx=topk_idx)
    assert all(torch.equal(a, b) for a, b in zip(ours[:2], titans[:2]))
    assert all(torch.equal(a, b) for a, b in zip(ours, reference))
    assert ours[0][0, 2].all() and not ours[0][0, [0, 1, 3, 4, 5]].any()  # only token 2 is bad


def test_w2_gradient_first_or_last_gives_the_same_bits_and_holds_less(monkeypatch):
    """The backward runs the w2 gradient first or last (``w2_grad_first``): both orders
    give every gradient bit for bit, and the rule picks the order that holds fewer
    bytes: last where the rows are few (grad y and h smaller than grad w2), first where
    they are many. Negative control: a w2 gradient run on the wrong rows differs."""
    from uniep.kernels import expert_rows

    order, counts, inputs, grad = small_problem(2)

    def run():
        return fwd_bwd(lambda x, s, a, b, c: fused_experts(x, s, order_and_inverse(order), counts, a, b, c, score_before_experts=False,
                                                           tiles=ExpertTiles.uniform(TILES)), inputs, grad)

    decided = []
    real_rule = expert_rows.w2_grad_first
    monkeypatch.setattr(expert_rows, "w2_grad_first", lambda state: decided.append(real_rule(state)) or decided[-1])
    natural = run()
    # 24 rows x (32 + 16) values of grad y and h against 4 x 32 x 16 of grad w2: last
    assert decided == [False]
    for forced in (True, False):
        monkeypatch.setattr(expert_rows, "w2_grad_first", lambda state, f=forced: f)
        assert all(torch.equal(a, b) for a, b in zip(run(), natural)), forced

    real_wgrad = expert_rows._down_weight_grad
    monkeypatch.setattr(expert_rows, "_down_weight_grad",
                        lambda state, tiles: (setattr(state, "grad_y", state.grad_y.roll(1, 0)), real_wgrad(state, tiles))[1])
    wrong = run()
    assert torch.equal(wrong[1], natural[1]) and not torch.equal(wrong[4], natural[4])  # x's gradient same, w2's not


def test_w2_gradient_first_where_the_rows_are_many():
    from types import SimpleNamespace

    from uniep.kernels.expert_rows import w2_grad_first

    def state(rows):  # the Qwen3-30B-A3B layer's sizes (D 2048, H 768, 128 experts, top-8)
        return SimpleNamespace(h=torch.empty(rows, 768, dtype=torch.bfloat16, device="meta"),
                               weights=(None, torch.empty(128, 2048, 768, dtype=torch.bfloat16, device="meta")))

    assert w2_grad_first(state(16384 * 8)) and not w2_grad_first(state(4096 * 8))
