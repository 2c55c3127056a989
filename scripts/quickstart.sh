#!/usr/bin/env bash
# The main job: set up, train the debug Qwen3-MoE with UniEP layers (EP = 2) and with
# TorchTitan's own MoE on the embedded corpus, then write the loss-parity report
# (verdict, plot, markdown/JSON, wandb offline run) to outputs/parity/.
# Runs on the GPUs of this machine, or on 2 CPU processes. Extra arguments go to both runs.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
if [ -x .venv/bin/python ]; then PATH="$PWD/.venv/bin:$PATH"; fi
extra=()
if [ "$(python3 -c 'import torch; print(torch.cuda.device_count())')" = 1 ]; then
  # One process per GPU: expert parallelism needs at least two.
  echo "quickstart: one GPU found, so expert-parallel degree 1 (EP 2 needs 2 GPUs or the CPU)"
  extra=(--parallelism.expert_parallel_degree 1)
fi
exec python3 scripts/loss_parity.py run train_configs/qwen3_moe_debug.toml "${extra[@]}" "$@"
