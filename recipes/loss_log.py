"""The loss log's file, ``<dump_folder>/loss_log.jsonl``: started before training,
read by the parity tool and the tests. Its records are written during training by
``recipes.metrics`` (which needs TorchTitan; reading a log does not).
"""

from __future__ import annotations

import json
from pathlib import Path

LOSS_LOG = "loss_log.jsonl"


def start_loss_log(dump_folder: str | Path, resume_from: int | None) -> str | None:
    """Before training (rank 0): a new run moves an earlier run's log aside (to
    ``loss_log.jsonl.N``, never deleted) and starts a fresh one; a resumed run appends a
    ``{"resume_from_step": N}`` line, after which the steps past N count anew. Returns
    what was done, for the log."""
    path = Path(dump_folder) / LOSS_LOG
    if resume_from is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as f:
            f.write(json.dumps({"resume_from_step": resume_from}) + "\n")
        return None
    if not path.exists():
        return None
    n = 1
    while path.with_name(f"{LOSS_LOG}.{n}").exists():
        n += 1
    path.rename(path.with_name(f"{LOSS_LOG}.{n}"))
    return f"an earlier run's {path} was moved to {path.name}.{n} (this run starts a new loss log)"


def read_loss_log(dump_folder: str | Path) -> dict[int, dict]:
    """step -> record. A ``resume_from_step`` line drops the steps after it logged so far
    (an interrupted run's steps past its last checkpoint); later records of a step win."""
    records = {}
    for line in (Path(dump_folder) / LOSS_LOG).read_text().splitlines():
        record = json.loads(line)
        if "resume_from_step" in record:
            records = {s: r for s, r in records.items() if s <= record["resume_from_step"]}
            continue
        records[record["step"]] = record
    return records
