"""Loss parity between two training runs: per-step comparison, verdict and reports.

A run is read from its ``loss_log.jsonl`` (``recipes.metrics``). Two kinds of verdict:

- ``bitwise``: every common step has exactly the same loss and grad norm. What UniEP
  promises for two runs of one config, and for configs that differ only in schedule
  knobs that do not change bits (see README, Determinism).
- ``close``: loss and grad norm within a relative band at every step. For UniEP vs
  TorchTitan's own MoE, whose sums run in another order. Defaults: loss 1e-2 and grad
  norm 5e-2 relative, sized for bf16 training; fp32 CPU runs land far inside (about
  1e-5 on the debug configs).

Throughput is reported beside the verdict (it does not enter it): per run the median
tokens per second per device and MFU over the steps after the first tenth (at least
the first two: start-up and compilation), the peak reserved memory, and the ratio of
run A's throughput to run B's.

Outputs (``write_reports``): ``parity.json`` and ``parity.md`` (summary, throughput and per-step
table), ``parity.png`` (both loss curves and the absolute difference), and a wandb run
group (a run per training, whose curves overlay, and a ``difference`` run with the
per-step differences, the summary table and the verdict) in offline mode unless the
environment sets ``WANDB_MODE`` (``wandb sync`` uploads offline runs later).
"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

from recipes.metrics import read_loss_log

Expect = Literal["bitwise", "close"]
METRICS = ("loss", "grad_norm")


@dataclass(frozen=True)
class Thresholds:
    loss_rtol: float = 1e-2
    grad_norm_rtol: float = 5e-2


@dataclass
class MetricDiff:
    max_abs: float
    mean_abs: float
    max_rel: float
    mean_rel: float


@dataclass
class ParityReport:
    name_a: str
    name_b: str
    expect: str
    steps: list[int]
    bitwise_equal_steps: int
    diffs: dict[str, MetricDiff]
    passed: bool
    reason: str
    thresholds: Thresholds = field(default_factory=Thresholds)
    rows: list[dict] = field(default_factory=list)
    throughput: dict[str, dict] = field(default_factory=dict)
    """run name -> {"tps", "mfu", "max_reserved_gib", "steps"} (runs that logged them)."""

    @property
    def throughput_ratio(self) -> float | None:
        """Run A's tokens per second over run B's, if both logged throughput."""
        a, b = self.throughput.get(self.name_a), self.throughput.get(self.name_b)
        return a["tps"] / b["tps"] if a and b and b["tps"] > 0 else None


def throughput_summary(run: dict[int, dict]) -> dict | None:
    """Median tps and MFU over the steps after the first tenth (at least the first two),
    peak reserved memory over all steps; None if the run logged no throughput."""
    steps = sorted(s for s, r in run.items() if "tps" in r)
    if not steps:
        return None
    skip = max(2, len(steps) // 10)
    steady = steps[skip:] or steps[-1:]
    has = lambda key: all(key in run[s] for s in steps)  # noqa: E731 (CPU runs log no MFU or memory)
    return {
        "tps": statistics.median(run[s]["tps"] for s in steady),
        "mfu": statistics.median(run[s]["mfu"] for s in steady) if has("mfu") else None,
        "max_reserved_gib": max(run[s]["max_reserved_gib"] for s in steps) if has("max_reserved_gib") else None,
        "steps": len(steady),
    }


def fmt(value: float | None, spec: str) -> str:
    """``value`` formatted, or ``n/a`` for a metric the device does not have."""
    return "n/a" if value is None else format(value, spec)


def _diff(values_a: list[float], values_b: list[float]) -> MetricDiff:
    abs_d = [abs(x - y) for x, y in zip(values_a, values_b)]
    rel_d = [d / max(abs(y), 1e-12) for d, y in zip(abs_d, values_b)]
    return MetricDiff(max(abs_d), sum(abs_d) / len(abs_d), max(rel_d), sum(rel_d) / len(rel_d))


def compare(
    run_a: dict[int, dict],
    run_b: dict[int, dict],
    *,
    expect: Expect,
    thresholds: Thresholds = Thresholds(),
    name_a: str = "a",
    name_b: str = "b",
) -> ParityReport:
    """Compare two runs' step records (as returned by ``read_loss_log``)."""
    if expect not in ("bitwise", "close"):
        raise ValueError(f"expect = {expect!r}; allowed values: 'bitwise', 'close'")
    steps = sorted(set(run_a) & set(run_b))
    if not steps:
        raise ValueError(f"runs {name_a} and {name_b} have no step in common")
    values = {m: ([run_a[s][m] for s in steps], [run_b[s][m] for s in steps]) for m in METRICS}
    diffs = {m: _diff(*values[m]) for m in METRICS}
    bitwise = sum(all(run_a[s][m] == run_b[s][m] for m in METRICS) for s in steps)
    missing = sorted(set(run_a) ^ set(run_b))
    non_finite = [s for s in steps if not all(math.isfinite(run_a[s][m]) and math.isfinite(run_b[s][m]) for m in METRICS)]

    if missing:
        passed, reason = False, f"steps logged by only one run: {missing[:10]}"
    elif non_finite:
        passed, reason = False, f"non-finite loss or grad norm at steps {non_finite[:10]}"
    elif expect == "bitwise":
        passed = bitwise == len(steps)
        first = next((s for s in steps if any(run_a[s][m] != run_b[s][m] for m in METRICS)), None)
        reason = f"{bitwise}/{len(steps)} steps bitwise equal" + ("" if passed else f"; first difference at step {first}")
    else:
        over = [
            f"{m} max relative difference {diffs[m].max_rel:.3g} > {limit:g}"
            for m, limit in (("loss", thresholds.loss_rtol), ("grad_norm", thresholds.grad_norm_rtol))
            if diffs[m].max_rel > limit
        ]
        passed = not over
        reason = "; ".join(over) if over else (
            f"loss within {thresholds.loss_rtol:g} and grad norm within {thresholds.grad_norm_rtol:g} "
            f"(relative) at all {len(steps)} steps"
        )
    rows = [
        {"step": s, **{f"{m}_{n}": r[s][m] for m in METRICS for n, r in ((name_a, run_a), (name_b, run_b))}}
        for s in steps
    ]
    throughput = {name: summary for name, run in ((name_a, run_a), (name_b, run_b))
                  if (summary := throughput_summary(run)) is not None}
    return ParityReport(name_a, name_b, expect, steps, bitwise, diffs, passed, reason, thresholds, rows, throughput)


def compare_folders(folder_a, folder_b, **kwargs) -> ParityReport:
    return compare(read_loss_log(folder_a), read_loss_log(folder_b), **kwargs)


def _markdown(report: ParityReport) -> str:
    a, b = report.name_a, report.name_b
    lines = [
        f"# Loss parity: {a} vs {b}",
        "",
        f"**Verdict: {'PASS' if report.passed else 'FAIL'}** ({report.expect}): {report.reason}",
        "",
        f"Steps compared: {len(report.steps)}; bitwise-equal steps: {report.bitwise_equal_steps}",
        "",
        "| metric | max abs diff | mean abs diff | max rel diff | mean rel diff |",
        "|---|---|---|---|---|",
    ]
    for m, d in report.diffs.items():
        lines.append(f"| {m} | {d.max_abs:.3e} | {d.mean_abs:.3e} | {d.max_rel:.3e} | {d.mean_rel:.3e} |")
    if report.throughput:
        lines += ["", "| run | tokens/s per device | MFU % | peak reserved GiB | steps (median over) |",
                  "|---|---|---|---|---|"]
        for name, t in report.throughput.items():
            lines.append(f"| {name} | {t['tps']:.0f} | {fmt(t['mfu'], '.2f')} | "
                         f"{fmt(t['max_reserved_gib'], '.2f')} | {t['steps']} |")
        if report.throughput_ratio is not None:
            lines += ["", f"Throughput {a} / {b}: {report.throughput_ratio:.3f}x"]
    lines += ["", f"| step | loss {a} | loss {b} | grad norm {a} | grad norm {b} |", "|---|---|---|---|---|"]
    for row in report.rows:
        lines.append(
            f"| {row['step']} | {row[f'loss_{a}']!r} | {row[f'loss_{b}']!r} | "
            f"{row[f'grad_norm_{a}']!r} | {row[f'grad_norm_{b}']!r} |"
        )
    return "\n".join(lines) + "\n"


def _plot(report: ParityReport, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    a, b = report.name_a, report.name_b
    steps = report.steps
    loss_a = [r[f"loss_{a}"] for r in report.rows]
    loss_b = [r[f"loss_{b}"] for r in report.rows]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True, height_ratios=(2, 1))
    top.plot(steps, loss_a, label=a, linewidth=2)
    top.plot(steps, loss_b, label=b, linestyle="--", linewidth=2)
    top.set_ylabel("training loss")
    top.legend()
    top.set_title(f"Loss parity: {'PASS' if report.passed else 'FAIL'} ({report.expect})")
    diff = [abs(x - y) for x, y in zip(loss_a, loss_b)]
    positive = [d for d in diff if d > 0]
    equal = len(diff) - len(positive)
    bottom.plot(steps, [d if d > 0 else float("nan") for d in diff], marker="o", color="tab:red",
                label=f"loss bitwise equal at {equal} of {len(diff)} steps (no point)")
    if positive:
        bottom.set_yscale("log")
        bottom.legend(loc="upper right", fontsize="small")
    else:
        bottom.text(0.5, 0.5, "bitwise equal at every step", transform=bottom.transAxes, ha="center")
    bottom.set_ylabel(f"|loss {a} - loss {b}|")
    bottom.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _wandb(report: ParityReport, out_dir: Path) -> Path:
    """A wandb run group: one run per training (same metric names, so the curves overlay)
    and a ``difference`` run with the per-step differences, the summary table and the
    verdict. Returns the difference run's folder."""
    import wandb

    os.environ.setdefault("WANDB_SILENT", "true")
    settings = dict(
        project=os.environ.get("WANDB_PROJECT", "uniep-parity"), group=f"parity-{out_dir.resolve().name}",
        dir=str(out_dir), mode=os.environ.get("WANDB_MODE", "offline"),
    )
    a, b = report.name_a, report.name_b
    for name in (a, b):
        run = wandb.init(name=name, job_type="training", **settings)
        for row in report.rows:
            run.log({"loss": row[f"loss_{name}"], "grad_norm": row[f"grad_norm_{name}"]}, step=row["step"])
        run.finish()

    run = wandb.init(name="difference", job_type="parity",
                     config={"expect": report.expect, **asdict(report.thresholds)}, **settings)
    for row in report.rows:
        run.log({
            "loss_abs_diff": abs(row[f"loss_{a}"] - row[f"loss_{b}"]),
            "grad_norm_abs_diff": abs(row[f"grad_norm_{a}"] - row[f"grad_norm_{b}"]),
        }, step=row["step"])
    table = wandb.Table(columns=["metric", "max_abs", "mean_abs", "max_rel", "mean_rel"])
    for m, d in report.diffs.items():
        table.add_data(m, d.max_abs, d.mean_abs, d.max_rel, d.mean_rel)
    run.log({"summary": table})
    run.summary.update({"passed": report.passed, "reason": report.reason,
                        "bitwise_equal_steps": report.bitwise_equal_steps, "steps": len(report.steps),
                        "throughput_ratio": report.throughput_ratio})
    run_dir = Path(run.dir).parent
    run.finish()
    return run_dir


def write_reports(report: ParityReport, out_dir: str | Path, *, plot: bool = True, wandb: bool = True) -> dict[str, Path]:
    """Write JSON, markdown, PNG and the wandb run into ``out_dir``; returns their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "parity.json", "markdown": out / "parity.md"}
    paths["json"].write_text(json.dumps({**asdict(report), "throughput_ratio": report.throughput_ratio}, indent=2) + "\n")
    paths["markdown"].write_text(_markdown(report))
    if plot:
        paths["png"] = out / "parity.png"
        _plot(report, paths["png"])
    if wandb:
        try:
            paths["wandb"] = _wandb(report, out)
        except Exception as e:  # noqa: BLE001 (any wandb failure: the reports above are written)
            print(f"[parity] warning: no wandb run written ({type(e).__name__}: {e}); "
                  "the JSON, markdown and PNG reports are complete", file=sys.stderr)
    return paths
