"""End to end: torchrun with 2 CPU processes (gloo), EP = 2, the debug configs on the
embedded corpus and tokenizer."""

import math
import os
import subprocess
from pathlib import Path

import pytest

from recipes.metrics import read_loss_log

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def run_train(config, dump_folder, *args):
    env = {**os.environ, "NPROC": "2", "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [str(ROOT / "scripts" / "run_train.sh"), str(ROOT / "train_configs" / config),
         "--job.dump_folder", str(dump_folder), "--metrics.disable_color_printing", *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return read_loss_log(dump_folder)


def losses(log, steps):
    return [log[s]["loss"] for s in steps]


def assert_trains(log, steps):
    assert sorted(log) == list(range(1, steps + 1))
    values = losses(log, range(1, steps + 1))
    assert all(math.isfinite(v) for v in values)
    # falls: the last five steps average well below the first five
    assert sum(values[-5:]) / 5 < sum(values[:5]) / 5 - 0.5, values


def test_qwen3_moe_debug_trains_with_ep2(tmp_path):
    assert_trains(run_train("qwen3_moe_debug.toml", tmp_path), 20)


def test_deepseek_v3_debug_trains_and_resumes_bitwise(tmp_path):
    checkpointing = ["--checkpoint.enable", "--checkpoint.interval", "10"]
    full = run_train("deepseek_v3_debug.toml", tmp_path / "full", *checkpointing)
    assert_trains(full, 20)

    # same job stopped at step 10 (checkpoint written; LR schedule still planned for 20
    # steps, as in a job that was interrupted), then resumed to step 20
    part = tmp_path / "part"
    first = run_train(
        "deepseek_v3_debug.toml", part, *checkpointing, "--training.steps", "10", "--lr_scheduler.total_steps", "20"
    )
    assert sorted(first) == list(range(1, 11))
    assert (part / "checkpoint" / "step-10").is_dir()
    resumed = run_train("deepseek_v3_debug.toml", part, *checkpointing, "--resume")
    # bitwise: deterministic mode, fixed seed, deterministic UniEP layers
    assert losses(first, range(1, 11)) == losses(full, range(1, 11))
    assert losses(resumed, range(11, 21)) == losses(full, range(11, 21))
