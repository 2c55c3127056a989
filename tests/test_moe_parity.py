"""UniEPMoE.from_torchtitan against TorchTitan 0.2.2's own MoE: forward, input grad and
every parameter grad, for the Qwen3 and DeepSeek-V3 router settings."""

import pytest
import torch
from torchtitan.models.moe import MoE, MoEArgs

from uniep import UniEPMoE

DIM, HIDDEN = 32, 48

ROUTERS = {
    # Qwen3-MoE: softmax, normalised top-k, scores applied after the experts
    "qwen3": dict(num_experts=16, top_k=8, num_shared_experts=0, score_func="softmax", route_norm=True, score_before_experts=False),
    # DeepSeek-V3 debug/16B: softmax, 2 shared experts
    "deepseek_v3": dict(num_experts=8, top_k=3, num_shared_experts=2, score_func="softmax", route_norm=False, score_before_experts=False),
    # DeepSeek-V3 671B: sigmoid, node-limited groups, route scale
    "deepseek_v3_671b": dict(num_experts=16, top_k=4, num_shared_experts=1, score_func="sigmoid", route_norm=True,
                             route_scale=2.5, num_expert_groups=4, num_limited_groups=2),
    # scores applied before the experts, gate with bias, top-1
    "score_before": dict(num_experts=4, top_k=1, num_shared_experts=1, score_func="sigmoid", gate_bias=True, score_before_experts=True),
}


def make_pair(router, seed, dtype=torch.float32):
    torch.manual_seed(seed)
    titan = MoE(MoEArgs(**router), dim=DIM, hidden_dim=HIDDEN)
    with torch.no_grad():
        titan.init_weights(0.02, torch.device("cpu"))
        # random, not zero: a bias of zeros would hide a wrong or missing bias path
        if titan.router.gate.bias is not None:
            titan.router.gate.bias.normal_()
    titan.to(dtype)
    titan.expert_bias = titan.expert_bias.float()
    titan.tokens_per_expert = titan.tokens_per_expert.float()
    return titan, UniEPMoE.from_torchtitan(titan)


def run(layer, x, grad_out):
    x = x.detach().clone().requires_grad_(True)
    layer.zero_grad(set_to_none=True)
    out = layer(x)
    out.backward(grad_out)
    grads = {name: p.grad.clone() for name, p in layer.named_parameters()}
    return out.detach(), x.grad, grads


def fwd_bwd_both(titan, uniep, x):
    grad_out = torch.randn_like(x)
    ref = run(titan, x, grad_out)
    titan.tokens_per_expert.zero_()
    got = run(uniep, x, grad_out)
    return ref, got


def assert_all_close(ref, got, **tol):
    torch.testing.assert_close(got[0], ref[0], **tol)
    torch.testing.assert_close(got[1], ref[1], **tol)
    assert got[2].keys() == ref[2].keys()
    for name in ref[2]:
        torch.testing.assert_close(got[2][name], ref[2][name], **tol, msg=lambda m: f"grad of {name}: {m}")


@pytest.mark.parametrize("router", ROUTERS, ids=list(ROUTERS))
def test_matches_torchtitan_fp32(router):
    titan, uniep = make_pair(ROUTERS[router], seed=hash(router) % 1000)
    x = torch.randn(3, 7, DIM)  # 21 tokens: not a multiple of anything
    ref, got = fwd_bwd_both(titan, uniep, x)
    assert_all_close(ref, got, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("router", ["qwen3", "deepseek_v3"])
def test_matches_torchtitan_bf16(router):
    titan, uniep = make_pair(ROUTERS[router], seed=7, dtype=torch.bfloat16)
    x = torch.randn(2, 9, DIM, dtype=torch.bfloat16)
    ref, got = fwd_bwd_both(titan, uniep, x)
    assert_all_close(ref, got, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize(
    "router, hot_experts",
    [
        ("score_before", [2]),  # top-1: every token on expert 2, three experts empty
        ("deepseek_v3", [0, 5, 6]),  # top-3: every token on the same three experts, five empty
        ("qwen3", list(range(8, 16))),  # top-8: experts 0-7 empty
    ],
)
def test_skewed_routing_and_empty_experts(router, hot_experts):
    titan, uniep = make_pair(ROUTERS[router], seed=3)
    with torch.no_grad():
        titan.expert_bias[hot_experts] = 100.0  # selection only; weights stay unbiased
    x = torch.randn(2, 5, DIM)
    ref, got = fwd_bwd_both(titan, uniep, x)
    assert_all_close(ref, got, rtol=1e-5, atol=1e-6)
    counts = uniep.tokens_per_expert
    assert counts[hot_experts].tolist() == [10.0] * len(hot_experts)
    assert counts.sum().item() == 10 * len(hot_experts)
    # experts with no tokens get exactly zero weight gradient
    cold = [e for e in range(uniep.num_experts) if e not in hot_experts]
    assert torch.count_nonzero(got[2]["experts.w1"][cold]) == 0


def test_repeated_runs_are_bitwise_identical():
    titan, uniep = make_pair(ROUTERS["deepseek_v3_671b"], seed=11)
    x, grad_out = torch.randn(4, 6, DIM), torch.randn(4, 6, DIM)
    first = run(uniep, x, grad_out)
    for _ in range(3):
        again = run(uniep, x, grad_out)
        assert torch.equal(again[0], first[0]) and torch.equal(again[1], first[1])
        assert all(torch.equal(again[2][n], first[2][n]) for n in first[2])


def test_tokens_per_expert_accumulates_like_torchtitan():
    titan, uniep = make_pair(ROUTERS["deepseek_v3"], seed=5)
    x = torch.randn(2, 8, DIM)
    titan(x)
    expected = titan.tokens_per_expert.clone()
    titan.tokens_per_expert.zero_()
    uniep(x)
    uniep(x)
    assert torch.equal(uniep.tokens_per_expert, 2 * expected)


def test_bad_input_shape_is_named():
    _, uniep = make_pair(ROUTERS["qwen3"], seed=1)
    with pytest.raises(ValueError, match=r"expects x of shape \(batch, seq, dim\); got \(4, 32\)"):
        uniep(torch.randn(4, DIM))


def test_routing_is_not_cast_by_fsdp_mixed_precision():
    """FSDP casts floating-point module arguments (through tuples, dicts, dataclasses) to
    its parameter dtype; the router scores handed to the experts must stay fp32."""
    from torch.distributed.utils import _apply_to_tensors

    from uniep.experts import Routing

    routing = Routing(torch.rand(4, 2), torch.zeros(4, 2, dtype=torch.int64), torch.zeros(8, dtype=torch.int64),
                      torch.arange(8))
    cast = _apply_to_tensors(lambda t: t.to(torch.bfloat16) if t.is_floating_point() else t, (routing,))
    assert cast[0].scores_TK.dtype == torch.float32
    # the control: the same tensors in a tuple are cast
    assert _apply_to_tensors(lambda t: t.to(torch.bfloat16), (routing.scores_TK,))[0].dtype == torch.bfloat16


def test_eager_call_holds_its_state_only_while_a_backward_can_come():
    """Eagerly the layer calls its expert path directly: the Triton path holds its
    activations for the backward (``uniep.backward_state``) while, and only while, a
    backward can come."""
    from uniep import UniEPConfig
    from uniep.backward_state import held_states

    small = dict(gemm_block_m=16, gemm_block_n=16, gemm_up_block_n=16, gemm_block_k=16, wgrad_block_m=16,
                 wgrad_block_n=16, wgrad_up_block_n=16, wgrad_block_k=16, num_programs=2)
    layer = UniEPMoE(16, 8, 4, 2, config=UniEPConfig(backend="triton", **small))
    layer.init_weights(0.02)
    x = torch.randn(1, 6, 16)
    with torch.no_grad():
        reference = layer(x)
    assert held_states() == 0
    out = layer(x)
    assert held_states() == 1 and torch.equal(out.detach(), reference)  # same bits either way
    out.sum().backward()
    assert held_states() == 0
    layer(x)  # a forward whose result is dropped
    assert held_states() == 0
