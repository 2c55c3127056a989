"""TrainSpecs ``uniep_qwen3`` and ``uniep_deepseek_v3``: TorchTitan's own models with every
MoE block replaced by a UniEP layer.

Everything but the MoE block (attention, norms, embeddings, optimizer, LR schedule,
loss, checkpoint adapter) is TorchTitan's, taken from its own TrainSpec.
"""

from __future__ import annotations

import copy
import dataclasses
from contextlib import contextmanager
from typing import Callable

from torch import nn
from torchtitan.models import deepseek_v3 as titan_deepseek_v3
from torchtitan.models import qwen3 as titan_qwen3
from torchtitan.models.deepseek_v3.infra import parallelize as titan_deepseek_parallelize
from torchtitan.models.qwen3.infra import parallelize as titan_qwen3_parallelize
from torchtitan.protocols.train_spec import TrainSpec, get_train_spec, register_train_spec

from recipes import data
from recipes.metrics import build_metrics_processor
from recipes.parallelize import apply_uniep_compile, apply_uniep_ep, check_uniep_parallelism
from uniep import UniEPConfig, UniEPMoE


def swap_moe_blocks(model: nn.Module, config: UniEPConfig) -> int:
    """Replace each TransformerBlock's ``moe`` with a UniEPMoE that takes over its
    parameters. Returns the number of blocks swapped."""
    swapped = 0
    for block in model.layers.values():
        if getattr(block, "moe_enabled", False):
            block.moe = UniEPMoE.from_torchtitan(block.moe, config)
            swapped += 1
    return swapped


def _uniep_args_cls(base: type) -> type:
    """``base`` model args plus a ``uniep`` field filled from the job's ``[uniep]`` table."""

    def update_from_config(self, job_config, **kwargs) -> None:
        base.update_from_config(self, job_config, **kwargs)
        self.uniep = job_config.uniep

    return dataclasses.make_dataclass(
        f"UniEP{base.__name__}",
        [("uniep", UniEPConfig, dataclasses.field(default_factory=UniEPConfig))],
        bases=(base,),
        namespace={"update_from_config": update_from_config},
    )


def _uniep_model_cls(base: type) -> type:
    def __init__(self, model_args) -> None:
        base.__init__(self, model_args)
        swap_moe_blocks(self, model_args.uniep)

    return type(f"UniEP{base.__name__}", (base,), {"__init__": __init__})


@contextmanager
def _uniep_expert_parallel(titan_parallelize_module):
    """Within the block, TorchTitan's parallelize function hands expert parallelism and
    compilation to UniEP: its calls to ``apply_moe_ep_tp`` and ``apply_compile`` reach
    ``apply_uniep_ep`` and ``apply_uniep_compile`` instead."""
    originals = (titan_parallelize_module.apply_moe_ep_tp, titan_parallelize_module.apply_compile)
    titan_parallelize_module.apply_moe_ep_tp = apply_uniep_ep
    titan_parallelize_module.apply_compile = apply_uniep_compile
    try:
        yield
    finally:
        titan_parallelize_module.apply_moe_ep_tp, titan_parallelize_module.apply_compile = originals


def _uniep_parallelize_fn(titan_fn: Callable, titan_module) -> Callable:
    """TorchTitan's FSDP/AC/compile steps, in TorchTitan's order, with UniEP's EP."""

    def parallelize(model, parallel_dims, job_config):
        check_uniep_parallelism(parallel_dims)
        with _uniep_expert_parallel(titan_module):
            return titan_fn(model, parallel_dims, job_config)

    return parallelize


SHORT_FLAVORS = {"30B-A3B-8L": ("30B-A3B", 8), "16B-8L": ("16B", 8)}
"""Flavor -> (TorchTitan flavor, layers): the real layer shapes with fewer layers, so a
model fits on one 2-GPU machine for parity and speed runs (UniEP and baselines alike)."""


def with_short_flavors(model_args: dict) -> dict:
    """TorchTitan's flavors plus the ``SHORT_FLAVORS`` whose full flavor it has."""
    flavors = dict(model_args)
    for name, (full, layers) in SHORT_FLAVORS.items():
        if full in model_args:
            flavors[name] = dataclasses.replace(model_args[full], n_layers=layers)
    return flavors


def _uniep_train_spec(titan_name: str, model_cls: type, parallelize_fn, parallelize_module) -> TrainSpec:
    titan_spec = get_train_spec(titan_name)
    flavors = {}
    for flavor, args in with_short_flavors(titan_spec.model_args).items():
        if getattr(args, "moe_enabled", True) and getattr(args, "moe_args", None) is not None:
            args_cls = _uniep_args_cls(type(args))
            flavors[flavor] = args_cls(
                **{f.name: copy.deepcopy(getattr(args, f.name)) for f in dataclasses.fields(args)}
            )
    return dataclasses.replace(
        titan_spec,
        model_cls=_uniep_model_cls(model_cls),
        model_args=flavors,
        parallelize_fn=_uniep_parallelize_fn(parallelize_fn, parallelize_module),
        build_tokenizer_fn=data.build_tokenizer,
        build_metrics_processor_fn=build_metrics_processor,
    )


TRAIN_SPECS = {
    "uniep_qwen3": ("qwen3", titan_qwen3.Qwen3Model, titan_qwen3.parallelize_qwen3, titan_qwen3_parallelize),
    "uniep_deepseek_v3": (
        "deepseek_v3",
        titan_deepseek_v3.DeepSeekV3Model,
        titan_deepseek_v3.parallelize_deepseekv3,
        titan_deepseek_parallelize,
    ),
}
"""UniEP spec name -> (TorchTitan spec, model class, parallelize fn, its module)."""


BASELINE_SPECS = {"titan_qwen3": "qwen3", "titan_deepseek_v3": "deepseek_v3"}
"""Baselines for parity runs: TorchTitan's own spec (its MoE, its parallelism), with the
embedded tokenizer resolved and the per-step loss log, like the UniEP specs."""

BASELINE_OF = {"uniep_qwen3": "titan_qwen3", "uniep_deepseek_v3": "titan_deepseek_v3"}


def register_all() -> None:
    """Register the UniEP and baseline TrainSpecs and the embedded dataset (idempotent)."""
    from torchtitan.protocols import train_spec as train_spec_module

    data.register_datasets()
    registered = train_spec_module._extra_train_specs
    for name, (titan_name, model_cls, fn, module) in TRAIN_SPECS.items():
        if name not in registered:
            register_train_spec(name, _uniep_train_spec(titan_name, model_cls, fn, module))
    for name, titan_name in BASELINE_SPECS.items():
        if name not in registered:
            titan_spec = get_train_spec(titan_name)
            register_train_spec(name, dataclasses.replace(
                titan_spec,
                model_args=with_short_flavors(titan_spec.model_args),
                build_tokenizer_fn=data.build_tokenizer,
                build_metrics_processor_fn=build_metrics_processor,
            ))
