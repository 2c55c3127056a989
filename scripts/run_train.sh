#!/usr/bin/env bash
# Train with a TOML config under torchrun, on the GPUs of this node or on the CPU.
#
#   scripts/run_train.sh CONFIG.toml [--section.key value ...] [--resume | --overwrite-checkpoints] [--microbatches N] [--perturb-weights N]
#
# NPROC   processes (default: number of GPUs, or 2 on a machine without GPUs)
# Overrides use TorchTitan's --section.key value form, e.g. --training.steps 50.
set -euo pipefail

if [ $# -lt 1 ] || [ ! -f "$1" ]; then
  echo "usage: $0 CONFIG.toml [--section.key value ...]   (config ${1:-<none>} not found)" >&2
  exit 2
fi
config=$1
shift

cd "$(dirname "$0")/.."
if [ -x .venv/bin/python ]; then PATH="$PWD/.venv/bin:$PATH"; fi
if [ -z "${NPROC:-}" ]; then
  NPROC=$(python -c "import torch; print(torch.cuda.device_count() or 2)")
fi
# NVLink multicast stays off unless the user turns it on (see README).
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
export TORCH_SYMM_MEM_DISABLE_MULTICAST=${TORCH_SYMM_MEM_DISABLE_MULTICAST:-1}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

# The config is checked once here, so an error reads as one message, not one per rank.
WORLD_SIZE=$NPROC python -m recipes.train --check-only --job.config_file "$config" "$@" >/dev/null || exit $?

exec torchrun --standalone --nproc_per_node="$NPROC" --local-ranks-filter="${LOG_RANK:-0}" --role rank --tee 3 \
  -m recipes.train --job.config_file "$config" "$@"
