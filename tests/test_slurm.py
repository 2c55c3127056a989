"""The Slurm script, run with bash and the SLURM_* variables of a one-node allocation
(``srun`` replaced by a stub that runs its command once), trains the debug config on
CPU, and a resubmission resumes from its last checkpoint."""

import json
import os
import socket
import stat
import subprocess
from pathlib import Path

import pytest

from recipes.loss_log import read_loss_log

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def sbatch(tmp_path, job_id, *args):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    srun = bin_dir / "srun"  # one node, one task: drop srun's own options, run the command
    srun.write_text('#!/bin/bash\nwhile [[ "$1" == --* ]]; do shift; done\nexec "$@"\n')
    srun.chmod(srun.stat().st_mode | stat.S_IEXEC)
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "SLURM_JOB_ID": str(job_id), "SLURM_JOB_NAME": "uniep-test", "SLURM_JOB_NUM_NODES": "1",
        "SLURM_NNODES": "1", "SLURM_JOB_NODELIST": "localhost", "SLURM_SUBMIT_DIR": str(ROOT),
        "NPROC": "2", "OMP_NUM_THREADS": "1", "UNIEP_RDZV_PORT": str(free_port()),
        "UNIEP_LOG_DIR": str(tmp_path / "logs"),
    }
    result = subprocess.run(
        ["bash", str(ROOT / "scripts" / "slurm" / "train.sbatch"), str(ROOT / "train_configs" / "deepseek_v3_debug.toml"),
         "--job.dump_folder", str(tmp_path / "run"), "--metrics.disable_color_printing",
         "--checkpoint.enable", "--checkpoint.interval", "2", "--lr_scheduler.total_steps", "6", *args],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def test_sbatch_trains_and_resumes_on_resubmission(tmp_path):
    first = sbatch(tmp_path, 1001, "--training.steps", "4")
    assert "1 node(s) x 2 processes" in first.stdout
    assert sorted(read_loss_log(tmp_path / "run")) == [1, 2, 3, 4]
    assert (tmp_path / "run" / "checkpoint" / "step-4").is_dir()
    assert any((tmp_path / "logs" / "uniep-test-1001").rglob("*"))  # per-job log folder

    sbatch(tmp_path, 1002, "--training.steps", "6")  # the resubmitted job
    log = read_loss_log(tmp_path / "run")
    assert sorted(log) == [1, 2, 3, 4, 5, 6]
    lines = (tmp_path / "run" / "loss_log.jsonl").read_text().splitlines()
    steps = [json.loads(line)["step"] for line in lines if '"step"' in line]
    assert steps == [1, 2, 3, 4, 5, 6]  # steps 1-4 were not trained again: the job resumed at step 5
    assert '{"resume_from_step": 4}' in lines
