"""The routed-expert call as the custom op ``uniep::routed_experts`` (what torch.compile
sees of a layer): opcheck (schema, fake tensors, autograd registration), a compiled
layer without graph breaks; and activation checkpointing of the fused Triton path
recomputing the same bits and dropping the state it holds for the backward."""

import torch
import torch.utils.checkpoint

from tests.kernels.routing import make_routing, order_and_inverse
from uniep import UniEPConfig, UniEPMoE
from uniep.backward_state import held_states
from uniep.kernels.fused_experts import fused_experts
from uniep.kernels.grouped_gemm import ExpertTiles, GemmTiles
from uniep.plan import expert_order
from uniep.routed_op import _routed_experts

TILES = GemmTiles(block_m=16, block_n=16, block_k=16, num_programs=2)
SMALL = dict(gemm_block_m=16, gemm_block_n=16, gemm_up_block_n=16, gemm_block_k=16, wgrad_block_m=16,
             wgrad_block_n=16, wgrad_up_block_n=16, wgrad_block_k=16, num_programs=2)
T, K, E, D, H = 9, 2, 4, 32, 16


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: Triton interpreter


def inputs(seed=0):
    gen = torch.Generator().manual_seed(seed)
    topk, order, counts = make_routing(T, K, E, "random", gen)
    x = torch.randn(T, D, generator=gen)
    scores = torch.rand(T, K, generator=gen)
    w = [torch.randn(*shape, generator=gen) * 0.2 for shape in ((E, H, D), (E, D, H), (E, H, D))]
    leaves = [t.to(DEVICE).requires_grad_(True) for t in (x, scores, *w)]
    return leaves[0], leaves[1], topk.to(DEVICE), order_and_inverse(order).to(DEVICE), counts.to(DEVICE), leaves[2:]


def fused(x, scores, order, counts, w1, w2, w3):
    return fused_experts(x, scores, order, counts, w1, w2, w3, score_before_experts=False,
                         tiles=ExpertTiles.uniform(TILES))


def grads_of(fn, leaves, grad):
    out = fn(*leaves)
    out.backward(grad)
    result = [out.detach()] + [t.grad.clone() for t in leaves]
    for t in leaves:
        t.grad = None
    return result


def test_opcheck():
    layer = UniEPMoE(D, H, E, K, config=UniEPConfig(backend="triton", **SMALL)).to(DEVICE)
    x, scores, topk, _, _, w = inputs()
    args = (x, scores, topk, *expert_order(topk, E), *w, layer.experts.path_id, True)
    torch.library.opcheck(_routed_experts, args,
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))


def test_compiled_layer_has_no_graph_breaks_and_matches_eager():
    torch.manual_seed(0)
    layer = UniEPMoE(D, H, E, K, score_func="softmax", config=UniEPConfig(backend="triton", **SMALL)).to(DEVICE)
    layer.init_weights(0.02)
    x = torch.randn(1, T, D, device=DEVICE)
    grad = torch.randn_like(x)

    def run(fn):
        xi = x.clone().requires_grad_(True)
        fn(xi).backward(grad)
        out = [xi.grad] + [p.grad.clone() for _, p in sorted(layer.named_parameters())]
        layer.zero_grad(set_to_none=True)
        return out

    eager = run(layer)
    compiled = run(torch.compile(layer, fullgraph=True, backend="aot_eager"))
    assert all(torch.equal(a, b) for a, b in zip(eager, compiled))
    assert held_states() == 0  # each backward took its saved graph back


def test_activation_checkpointing_recomputes_the_same_bits():
    x, scores, _, order, counts, w = inputs(2)
    grad = torch.randn(T, D, device=DEVICE)

    def checkpointed(x, scores, w1, w2, w3):
        return torch.utils.checkpoint.checkpoint(fused, x, scores, order, counts, w1, w2, w3, use_reentrant=False)

    def plain(x, scores, w1, w2, w3):
        return fused(x, scores, order, counts, w1, w2, w3)

    eager = grads_of(plain, [x, scores, *w], grad)
    assert all(torch.equal(a, b) for a, b in zip(eager, grads_of(checkpointed, [x, scores, *w], grad)))


def test_activation_checkpointing_drops_the_held_state():
    """The Triton path's activations wait for the backward in ``uniep.backward_state``,
    under a handle that checkpointing discards with the other saved tensors."""
    x, scores, _, order, counts, w = inputs(3)
    out = fused(x, scores, order, counts, *w)
    assert held_states() == 1  # the control: without checkpointing the state waits for the backward
    del out
    assert held_states() == 0
    out = torch.utils.checkpoint.checkpoint(fused, x, scores, order, counts, *w, use_reentrant=False)
    assert held_states() == 0  # dropped; the backward recomputes it
    out.sum().backward()
    assert held_states() == 0 and x.grad is not None
