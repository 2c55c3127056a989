"""The expert order in one launch (``uniep.kernels.expert_order``, here in the Triton
interpreter): the bits of the PyTorch sort it replaces (``uniep.plan.expert_order``), for
any routing and block size; the launch up to ``MAX_PAIRS`` pairs and the sort above; and
the layer using them exactly where its experts run on Triton, outside torch.compile."""

import pytest
import torch

import uniep.kernels.expert_order as kernel
from tests.kernels.routing import make_routing
from uniep import UniEPConfig, UniEPMoE
from uniep.plan import expert_order


def _within_experts_reversed(order: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Each expert's pairs in descending order: a sort by expert that is not stable."""
    return torch.cat([part.flip(0) for part in order.split(counts.tolist())])


@pytest.mark.parametrize(
    "T, K, E, kind",
    [
        (37, 4, 8, "random"),
        (50, 3, 16, "skewed"),  # experts K+1.. empty
        (20, 1, 5, "one_expert"),  # every pair on the last expert
        (1100, 4, 6, "random"),  # P = 4400: two blocks of pairs, the last partial
        (1, 1, 1, "random"),
        (0, 2, 4, "random"),  # no tokens: counts 0, an empty order
    ],
)
def test_the_bits_of_the_pytorch_sort(T, K, E, kind):
    gen = torch.Generator().manual_seed(T + K + E)
    idx = make_routing(T, K, E, kind, gen)[0] if T else torch.zeros(0, K, dtype=torch.int64)
    counts, order_2P = kernel.expert_order_triton(idx, E)
    ref_counts, ref_order_2P = expert_order(idx, E)
    assert counts.dtype == order_2P.dtype == torch.int64 and order_2P.shape == (2, T * K)
    assert torch.equal(counts, ref_counts) and torch.equal(order_2P, ref_order_2P)
    assert torch.equal(order_2P[1][order_2P[0]], torch.arange(T * K))  # the inverse
    # the control: an order by expert that is not the stable one is told apart
    if T * K > E:
        assert not torch.equal(order_2P[0], _within_experts_reversed(ref_order_2P[0], ref_counts))


def test_block_size_and_id_dtype_do_not_change_the_bits():
    """Blocks of 16 pairs (nine, the place carried from block to block) and int32 ids
    give the bits of the default launch."""
    idx = make_routing(45, 3, 7, "random", torch.Generator().manual_seed(0))[0]
    default = kernel.expert_order_triton(idx, 7)
    small_blocks = kernel.expert_order_triton(idx, 7, block=16, num_warps=4)
    narrow_ids = kernel.expert_order_triton(idx.to(torch.int32), 7)
    for got in (small_blocks, narrow_ids):
        assert all(torch.equal(a, b) for a, b in zip(got, default))


def test_the_launch_up_to_max_pairs_and_the_sort_above(monkeypatch):
    """``expert_order_on_triton`` launches the kernel up to ``MAX_PAIRS`` pairs and sorts
    above (where the launch is the slower on a GPU); the same bits either way."""
    calls = []
    real = kernel.expert_order_triton
    monkeypatch.setattr(kernel, "expert_order_triton", lambda idx, e: calls.append(idx.numel()) or real(idx, e))
    monkeypatch.setattr(kernel, "MAX_PAIRS", 12)
    gen = torch.Generator().manual_seed(5)
    for T, launched in ((4, [12]), (5, [])):  # 12 pairs, 15 pairs (K = 3)
        calls.clear()
        idx = make_routing(T, 3, 6, "random", gen)[0]
        got = kernel.expert_order_on_triton(idx, 6)
        assert calls == launched
        assert all(torch.equal(a, b) for a, b in zip(got, expert_order(idx, 6)))


@pytest.mark.parametrize("backend, on_triton", [("triton", True), ("torch", False)])
def test_the_layer_orders_on_triton_where_its_experts_run(monkeypatch, backend, on_triton):
    """The layer takes the launch where its experts run on Triton (here the interpreter),
    the PyTorch sort elsewhere and under torch.compile; both give the same layer."""
    calls = []
    real = kernel.expert_order_triton
    monkeypatch.setattr(kernel, "expert_order_triton", lambda idx, e: calls.append(idx.shape) or real(idx, e))
    torch.manual_seed(0)
    layer = UniEPMoE(16, 8, 4, 2, config=UniEPConfig(backend=backend))
    layer.init_weights(0.05)
    x = torch.randn(1, 9, 16)
    out = layer(x)
    assert (calls == [(9, 2)]) == on_triton
    calls.clear()
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")(x)
    assert calls == []
    torch.testing.assert_close(compiled, out)
