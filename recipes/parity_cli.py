"""``scripts/loss_parity.py``: train the runs (or read their logs) and write the parity report.

    loss_parity.py run CONFIG.toml [--baseline torchtitan|uniep] [--noise-runs N] [--no-deterministic]
                                   [--a-args "..."] [--b-args "..."] [--names CANDIDATE,BASELINE]
                                   [--window W] [--k K] [--floor F] [--expect-bitwise] [--out DIR]
                                   [overrides for every run ...]
    loss_parity.py compare CANDIDATE BASELINE [MORE_BASELINES ...] [--names A,B,...]
                                   [--window W] [--k K] [--floor F] [--expect-bitwise] [--out DIR]

``run`` trains, one after the other with ``scripts/run_train.sh`` on the same seed and
data: the candidate (the config as given), the baseline and ``--noise-runs`` more runs
of the baseline (default 1) with changes of rounding, not math, which measure the
noise band: non-deterministic kernels, twice the CPU threads, each batch as two
gradient-accumulation microbatches (``recipes.train --microbatches 2``, where the local
batch size is even: on a GPU in float32 the first two alone can leave a run bit for
bit the same, a band of 0), and every initial weight one ulp away, noise run ``i``
with ``recipes.train --perturb-weights i`` (``recipes.perturb``: without it, noise
runs on a CPU were copies of one run and too close to the baseline). ``--baseline
torchtitan`` (default) swaps the UniEP model for TorchTitan's own MoE (``uniep_qwen3`` ->
``titan_qwen3``; on a machine without GPUs at expert-parallel degree 1, since
TorchTitan's EP needs a Triton GPU kernel); ``--baseline uniep`` runs the config again
(differences in ``--b-args``, e.g. ``--b-args "--uniep.transport megakernel"``). Runs
are deterministic (``--debug.deterministic``) unless ``--no-deterministic``.

``compare`` judges finished runs (folders with ``loss_log.jsonl``): the first is the
candidate, the second the baseline, any more are extra baselines that give the band.

Exit status: 0 bitwise or within noise, 1 drift, 2 bad input (named), 3 a training failed.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python < 3.11
    import tomli as tomllib

from recipes.parity import LogError, Method, compare_folders, fmt, write_reports
from recipes.preflight import job_setting

ROOT = Path(__file__).resolve().parents[1]
BAD_INPUT, TRAINING_FAILED = 2, 3
"""Exit statuses besides 0 (parity holds) and 1 (drift)."""


def train(name: str, config: str, dump_folder: Path, args: list[str], env: dict[str, str] | None = None) -> None:
    """Run one training, echoing its step lines; its full log goes to dump_folder/train.log."""
    dump_folder.mkdir(parents=True, exist_ok=True)
    log = dump_folder / "train.log"
    cmd = [str(ROOT / "scripts" / "run_train.sh"), config, "--job.dump_folder", str(dump_folder),
           "--metrics.disable_color_printing", "--overwrite-checkpoints", *args]
    print(f"[parity] training {name}: {shlex.join(cmd)}", flush=True)
    with log.open("w") as f, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                              env={**os.environ, **(env or {})}) as proc:
        for line in proc.stdout:
            f.write(line)
            if "step:" in line or "configuration error" in line:
                print(f"[parity] {name}: {line.split(' - ')[-1].rstrip()}", flush=True)
    if proc.returncode != 0:
        tail = "".join(log.read_text().splitlines(keepends=True)[-15:])
        print(f"{tail}[parity] training {name} failed (exit {proc.returncode}); full log: {log}", file=sys.stderr)
        sys.exit(TRAINING_FAILED)


def label(config: dict, overrides: list[str]) -> str:
    """What ran: model name, and for UniEP models the transport, and the EP degree."""
    from recipes.models import BASELINE_OF  # TorchTitan: imported only where runs are trained

    model = job_setting(config, overrides, "model", "name", "?")
    ep = job_setting(config, overrides, "parallelism", "expert_parallel_degree", 1)
    if model in BASELINE_OF:
        return f"{model}[{job_setting(config, overrides, 'uniep', 'transport', 'all_to_all')},ep{ep}]"
    return f"{model}[ep{ep}]"


def baseline_args(config: dict, baseline: str) -> list[str]:
    if baseline == "uniep":
        return []
    from recipes.models import BASELINE_OF

    model_name = config.get("model", {}).get("name")
    if model_name not in BASELINE_OF:
        raise ValueError(f"--baseline torchtitan: model.name = {model_name!r}; allowed: {', '.join(BASELINE_OF)}")
    args = ["--model.name", BASELINE_OF[model_name]]
    import torch

    if not torch.cuda.is_available():
        args += ["--parallelism.expert_parallel_degree", "1"]
    return args


def _folder(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("_")


def _names(given: str | None, defaults: list[str]) -> list[str]:
    """``--names`` (comma-separated, in run order; fewer than the runs: the rest keep
    their defaults) or the defaults; distinct."""
    names = list(defaults)
    if given is not None:
        parts = [p.strip() for p in given.split(",")]
        if len(parts) > len(defaults) or not all(parts):
            raise ValueError(f"--names {given!r}: give up to {len(defaults)} non-empty names, comma-separated "
                             f"(candidate, baseline{', extra baselines' if len(defaults) > 2 else ''})")
        names[:len(parts)] = parts
    if len(set(names)) != len(names):
        raise ValueError(f"run names must differ; got {names} (set them with --names)")
    return names


def _refuse_dump_folder(*arg_lists: list[str]) -> None:
    for args in arg_lists:
        for arg in args:
            if arg.partition("=")[0] in ("--job.dump_folder", "--job.dump-folder"):
                raise ValueError("--job.dump_folder: each run gets its own folder under --out; set --out instead "
                                 "(one folder for several runs would mix their logs and checkpoints)")


def _run_all(args, overrides: list[str]) -> tuple[list[Path], list[str], Path]:
    """Train the candidate, the baseline and the noise runs; their folders and names."""
    if not Path(args.config).is_file():
        raise ValueError(f"config {args.config!r}: no such file")
    if args.noise_runs < 0:
        raise ValueError(f"--noise-runs = {args.noise_runs} must be >= 0")
    a_args, b_args = shlex.split(args.a_args), shlex.split(args.b_args)
    _refuse_dump_folder(overrides, a_args, b_args)
    with open(args.config, "rb") as f:
        config = tomllib.load(f)
    common = [*overrides] + ([] if args.no_deterministic else ["--debug.deterministic"])
    cand = [*common, *a_args]
    base = [*common, *baseline_args(config, args.baseline), *b_args]
    defaults = [label(config, cand), label(config, base)]
    if defaults[0] == defaults[1]:
        defaults[1] += "#b"
    defaults += [f"{defaults[1]}~noise{i + 1}" for i in range(args.noise_runs)]
    names = _names(args.names, defaults)
    out = Path(args.out or f"outputs/parity/{Path(args.config).stem}-vs-{args.baseline}")
    folders = [out / _folder(n) for n in names]
    train(names[0], args.config, folders[0], cand)
    train(names[1], args.config, folders[1], base)
    for number, (name, folder) in enumerate(zip(names[2:], folders[2:]), start=1):
        train(name, args.config, folder, noise_args(config, base, number), env=noise_env())
    return folders, names, out


def noise_args(config: dict, base: list[str], number: int) -> list[str]:
    """The baseline's arguments for noise run ``number`` (1, 2, ...): non-deterministic
    kernels, the initial weights one ulp away (a different sample for each number) and,
    where the local batch splits in two, two gradient-accumulation microbatches per step."""
    noise = [*(a for a in base if a != "--debug.deterministic"), "--perturb-weights", str(number)]
    local = int(job_setting(config, base, "training", "local_batch_size", 8))  # TorchTitan's default
    if local % 2 == 0:
        return [*noise, "--microbatches", "2"]
    if number == 1:
        print(f"[parity] noise runs: training.local_batch_size = {local} does not split into two microbatches; "
              "they change the kernels' determinism, the CPU threads and the initial weights' last bits", flush=True)
    return noise


def noise_env() -> dict[str, str]:
    """A noise run's environment: twice this process's CPU threads."""
    return {"OMP_NUM_THREADS": str(2 * int(os.environ.get("OMP_NUM_THREADS", "1")))}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="loss_parity.py", description="Loss parity between training runs.")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="train the candidate, the baseline and the noise runs, then compare")
    run.add_argument("config")
    run.add_argument("--baseline", choices=("torchtitan", "uniep"), default="torchtitan")
    run.add_argument("--noise-runs", type=int, default=1, help="extra baseline runs that measure the noise band")
    run.add_argument("--no-deterministic", action="store_true", help="TorchTitan's default (fast) kernels")
    run.add_argument("--a-args", default="", help="extra overrides for the candidate (quoted)")
    run.add_argument("--b-args", default="", help="extra overrides for the baseline and noise runs (quoted)")
    cmp_ = sub.add_parser("compare", help="judge finished runs (their dump folders)")
    cmp_.add_argument("runs", nargs="+", metavar="RUN", help="candidate, baseline, extra baselines")
    for p in (run, cmp_):
        p.add_argument("--names", default=None, help="labels of the runs in order, comma-separated")
        p.add_argument("--window", type=int, default=None, help="steps per window (default: a tenth, at least 5)")
        p.add_argument("--k", type=float, default=Method.k, help="tolerance = k x the noise band ...")
        p.add_argument("--floor", type=float, default=Method.floor, help="... or this fraction of the mean loss")
        p.add_argument("--expect-bitwise", action="store_true", help="anything short of bitwise is drift")
        p.add_argument("--out", default=None, help="report folder (default: next to the runs)")
        p.add_argument("--no-wandb", action="store_true", help="skip the wandb run group")
    args, overrides = parser.parse_known_args(argv)

    try:
        if args.window is not None and args.window < 1:
            raise ValueError(f"--window = {args.window} must be >= 1")
        if args.command == "run":
            folders, names, out = _run_all(args, overrides)
        else:
            if overrides:
                raise ValueError(f"unknown arguments {overrides}")
            if len(args.runs) < 2:
                raise ValueError("compare needs a candidate and a baseline run folder")
            folders = [Path(r) for r in args.runs]
            names = _names(args.names, [_folder(f.name) or f"run{i}" for i, f in enumerate(folders)])
            out = Path(args.out or folders[0].parent / "parity")
        method = Method(args.window, args.k, args.floor, args.expect_bitwise)
        report = compare_folders(folders, names, method)
    except (ValueError, LogError) as e:
        print(f"[parity] error: {e}", file=sys.stderr)
        sys.exit(BAD_INPUT)
    paths = write_reports(report, out, wandb=not args.no_wandb)
    print(f"[parity] verdict: {report.verdict}: {report.reason}")
    print(f"[parity] compared {report.note}; window {report.window} steps; bitwise-equal steps "
          f"{report.bitwise_equal_steps}/{len(report.steps)}")
    for k in report.statistics:
        band = fmt(report.band[k] if report.band else None, ".3e")
        print(f"[parity]   {k:11s} |mean loss diff| {report.statistics[k]:.3e}  band {band}  "
              f"tolerance {report.tolerance[k]:.3e}")
    for name, t in report.throughput.items():
        print(f"[parity] {name}: {t['tps']:.0f} tokens/s per device, MFU {fmt(t['mfu'], '.2f')}%, "
              f"peak reserved {fmt(t['max_reserved_gib'], '.2f')} GiB (median of {t['steps']} steps)")
    if report.throughput_ratio is not None:
        print(f"[parity] throughput {report.candidate} / {report.baseline}: {report.throughput_ratio:.3f}x")
    for kind, path in paths.items():
        print(f"[parity] {kind}: {path}")
    sys.exit(0 if report.passed else 1)


if __name__ == "__main__":
    main()
