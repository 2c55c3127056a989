"""Host time of a UniEP layer call, part by part: what the CPU spends issuing one
forward+backward, to find what keeps the device waiting.

    python scripts/host_time.py [--shape qwen3_4k] [--calls 20] [--python 30] [--launch-costs 200]
                                [--device cuda]

For the timed calls, the layer's forward, its router, the routed-expert call (eager: the
path itself, no custom op), the expert path, the expert autograd function and every
Triton launch (per kernel) are wrapped in wall-clock timers that work in whichever thread runs
them (on CUDA the backward runs on the autograd engine's device thread, which profilers
of the main thread do not follow). Prints milliseconds per forward+backward, inclusive
(a part contains the parts indented below it), then the host time to issue one call and
the time until the device has finished it. Nothing inside the calls synchronizes; a
part's time is host time only. Python's automatic garbage collection is paused while
they run, as in bench_moe's timers and TorchTitan's training steps. ``--python N``:
then as many calls again under cProfile, the backward on the calling thread
(``torch.autograd.set_multithreading_enabled(False)``; cProfile does not see autograd's
device threads), and the ``N`` Python functions with
the most self time: microseconds per call, self and inclusive, and calls per call (which
functions to make cheaper; the profiler's own cost is in these times, not in the timers
above). ``--launch-costs R``: then each Triton launch of one call again, step by step,
each step ``R`` times (``CachedLaunch.stages``: the binder, the key, the native launch, the
native launch given tensor addresses as integers, the whole direct launch, the JIT's
launch), microseconds per launch, median (which part of a launch to make cheaper; the
kernels run again on stale inputs, so no result of these launches is used).
``--device cpu`` runs the Triton interpreter on a tiny shape (tests the script; CPU times
say nothing about a GPU host; the interpreter has no direct launches).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_moe import SHAPES, build_layers  # noqa: E402

from uniep.tune.measure import garbage_collector_paused  # noqa: E402


class HostTimers:
    """Inclusive wall-clock time and calls per label, of wrapped callables."""

    def __init__(self) -> None:
        self.ms: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._undo: list[tuple[object, str, object]] = []

    def wrap(self, owner, attr: str, label) -> None:
        """Time ``owner.attr`` under ``label`` (a string, or a function of the call's first
        argument, e.g. the kernel of a launch). Static methods stay static."""
        raw = owner.__dict__[attr] if isinstance(owner, type) else getattr(owner, attr)
        static = isinstance(raw, staticmethod)
        original = raw.__func__ if static else raw

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                name = label if isinstance(label, str) else label(args[0])
                self.ms[name] += (time.perf_counter() - start) * 1e3
                self.calls[name] += 1

        setattr(owner, attr, staticmethod(timed) if static else timed)
        self._undo.append((owner, attr, raw))

    def unwrap(self) -> None:
        for owner, attr, raw in reversed(self._undo):
            setattr(owner, attr, raw)
        self._undo.clear()


def instrument(timers: HostTimers, layer) -> list[tuple[str, int]]:
    """Wrap the layer's parts; returns the report's (label, indent) rows in order."""
    import uniep.experts
    from uniep.kernels.fused_experts import _FusedExperts
    from uniep.moe import UniEPMoE
    from uniep.router import TopKRouter

    timers.wrap(UniEPMoE, "forward", "layer forward")
    timers.wrap(TopKRouter, "forward", "router")
    timers.wrap(uniep.experts, "routed_experts", "routed-expert call")
    timers.wrap(type(layer.expert_path), "__call__", f"expert path ({type(layer.expert_path).__name__})")
    timers.wrap(_FusedExperts, "forward", "expert autograd forward")
    timers.wrap(_FusedExperts, "backward", "expert autograd backward")
    from uniep.kernels.launch import CachedLaunch

    timers.wrap(CachedLaunch, "_launch", lambda launch: f"launch {launch.fn.fn.__name__}")
    return [("layer forward", 1), ("router", 2), ("routed-expert call", 2),
            (f"expert path ({type(layer.expert_path).__name__})", 3), ("expert autograd forward", 4),
            ("layer backward (.backward())", 1), ("expert autograd backward", 2)]


def python_profile(step, calls: int, top: int) -> list[tuple[str, float, float, float]]:
    """(function, self us, inclusive us, calls) per call of ``step``, for the ``top``
    functions with the most self time over ``calls`` calls under cProfile, the backward
    on the calling thread."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    with torch.autograd.set_multithreading_enabled(False), garbage_collector_paused():
        profiler.enable()
        try:
            for _ in range(calls):
                step()
        finally:
            profiler.disable()
    rows = []
    for (file, line, name), (_, count, self_s, total_s, _) in pstats.Stats(profiler).stats.items():
        where = name if file == "~" else f"{'/'.join(Path(file).parts[-2:])}:{line}({name})"
        rows.append((where, self_s * 1e6 / calls, total_s * 1e6 / calls, count / calls))
    return sorted(rows, key=lambda r: -r[1])[:top]


def launch_costs(step, repeats: int, sync) -> list[tuple[str, int, dict[str, float]]]:
    """(kernel, tensor arguments, microseconds per launch of each stage: the median of
    ``repeats``) for every direct launch of one call of ``step`` (the backward on the
    calling thread), in launch order."""
    from uniep.kernels.launch import CachedLaunch

    launches = []
    original = CachedLaunch._launch

    def recording(self, grid, *args, **kwargs):
        launches.append((self, grid, args, kwargs))
        return original(self, grid, *args, **kwargs)

    CachedLaunch._launch = recording
    try:
        with torch.autograd.set_multithreading_enabled(False):
            step()
    finally:
        CachedLaunch._launch = original
    sync()
    rows = []
    with garbage_collector_paused():
        for cached, grid, args, kwargs in launches:
            stages = cached.stages(grid, *args, **kwargs)
            if stages is None:
                continue
            times = {}
            for name, run in stages.items():
                samples = []
                for _ in range(repeats):
                    start = time.perf_counter()
                    run()
                    samples.append(time.perf_counter() - start)
                sync()
                times[name] = statistics.median(samples) * 1e6
            tensors = sum(isinstance(a, torch.Tensor) for a in (*args, *kwargs.values()))
            kernel = getattr(cached.fn, "fn", cached.fn)  # a JIT function's Python function
            rows.append((getattr(kernel, "__name__", type(kernel).__name__), tensors, times))
    return rows


def print_launch_costs(rows: list[tuple[str, int, dict[str, float]]]) -> None:
    if not rows:
        print("launch costs: no direct launches here (the interpreter, another Triton, or a launch hook set)")
        return
    names = list(rows[0][2])
    print("launch costs, us per launch (median), step by step:")
    print(f"  {'kernel':<34s} {'tensors':>7s} " + " ".join(f"{n:>{max(8, len(n))}s}" for n in names))
    for kernel, tensors, times in rows:
        print(f"  {kernel[:34]:<34s} {tensors:7d} " + " ".join(f"{times[n]:{max(8, len(n))}.1f}" for n in names))
    print(f"  {'sum over the call':<34s} {sum(r[1] for r in rows):7d} "
          + " ".join(f"{sum(r[2][n] for r in rows):{max(8, len(n))}.1f}" for n in names))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="qwen3_4k", choices=list(SHAPES))
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--python", type=int, default=0, metavar="N",
                        help="also profile as many calls under cProfile and print the N functions with the most self time")
    parser.add_argument("--launch-costs", type=int, default=0, metavar="R",
                        help="also time each launch of one call step by step, each step R times")
    args = parser.parse_args()
    if args.calls < 1 or args.python < 0 or args.launch_costs < 0:
        sys.exit(f"--calls = {args.calls}, --python = {args.python}, --launch-costs = {args.launch_costs}: "
                 "allowed values: calls 1 or more, python and launch-costs 0 or more")
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("host_time.py: no CUDA GPU here (--device cpu runs the Triton interpreter on a tiny shape)")
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    _, layer, T, D, *_ = build_layers(args.shape, dtype=dtype, device=args.device)
    x = torch.randn(1, T, D, device=args.device, dtype=dtype)
    grad = torch.randn_like(x)
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    timers = HostTimers()

    def step() -> None:
        xi = x.detach().requires_grad_(True)
        out = layer(xi)
        start = time.perf_counter()
        out.backward(grad)
        timers.ms["layer backward (.backward())"] += (time.perf_counter() - start) * 1e3
        timers.calls["layer backward (.backward())"] += 1
        layer.zero_grad(set_to_none=True)

    for _ in range(3):  # compile the kernels, fill the allocator's cache
        step()
    timers.ms.clear()
    timers.calls.clear()
    rows = instrument(timers, layer)
    try:
        with garbage_collector_paused():
            sync()
            start = time.perf_counter()
            for _ in range(args.calls):
                step()
            issue_ms = (time.perf_counter() - start) / args.calls * 1e3
            sync()
            finish_ms = (time.perf_counter() - start) / args.calls * 1e3
    finally:
        timers.unwrap()
    print(f"{args.shape} on {args.device}: host ms per forward+backward, inclusive, over {args.calls} calls")
    for label, indent in rows:
        print(f"{'  ' * indent}{label:<{40 - 2 * indent}s} {timers.calls[label] / args.calls:5.1f} calls "
              f"{timers.ms[label] / args.calls:8.3f} ms")
    launches = sorted((k for k in timers.ms if k.startswith("launch ")), key=lambda k: -timers.ms[k])
    print(f"  Triton launches, {sum(timers.calls[k] for k in launches) / args.calls:.1f} per call, "
          f"{sum(timers.ms[k] for k in launches) / args.calls:.3f} ms:")
    for k in launches:
        print(f"    {k[7:]:<36s} {timers.calls[k] / args.calls:5.1f} calls {timers.ms[k] / args.calls:8.3f} ms")
    print(f"issue {issue_ms:.3f} ms per call (host), finished {finish_ms:.3f} ms per call (device done)")
    if args.python:
        rows = python_profile(step, args.calls, args.python)
        sync()
        print(f"Python functions by self time under cProfile, {args.calls} calls, backward on this thread "
              "(us per call: self, inclusive; calls per call):")
        for where, self_us, total_us, count in rows:
            print(f"  {self_us:8.1f} {total_us:9.1f} {count:6.1f}  {where[:110]}")
    if args.launch_costs:
        print_launch_costs(launch_costs(step, args.launch_costs, sync))


if __name__ == "__main__":
    main()
