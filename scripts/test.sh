#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the test suite. Extra arguments go to pytest,
# e.g. scripts/test.sh -m "not slow" for the quick tests only.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
if [ -x .venv/bin/python ]; then PATH="$PWD/.venv/bin:$PATH"; fi
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec python3 -m pytest -q "$@"
