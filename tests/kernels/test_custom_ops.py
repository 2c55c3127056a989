"""The fused expert block as PyTorch custom ops: opcheck (schema, fake tensors,
autograd registration), torch.compile without graph breaks, activation checkpointing."""

import torch
import torch.utils.checkpoint

from tests.kernels.routing import make_routing
from uniep.kernels.fused_experts import _fused_experts_fwd, fused_experts
from uniep.kernels.grouped_gemm import ExpertTiles, GemmTiles

TILES = GemmTiles(block_m=16, block_n=16, block_k=16, num_programs=2)
T, K, E, D, H = 9, 2, 4, 32, 16


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: Triton interpreter


def inputs(seed=0):
    gen = torch.Generator().manual_seed(seed)
    _, order, counts = make_routing(T, K, E, "random", gen)
    x = torch.randn(T, D, generator=gen)
    scores = torch.rand(T, K, generator=gen)
    w = [torch.randn(*shape, generator=gen) * 0.2 for shape in ((E, H, D), (E, D, H), (E, H, D))]
    leaves = [t.to(DEVICE).requires_grad_(True) for t in (x, scores, *w)]
    return leaves[0], leaves[1], order.to(DEVICE), counts.to(DEVICE), leaves[2:]


def layer(x, scores, order, counts, w1, w2, w3):
    return fused_experts(x, scores, order, counts, w1, w2, w3, score_before_experts=False, tiles=ExpertTiles.uniform(TILES))


def grads_of(fn, x, scores, order, counts, w, grad):
    out = fn(x, scores, order, counts, *w)
    out.backward(grad)
    result = [out.detach()] + [t.grad.clone() for t in (x, scores, *w)]
    for t in (x, scores, *w):
        t.grad = None
    return result


def test_opcheck():
    x, scores, order, counts, w = inputs()
    args = (x, scores, order, counts, *w, False, ExpertTiles.uniform(TILES).packed())
    torch.library.opcheck(_fused_experts_fwd, args, test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))


def test_compiles_without_graph_breaks_and_matches_eager():
    x, scores, order, counts, w = inputs(1)
    grad = torch.randn(T, D, device=DEVICE)
    eager = grads_of(layer, x, scores, order, counts, w, grad)
    compiled = grads_of(torch.compile(layer, fullgraph=True, backend="aot_eager"), x, scores, order, counts, w, grad)
    assert all(torch.equal(a, b) for a, b in zip(eager, compiled))


def test_activation_checkpointing_recomputes_the_same_bits():
    x, scores, order, counts, w = inputs(2)
    grad = torch.randn(T, D, device=DEVICE)
    eager = grads_of(layer, x, scores, order, counts, w, grad)

    def checkpointed(*args):
        return torch.utils.checkpoint.checkpoint(layer, *args, use_reentrant=False)

    assert all(torch.equal(a, b) for a, b in zip(eager, grads_of(checkpointed, x, scores, order, counts, w, grad)))
