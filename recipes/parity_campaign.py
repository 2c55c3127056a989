"""``scripts/parity_campaign.py``: the runs that show the parity verdict separates a right
UniEP from a wrong one on a real config, in both kernel modes, judged in one table.

    parity_campaign.py CONFIG.toml [--steps 200] [--modes nondeterministic,deterministic] [--noise-runs 1]
                       [--only MODE/RUN,...] [--out DIR] [--no-wandb] [overrides for every run ...]

For each mode (TorchTitan's default kernels, or ``--debug.deterministic``) it trains with
``scripts/run_train.sh``, on one seed, initial weights and data:

    titan         the baseline: TorchTitan's own MoE (``loss_parity.py run``'s baseline)
    titan_noise1  the baseline's noise runs (``loss_parity.py run``'s: non-deterministic
    ...           kernels, twice the CPU threads, two microbatches, the initial weights
                  one ulp away, a different sample each): the band
    titan_again   the baseline again, as given: TorchTitan against itself
    uniep         the config as given
    wrong         UniEP with every router score scaled by 0.98 (``tests/wrong_variant.py``)

then judges titan_again, uniep and wrong against titan with the noise runs' band
(``loss_parity.py compare``; reports under ``OUT/MODE/RUN-vs-titan``). Bars:
titan_again and uniep not drift, wrong drift, and UniEP closer to TorchTitan when
deterministic than not (max-window statistic). A run whose folder holds a complete log
of ``--steps`` steps is kept, so a campaign can span calls with a time limit:
``--only`` trains just the runs named (e.g. ``deterministic/uniep``), and every call
judges what is complete.

Exit status: 0 every bar met, 1 a bar missed, 2 bad input (named), 3 a training failed,
4 runs still missing.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python < 3.11
    import tomli as tomllib

from recipes.parity import LogError, Method, compare_folders, read_run, write_reports
from recipes.parity_cli import BAD_INPUT, baseline_args, label, noise_args, noise_env, train

MODES = ("nondeterministic", "deterministic")
EXPECTED = {"titan_again": "not drift", "uniep": "not drift", "wrong": "drift"}
"""Candidate -> the verdict a working parity tool gives it against titan."""
RUNS_MISSING = 4
WRONG_VARIANT = ["--experimental.custom_import", "tests.wrong_variant"]


def noise_runs(n: int) -> list[str]:
    return [f"titan_noise{i + 1}" for i in range(n)]


def run_args(config: dict, overrides: list[str], mode: str, steps: int,
             noise: int = 1) -> dict[str, tuple[list[str], dict]]:
    """run -> (its overrides, extra environment) in ``mode``, baseline and noise runs first."""
    common = [*overrides, "--training.steps", str(steps)]
    if mode == "deterministic":
        common.append("--debug.deterministic")
    base = [*common, *baseline_args(config, "torchtitan")]
    noise_plan = {name: (noise_args(config, base, i), noise_env()) for i, name in enumerate(noise_runs(noise), start=1)}
    return {"titan": (base, {}), **noise_plan,
            "titan_again": (base, {}), "uniep": (common, {}), "wrong": ([*common, *WRONG_VARIANT], {})}


def complete(folder: Path, steps: int) -> bool:
    """Whether ``folder`` holds a readable log of steps 1..``steps``."""
    try:
        records = read_run(folder, folder.name).records
    except LogError:
        return False
    return sorted(records) == list(range(1, steps + 1))


def _parse(argv):
    parser = argparse.ArgumentParser(prog="parity_campaign.py", description=__doc__.split("\n")[0])
    parser.add_argument("config")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--noise-runs", type=int, default=1, help="baseline noise runs per mode (the band)")
    parser.add_argument("--only", default=None, help="train only these MODE/RUN (comma-separated); judge all")
    parser.add_argument("--out", default=None, help="default: outputs/parity_campaign/CONFIG")
    parser.add_argument("--no-wandb", action="store_true")
    args, overrides = parser.parse_known_args(argv)
    args.modes = [m for m in args.modes.split(",") if m]
    if not Path(args.config).is_file():
        raise ValueError(f"config {args.config!r}: no such file")
    if args.steps < 1:
        raise ValueError(f"--steps = {args.steps} must be >= 1")
    unknown = [m for m in args.modes if m not in MODES]
    if unknown or not args.modes:
        raise ValueError(f"--modes {unknown or args.modes}: allowed {', '.join(MODES)}")
    if args.noise_runs < 1:
        raise ValueError(f"--noise-runs = {args.noise_runs} must be >= 1 (the band)")
    every = [f"{m}/{r}" for m in args.modes for r in ["titan", *noise_runs(args.noise_runs), *EXPECTED]]
    args.only = None if args.only is None else [o for o in args.only.split(",") if o]
    if args.only is not None and (not args.only or any(o not in every for o in args.only)):
        raise ValueError(f"--only {args.only}: allowed {', '.join(every)}")
    if any(a.partition("=")[0] in ("--job.dump_folder", "--training.steps", "--debug.deterministic")
           for a in overrides):
        raise ValueError("--job.dump_folder, --training.steps and --debug.deterministic are the campaign's "
                         "(--out, --steps, --modes)")
    return args, overrides


def main(argv: list[str] | None = None) -> None:
    try:
        args, overrides = _parse(argv)
        with open(args.config, "rb") as f:
            config = tomllib.load(f)
        plan = {mode: run_args(config, overrides, mode, args.steps, args.noise_runs) for mode in args.modes}
    except ValueError as e:
        print(f"[campaign] error: {e}", file=sys.stderr)
        sys.exit(BAD_INPUT)
    out = Path(args.out or f"outputs/parity_campaign/{Path(args.config).stem}")
    for mode, runs in plan.items():
        for run, (run_overrides, env) in runs.items():
            folder = out / mode / run
            if complete(folder, args.steps):
                print(f"[campaign] {mode}/{run}: complete ({args.steps} steps), kept", flush=True)
            elif args.only is None or f"{mode}/{run}" in args.only:
                train(f"{mode}/{run}", args.config, folder, run_overrides, env=env)
    sys.exit(judge(config, plan, out, args))


def judge(config: dict, plan: dict, out: Path, args) -> int:
    """Print the verdict table; the exit status."""
    rows, missing, max_window = [], [], {}
    for mode in args.modes:
        names = {run: label(config, run_overrides) for run, (run_overrides, _) in plan[mode].items()}
        done = {run for run in plan[mode] if complete(out / mode / run, args.steps)}
        missing += [f"{mode}/{run}" for run in plan[mode] if run not in done]
        band = noise_runs(args.noise_runs)
        if not {"titan", *band} <= done:
            continue
        for cand in (c for c in EXPECTED if c in done):
            runs = [cand, "titan", *band]
            report = compare_folders([out / mode / r for r in runs], [f"{names[r]}~{r}" for r in runs], Method())
            write_reports(report, out / mode / f"{cand}-vs-titan", wandb=not args.no_wandb)
            met = (report.verdict == "drift") == (EXPECTED[cand] == "drift")
            rows.append((mode, cand, report.verdict, report.statistics["max window"],
                         report.tolerance["max window"], EXPECTED[cand], met))
            print(f"[campaign] {mode}/{cand}: {report.verdict}: {report.reason}", flush=True)
            if cand == "uniep":
                max_window[mode] = report.statistics["max window"]
    print(f"\n[campaign] {args.steps} steps; candidates against titan, band from {args.noise_runs} noise run(s)")
    print("| mode | run | verdict | max window | tolerance | expected | bar |\n|---|---|---|---|---|---|---|")
    for mode, cand, verdict, stat, tol, expected, met in rows:
        print(f"| {mode} | {cand} | {verdict} | {stat:.3e} | {tol:.3e} | {expected} | {'met' if met else 'MISSED'} |")
    bars = [row[-1] for row in rows]
    if len(max_window) == 2:
        tighter = max_window["deterministic"] < max_window["nondeterministic"]
        print(f"[campaign] deterministic uniep vs titan {max_window['deterministic']:.3e} < non-deterministic "
              f"{max_window['nondeterministic']:.3e}: {'met' if tighter else 'MISSED'}")
        bars.append(tighter)
    if missing:
        print(f"[campaign] not yet trained: {', '.join(missing)}")
    return 1 if not all(bars) else RUNS_MISSING if missing else 0
