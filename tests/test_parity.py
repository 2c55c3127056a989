"""The loss-parity tool: verdicts on synthetic logs (a planted drift, a noise band),
bad input, report files, and real CPU runs (bitwise for a resumed run, within noise for
TorchTitan, drift for a deliberately wrong UniEP and a planted learning rate)."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from recipes.parity import LogError, Method, Run, compare, read_run, write_reports

ROOT = Path(__file__).resolve().parents[1]


def log(losses, grad_norm=1.0):
    return {s: {"step": s, "loss": v, "grad_norm": grad_norm} for s, v in enumerate(losses, start=1)}


def run(name, losses, **kw):
    return Run(name, log(losses, **kw))


def noisy(n, seed, scale=0.05, drift=0.0):
    """A decaying loss curve with chaotic per-step noise (spikes), plus a slow drift."""
    import random

    rnd = random.Random(seed)
    return [8.0 - 3.0 * (1 - math.exp(-s / 30)) + scale * rnd.gauss(0, 1) * (3 if s % 17 == 0 else 1)
            + drift * s / n for s in range(1, n + 1)]


def test_identical_runs_are_bitwise():
    report = compare(run("a", [8.0, 7.5, 7.1]), run("b", [8.0, 7.5, 7.1]))
    assert report.verdict == "bitwise" and report.bitwise_equal_steps == 3 and report.passed


def test_expect_bitwise_names_the_first_difference():
    report = compare(run("a", [8.0, 7.5, 7.1]), run("b", [8.0, math.nextafter(7.5, 8.0), 7.1]),
                     method=Method(expect_bitwise=True))
    assert report.verdict == "drift" and "first difference at step 2" in report.reason


def test_two_noisy_runs_are_within_noise_and_a_drift_is_not():
    """200 chaotic steps: per-step differences reach several percent, yet a run with the
    same statistics is within the band two valid runs give; a slow 3% drift is not."""
    base, same, noise = noisy(200, 1), noisy(200, 2), noisy(200, 3)
    per_step = max(abs(x - y) / y for x, y in zip(same, base))
    assert per_step > 0.03  # the old per-step 1% verdict would have failed this pair
    ok = compare(run("cand", same), run("base", base), [run("noise", noise)])
    assert ok.verdict == "within noise", ok.reason
    bad = compare(run("cand", noisy(200, 2, drift=0.15)), run("base", base), [run("noise", noise)])
    assert bad.verdict == "drift" and "beyond noise" in bad.reason, bad.reason


def test_without_extra_baselines_the_floor_decides():
    base = [8.0, 7.0, 6.5, 6.0, 5.8]
    assert compare(run("a", [x * (1 + 1e-6) for x in base]), run("b", base)).verdict == "within noise"
    report = compare(run("a", [x * (1 + 1e-3) for x in base]), run("b", base))
    assert report.verdict == "drift" and "no measured noise band" in report.reason


def test_runs_of_different_lengths_are_compared_over_common_steps():
    report = compare(run("a", [8.0, 7.0, 6.0]), run("b", [8.0, 7.0]))
    assert report.steps == [1, 2] and "differ in length (a 3 steps, b 2 steps)" in report.note


def test_non_finite_is_drift():
    assert compare(run("a", [8.0, float("nan")]), run("b", [8.0, 7.0])).verdict == "drift"


def write_log(folder, lines):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "loss_log.jsonl").write_text("".join(line + "\n" for line in lines))
    return folder


@pytest.mark.parametrize("lines, message", [
    (None, "is not a folder"),
    ([], "no steps logged"),
    (['{"step": 1, "loss": 8.0, "grad_norm": 1.0}', '{"step": 2, "loss": 7.'], "loss_log.jsonl:2: not a JSON record"),
    (['{"step": 1, "loss": 8.0}'], "loss_log.jsonl:1: record without grad_norm"),
])
def test_bad_input_names_the_file_and_line(tmp_path, lines, message):
    folder = tmp_path / "run" if lines is None else write_log(tmp_path / "run", lines)
    with pytest.raises(LogError, match=message):
        read_run(folder, "a")


def parity_cli(*args, command="compare"):
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "loss_parity.py"), command, *args, "--no-wandb"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_cli_bad_input_exits_2_with_one_message(tmp_path):
    good = write_log(tmp_path / "good", ['{"step": 1, "loss": 8.0, "grad_norm": 1.0}'])
    truncated = write_log(tmp_path / "cut", ['{"step": 1, "loss": 8.0, "grad_norm": 1.0}', '{"step": 2, "lo'])
    cases = [
        ((str(good), str(tmp_path / "missing")), "is not a folder"),
        ((str(good), str(truncated)), "cut/loss_log.jsonl:2: not a JSON record"),
        ((str(good), str(good), "--names", "x,x"), "run names must differ"),
        ((str(good), str(truncated), "--names", "a,b,c"), "give up to 2 non-empty names"),
    ]
    for args, message in cases:
        result = parity_cli(*args)
        assert result.returncode == 2, (args, result.stdout, result.stderr)
        assert message in result.stderr and "Traceback" not in result.stderr, result.stderr


def test_run_refuses_a_dump_folder(tmp_path):
    result = parity_cli(str(ROOT / "train_configs" / "deepseek_v3_debug.toml"), "--job.dump_folder", str(tmp_path),
                        command="run")
    assert result.returncode == 2 and "--job.dump_folder: each run gets its own folder" in result.stderr
    assert not any(tmp_path.iterdir())  # nothing trained, nothing written or deleted


def test_run_labels_come_from_what_ran():
    from recipes.parity_cli import label

    config = {"model": {"name": "uniep_qwen3"}, "parallelism": {"expert_parallel_degree": 2}}
    assert label(config, []) == "uniep_qwen3[all_to_all,ep2]"
    assert label(config, ["--uniep.transport", "megakernel"]) == "uniep_qwen3[megakernel,ep2]"
    assert label(config, ["--model.name", "titan_qwen3", "--parallelism.expert_parallel_degree=1"]) == "titan_qwen3[ep1]"


def test_noise_runs_split_each_batch_and_perturb_the_weights(capsys):
    """A noise run changes rounding, not math: non-deterministic kernels, two
    gradient-accumulation microbatches (on a GPU in float32 the kernels alone changed
    no bit of TorchTitan's run, so the band was 0), and the initial weights one ulp away,
    a different sample per noise run. An odd batch cannot split: said once."""
    from recipes.parity_cli import noise_args

    base = ["--debug.deterministic", "--model.name", "titan_qwen3"]
    assert noise_args({"training": {"local_batch_size": 4}}, base, 2) == [
        "--model.name", "titan_qwen3", "--perturb-weights", "2", "--microbatches", "2"]
    odd = [*base, "--training.local_batch_size", "1"]
    assert noise_args({"training": {"local_batch_size": 4}}, odd, 1) == [*odd[1:], "--perturb-weights", "1"]
    assert noise_args({"training": {"local_batch_size": 4}}, odd, 2) == [*odd[1:], "--perturb-weights", "2"]
    assert capsys.readouterr().out.count("does not split into two microbatches") == 1


def ulps_moved(before: torch.Tensor, after: torch.Tensor) -> torch.Tensor:
    """+1 / -1 where ``after`` is the next float above / below ``before``, else 0."""
    inf = torch.tensor(float("inf"), dtype=before.dtype)
    return (after == torch.nextafter(before, inf)).int() - (after == torch.nextafter(before, -inf)).int()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_perturbed_weights_move_one_ulp_each_way_alike_for_equal_values(dtype):
    from recipes.perturb import perturb_

    weights = torch.randn(4096).to(dtype)
    weights[:8] = 0.0
    moved = weights.clone()
    perturb_(moved, 1)
    direction = ulps_moved(weights, moved)
    assert (direction != 0).all()  # every element, exactly one ulp
    assert 0.4 < (direction > 0).float().mean() < 0.6  # up and down alike, no bias
    # the direction depends on the value alone: a replica, or a shard laid out in
    # another order, moves the same way
    order = torch.randperm(4096)
    shuffled = weights[order].clone()
    perturb_(shuffled, 1)
    assert torch.equal(shuffled, moved[order])
    # another noise run is another sample
    other = weights.clone()
    perturb_(other, 2)
    assert 0.3 < (ulps_moved(weights, other) != direction).float().mean() < 0.7


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_perturbed_weights_move_alike_on_gpu_and_cpu(dtype):
    """The GPU main job's noise runs perturb CUDA parameters: each moves as its CPU copy
    does (the CPU test above pins the CPU's moves)."""
    from recipes.perturb import perturb_

    weights = torch.randn(1 << 20).to(dtype)
    on_cpu, on_gpu = weights.clone(), weights.cuda()
    perturb_(on_cpu, 5)
    perturb_(on_gpu, 5)
    assert torch.equal(on_gpu.cpu(), on_cpu) and (ulps_moved(weights, on_cpu) != 0).all()


def test_perturbing_a_model_moves_every_parameter_and_refuses_bad_input(monkeypatch):
    from recipes import perturb
    from recipes.perturb import perturb_, perturb_model_

    monkeypatch.setattr(perturb, "_CHUNK", 5)  # chunks that do not divide the tensors
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
    before = [p.detach().clone() for p in model.parameters()]
    assert perturb_model_([model], 3) == sum(p.numel() for p in before)
    for b, p in zip(before, model.parameters()):
        whole = b.clone()
        perturb_(whole, 3)
        assert torch.equal(p.detach(), whole)  # chunked as in one piece
        assert (ulps_moved(b, p.detach()) != 0).all()
    with pytest.raises(ValueError, match="--perturb-weights = 0 must be >= 1"):
        perturb_(torch.zeros(2), 0)
    with pytest.raises(ValueError, match="dtype torch.float64 are not supported"):
        perturb_(torch.zeros(2, dtype=torch.float64), 1)


def test_reports_are_written(tmp_path):
    report = compare(run("uniep", noisy(30, 1)), run("torchtitan", noisy(30, 2)), [run("torchtitan~noise1", noisy(30, 3))])
    paths = write_reports(report, tmp_path)
    summary = json.loads(paths["json"].read_text())
    assert summary["verdict"] == report.verdict and summary["steps"] == list(range(1, 31))
    assert summary["band"] is not None and set(summary["statistics"]) == {"max window", "last window", "run mean"}
    assert f"**Verdict: {report.verdict}**" in paths["markdown"].read_text()
    assert paths["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert paths["wandb"].name.startswith("offline-run-")  # offline: nothing sent
    assert len(list((tmp_path / "wandb").glob("offline-run-*"))) == 4  # 3 trainings and the parity run


def test_throughput_summary_skips_start_up_and_takes_medians(tmp_path):
    def timed(tps):
        records = log([8.0] * len(tps))
        for s, t in enumerate(tps, start=1):
            records[s].update(tps=t, mfu=t / 100, max_reserved_gib=float(s))
        return records

    a = Run("uniep", timed([10.0, 50.0] + [300.0 + i for i in range(18)]))
    b = Run("torchtitan", timed([10.0, 50.0] + [200.0] * 18))
    report = compare(a, b)
    assert report.throughput["uniep"] == {"tps": 308.5, "mfu": 3.085, "max_reserved_gib": 20.0, "steps": 18}
    assert report.throughput_ratio == 308.5 / 200.0
    text = write_reports(report, tmp_path, plot=False, wandb=False)["markdown"].read_text()
    assert "| uniep | 308 | 3.08 | 20.00 | 18 |" in text and "Throughput uniep / torchtitan: 1.542x" in text


def test_cpu_runs_show_n_a_for_device_metrics(tmp_path):
    a, b = log([8.0, 7.0, 6.0]), log([8.0, 7.0, 6.0])
    for records in (a, b):
        for s in records:
            records[s]["tps"] = 100.0
    report = compare(Run("uniep", a), Run("torchtitan", b))
    assert report.throughput["uniep"]["mfu"] is None and report.throughput["uniep"]["max_reserved_gib"] is None
    text = write_reports(report, tmp_path, plot=False, wandb=False)["markdown"].read_text()
    assert "| uniep | 100 | n/a | n/a | 1 |" in text


def test_a_wandb_failure_costs_one_warning_not_the_report(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb fails, as with a broken install
    report = compare(run("a", [8.0, 7.0]), run("b", [8.0, 7.0]))
    paths = write_reports(report, tmp_path)
    assert {"json", "markdown", "png"} <= set(paths) and "wandb" not in paths
    assert all(p.is_file() for p in paths.values())
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("[parity] warning: no wandb run written (ModuleNotFoundError")


@pytest.mark.slow
def test_resumed_run_is_bitwise_equal_to_the_uninterrupted_one(deepseek_runs, tmp_path):
    result = parity_cli(str(deepseek_runs["uniep"]), str(deepseek_runs["resumed"]), "--expect-bitwise", "--out", str(tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "[parity] verdict: bitwise: 20/20 steps bitwise equal" in result.stdout


@pytest.mark.slow
def test_uniep_matches_torchtitan_within_noise(deepseek_runs, tmp_path):
    result = parity_cli(str(deepseek_runs["uniep"]), str(deepseek_runs["torchtitan"]), str(deepseek_runs["torchtitan_noise1"]),
                        str(deepseek_runs["torchtitan_noise2"]), "--out", str(tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "[parity] verdict: within noise" in result.stdout
    for number in (1, 2):  # each noise run is its own sample
        log = (deepseek_runs[f"torchtitan_noise{number}"] / "output.log").read_text()
        assert f"--perturb-weights {number}: " in log and "weights on this rank moved one ulp" in log
    assert (tmp_path / "parity.png").is_file() and (tmp_path / "parity.json").is_file()
    assert "[parity] throughput uniep / torchtitan: " in result.stdout  # both runs logged it


@pytest.mark.slow
@pytest.mark.parametrize("wrong", ["wrong_scores", "perturbed_lr"])
def test_a_wrong_variant_drifts(deepseek_runs, tmp_path, wrong):
    """Negative controls: router scores scaled by 0.98, and twice the learning rate."""
    result = parity_cli(str(deepseek_runs[wrong]), str(deepseek_runs["torchtitan"]), str(deepseek_runs["torchtitan_noise1"]),
                        str(deepseek_runs["torchtitan_noise2"]), "--out", str(tmp_path))
    assert result.returncode == 1, result.stdout + result.stderr
    assert "[parity] verdict: drift: windowed mean loss differs beyond noise" in result.stdout
