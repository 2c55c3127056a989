"""Expert parallelism handed to UniEP inside TorchTitan's parallelize functions.

TorchTitan's ``parallelize_qwen3`` / ``parallelize_deepseekv3`` run unchanged (AC,
compile, FSDP/HSDP with experts on the ``efsdp`` mesh, DDP), except that their EP step
reaches ``apply_uniep_ep``: the routed experts become ``Shard(0)`` DTensors over the EP
mesh, exactly as TorchTitan shards them, and the UniEP layer moves tokens itself; and
their compile step reaches ``apply_uniep_compile``, which compiles a UniEP block as
TorchTitan compiles its own MoE blocks.
"""

from __future__ import annotations

import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
from torch.distributed.device_mesh import DeviceMesh
from torchtitan.tools.logging import logger

from uniep import UniEPMoE


class UnsupportedParallelism(ValueError):
    pass


def check_uniep_parallelism(parallel_dims) -> None:
    """Reject parallelisms that UniEP layers do not implement yet, before any work."""
    unsupported = {
        "tensor_parallel_degree": parallel_dims.tp,
        "expert_tensor_parallel_degree": parallel_dims.etp,
        "context_parallel_degree": parallel_dims.cp,
        "pipeline_parallel_degree": parallel_dims.pp,
    }
    for name, degree in unsupported.items():
        if degree != 1:
            raise UnsupportedParallelism(
                f"parallelism.{name} = {degree}: UniEP layers support 1 only "
                "(data parallel + FSDP + expert parallel)"
            )


def apply_uniep_ep(
    model,
    tp_mesh: DeviceMesh | None,
    ep_mesh: DeviceMesh | None,
    etp_mesh: DeviceMesh | None,
    ep_etp_mesh: DeviceMesh | None,
    dual_pipe_v: bool = False,
    use_deepep: bool = False,
) -> None:
    """Stands in for TorchTitan's ``apply_moe_ep_tp`` (same signature)."""
    if tp_mesh is not None or etp_mesh is not None or dual_pipe_v or use_deepep:
        raise UnsupportedParallelism(
            "UniEP expert parallelism runs without TP, ETP, DualPipeV and DeepEP"
        )
    if ep_mesh is None:
        return
    layers = [block.moe for block in model.layers.values() if isinstance(getattr(block, "moe", None), UniEPMoE)]
    for moe in layers:
        moe.shard_experts(ep_mesh)
    logger.info(f"Applied UniEP expert parallelism (degree {ep_mesh.size()}) to {len(layers)} MoE layers")


def apply_uniep_compile(model, compile_config, ep_enabled: bool) -> None:
    """Stands in for TorchTitan's ``apply_compile`` (same signature).

    As TorchTitan does for its MoE blocks: every child of the block is compiled on its
    own (``fullgraph=True``), and inside the MoE layer every child but the routed
    experts, which FSDP wraps on their own mesh (its hooks would break the graph), so they
    run eagerly (``uniep.routed_op``: the path itself, no op boundary); blocks without a
    UniEP layer are compiled whole.
    """
    torch._dynamo.config.capture_scalar_outputs = True
    compiled = 0
    for layer_id, block in model.layers.named_children():
        inner = block._checkpoint_wrapped_module if isinstance(block, CheckpointWrapper) else block
        moe = getattr(inner, "moe", None)
        if not isinstance(moe, UniEPMoE):
            model.layers.register_module(
                layer_id, torch.compile(block, backend=compile_config.backend, fullgraph=True)
            )
            continue
        for parent in (inner, moe):
            for name, child in list(parent.named_children()):
                if child is moe or name == "experts":
                    continue
                setattr(parent, name, torch.compile(child, backend=compile_config.backend, fullgraph=True))
        compiled += 1
    logger.info(f"Compiled {compiled} UniEP blocks (each child; the routed experts are one opaque op)")
