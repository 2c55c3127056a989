#!/usr/bin/env bash
# Create .venv (reusing a torch/triton already installed on the system, e.g. on GPU
# hosts) and install UniEP with its dependencies. Safe to run again.
#
# Without an NVIDIA GPU it installs torch 2.13.0 first; set PIP_INDEX_URL or
# PIP_EXTRA_INDEX_URL to a CPU-only wheel index if your default index serves CUDA builds.
set -euo pipefail
cd "$(dirname "$0")/.."

python3 -m venv --system-site-packages .venv
py=.venv/bin/python
if ! "$py" -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    "$py" -m pip install -q "torch>=2.11,<2.15"
  else
    echo "setup: no GPU found, installing torch 2.13.0 (CPU)"
    "$py" -m pip install -q torch==2.13.0
  fi
fi
"$py" -m pip install -q -e ".[dev]"
"$py" -c "import torch, torchtitan, uniep; print(f'setup: torch {torch.__version__}, torchtitan {torchtitan.__version__}, CUDA {torch.cuda.is_available()}')"
