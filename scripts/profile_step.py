"""Where one training step's time and memory go, UniEP beside TorchTitan.

    python scripts/profile_step.py run CONFIG --out DIR [--step 8] [--compile] [overrides ...]
    python scripts/profile_step.py summarize RUN_DIR [RUN_DIR ...]

``run`` trains the config's UniEP model and its TorchTitan baseline (``titan_*``) for
``--step`` steps each with TorchTitan's profiler and memory snapshot on the last step
(``--profiling.*``), then summarizes both. ``summarize`` reads a run folder's last
trace (``profile_traces/iteration_N/rank0_trace.json``) and memory snapshot
(``memory_snapshot/iteration_N/rank0_memory_snapshot.pickle``) and prints:

- the step: wall time (the profiler's step span), device busy time (the union of its
  kernels' intervals) and the rest (host gaps and waits);
- device time per kernel group (GEMMs, communication, Triton, other) and the top kernels;
- memory: allocated at the snapshot, and the peak and its time over the recorded
  allocation history (rebuilt backwards from the snapshot's state).
"""

from __future__ import annotations

import argparse
import json
import pickle
import re
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# kernel group -> name patterns (first match wins)
GROUPS = [
    ("communication", re.compile(r"nccl|all_?to_?all|allgather|reduce_?scatter|symm|_push|multimem", re.I)),
    ("uniep GEMMs", re.compile(r"_grouped_gemm_kernel|_grouped_wgrad_kernel|_dispatch_gemm|_gemm_combine", re.I)),
    ("library GEMMs", re.compile(r"gemm|cutlass|nvjet|xmma|cublas|sm90_|wgmma|gemv", re.I)),
    ("triton (other)", re.compile(r"^triton_|_kernel$", re.I)),
]
DEVICE_CATEGORIES = {"kernel", "gpu_memcpy", "gpu_memset"}


def group_of(name: str) -> str:
    return next((g for g, pattern in GROUPS if pattern.search(name)), "other")


def union_us(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total


def summarize_trace(trace: dict) -> dict:
    """Step wall/busy/other (ms), device ms per group and per kernel, of a chrome trace."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    steps = [e for e in events if str(e.get("name", "")).startswith("ProfilerStep#")]
    kernels = [e for e in events if e.get("cat") in DEVICE_CATEGORIES]
    if not steps or not kernels:
        raise ValueError("the trace has no ProfilerStep span or no device kernels (was it a GPU run?)")
    step = max(steps, key=lambda e: e["ts"])
    start = step["ts"]
    # a step's kernels may end after its host span: take those launched from it on
    in_step = [k for k in kernels if k["ts"] >= start]
    per_kernel: dict[str, float] = defaultdict(float)
    per_group: dict[str, float] = defaultdict(float)
    for k in in_step:
        per_kernel[k["name"]] += k["dur"] / 1e3
        per_group[group_of(k["name"])] += k["dur"] / 1e3
    busy = union_us([(k["ts"], k["ts"] + k["dur"]) for k in in_step]) / 1e3
    end = max([start + step["dur"]] + [k["ts"] + k["dur"] for k in in_step])
    wall = (end - start) / 1e3
    return dict(step=step["name"], wall_ms=wall, busy_ms=busy, other_ms=wall - busy,
                groups=dict(sorted(per_group.items(), key=lambda kv: -kv[1])),
                kernels=dict(sorted(per_kernel.items(), key=lambda kv: -kv[1])))


def summarize_snapshot(snapshot: dict, device: int = 0) -> dict:
    """GiB allocated at the snapshot, and the peak over its recorded history (the first
    time it was reached: after event ``peak_after_event``, -1 = before the history)."""
    allocated = sum(block["size"] for seg in snapshot.get("segments", []) if seg.get("device", 0) == device
                    for block in seg.get("blocks", []) if block.get("state") == "active_allocated")
    traces = snapshot.get("device_traces", [])
    events = traces[device] if device < len(traces) else []
    # walk back from the snapshot's state: ``level`` is the total after event i
    level, peak, peak_index = allocated, allocated, len(events) - 1
    for i in range(len(events) - 1, -1, -1):
        if level >= peak:
            peak, peak_index = level, i
        action, size = events[i]["action"], events[i]["size"]
        if action == "alloc":
            level -= size
        elif action == "free_completed":
            level += size
    if level >= peak:  # before the recorded history
        peak, peak_index = level, -1
    return dict(allocated_gib=allocated / 2**30, peak_gib=peak / 2**30, events=len(events),
                peak_after_event=peak_index)


def _last(run: Path, pattern: str) -> Path | None:
    found = sorted(run.glob(pattern), key=lambda p: int(re.search(r"iteration_(\d+)", str(p)).group(1)))
    return found[-1] if found else None


def summarize_run(run: Path) -> dict:
    trace_file = _last(run, "profile_traces/iteration_*/rank0_trace.json")
    if trace_file is None:
        raise FileNotFoundError(f"{run}: no profile_traces/iteration_*/rank0_trace.json (ran with --profiling.enable_profiling?)")
    summary = dict(run=str(run), trace=str(trace_file), **summarize_trace(json.loads(trace_file.read_text())))
    snapshot_file = _last(run, "memory_snapshot/iteration_*/rank0_memory_snapshot.pickle")
    if snapshot_file is not None:
        with snapshot_file.open("rb") as f:
            summary["memory"] = summarize_snapshot(pickle.load(f))
    return summary


def print_summaries(summaries: list[dict], top: int = 12) -> None:
    names = [Path(s["run"]).name for s in summaries]
    print("| | " + " | ".join(names) + " |\n|---" * (len(names) + 1) + "|")
    for key, label in (("wall_ms", "step wall ms"), ("busy_ms", "device busy ms"), ("other_ms", "host gaps, waits ms")):
        print(f"| {label} | " + " | ".join(f"{s[key]:.1f}" for s in summaries) + " |")
    for group in dict.fromkeys(g for s in summaries for g in s["groups"]):
        print(f"| {group} ms | " + " | ".join(f"{s['groups'].get(group, 0.0):.1f}" for s in summaries) + " |")
    for key, label in (("allocated_gib", "allocated at snapshot GiB"), ("peak_gib", "peak over history GiB")):
        print(f"| {label} | " + " | ".join(f"{s['memory'][key]:.2f}" if "memory" in s else "-" for s in summaries) + " |")
    for name, s in zip(names, summaries):
        print(f"\n{name} ({s['step']}): top kernels, device ms")
        for kernel, ms in list(s["kernels"].items())[:top]:
            print(f"  {ms:8.2f}  {group_of(kernel):15s} {kernel[:100]}")


def run(args, overrides: list[str]) -> list[Path]:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python < 3.11
        import tomli as tomllib

    from recipes.parity_cli import _refuse_dump_folder, baseline_args, train

    _refuse_dump_folder(overrides)
    config = tomllib.loads(Path(args.config).read_text())
    profiling = ["--training.steps", str(args.step), "--profiling.enable_profiling",
                 "--profiling.profile_freq", str(args.step), "--profiling.enable_memory_snapshot"]
    if args.compile:
        profiling.append("--compile.enable")
    folders = []
    for name, extra in (("uniep", []), ("torchtitan", baseline_args(config, "torchtitan"))):
        folder = Path(args.out) / name
        train(name, args.config, folder, [*profiling, *extra, *overrides])
        folders.append(folder)
    return folders


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="train UniEP and TorchTitan with the profiler, then summarize")
    r.add_argument("config")
    r.add_argument("--out", required=True, help="folder for the two runs")
    r.add_argument("--step", type=int, default=8,
                   help="steps to train; the last one is profiled (>= 4: TorchTitan's profiler warms up 3 steps)")
    r.add_argument("--compile", action="store_true", help="both models under torch.compile")
    s = sub.add_parser("summarize", help="summarize profiled run folders")
    s.add_argument("runs", nargs="+")
    args, overrides = parser.parse_known_args(argv)
    if args.command == "summarize" and overrides:
        parser.error(f"summarize takes run folders only; unknown: {overrides}")
    if args.command == "run":
        if args.step < 4:
            parser.error(f"--step {args.step}: at least 4 (TorchTitan's profiler warms up 3 steps first)")
        if not Path(args.config).is_file():
            parser.error(f"config {args.config!r}: no such file")
        try:
            folders = run(args, overrides)
        except ValueError as e:
            sys.exit(f"profile_step.py: {e}")
    else:
        folders = [Path(p) for p in args.runs]
    try:
        summaries = [summarize_run(f) for f in folders]
    except (FileNotFoundError, ValueError) as e:
        sys.exit(f"profile_step.py: {e}")
    print_summaries(summaries)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
