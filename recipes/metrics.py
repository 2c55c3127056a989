"""Per-step loss log: TorchTitan's metrics plus ``<dump_folder>/loss_log.jsonl``.

Each line is ``{"step", "loss", "grad_norm", "lr"}`` with full float precision (the
console shows five decimals), so runs can be compared bitwise, plus TorchTitan's
throughput numbers of the step: ``tps`` (tokens per second per device), ``mfu`` (%),
``tflops`` and ``max_reserved_gib`` (peak reserved device memory; the last three on
GPUs only), and the expert load of each MoE layer since the last log line
(``moe_max_over_mean``, ``moe_idle_fraction``: lists in layer order, see
``recipes.moe_load``; also sent to TorchTitan's TensorBoard/wandb loggers as
``moe/<layer>/...``). Rank 0 writes it; a resumed run appends (``recipes.loss_log``).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torchtitan.components.metrics import MetricsProcessor
from torchtitan.tools.logging import logger

from recipes.loss_log import LOSS_LOG
from recipes.moe_load import ExpertLoad


def _as_float(value) -> float:
    return float(value.item() if isinstance(value, torch.Tensor) else value)


# loss-log key -> TorchTitan's metric name
THROUGHPUT = {"tps": "throughput(tps)", "mfu": "mfu(%)", "tflops": "tflops",
              "max_reserved_gib": "memory/max_reserved(GiB)"}


class _KeepLast:
    """TorchTitan's metric loggers, keeping the metrics of the last step they logged."""

    def __init__(self, loggers):
        self.loggers, self.last = loggers, {}

    def log(self, metrics, step):
        self.last = dict(metrics)
        self.loggers.log(metrics, step)

    def __getattr__(self, name):
        return getattr(self.loggers, name)


class LossLogMetricsProcessor(MetricsProcessor):
    def __init__(self, job_config, parallel_dims, tag=None):
        super().__init__(job_config, parallel_dims, tag)
        rank0 = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
        self.loss_log = Path(job_config.job.dump_folder) / LOSS_LOG if rank0 else None
        self.logger = _KeepLast(self.logger)
        # MFU, TFLOP/s and reserved memory are a GPU's peak and allocator's: on the CPU
        # the first two mean nothing and the memory is the process's resident set
        # (recipes.cpu), another quantity, so only the throughput is kept.
        self.kept = THROUGHPUT if torch.cuda.is_available() else {"tps": THROUGHPUT["tps"]}
        self.expert_load = ExpertLoad()

    @property
    def model_parts(self):
        return self._model_parts

    @model_parts.setter
    def model_parts(self, parts) -> None:
        # TorchTitan hands the processor the final (parallelized, compiled) model here
        self._model_parts = parts
        if parts:
            self.expert_load.attach(parts)

    def log(self, step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=None):
        load = self.expert_load.summary()  # a collective: before the rank-0-only part
        if load:
            extra_metrics = {**(extra_metrics or {}), **{
                f"moe/{layer}/{key}": values[i]
                for key, values in load.items() for i, layer in enumerate(self.expert_load.layers)
            }}
        super().log(step, global_avg_loss, global_max_loss, grad_norm, extra_metrics)
        if self.loss_log is None:
            return
        record = {"step": step, "loss": _as_float(global_avg_loss), "grad_norm": _as_float(grad_norm)}
        if load:
            record.update({f"moe_{key}": values for key, values in load.items()})
            worst = max(range(len(load["max_over_mean"])), key=load["max_over_mean"].__getitem__)
            logger.info(f"expert load: busiest expert {load['max_over_mean'][worst]:.2f}x the mean "
                        f"({self.expert_load.layers[worst]}), idle experts up to {max(load['idle_fraction']):.0%}")
        if extra_metrics and "lr" in extra_metrics:
            record["lr"] = _as_float(extra_metrics["lr"])
        record.update({key: _as_float(self.logger.last[name]) for key, name in self.kept.items()
                       if name in self.logger.last})
        self.loss_log.parent.mkdir(parents=True, exist_ok=True)
        with self.loss_log.open("a") as f:
            f.write(json.dumps(record) + "\n")


def build_metrics_processor(job_config, parallel_dims, model_args=None, tag=None):
    return LossLogMetricsProcessor(job_config, parallel_dims, tag)
