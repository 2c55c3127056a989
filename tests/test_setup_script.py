"""scripts/setup.sh picks where to install: an environment that already has a suitable
torch (a GPU cluster's virtual environment or conda) is used as it is, never given a
second torch; without one, a new .venv gets torch. Run against a stand-in python3 that
logs what it is asked to do."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# A python3 that answers the setup script's questions from $FAKE_TORCH ("" = no torch)
# and logs every other call. ``-m venv DIR`` makes DIR/bin/python (this same stand-in).
FAKE_PYTHON = r"""#!/usr/bin/env bash
echo "$0 $*" >> "$CALL_LOG"
if [ "$1" = "-c" ]; then
  case "$2" in
    *"sys.exit(0 if"*) [ "$FAKE_TORCH" = "2.11.0+cu130" ] || [ "$FAKE_TORCH" = "2.13.0+cpu" ]; exit $? ;;
    "import torch") [ -n "$FAKE_TORCH" ]; exit $? ;;
    *) echo "$FAKE_TORCH"; exit 0 ;;
  esac
fi
if [ "$1" = "-m" ] && [ "$2" = "venv" ]; then
  mkdir -p "$3/bin"; cp "$0" "$3/bin/python"; exit 0
fi
exit 0
"""


def run_setup(tmp_path, torch_version, has_gpu=False):
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / "setup.sh", repo / "scripts" / "setup.sh")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").write_text(FAKE_PYTHON)
    (bin_dir / "python3").chmod(0o755)
    if has_gpu:
        (bin_dir / "nvidia-smi").write_text("#!/bin/sh\nexit 0\n")
        (bin_dir / "nvidia-smi").chmod(0o755)
    log = tmp_path / "calls.log"
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "CALL_LOG": str(log), "FAKE_TORCH": torch_version,
           "HOME": os.environ.get("HOME", "/tmp")}
    result = subprocess.run(["bash", str(repo / "scripts" / "setup.sh")], env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    return result.stdout, log.read_text().splitlines(), repo


@pytest.mark.parametrize("version", ["2.11.0+cu130", "2.13.0+cpu"])
def test_active_environment_with_torch_is_used_as_is(tmp_path, version):
    out, calls, repo = run_setup(tmp_path, version, has_gpu=True)
    assert "installing into the active environment" in out
    assert not (repo / ".venv").exists()
    assert not any("-m venv" in c for c in calls)
    assert not any("pip install" in c and "torch" in c for c in calls), calls  # no second torch
    assert any(c.endswith("-m pip install -q -e .") and "/bin/python3 " in c for c in calls), calls


def test_without_torch_a_venv_gets_one(tmp_path):
    out, calls, repo = run_setup(tmp_path, "")
    assert (repo / ".venv" / "bin" / "python").exists()
    assert any("-m venv .venv" in c for c in calls)
    assert any(".venv/bin/python -m pip install -q torch==2.13.0" in c for c in calls), calls


def test_unsupported_torch_is_not_used(tmp_path):
    out, calls, repo = run_setup(tmp_path, "2.9.1")
    assert "outside 2.11-2.14" in out
    assert (repo / ".venv").exists()
