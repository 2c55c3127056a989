#!/usr/bin/env bash
# Set up (scripts/setup.sh), lint (ruff, config in pyproject.toml) and run the test suite. Extra arguments go to pytest,
# e.g. scripts/test.sh -m "not slow" for the quick tests only.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh dev
if [ -x .venv/bin/python ]; then PATH="$PWD/.venv/bin:$PATH"; fi
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
python3 -m ruff check uniep recipes scripts tests
exec python3 -m pytest -q "$@"
