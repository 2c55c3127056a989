#!/usr/bin/env bash
# Set up, then train the debug Qwen3-MoE with UniEP layers (EP = 2) on the embedded
# corpus, on the GPUs of this machine or on 2 CPU processes.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec scripts/run_train.sh train_configs/qwen3_moe_debug.toml --overwrite-checkpoints "$@"
