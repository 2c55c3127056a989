"""The parity campaign's bookkeeping on synthetic trainings (a fake ``train`` writes the
loss log a run of those overrides would): which runs it trains, keeps and judges, its
table and exit status, and that it fails when the verdict cannot tell the wrong
variant (negative control)."""

import json
import math
import random
from pathlib import Path

import pytest

import recipes.parity_campaign as campaign

ROOT = Path(__file__).resolve().parents[1]
CONFIG = str(ROOT / "train_configs" / "qwen3_moe_debug.toml")
RUNS = ("titan", "titan_noise1", "titan_again", "uniep", "wrong")


def fake_trainer(calls, wrong_drifts=True):
    """A ``train`` that logs a decaying loss with per-step noise, and for the wrong
    variant a slow drift. (Seeds for which the valid runs fall inside the band: with one
    noise run the band is itself noisy, and an unlucky valid pair can read as drift.)"""

    def train(name, config, folder, overrides, env=None):
        calls.append(name)
        steps = int(overrides[overrides.index("--training.steps") + 1])
        deterministic = "--debug.deterministic" in overrides
        seed = {"titan": 1, "titan_again": 1 if deterministic else 21, "titan_noise1": 17, "titan_noise2": 18, "uniep": 4, "wrong": 5}
        run = name.split("/")[1]
        rnd = random.Random(seed[run])
        # per-step noise: every run's own when not deterministic; when deterministic the two
        # TorchTitan runs are the same, UniEP close, the noise run as non-deterministic as ever
        noise = 0.02 if not deterministic or run == "titan_noise1" else 0.002 if run in ("uniep", "wrong") else 0.0
        drift = 0.2 if run == "wrong" and wrong_drifts else 0.0
        folder.mkdir(parents=True, exist_ok=True)
        with (folder / "loss_log.jsonl").open("w") as f:
            for s in range(1, steps + 1):
                loss = 8.0 - 3.0 * (1 - math.exp(-s / 30)) + noise * rnd.gauss(0, 1) + drift * s / steps
                f.write(json.dumps({"step": s, "loss": loss, "grad_norm": 1.0}) + "\n")

    return train


def run_campaign(monkeypatch, tmp_path, *extra, wrong_drifts=True):
    calls = []
    monkeypatch.setattr(campaign, "train", fake_trainer(calls, wrong_drifts))
    with pytest.raises(SystemExit) as stop:
        campaign.main([CONFIG, "--steps", "60", "--out", str(tmp_path), "--no-wandb", *extra])
    return stop.value.code, calls


def test_a_whole_campaign_meets_its_bars_and_a_second_call_trains_nothing(monkeypatch, tmp_path, capsys):
    code, calls = run_campaign(monkeypatch, tmp_path)
    out = capsys.readouterr().out
    assert code == 0, out
    assert sorted(calls) == sorted(f"{m}/{r}" for m in campaign.MODES for r in RUNS)
    assert "| deterministic | titan_again | bitwise |" in out
    assert "| nondeterministic | uniep | within noise |" in out and "| deterministic | wrong | drift |" in out
    assert "deterministic uniep vs titan" in out and "MISSED" not in out
    assert (tmp_path / "deterministic" / "wrong-vs-titan" / "parity.md").is_file()
    code, calls = run_campaign(monkeypatch, tmp_path)
    assert (code, calls) == (0, [])


def test_only_trains_the_runs_named_and_a_cut_log_is_trained_again(monkeypatch, tmp_path, capsys):
    code, calls = run_campaign(monkeypatch, tmp_path, "--only", "deterministic/titan,deterministic/titan_noise1,"
                                                                 "deterministic/uniep")
    out = capsys.readouterr().out
    assert code == campaign.RUNS_MISSING and sorted(calls) == ["deterministic/titan", "deterministic/titan_noise1",
                                                               "deterministic/uniep"]
    assert "| deterministic | uniep | within noise |" in out and "not yet trained: nondeterministic/titan," in out
    log = tmp_path / "deterministic" / "uniep" / "loss_log.jsonl"
    log.write_text("".join(log.read_text().splitlines(keepends=True)[:30]))  # a run cut short
    code, calls = run_campaign(monkeypatch, tmp_path, "--only", "deterministic/uniep")
    assert calls == ["deterministic/uniep"]


def test_a_wrong_variant_the_verdict_misses_fails_the_campaign(monkeypatch, tmp_path, capsys):
    code, _ = run_campaign(monkeypatch, tmp_path, wrong_drifts=False)
    out = capsys.readouterr().out
    assert code == 1 and "| not drift |" not in out.split("wrong")[1].split("\n")[0]
    assert "| wrong | within noise |" in out and "| drift | MISSED |" in out


def test_more_noise_runs_widen_the_band_from_all_of_them(monkeypatch, tmp_path, capsys):
    code, calls = run_campaign(monkeypatch, tmp_path, "--modes", "deterministic", "--noise-runs", "2")
    out = capsys.readouterr().out
    assert code == 0, out
    assert calls == [f"deterministic/{r}" for r in ("titan", "titan_noise1", "titan_noise2", "titan_again", "uniep",
                                                     "wrong")]
    assert "band from 2 noise run(s)" in out and "2 extra baseline(s)" in out


@pytest.mark.parametrize("args, message", [
    (["--modes", "fast"], "--modes ['fast']: allowed nondeterministic, deterministic"),
    (["--only", "deterministic/tt"], "--only ['deterministic/tt']: allowed nondeterministic/titan,"),
    (["--steps", "0"], "--steps = 0 must be >= 1"),
    (["--noise-runs", "0"], "--noise-runs = 0 must be >= 1"),
    (["--training.steps", "5"], "--job.dump_folder, --training.steps and --debug.deterministic are the campaign's"),
])
def test_bad_input_is_named(monkeypatch, tmp_path, capsys, args, message):
    code, calls = run_campaign(monkeypatch, tmp_path, *args)
    assert (code, calls) == (2, []) and message in capsys.readouterr().err
