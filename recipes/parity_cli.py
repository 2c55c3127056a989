"""``scripts/loss_parity.py``: train two runs (or read their logs) and write the parity report.

    loss_parity.py run CONFIG.toml [--baseline torchtitan|uniep] [--a-args "..."] [--b-args "..."]
                                   [--expect close|bitwise] [--out DIR] [overrides for both runs ...]
    loss_parity.py compare RUN_A RUN_B [--names A,B] [--expect close|bitwise] [--out DIR]

``run`` trains run A (the config as given) and run B (the baseline) one after the
other with ``scripts/run_train.sh``, on the same seed and data, then compares them.
``--baseline torchtitan`` (default) swaps the UniEP model for TorchTitan's own MoE
(``uniep_qwen3`` -> ``titan_qwen3``); on a machine without GPUs it also sets its
expert-parallel degree to 1, since TorchTitan's EP needs a Triton GPU kernel.
``--baseline uniep`` runs the same config again (extra differences in ``--b-args``),
e.g. ``--b-args "--parallelism.expert_parallel_degree 1"``. Exit status: 0 when parity
holds, 1 when it does not, 2 on bad input.
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python < 3.11
    import tomli as tomllib

from recipes.models import BASELINE_OF
from recipes.parity import Thresholds, compare_folders, fmt, write_reports

ROOT = Path(__file__).resolve().parents[1]
TRAINING_FAILED = 3
"""Exit status when a training run fails (1: the verdict failed)."""


def train(name: str, config: str, dump_folder: Path, args: list[str]) -> None:
    """Run one training, echoing its step lines; its full log goes to dump_folder/train.log."""
    dump_folder.mkdir(parents=True, exist_ok=True)
    log = dump_folder / "train.log"
    cmd = [str(ROOT / "scripts" / "run_train.sh"), config, "--job.dump_folder", str(dump_folder),
           "--metrics.disable_color_printing", "--overwrite-checkpoints", *args]
    print(f"[parity] training {name}: {shlex.join(cmd)}", flush=True)
    with log.open("w") as f, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
        for line in proc.stdout:
            f.write(line)
            if "step:" in line:
                print(f"[parity] {name}: {line.split(' - ')[-1].rstrip()}", flush=True)
    if proc.returncode != 0:
        tail = "".join(log.read_text().splitlines(keepends=True)[-15:])
        print(f"{tail}[parity] training {name} failed (exit {proc.returncode}); full log: {log}", file=sys.stderr)
        sys.exit(TRAINING_FAILED)


def baseline_args(config: str, baseline: str) -> list[str]:
    if baseline == "uniep":
        return []
    with open(config, "rb") as f:
        model_name = tomllib.load(f).get("model", {}).get("name")
    if model_name not in BASELINE_OF:
        sys.exit(f"--baseline torchtitan: model.name = {model_name!r} in {config}; allowed: {', '.join(BASELINE_OF)}")
    args = ["--model.name", BASELINE_OF[model_name]]
    import torch

    if not torch.cuda.is_available():
        args += ["--parallelism.expert_parallel_degree", "1"]
    return args


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="loss_parity.py", description="Loss parity between two training runs.")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="train both runs, then compare")
    run.add_argument("config")
    run.add_argument("--baseline", choices=("torchtitan", "uniep"), default="torchtitan")
    run.add_argument("--a-args", default="", help="extra overrides for run A (quoted)")
    run.add_argument("--b-args", default="", help="extra overrides for run B (quoted)")
    cmp_ = sub.add_parser("compare", help="compare two finished runs (their dump folders)")
    cmp_.add_argument("run_a")
    cmp_.add_argument("run_b")
    cmp_.add_argument("--names", default="a,b", help="labels of the two runs, comma-separated")
    for p in (run, cmp_):
        p.add_argument("--expect", choices=("close", "bitwise"), default=None,
                       help="verdict kind (default: close, or bitwise for --baseline uniep without --b-args)")
        p.add_argument("--out", default=None, help="report folder (default: next to the runs)")
        p.add_argument("--loss-rtol", type=float, default=Thresholds.loss_rtol)
        p.add_argument("--grad-norm-rtol", type=float, default=Thresholds.grad_norm_rtol)
        p.add_argument("--no-wandb", action="store_true", help="skip the wandb run group")
    args, overrides = parser.parse_known_args(argv)

    if args.command == "run":
        if not Path(args.config).is_file():
            parser.error(f"config {args.config!r}: no such file")
        out = Path(args.out or f"outputs/parity/{Path(args.config).stem}-vs-{args.baseline}")
        name_a, name_b = "uniep", args.baseline if args.baseline == "torchtitan" else "uniep_b"
        expect = args.expect or ("bitwise" if args.baseline == "uniep" and not args.b_args else "close")
        folder_a, folder_b = out / name_a, out / name_b
        train(name_a, args.config, folder_a, [*overrides, *shlex.split(args.a_args)])
        train(name_b, args.config, folder_b, [*overrides, *baseline_args(args.config, args.baseline), *shlex.split(args.b_args)])
    else:
        if overrides:
            parser.error(f"unknown arguments {overrides}")
        folder_a, folder_b = Path(args.run_a), Path(args.run_b)
        name_a, name_b = args.names.split(",", 1)
        out = Path(args.out or folder_a.parent / "parity")
        expect = args.expect or "close"

    report = compare_folders(
        folder_a, folder_b, expect=expect, name_a=name_a, name_b=name_b,
        thresholds=Thresholds(args.loss_rtol, args.grad_norm_rtol),
    )
    paths = write_reports(report, out, wandb=not args.no_wandb)
    print(f"[parity] {'PASS' if report.passed else 'FAIL'} ({expect}): {report.reason}")
    print(f"[parity] loss: max abs diff {report.diffs['loss'].max_abs:.3e}, max rel diff {report.diffs['loss'].max_rel:.3e}; "
          f"bitwise-equal steps {report.bitwise_equal_steps}/{len(report.steps)}")
    for name, t in report.throughput.items():
        print(f"[parity] {name}: {t['tps']:.0f} tokens/s per device, MFU {fmt(t['mfu'], '.2f')}%, "
              f"peak reserved {fmt(t['max_reserved_gib'], '.2f')} GiB (median of {t['steps']} steps)")
    if report.throughput_ratio is not None:
        print(f"[parity] throughput {report.name_a} / {report.name_b}: {report.throughput_ratio:.3f}x")
    for kind, path in paths.items():
        print(f"[parity] {kind}: {path}")
    sys.exit(0 if report.passed else 1)


if __name__ == "__main__":
    main()
