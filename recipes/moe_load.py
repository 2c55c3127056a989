"""Per-layer expert load during training, for any MoE model (UniEP's or TorchTitan's).

A forward hook on each MoE layer's router counts the tokens routed to each expert
(``uniep.plan.local_counts`` of the router's expert ids: a sort and a search per layer,
no host sync, unlike ``torch.bincount`` on CUDA). At each
log step the counts are summed over all ranks and reduced, per layer, to the busiest
expert's tokens over the mean (1 = perfectly balanced) and the fraction of experts
that got no token; MoE users watch these for imbalance and router collapse.
"""

from __future__ import annotations

import re
from functools import partial

import torch
import torch.distributed as dist

from uniep.plan import local_counts


class ExpertLoad:
    def __init__(self):
        self.counts: dict[str, torch.Tensor] = {}
        """layer name -> (E,) int64 tokens per expert since the last summary (this rank)."""
        self.layers: list[str] = []

    def attach(self, model_parts) -> None:
        """Count at every module with a ``router`` and ``experts.num_experts`` (the MoE
        layers; a compiled router is hooked as compiled)."""
        for part in model_parts:
            for name, module in part.named_modules():
                router, experts = getattr(module, "router", None), getattr(module, "experts", None)
                if isinstance(router, torch.nn.Module) and hasattr(experts, "num_experts"):
                    layer = re.sub(r"\._checkpoint_wrapped_module|\._orig_mod|\._fsdp_wrapped_module", "", name)
                    layer = layer.removesuffix(".moe")
                    self.layers.append(layer)
                    router.register_forward_hook(partial(self._count, layer, experts.num_experts))

    def _count(self, layer: str, num_experts: int, module, inputs, output) -> None:
        if torch._C._current_graph_task_id() != -1:
            return  # an activation-checkpoint recompute inside the backward: counted already
        counts = local_counts(output[1], num_experts)
        previous = self.counts.get(layer)
        self.counts[layer] = counts if previous is None else previous + counts

    def summary(self) -> dict[str, list[float]]:
        """Per layer (in model order) since the last summary: ``max_over_mean`` and
        ``idle_fraction``. A collective when distributed: every rank calls it."""
        if not self.layers or set(self.counts) != set(self.layers):
            return {}
        table = torch.stack([self.counts[name] for name in self.layers])
        if dist.is_initialized():
            dist.all_reduce(table)
        self.counts.clear()
        table = table.double()
        mean = table.mean(dim=1).clamp_min(1e-12)
        return {
            "max_over_mean": (table.max(dim=1).values / mean).tolist(),
            "idle_fraction": (table == 0).double().mean(dim=1).tolist(),
        }
