"""Where the device waits during a layer's forward+backward calls issued back to back,
and which host operations synchronize with it.

    python scripts/device_gaps.py [--shape dsv3_16b] [--calls 5] [--layers uniep,torchtitan_compiled]
                                  [--stacks] [--list]

For each layer (UniEP or TorchTitan, eager or under ``torch.compile``; same weights,
built by ``bench_moe.py``): after warm-up,

1. one forward+backward under ``torch.cuda.set_sync_debug_mode("warn")``: every PyTorch
   operation that makes the host wait for the device is printed with the Python lines that
   called it (Triton launches and the allocator are not covered; the trace below is);
2. ``--calls`` calls back to back under the profiler (CUDA activities; with
   ``--stacks`` also the host's operators and Python stacks), then from the trace: the
   span from the first device operation to the last, the device's busy time (union of
   kernels, copies and memsets), the idle rest, the idle gaps by size, and the largest,
   each with the operations before and after it, how long the second was issued before
   it started (a few microseconds: the device waited for the host to issue it) and, with
   ``--stacks``, the Python lines that issued it; host calls that blocked on the device
   (``cudaStreamSynchronize``, blocking copies, ...) with their duration; for each large gap
   also how long the host ran since it issued the previous device operation and the slow host API
   calls in that time (``cudaMalloc``, a launch that blocked, a module load), and over the
   whole trace the host API calls that took at least ``SLOW_HOST_CALL_US``; the device time
   per call by kind (``KINDS``: the routed experts' grouped GEMMs, UniEP's or the CUTLASS
   ones TorchTitan's MoE runs; other GEMMs; the rest), which says whether a layer's lead
   is in its expert GEMMs or around them. ``--list`` prints every device operation of the
   last call: start, duration, idle before it.

Nothing here times a layer for a result (``bench_moe.py`` does). With ``--stacks`` the
profiler's host cost makes the host slower than it is, so gaps the host causes grow;
without, the host runs about as ahead of the device as it does unprofiled.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import traceback
import warnings
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_moe import SHAPES, build_layers  # noqa: E402
from profile_step import DEVICE_CATEGORIES, union_us  # noqa: E402

LAUNCH_CATEGORIES = {"cuda_runtime", "cuda_driver"}
BLOCKING_PRINTED = 10
GAP_BUCKETS_US = (2, 5, 10, 50, 200)
SLOW_HOST_CALL_US = 50
# Device operations by kind, the first pattern that matches a kernel's name: the routed
# experts' grouped GEMMs (UniEP's Triton launches; ``torch._grouped_mm``'s CUTLASS kernels,
# which TorchTitan's MoE runs them on), the other GEMMs (cuBLAS: router, shared experts,
# TorchTitan's fp32 ones), the rest (copies, gathers, combines, elementwise, sorts).
KINDS = (("expert GEMMs", re.compile(r"_grouped_(gemm|wgrad)_kernel|^_ZN7cutlass13device_kernel")),
         ("other GEMMs", re.compile(r"nvjet|xmma|gemv|splitKreduce|^_ZN7cutlass|cublas", re.IGNORECASE)),
         ("the rest", re.compile("")))


def _blocking(name: str) -> bool:
    """A host API call that waits for the device (``cudaMemcpy`` without ``Async``...)."""
    return "Synchronize" in name or name in ("cudaMemcpy", "cuMemcpyDtoH_v2", "cuMemcpyHtoD_v2", "cudaFree")


def _issuer(launch: dict, host_spans: dict[int, list[dict]], depth: int) -> list[str]:
    """The innermost ``depth`` host spans (Python lines, operators) around ``launch`` on
    its thread, innermost first."""
    around = [e for e in host_spans.get(launch.get("tid"), []) if e["ts"] <= launch["ts"] <= e["ts"] + e["dur"]]
    around.sort(key=lambda e: e["dur"])
    names = []
    for e in around:
        name = str(e["name"])
        if "site-packages" in name or "/torch/" in name or name.startswith("<built-in"):
            continue
        names.append(name.replace(str(Path.cwd()) + "/", ""))
        if len(names) == depth:
            break
    return names


def _host_before(launch: dict, api_calls: list[dict], issuing: set) -> tuple[float | None, list[str]]:
    """Microseconds from the end of the previous host call that issued a device operation
    (``issuing``: their correlation ids; any thread, the backward issues from the autograd
    engine's) to ``launch``, and the slow host API calls in between (``launch`` too),
    with their threads and durations: what held the host up before it issued ``launch``."""
    earlier = [e["ts"] + e["dur"] for e in api_calls
               if e["ts"] + e["dur"] <= launch["ts"] and e.get("args", {}).get("correlation") in issuing]
    if not earlier:
        return None, []
    since = max(earlier)
    slow = [f"{e['name']} {e['dur']:.0f} us (thread {e.get('tid')})" for e in api_calls
            if since <= e["ts"] <= launch["ts"] and e["dur"] >= SLOW_HOST_CALL_US]
    return launch["ts"] - since, slow


def kind_of(name: str) -> str:
    """The ``KINDS`` entry a device operation's name falls in."""
    return next(kind for kind, pattern in KINDS if pattern.search(name))


def device_us_by_kind(ops: list[dict]) -> dict[str, tuple[float, int]]:
    """(device microseconds, operations) of each kind, in ``KINDS`` order."""
    totals = {kind: (0.0, 0) for kind, _ in KINDS}
    for op in ops:
        kind = kind_of(op["name"])
        us, count = totals[kind]
        totals[kind] = (us + op["dur_us"], count + 1)
    return totals


def analyze_trace(trace: dict, top: int = 8, depth: int = 3) -> dict:
    """Span, busy and idle microseconds of a trace's device operations; the ``top``
    largest idle gaps (the operations around each, the lead of the second's launch, the
    host lines that issued it); the host calls that blocked on the device."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    device = sorted((e for e in events if e.get("cat") in DEVICE_CATEGORIES), key=lambda e: e["ts"])
    if not device:
        raise ValueError("the trace has no device operations (was it a GPU run?)")
    launches = {e["args"]["correlation"]: e for e in events
                if e.get("cat") in LAUNCH_CATEGORIES and "correlation" in e.get("args", {})}
    api_calls = [e for e in events if e.get("cat") in LAUNCH_CATEGORIES]
    issuing = {e.get("args", {}).get("correlation") for e in device}
    host_spans: dict[int, list[dict]] = defaultdict(list)
    for e in events:
        if e.get("cat") in ("python_function", "cpu_op", "user_annotation"):
            host_spans[e.get("tid")].append(e)
    start = device[0]["ts"]
    stop = max(e["ts"] + e["dur"] for e in device)
    busy = union_us([(e["ts"], e["ts"] + e["dur"]) for e in device])
    gaps, end, before = [], device[0]["ts"], None
    for e in device:
        if e["ts"] > end and before is not None:
            launch = launches.get(e.get("args", {}).get("correlation"))
            host_us, slow = (None, []) if launch is None else _host_before(launch, api_calls, issuing)
            gaps.append(dict(
                idle_us=e["ts"] - end, before=before["name"], after=e["name"],
                launch_lead_us=None if launch is None else e["ts"] - launch["ts"],
                issued_by=[] if launch is None else _issuer(launch, host_spans, depth),
                host_since_previous_launch_us=host_us, slow_host_calls=slow,
            ))
        if e["ts"] + e["dur"] >= end:
            end, before = e["ts"] + e["dur"], e
    buckets = [dict(up_to_us=b, count=0, idle_us=0.0) for b in (*GAP_BUCKETS_US, float("inf"))]
    for g in gaps:
        bucket = next(b for b in buckets if g["idle_us"] <= b["up_to_us"])
        bucket["count"] += 1
        bucket["idle_us"] += g["idle_us"]
    gaps.sort(key=lambda g: -g["idle_us"])
    blocking = [dict(name=e["name"], dur_us=e["dur"], issued_by=_issuer(e, host_spans, depth))
                for e in events if e.get("cat") in LAUNCH_CATEGORIES and _blocking(str(e["name"]))]
    slow_calls: dict[str, list[float]] = defaultdict(list)
    for e in api_calls:
        if e["dur"] >= SLOW_HOST_CALL_US:
            slow_calls[str(e["name"])].append(e["dur"])
    slow = sorted(((n, len(d), sum(d), max(d)) for n, d in slow_calls.items()), key=lambda x: -x[2])
    ops = [dict(name=e["name"], start_us=e["ts"] - start, dur_us=e["dur"]) for e in device]
    return dict(span_us=stop - start, busy_us=busy, idle_us=stop - start - busy, gaps=gaps[:top],
                gap_count=len(gaps), gap_buckets=buckets, blocking=blocking, device_ops=len(device),
                slow_host_calls=[dict(name=n, count=c, total_us=t, max_us=m) for n, c, t, m in slow],
                ops=ops, by_kind=device_us_by_kind(ops))


def print_analysis(name: str, a: dict, calls: int) -> None:
    print(f"{name}: {calls} forward+backward calls back to back, {a['device_ops'] / calls:.0f} device operations "
          f"per call; per call span {a['span_us'] / calls / 1e3:.3f} ms, device busy {a['busy_us'] / calls / 1e3:.3f}, "
          f"idle {a['idle_us'] / calls / 1e3:.3f} ms in {a['gap_count'] / calls:.0f} gaps")
    print("  idle gaps by size: " + ", ".join(
        f"<= {b['up_to_us']:g} us: {b['count'] / calls:.0f} ({b['idle_us'] / calls / 1e3:.3f} ms)"
        for b in a["gap_buckets"]) + " per call")
    print("  device time by kind: " + ", ".join(
        f"{kind} {us / calls / 1e3:.3f} ms ({count / calls:.0f} ops)" for kind, (us, count) in a["by_kind"].items())
        + " per call")
    for g in a["gaps"]:
        lead = "?" if g["launch_lead_us"] is None else f"{g['launch_lead_us']:.0f}"
        print(f"  idle {g['idle_us']:8.1f} us  {g['before'][:50]} -> {g['after'][:50]}  (issued {lead} us before "
              f"it started)")
        if g["host_since_previous_launch_us"] is not None:
            print(f"      the host ran {g['host_since_previous_launch_us']:.0f} us since the previous launch"
                  + (": " + ", ".join(g["slow_host_calls"]) if g["slow_host_calls"] else ""))
        for line in g["issued_by"]:
            print(f"      from {line[:110]}")
    for c in a["slow_host_calls"]:
        print(f"  host API calls of >= {SLOW_HOST_CALL_US} us: {c['name']} {c['count']} x, {c['total_us'] / calls:.0f} us "
              f"per call, longest {c['max_us']:.0f} us")
    if a["blocking"]:
        print(f"  host calls that waited for the device: {len(a['blocking'])}")
        for b in a["blocking"][:BLOCKING_PRINTED]:
            print(f"    {b['name']} {b['dur_us']:.0f} us, from {' <- '.join(b['issued_by'])[:160]}")
    else:
        print("  no host call waited for the device")


def print_ops(ops: list[dict], per_call: int) -> None:
    """Each device operation of the last call: start (from the call's first), duration,
    idle before it."""
    last = ops[-per_call:]
    t0, end = last[0]["start_us"], last[0]["start_us"]
    print(f"  the last call's {len(last)} device operations: start us, duration us, idle before us")
    for op in last:
        idle = max(0.0, op["start_us"] - end)
        print(f"    {op['start_us'] - t0:9.1f} {op['dur_us']:8.1f} {idle:7.1f}  {op['name'][:90]}")
        end = max(end, op["start_us"] + op["dur_us"])


def report_syncs(name: str, step) -> int:
    """Runs ``step`` once under the sync debug mode; prints each synchronizing operation
    with its caller lines; returns how many there were."""
    seen = []

    def show(message, category, filename, lineno, file=None, line=None):
        stack = [f for f in traceback.extract_stack()[:-1] if "site-packages" not in f.filename
                 and "/torch/" not in f.filename and f.filename != __file__]
        seen.append((str(message).splitlines()[0], stack[-4:]))

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = show
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
            torch.cuda.synchronize()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    print(f"{name}: {len(seen)} synchronizing operation(s) in one forward+backward")
    for message, stack in seen:
        print(f"  {message[:100]}")
        for frame in reversed(stack):
            print(f"      {Path(frame.filename).name}:{frame.lineno} {frame.line}")
    return len(seen)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="dsv3_16b", choices=[s for s in SHAPES if s != "tiny"])
    parser.add_argument("--calls", type=int, default=5)
    parser.add_argument("--layers", default="uniep,torchtitan_compiled",
                        help="of uniep, uniep_compiled, torchtitan, torchtitan_compiled")
    parser.add_argument("--top", type=int, default=8, help="gaps to print per layer")
    parser.add_argument("--stacks", action="store_true", help="also trace the host's operators and Python stacks")
    parser.add_argument("--list", action="store_true", help="print every device operation of the last call")
    parser.add_argument("--json", help="write the analyses here")
    args = parser.parse_args()
    layers = args.layers.split(",")
    allowed = ("uniep", "uniep_compiled", "torchtitan", "torchtitan_compiled")
    if [x for x in layers if x not in allowed] or args.calls < 1:
        sys.exit(f"--layers {args.layers!r} / --calls {args.calls}: allowed layers {', '.join(allowed)}, calls >= 1")
    if not torch.cuda.is_available():
        sys.exit("device_gaps.py needs a CUDA GPU")
    from torch.profiler import ProfilerActivity, profile

    titan, uniep, T, D, *_ = build_layers(args.shape)
    built = dict(uniep=uniep, uniep_compiled=torch.compile(uniep), torchtitan=titan,
                 torchtitan_compiled=torch.compile(titan))
    gen = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(1, T, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    grad = torch.randn_like(x)
    results = {}
    for name in layers:
        layer = built[name]

        def step():
            xi = x.detach().requires_grad_(True)
            layer(xi).backward(grad)
            layer.zero_grad(set_to_none=True)

        for _ in range(5):
            step()
        torch.cuda.synchronize()
        syncs = report_syncs(name, step)
        step()
        torch.cuda.synchronize()
        activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if args.stacks else [ProfilerActivity.CUDA]
        with profile(activities=activities, with_stack=args.stacks) as prof:
            for _ in range(args.calls):
                step()
            torch.cuda.synchronize()
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "trace.json"
            prof.export_chrome_trace(str(path))
            analysis = analyze_trace(json.loads(path.read_text()), top=args.top)
        print_analysis(f"{args.shape} {name}", analysis, args.calls)
        if args.list:
            print_ops(analysis["ops"], analysis["device_ops"] // args.calls)
        del analysis["ops"]
        results[name] = dict(syncs=syncs, **analysis)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
