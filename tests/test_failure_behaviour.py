"""Failure behaviour: what a user gets on bad input and on faults. Nothing the user had
is deleted or silently overwritten, and nothing waits without a bound.

The process tests (slow) start real CPU trainings with torchrun and inject the fault:
a rank killed mid-step, a rank frozen, a checkpoint save cut short before --resume."""

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from recipes.loss_log import LOSS_LOG, read_loss_log, start_loss_log
from uniep import UniEPMoE

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "train_configs" / "deepseek_v3_debug.toml"


# data ---------------------------------------------------------------------------------

def test_jsonl_dataset_reads_local_files_offline(tmp_path, monkeypatch):
    from recipes.data import _load_local

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    path = tmp_path / "good.jsonl"
    path.write_text("".join(json.dumps({"text": f"line {i}"}) + "\n" for i in range(50)))
    start = time.monotonic()
    rows = _load_local("jsonl", str(path))
    assert len(rows) == 50 and rows[49]["text"] == "line 49"
    assert time.monotonic() - start < 30  # no network retries


# the layer ----------------------------------------------------------------------------

def test_from_torchtitan_names_what_is_missing():
    with pytest.raises(TypeError, match="expects a torchtitan.models.moe.MoE .* got Linear, which lacks experts.w1"):
        UniEPMoE.from_torchtitan(nn.Linear(4, 4))


@pytest.mark.parametrize("topk, message", [
    (torch.zeros(3, 3, dtype=torch.long), r"shape \(batch\*seq, top_k\) = \(3, 2\); got torch.int64 of shape \(3, 3\)"),
    (torch.zeros(3, 2), r"must be an integer tensor"),
    (torch.tensor([[0, 5], [1, 2], [0, 1]]), r"topk_idx holds experts 0..5; allowed: 0..3"),
    (torch.tensor([[0, 1], [-1, 2], [0, 1]]), r"topk_idx holds experts -1..2; allowed: 0..3"),
    (torch.tensor([[0, 1], [2, 2], [0, 1]]), r"routes token 1 to expert\(s\) more than once: \[2, 2\]"),
])
def test_a_given_routing_is_validated(topk, message):
    layer = UniEPMoE(8, 4, 4, 2)
    layer.init_weights(0.02)
    with pytest.raises(ValueError, match=message):
        layer(torch.randn(1, 3, 8), topk)
    assert layer(torch.randn(1, 3, 8), torch.tensor([[0, 1], [2, 3], [1, 0]])).shape == (1, 3, 8)  # control


# the loss log -------------------------------------------------------------------------

def write_log(folder, records):
    with (folder / LOSS_LOG).open("a") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)


def test_a_new_run_moves_the_old_log_aside(tmp_path):
    write_log(tmp_path, [{"step": s, "loss": 9.0, "grad_norm": 1.0} for s in (1, 2, 3, 4)])
    assert "moved to loss_log.jsonl.1" in start_loss_log(tmp_path, resume_from=None)
    assert not (tmp_path / LOSS_LOG).exists()
    assert len((tmp_path / f"{LOSS_LOG}.1").read_text().splitlines()) == 4  # kept, not deleted
    write_log(tmp_path, [{"step": 1, "loss": 8.0, "grad_norm": 1.0}])
    assert sorted(read_loss_log(tmp_path)) == [1]  # a report never mixes the two runs
    start_loss_log(tmp_path, resume_from=None)
    assert (tmp_path / f"{LOSS_LOG}.2").exists()


def test_a_resumed_log_records_where_and_drops_steps_past_the_checkpoint(tmp_path):
    # steps 1-5 logged, checkpoint at step 4, crash; the resumed run trains 5-6 again
    write_log(tmp_path, [{"step": s, "loss": 10.0 - s, "grad_norm": 1.0} for s in range(1, 6)])
    assert start_loss_log(tmp_path, resume_from=4) is None
    write_log(tmp_path, [{"step": 5, "loss": 4.5, "grad_norm": 1.0}])
    log = read_loss_log(tmp_path)
    assert sorted(log) == [1, 2, 3, 4, 5] and log[5]["loss"] == 4.5
    assert json.loads((tmp_path / LOSS_LOG).read_text().splitlines()[5]) == {"resume_from_step": 4}
    # the resumed run stopped at step 5: the old step 6 must not survive either
    write_log(tmp_path, [{"step": 6, "loss": 3.0, "grad_norm": 1.0}, {"resume_from_step": 5}])
    assert sorted(read_loss_log(tmp_path)) == [1, 2, 3, 4, 5]


# the error file torchrun reads --------------------------------------------------------

@pytest.mark.parametrize("whole", [True, False], ids=["whole", "torch_elastic_as_is"])
def test_an_error_report_cut_short_leaves_no_file_that_breaks_torchrun(tmp_path, monkeypatch, whole):
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure
    from torch.distributed.elastic.multiprocessing.errors.error_handler import ErrorHandler

    from recipes.error_file import write_error_files_whole

    path = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
    monkeypatch.setattr(ErrorHandler, "record_exception", ErrorHandler.record_exception)  # undone after
    if whole:
        write_error_files_whole()

    def report() -> None:  # a surviving rank's training raises on the broken collective
        try:
            raise RuntimeError("Connection closed by peer")
        except RuntimeError as e:
            ErrorHandler().record_exception(e)

    def read_by_agent() -> ProcessFailure:  # what torchrun's agent does with the file
        return ProcessFailure(local_rank=0, pid=1, exitcode=-15, error_file=str(path))

    dump = json.dump

    def sigterm_mid_write(*args, **kwargs):  # torchrun's agent stops the rank between open and dump
        raise KeyboardInterrupt

    monkeypatch.setattr(json, "dump", sigterm_mid_write)
    with pytest.raises(KeyboardInterrupt):
        report()
    if not whole:  # the negative control: the empty file torchrun's agent died on in CI
        assert path.read_text() == ""
        with pytest.raises(json.JSONDecodeError):
            read_by_agent()
        return
    assert not path.exists() and "Signal 15 (SIGTERM)" in read_by_agent().message
    monkeypatch.setattr(json, "dump", dump)
    report()  # not cut short: the whole report arrives
    assert read_by_agent().message["message"] == "RuntimeError: Connection closed by peer"
    assert [p.name for p in tmp_path.iterdir()] == ["error.json"]


# faults in real trainings (torchrun, 2 CPU processes) ---------------------------------

def launch(dump, *args, log_name="out.log"):
    env = {**os.environ, "NPROC": "2", "OMP_NUM_THREADS": "1", "LOG_RANK": "0,1"}
    out = open(dump.parent / log_name, "w")
    proc = subprocess.Popen(
        [str(ROOT / "scripts" / "run_train.sh"), str(CONFIG), "--job.dump_folder", str(dump),
         "--metrics.disable_color_printing", *args],
        cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
    )
    return proc, dump.parent / log_name


def rank_pid(dump: Path, rank: int, timeout: float = 120) -> int:
    """The pid of training rank ``rank`` of the run writing to ``dump``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"recipes.train" in cmd and str(dump).encode() in cmd and f"RANK={rank}".encode() in env \
                    and b"--check-only" not in cmd:
                return int(pid)
        time.sleep(0.5)
    raise AssertionError(f"no rank {rank} process of {dump}")


def wait_for(log: Path, text: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while text not in log.read_text():
        assert time.monotonic() < deadline, f"{text!r} not in {log} after {timeout} s:\n{log.read_text()[-2000:]}"
        time.sleep(0.5)


def finish(proc, timeout: float) -> tuple[int, float]:
    """Exit status and seconds until it came; the whole process group is killed after."""
    start = time.monotonic()
    try:
        return proc.wait(timeout=timeout), time.monotonic() - start
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.mark.slow
def test_a_killed_rank_ends_the_job_promptly_naming_it(tmp_path):
    proc, log = launch(tmp_path / "run", "--training.steps", "200")
    wait_for(log, "step:  2")
    os.kill(rank_pid(tmp_path / "run", 1), signal.SIGKILL)
    code, seconds = finish(proc, timeout=120)
    assert code != 0 and seconds < 60, (code, seconds)
    text = log.read_text()
    assert "local_rank: 1" in text and "SIGKILL" in text, text[-3000:]


@pytest.mark.slow
def test_a_frozen_rank_ends_the_job_within_the_collective_timeout(tmp_path):
    proc, log = launch(tmp_path / "run", "--training.steps", "200", "--comm.train_timeout_seconds", "10")
    wait_for(log, "step:  2")
    frozen = rank_pid(tmp_path / "run", 1)
    os.kill(frozen, signal.SIGSTOP)
    try:
        code, seconds = finish(proc, timeout=150)
    finally:
        for sig in (signal.SIGCONT, signal.SIGKILL):
            try:
                os.kill(frozen, sig)
            except ProcessLookupError:
                pass
    assert code != 0 and seconds < 120, (code, seconds)


@pytest.mark.slow
def test_a_save_cut_short_resumes_from_the_last_complete_step(tmp_path):
    dump = tmp_path / "run"
    checkpointing = ["--checkpoint.enable", "--checkpoint.interval", "2", "--lr_scheduler.total_steps", "4"]
    proc, log = launch(dump, *checkpointing, "--training.steps", "4")
    assert finish(proc, timeout=600)[0] == 0, log.read_text()[-3000:]
    first = read_loss_log(dump)
    (dump / "checkpoint" / "step-4" / ".metadata").unlink()  # as if the job died saving step 4
    proc, log = launch(dump, *checkpointing, "--training.steps", "4", "--resume", log_name="resumed.log")
    assert finish(proc, timeout=600)[0] == 0, log.read_text()[-3000:]
    text = log.read_text()
    assert "step-4 in" in text and "is incomplete" in text and "resuming from step-2" in text
    again = read_loss_log(dump)
    assert sorted(again) == [1, 2, 3, 4]
    assert [again[s]["loss"] for s in (3, 4)] == [first[s]["loss"] for s in (3, 4)]  # steps 3-4 trained again
    assert '{"resume_from_step": 2}' in (dump / LOSS_LOG).read_text()
