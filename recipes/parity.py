"""Loss parity: does a candidate run train the same model as a baseline run?

A run is read from its ``loss_log.jsonl`` (``recipes.loss_log``). The verdict is one of:

- ``bitwise``: every common step has exactly the same loss and grad norm (two runs of
  one deterministic UniEP config, a resumed run, the megakernel against all_to_all).
- ``within noise``: the candidate's windowed mean loss stays as close to the
  baseline's as two valid runs of the baseline stay to each other.
- ``drift``: it does not (a failure).

Why windows: bf16 training is chaotic. Two runs of one TorchTitan config with
non-deterministic kernels differ by up to 6.5% in loss at single steps (spikes) within
40 steps on an H200, while their means over windows of steps stay within about 1%. So
the loss is averaged over consecutive windows of ``window`` steps (default: a tenth of
the run, at least 5 steps; a shorter last window is dropped), and three statistics of
the candidate-vs-baseline difference are judged: the largest window difference, the
last window's difference and the difference of the whole-run means.

The noise band is measured, not guessed: the same three statistics between the
baseline and each extra baseline (the baseline trained again with a change that
changes rounding, not math: non-deterministic kernels, another thread count or
layout, the initial weights one ulp away). The
candidate passes when each statistic is at most ``k`` times the largest the extra
baselines show (default 2: a single noise run underestimates the spread), or at most
the floor (default 1e-4 of the baseline's mean loss; deterministic runs can be bitwise,
a band of zero). Without extra baselines the floor alone decides, and the report says
so. Grad norms are shown, not judged (they spike more than the loss).

Throughput is reported beside the verdict (it does not enter it): per run the median
tokens per second per device and MFU over the steps after the first tenth (at least
the first two: start-up and compilation), the peak reserved memory, and the ratio of
the candidate's throughput to the baseline's.

Outputs (``write_reports``): ``parity.json`` and ``parity.md`` (verdict with the numbers
that decided it, statistics, throughput, per-step table), ``parity.png`` (the curves,
and the windowed difference with the noise band shaded), and a wandb run group (a run
per training, curves as line series, and a ``parity`` run with the windowed difference,
the band, the verdict in the summary and a table) in offline mode unless the environment
sets ``WANDB_MODE`` (``wandb sync`` uploads offline runs later).
"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from recipes.loss_log import LOSS_LOG, read_loss_log

VERDICTS = ("bitwise", "within noise", "drift")
STATISTICS = ("max window", "last window", "run mean")


class LogError(ValueError):
    """A run folder or its loss log cannot be read (the message names the file and line)."""


@dataclass(frozen=True)
class Method:
    window: int | None = None
    """Steps per window; None: a tenth of the common steps, at least 5."""
    k: float = 2.0
    """A statistic may reach ``k`` times the largest the extra baselines show."""
    floor: float = 1e-4
    """... or this fraction of the baseline's mean loss."""
    expect_bitwise: bool = False
    """Anything short of bitwise is drift (resumed runs, schedule knobs)."""

    def window_for(self, steps: int) -> int:
        return max(1, min(steps, self.window or max(5, steps // 10)))


@dataclass
class Run:
    name: str
    records: dict[int, dict]


@dataclass
class ParityReport:
    candidate: str
    baseline: str
    extra_baselines: list[str]
    verdict: str
    reason: str
    steps: list[int]
    note: str
    """What was compared (common steps, runs of different lengths)."""
    bitwise_equal_steps: int
    window: int
    statistics: dict[str, float]
    """Candidate vs baseline: |difference| of windowed mean losses."""
    band: dict[str, float] | None
    """The largest of each statistic between the baseline and an extra baseline."""
    tolerance: dict[str, float]
    method: Method
    rows: list[dict] = field(default_factory=list)
    windows: list[dict] = field(default_factory=list)
    throughput: dict[str, dict] = field(default_factory=dict)
    """run name -> {"tps", "mfu", "max_reserved_gib", "steps"} (runs that logged them)."""

    @property
    def passed(self) -> bool:
        return self.verdict != "drift"

    @property
    def throughput_ratio(self) -> float | None:
        """The candidate's tokens per second over the baseline's, if both logged them."""
        a, b = self.throughput.get(self.candidate), self.throughput.get(self.baseline)
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


def window_means(records: dict[int, dict], steps: list[int], window: int, metric: str = "loss") -> list[float]:
    """Mean of ``metric`` over consecutive windows of ``window`` of ``steps`` (a shorter
    last window is dropped)."""
    full = len(steps) // window * window
    return [statistics.fmean(records[s][metric] for s in steps[i:i + window]) for i in range(0, full, window)]


def divergence(a: dict[int, dict], b: dict[int, dict], steps: list[int], window: int) -> dict[str, float]:
    """The three statistics of |mean loss of a - mean loss of b|."""
    wa, wb = window_means(a, steps, window), window_means(b, steps, window)
    diffs = [abs(x - y) for x, y in zip(wa, wb)]
    run_mean = abs(statistics.fmean(a[s]["loss"] for s in steps) - statistics.fmean(b[s]["loss"] for s in steps))
    return {"max window": max(diffs), "last window": diffs[-1], "run mean": run_mean}


def compare(candidate: Run, baseline: Run, extra_baselines: list[Run] = (), method: Method = Method()) -> ParityReport:
    """Judge ``candidate`` against ``baseline``, the noise band from ``extra_baselines``."""
    runs = [candidate, baseline, *extra_baselines]
    names = [r.name for r in runs]
    if len(set(names)) != len(names):
        raise LogError(f"run names must differ; got {names}")
    steps = sorted(set.intersection(*(set(r.records) for r in runs)))
    if not steps:
        raise LogError(f"runs {', '.join(names)} have no step in common")
    lengths = {r.name: len(r.records) for r in runs}
    note = f"{len(steps)} common steps ({steps[0]}-{steps[-1]})"
    if len(set(lengths.values())) > 1:
        note += "; the runs differ in length (" + ", ".join(f"{n} {c} steps" for n, c in lengths.items()) + \
                "): compared over the common steps"
    non_finite = [s for s in steps for r in runs if not all(math.isfinite(r.records[s][m]) for m in ("loss", "grad_norm"))]
    c, b = candidate.records, baseline.records
    bitwise = sum(c[s]["loss"] == b[s]["loss"] and c[s]["grad_norm"] == b[s]["grad_norm"] for s in steps)
    window = method.window_for(len(steps))
    stats = divergence(c, b, steps, window)
    bands = [divergence(e.records, b, steps, window) for e in extra_baselines]
    band = {k: max(x[k] for x in bands) for k in STATISTICS} if bands else None
    floor = method.floor * abs(statistics.fmean(b[s]["loss"] for s in steps))
    tolerance = {k: max(method.k * (band[k] if band else 0.0), floor) for k in STATISTICS}

    if non_finite:
        verdict, reason = "drift", f"non-finite loss or grad norm at step {non_finite[0]}"
    elif bitwise == len(steps):
        verdict, reason = "bitwise", f"{bitwise}/{len(steps)} steps bitwise equal (loss and grad norm)"
    elif method.expect_bitwise:
        first = next(s for s in steps if c[s]["loss"] != b[s]["loss"] or c[s]["grad_norm"] != b[s]["grad_norm"])
        verdict, reason = "drift", f"expected bitwise: {bitwise}/{len(steps)} steps equal, first difference at step {first}"
    else:
        over = [f"{k} {stats[k]:.3g} > {tolerance[k]:.3g}" for k in STATISTICS if stats[k] > tolerance[k]]
        basis = (f"{method.k:g} x the band of {len(bands)} extra baseline(s), floor {floor:.3g}" if bands
                 else f"the floor {floor:.3g} alone (no extra baselines: no measured noise band)")
        if over:
            verdict, reason = "drift", f"windowed mean loss differs beyond noise: {'; '.join(over)} ({basis})"
        else:
            worst = max(STATISTICS, key=lambda k: stats[k] / tolerance[k])
            verdict, reason = "within noise", (f"every statistic within tolerance, closest {worst} "
                                               f"{stats[worst]:.3g} <= {tolerance[worst]:.3g} ({basis})")

    rows = [{"step": s, **{f"{m}_{r.name}": r.records[s][m] for r in runs for m in ("loss", "grad_norm")}} for s in steps]
    means = {r.name: window_means(r.records, steps, window) for r in runs}
    windows = [{"first_step": steps[i * window], "last_step": steps[i * window + window - 1],
                **{f"loss_{n}": v[i] for n, v in means.items()}} for i in range(len(means[candidate.name]))]
    throughput = {r.name: t for r in runs if (t := throughput_summary(r.records)) is not None}
    return ParityReport(candidate.name, baseline.name, [e.name for e in extra_baselines], verdict, reason, steps,
                        note, bitwise, window, stats, band, tolerance, method, rows, windows, throughput)


def read_run(folder: str | Path, name: str) -> Run:
    """A run's records, or a ``LogError`` naming the folder, file and line."""
    folder = Path(folder)
    log = folder / LOSS_LOG
    if not folder.is_dir():
        raise LogError(f"run {name}: {str(folder)!r} is not a folder")
    if not log.is_file():
        raise LogError(f"run {name}: no {LOSS_LOG} in {str(folder)!r} (did the training start?)")
    for number, line in enumerate(log.read_text().splitlines(), start=1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise LogError(f"{log}:{number}: not a JSON record ({e.msg}; a truncated write?): {line[:80]!r}") from None
        missing = [] if "resume_from_step" in record else [k for k in ("step", "loss", "grad_norm") if k not in record]
        if missing:
            raise LogError(f"{log}:{number}: record without {', '.join(missing)}: {line[:80]!r}")
    records = read_loss_log(folder)
    if not records:
        raise LogError(f"{log}: no steps logged")
    return Run(name, records)


def compare_folders(folders: list[str | Path], names: list[str], method: Method = Method()) -> ParityReport:
    """``folders`` = candidate, baseline, extra baselines; ``names`` their labels."""
    runs = [read_run(f, n) for f, n in zip(folders, names)]
    return compare(runs[0], runs[1], runs[2:], method)


def _markdown(report: ParityReport) -> str:
    a, b = report.candidate, report.baseline
    lines = [
        f"# Loss parity: {a} vs {b}",
        "",
        f"**Verdict: {report.verdict}**: {report.reason}",
        "",
        f"Compared: {report.note}; bitwise-equal steps: {report.bitwise_equal_steps}; window {report.window} steps; "
        f"extra baselines (noise band): {', '.join(report.extra_baselines) or 'none'}.",
        "",
        "| statistic (|mean loss difference|) | candidate vs baseline | noise band | tolerance |",
        "|---|---|---|---|",
    ]
    for k in STATISTICS:
        band = fmt(report.band[k] if report.band else None, ".3e")
        lines.append(f"| {k} | {report.statistics[k]:.3e} | {band} | {report.tolerance[k]:.3e} |")
    if report.throughput:
        lines += ["", "| run | tokens/s per device | MFU % | peak reserved GiB | steps (median over) |",
                  "|---|---|---|---|---|"]
        for name, t in report.throughput.items():
            lines.append(f"| {name} | {t['tps']:.0f} | {fmt(t['mfu'], '.2f')} | "
                         f"{fmt(t['max_reserved_gib'], '.2f')} | {t['steps']} |")
        if report.throughput_ratio is not None:
            lines += ["", f"Throughput {a} / {b}: {report.throughput_ratio:.3f}x"]
    names = [a, b, *report.extra_baselines]
    lines += ["", "| step | " + " | ".join(f"loss {n}" for n in names) + f" | grad norm {a} | grad norm {b} |",
              "|---" * (len(names) + 3) + "|"]
    for row in report.rows:
        lines.append(f"| {row['step']} | " + " | ".join(repr(row[f'loss_{n}']) for n in names)
                     + f" | {row[f'grad_norm_{a}']!r} | {row[f'grad_norm_{b}']!r} |")
    return "\n".join(lines) + "\n"


def _plot(report: ParityReport, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    a, b = report.candidate, report.baseline
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True, height_ratios=(2, 1))
    top.plot(report.steps, [r[f"loss_{a}"] for r in report.rows], label=a, linewidth=2)
    top.plot(report.steps, [r[f"loss_{b}"] for r in report.rows], label=b, linestyle="--", linewidth=2)
    for name in report.extra_baselines:
        top.plot(report.steps, [r[f"loss_{name}"] for r in report.rows], label=name, linewidth=0.8, alpha=0.6)
    top.set_ylabel("training loss")
    top.legend(fontsize="small")
    top.set_title(f"Loss parity: {report.verdict}")
    centers = [(w["first_step"] + w["last_step"]) / 2 for w in report.windows]
    diff = [w[f"loss_{a}"] - w[f"loss_{b}"] for w in report.windows]
    tol = report.tolerance["max window"]
    bottom.fill_between(centers, [-tol] * len(centers), [tol] * len(centers), color="tab:gray", alpha=0.3,
                        label=f"tolerance ({'noise band' if report.band else 'floor'})")
    for name in report.extra_baselines:
        bottom.plot(centers, [w[f"loss_{name}"] - w[f"loss_{b}"] for w in report.windows], color="tab:gray",
                    marker=".", linewidth=0.8, label=f"{name} - {b}")
    bottom.plot(centers, diff, marker="o", color="tab:red", label=f"{a} - {b}")
    bottom.axhline(0, color="black", linewidth=0.5)
    bottom.set_ylabel(f"window mean loss diff\n({report.window} steps)")
    bottom.set_xlabel("step")
    bottom.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _wandb(report: ParityReport, out_dir: Path) -> Path:
    """A wandb run group: one run per training (same metric names, so the curves overlay)
    and a ``parity`` run with the windowed differences, band, verdict and table. Returns
    the parity run's folder."""
    import wandb

    os.environ.setdefault("WANDB_SILENT", "true")
    settings = dict(
        project=os.environ.get("WANDB_PROJECT", "uniep-parity"), group=f"parity-{out_dir.resolve().name}",
        dir=str(out_dir), mode=os.environ.get("WANDB_MODE", "offline"),
    )
    a, b = report.candidate, report.baseline
    for name in (a, b, *report.extra_baselines):
        run = wandb.init(name=name, job_type="training", **settings)
        for row in report.rows:
            run.log({"loss": row[f"loss_{name}"], "grad_norm": row[f"grad_norm_{name}"]}, step=row["step"])
        run.finish()

    run = wandb.init(name="parity", job_type="parity", config=asdict(report.method), **settings)
    for w in report.windows:
        run.log({"window_loss_diff": w[f"loss_{a}"] - w[f"loss_{b}"],
                 "tolerance": report.tolerance["max window"]}, step=w["last_step"])
    table = wandb.Table(columns=["statistic", "candidate_vs_baseline", "noise_band", "tolerance"])
    for k in STATISTICS:
        table.add_data(k, report.statistics[k], report.band[k] if report.band else None, report.tolerance[k])
    run.log({"statistics": table})
    run.summary.update({"verdict": report.verdict, "reason": report.reason, "passed": report.passed,
                        "bitwise_equal_steps": report.bitwise_equal_steps, "steps": len(report.steps),
                        "throughput_ratio": report.throughput_ratio})
    run_dir = Path(run.dir).parent
    run.finish()
    return run_dir


def write_reports(report: ParityReport, out_dir: str | Path, *, plot: bool = True, wandb: bool = True) -> dict[str, Path]:
    """Write JSON, markdown, PNG and the wandb runs into ``out_dir``; returns their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "parity.json", "markdown": out / "parity.md"}
    summary = {**asdict(report), "passed": report.passed, "throughput_ratio": report.throughput_ratio}
    paths["json"].write_text(json.dumps(summary, indent=2) + "\n")
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
