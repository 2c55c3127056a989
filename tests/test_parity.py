"""The loss-parity tool: verdicts on synthetic logs, report files, and real CPU runs
(bitwise for a resumed deterministic run, a band for TorchTitan, a planted difference)."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from recipes.parity import Thresholds, compare, write_reports

ROOT = Path(__file__).resolve().parents[1]


def log(losses, grad_norm=1.0):
    return {s: {"step": s, "loss": v, "grad_norm": grad_norm} for s, v in enumerate(losses, start=1)}


def test_identical_runs_are_bitwise():
    a = log([8.0, 7.5, 7.1])
    report = compare(a, log([8.0, 7.5, 7.1]), expect="bitwise")
    assert report.passed and report.bitwise_equal_steps == 3


def test_one_ulp_breaks_bitwise_and_names_the_step():
    report = compare(log([8.0, 7.5, 7.1]), log([8.0, math.nextafter(7.5, 8.0), 7.1]), expect="bitwise")
    assert not report.passed
    assert "2/3 steps bitwise equal; first difference at step 2" in report.reason


def test_close_band():
    a = log([8.0, 7.0, 6.0])
    assert compare(a, log([8.0, 7.0 * (1 + 5e-3), 6.0]), expect="close").passed
    report = compare(a, log([8.0, 7.0 * (1 + 2e-2), 6.0]), expect="close")
    assert not report.passed and "loss max relative difference 0.0196 > 0.01" in report.reason
    assert compare(a, log([8.0, 7.0 * (1 + 2e-2), 6.0]), expect="close", thresholds=Thresholds(loss_rtol=0.05)).passed


def test_missing_and_non_finite_steps_fail():
    assert "steps logged by only one run: [3]" in compare(log([8.0, 7.0, 6.0]), log([8.0, 7.0]), expect="close").reason
    assert "non-finite" in compare(log([8.0, float("nan")]), log([8.0, 7.0]), expect="close").reason


def test_reports_are_written(tmp_path):
    report = compare(log([8.0, 7.0, 6.5]), log([8.0, 7.01, 6.5]), expect="close", name_a="uniep", name_b="torchtitan")
    paths = write_reports(report, tmp_path)
    summary = json.loads(paths["json"].read_text())
    assert summary["passed"] is True and summary["steps"] == [1, 2, 3]
    assert "**Verdict: PASS** (close)" in paths["markdown"].read_text()
    assert paths["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert paths["wandb"].name.startswith("offline-run-")  # offline: nothing sent
    assert list(paths["wandb"].glob("*.wandb"))
    assert len(list((tmp_path / "wandb").glob("offline-run-*"))) == 3  # uniep, torchtitan, difference


def test_throughput_summary_skips_start_up_and_takes_medians(tmp_path):
    def timed(tps):
        run = log([8.0] * len(tps))
        for s, t in enumerate(tps, start=1):
            run[s].update(tps=t, mfu=t / 100, max_reserved_gib=float(s))
        return run

    # 20 steps: the first two (start-up) are slow and left out of the medians
    a = timed([10.0, 50.0] + [300.0 + i for i in range(18)])
    b = timed([10.0, 50.0] + [200.0] * 18)
    report = compare(a, b, expect="bitwise", name_a="uniep", name_b="torchtitan")
    assert report.throughput["uniep"] == {"tps": 308.5, "mfu": 3.085, "max_reserved_gib": 20.0, "steps": 18}
    assert report.throughput_ratio == 308.5 / 200.0
    text = write_reports(report, tmp_path, plot=False, wandb=False)["markdown"].read_text()
    assert "| uniep | 308 | 3.08 | 20.00 | 18 |" in text and "Throughput uniep / torchtitan: 1.542x" in text
    # logs without throughput (older runs) compare as before
    assert compare(log([8.0]), log([8.0]), expect="bitwise").throughput_ratio is None


def test_cpu_runs_show_n_a_for_device_metrics(tmp_path):
    # CPU runs log tokens/s only (MFU and memory are GPU measurements)
    a, b = log([8.0, 7.0, 6.0]), log([8.0, 7.0, 6.0])
    for run in (a, b):
        for s in run:
            run[s]["tps"] = 100.0
    report = compare(a, b, expect="bitwise", name_a="uniep", name_b="torchtitan")
    assert report.throughput["uniep"]["mfu"] is None and report.throughput["uniep"]["max_reserved_gib"] is None
    text = write_reports(report, tmp_path, plot=False, wandb=False)["markdown"].read_text()
    assert "| uniep | 100 | n/a | n/a | 1 |" in text


def test_a_wandb_failure_costs_one_warning_not_the_report(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb fails, as with a broken install
    report = compare(log([8.0, 7.0]), log([8.0, 7.0]), expect="bitwise")
    paths = write_reports(report, tmp_path)
    assert {"json", "markdown", "png"} <= set(paths) and "wandb" not in paths
    assert all(p.is_file() for p in paths.values())
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("[parity] warning: no wandb run written (ModuleNotFoundError")


def parity_cli(*args):
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "loss_parity.py"), "compare", *args, "--no-wandb"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_resumed_run_is_bitwise_equal_to_the_uninterrupted_one(deepseek_runs, tmp_path):
    result = parity_cli(str(deepseek_runs["uniep"]), str(deepseek_runs["resumed"]), "--expect", "bitwise", "--out", str(tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "PASS (bitwise): 20/20 steps bitwise equal" in result.stdout


@pytest.mark.slow
def test_uniep_matches_torchtitan_within_the_band(deepseek_runs, tmp_path):
    result = parity_cli(str(deepseek_runs["uniep"]), str(deepseek_runs["torchtitan"]), "--names", "uniep,torchtitan",
                        "--out", str(tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "PASS (close)" in result.stdout
    assert (tmp_path / "parity.png").is_file() and (tmp_path / "parity.json").is_file()
    assert "[parity] throughput uniep / torchtitan: " in result.stdout  # both runs logged it


@pytest.mark.slow
def test_planted_learning_rate_difference_fails(deepseek_runs, tmp_path):
    result = parity_cli(str(deepseek_runs["uniep"]), str(deepseek_runs["perturbed_lr"]), "--out", str(tmp_path))
    assert result.returncode == 1, result.stdout + result.stderr
    assert "FAIL (close): loss max relative difference" in result.stdout
