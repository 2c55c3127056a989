#!/usr/bin/env bash
# Install UniEP and its dependencies. Safe to run again.
#
#   scripts/setup.sh        # what training needs (the quickstart)
#   scripts/setup.sh dev    # and the test and lint tools (pytest, triton, ruff; scripts/test.sh)
#
# Where: an existing .venv; else the active Python environment (a virtual environment,
# conda, or the system) when it already has torch 2.11-2.14, as on GPU clusters, so a
# GPU machine never gets a second torch; else a new .venv (with torch 2.13.0 for the
# CPU when there is no NVIDIA GPU). The scripts then use .venv if it exists, else the
# active environment.
#
# Offline (no package index): PIP_NO_INDEX=1 PIP_FIND_LINKS=/path/to/wheels scripts/setup.sh
# (pip reads both; the folder needs every package pip would otherwise download).
# Set PIP_INDEX_URL or PIP_EXTRA_INDEX_URL to a CPU-only wheel index if your default
# index serves CUDA builds of torch.
set -euo pipefail
cd "$(dirname "$0")/.."

suitable_torch='import sys, torch
major, minor = (int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
sys.exit(0 if (2, 11) <= (major, minor) < (2, 15) else 1)'

if [ -x .venv/bin/python ]; then
  py=.venv/bin/python
elif python3 -c "$suitable_torch" 2>/dev/null; then
  py=python3
  echo "setup: installing into the active environment ($(python3 -c 'import sys; print(sys.prefix)')," \
       "torch $(python3 -c 'import torch; print(torch.__version__)'))"
else
  if python3 -c 'import torch' 2>/dev/null; then
    echo "setup: the active environment's torch $(python3 -c 'import torch; print(torch.__version__)')" \
         "is outside 2.11-2.14 (TorchTitan 0.2.2); creating .venv"
  fi
  python3 -m venv .venv
  py=.venv/bin/python
  if command -v nvidia-smi >/dev/null 2>&1; then
    "$py" -m pip install -q "torch>=2.11,<2.15"
  else
    echo "setup: no GPU found, installing torch 2.13.0 (CPU) into .venv"
    "$py" -m pip install -q torch==2.13.0
  fi
fi
"$py" -m pip install -q -e ".${1:+[$1]}"
"$py" -c "import torch, torchtitan, uniep; print(f'setup: torch {torch.__version__}, torchtitan {torchtitan.__version__}, CUDA {torch.cuda.is_available()}')"
