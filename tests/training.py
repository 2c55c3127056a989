"""Launching CPU training runs from tests (torchrun via scripts/run_train.sh)."""

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_train(config: str, dump_folder: Path, *args: str, nproc: int = 2, threads: int = 1) -> None:
    env = {**os.environ, "NPROC": str(nproc), "OMP_NUM_THREADS": str(threads), "LOG_RANK": "0,1"}
    result = subprocess.run(
        [str(ROOT / "scripts" / "run_train.sh"), str(ROOT / "train_configs" / config),
         "--job.dump_folder", str(dump_folder), "--metrics.disable_color_printing", *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    with open(Path(dump_folder) / "output.log", "a") as f:
        f.write(result.stdout + result.stderr)
