"""Training-time expert load (recipes.moe_load): counted at the routers of UniEP's and
TorchTitan's MoE layers, reduced per layer, not double-counted by recomputation."""

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from recipes.moe_load import ExpertLoad
from uniep import UniEPMoE


def titan_moe(num_experts=8, top_k=2, dim=16):
    from torchtitan.models.moe import MoE, MoEArgs

    moe = MoE(MoEArgs(num_experts=num_experts, top_k=top_k, score_func="softmax"), dim=dim, hidden_dim=8)
    with torch.no_grad():
        moe.init_weights(0.02, torch.device("cpu"))
    return moe


@pytest.mark.parametrize("kind", ["uniep", "torchtitan"])
def test_load_per_layer(kind):
    torch.manual_seed(0)
    layers = nn.ModuleDict({str(i): nn.ModuleDict({"moe": titan_moe()}) for i in range(2)})
    if kind == "uniep":
        for block in layers.values():
            block["moe"] = UniEPMoE.from_torchtitan(block["moe"])
    load = ExpertLoad()
    load.attach([layers])
    assert load.layers == ["0", "1"]
    with torch.no_grad():
        layers["1"]["moe"].expert_bias[:2] = 100.0  # layer 1: every token on experts 0 and 1
        for block in layers.values():
            block["moe"](torch.randn(1, 12, 16))
    summary = load.summary()
    assert summary["max_over_mean"][1] == pytest.approx(4.0)  # 12 tokens each on 2 of 8 experts: 12 / 3
    assert summary["idle_fraction"][1] == pytest.approx(6 / 8)
    assert summary["max_over_mean"][0] < 4.0 and summary["idle_fraction"][0] < 6 / 8
    assert load.summary() == {}  # counts restart after each summary


def test_activation_checkpoint_recompute_is_not_counted():
    torch.manual_seed(0)
    layer = UniEPMoE(16, 8, 4, 2)
    layer.init_weights(0.02)
    load = ExpertLoad()
    load.attach([nn.ModuleDict({"moe": layer})])
    x = torch.randn(1, 6, 16, requires_grad=True)
    checkpoint(layer, x, use_reentrant=False).sum().backward()  # the router runs twice
    (layer_name,) = load.layers
    assert int(load.counts[layer_name].sum()) == 6 * 2  # 6 tokens x top-2, once
