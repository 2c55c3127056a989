"""The UniEP train specs build TorchTitan's models with UniEP layers: same state dict
(keys and values from the same seed), checkpoints interchangeable both ways, and
TorchTitan's aux-loss-free load-balancing hook works on UniEP layers."""

import copy
import dataclasses

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torchtitan.components.optimizer import build_optimizers_with_moe_load_balancing
from torchtitan.config.job_config import Optimizer as OptimizerConfig
from torchtitan.distributed import ParallelDims
from torchtitan.protocols.train_spec import get_train_spec

from recipes.models import register_all
from uniep import UniEPMoE

register_all()

# (uniep spec, torchtitan spec, flavor); models shrunk to keep the test light
CASES = [("uniep_qwen3", "qwen3", "debugmodel_moe"), ("uniep_deepseek_v3", "deepseek_v3", "debugmodel")]


def small_args(spec_name, flavor):
    args = copy.deepcopy(get_train_spec(spec_name).model_args[flavor])
    args.n_layers = 3
    args.moe_args.num_experts = 8
    args.moe_args.top_k = min(args.moe_args.top_k, 4)
    args.moe_impl = "standard"  # DeepSeek-V3 reads it; normally set by update_from_config
    return args


def build(spec_name, args, seed):
    spec = get_train_spec(spec_name)
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = spec.model_cls(args)
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device("cpu"))
    return model


def titan_args_of(uniep_args, titan_spec, flavor):
    base = type(get_train_spec(titan_spec).model_args[flavor])
    args = base(**{f.name: getattr(uniep_args, f.name) for f in dataclasses.fields(base)})
    args.moe_impl = "standard"
    return args


@pytest.mark.parametrize("uniep_spec, titan_spec, flavor", CASES)
def test_same_seed_same_state_dict(uniep_spec, titan_spec, flavor):
    args = small_args(uniep_spec, flavor)
    ours = build(uniep_spec, args, seed=0)
    theirs = build(titan_spec, titan_args_of(args, titan_spec, flavor), seed=0)
    moe_layers = [m for m in ours.modules() if isinstance(m, UniEPMoE)]
    assert len(moe_layers) == sum(b.moe_enabled for b in theirs.layers.values()) > 0
    ours_sd, theirs_sd = ours.state_dict(), theirs.state_dict()
    assert ours_sd.keys() == theirs_sd.keys()
    for key in theirs_sd:
        assert torch.equal(ours_sd[key], theirs_sd[key]), key


@pytest.mark.parametrize("uniep_spec, titan_spec, flavor", CASES)
def test_checkpoints_load_both_ways(uniep_spec, titan_spec, flavor, tmp_path):
    args = small_args(uniep_spec, flavor)
    titan_args = titan_args_of(args, titan_spec, flavor)
    for src_spec, src_args, dst_spec, dst_args in [
        (uniep_spec, args, titan_spec, titan_args),
        (titan_spec, titan_args, uniep_spec, args),
    ]:
        src = build(src_spec, src_args, seed=1)
        dst = build(dst_spec, dst_args, seed=2)  # other seed: loading must change it
        folder = tmp_path / src_spec
        dcp.save(src.state_dict(), checkpoint_id=str(folder), no_dist=True)
        state = dst.state_dict()
        dcp.load(state, checkpoint_id=str(folder), no_dist=True)
        dst.load_state_dict(state)
        for key, value in src.state_dict().items():
            assert torch.equal(dst.state_dict()[key], value), key


@pytest.fixture
def single_process_group():
    torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
    yield
    torch.distributed.destroy_process_group()


def test_torchtitan_load_balancing_hook_updates_uniep_layers(single_process_group):
    args = small_args("uniep_deepseek_v3", "debugmodel")
    model = build("uniep_deepseek_v3", args, seed=0)
    parallel_dims = ParallelDims(
        dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, etp=1, world_size=1
    )
    optimizers = build_optimizers_with_moe_load_balancing(
        [model], OptimizerConfig(implementation="foreach"), parallel_dims
    )
    layer = next(m for m in model.modules() if isinstance(m, UniEPMoE))
    model(torch.randint(0, args.vocab_size, (2, 16))).sum().backward()
    counts = layer.tokens_per_expert.clone()
    assert counts.sum().item() == 2 * 16 * layer.top_k
    optimizers.step()
    expected = layer.load_balance_coeff * torch.sign(counts.mean() - counts)
    torch.testing.assert_close(layer.expert_bias, expected - expected.mean())
    assert layer.tokens_per_expert.sum().item() == 0


@pytest.mark.parametrize("uniep_spec, titan_spec, short, full", [
    ("uniep_qwen3", "titan_qwen3", "30B-A3B-8L", "30B-A3B"),
    ("uniep_deepseek_v3", "titan_deepseek_v3", "16B-8L", "16B"),
])
def test_short_flavors_keep_the_layer_shapes_with_8_layers(uniep_spec, titan_spec, short, full):
    for spec in (uniep_spec, titan_spec):  # UniEP and its baseline have the same flavor
        flavors = get_train_spec(spec).model_args
        short_args, full_args = flavors[short], flavors[full]
        assert short_args.n_layers == 8 and full_args.n_layers > 8
        assert repr(dataclasses.replace(short_args, n_layers=full_args.n_layers)) == repr(full_args)
