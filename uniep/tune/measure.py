"""Measured refinement: time the cost model's best candidates on the real device, keep
the fastest in the cache, and report how far the predictions were off."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import statistics
import sys

import torch

from uniep.config import UniEPConfig
from uniep.moe import UniEPMoE
from uniep.tune.cache import MoEShape, TuneCache
from uniep.tune.device import DeviceSpec
from uniep.tune.search import neighbors, rank
from uniep.tune.space import KNOBS, POINT_SETS, SWITCHES, default_switches, full_space


@contextlib.contextmanager
def garbage_collector_paused():
    """Python's automatic garbage collection off (after one collection), and back as it
    was on exit. TorchTitan's trainer runs its steps so (automatic collection off, one
    every ``training.gc_freq`` steps); with it on, a collection that falls inside a
    timed call adds its host time to whichever layer it hits, more the more objects the
    process holds."""
    was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def median_cuda_ms(step, warmup: int = 3, iters: int = 10) -> float:
    """Median milliseconds of ``step()`` (CUDA events), after ``warmup`` calls; automatic
    garbage collection paused (``garbage_collector_paused``)."""
    with garbage_collector_paused():
        for _ in range(warmup):
            step()
        times = []
        for _ in range(iters):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
    return statistics.median(times)


def back_to_back_cuda_ms(step, warmup: int = 3, iters: int = 10, rounds: int = 3) -> float:
    """Milliseconds per call of ``step()`` issued ``iters`` times back to back (events
    around the whole run, no synchronization between calls), median over ``rounds``
    runs, after ``warmup`` calls. The host issues a call while the device still runs
    the one before, as it does across the layers of a training step, so the host's
    lead at the start of a call is hidden where ``median_cuda_ms`` counts it. Automatic
    garbage collection paused, as there."""
    with garbage_collector_paused():
        for _ in range(warmup):
            step()
        torch.cuda.synchronize()
        per_call = []
        for _ in range(rounds):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                step()
            end.record()
            torch.cuda.synchronize()
            per_call.append(start.elapsed_time(end) / iters)
    return statistics.median(per_call)


def time_layer(layer: UniEPMoE, x: torch.Tensor, grad: torch.Tensor) -> float:
    """Median forward+backward milliseconds of ``layer`` on ``x``."""
    def step():
        xi = x.detach().requires_grad_(True)
        layer(xi).backward(grad)
        layer.zero_grad(set_to_none=True)

    return median_cuda_ms(step)


def _progress(i: int, n: int, label: str, best: float) -> None:
    width = 24
    filled = int(width * i / n)
    sys.stdout.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {i}/{n} {label:<40s} best {best:7.3f} ms")
    sys.stdout.flush()


# A flipped switch is kept only where, in each of SWITCH_ROUNDS rounds, it is this much
# faster than the point timed before and after it: one point's timings within one call
# moved by up to 3% on an H100, and one flip that changed nothing measured 3% faster
# once (benchmarks/RESULTS.md); a switch changes no bits, so a smaller gain is not worth it.
SWITCH_MARGIN = 0.01
SWITCH_ROUNDS = 3


def candidates(
    shape: MoEShape, tokens: int, spec: DeviceSpec, *, top: int = 8, ep_size: int = 1, local_search: int = 0,
) -> tuple[list[tuple[str, dict]], dict[tuple, float]]:
    """The points to measure first, as (label, knobs): the ``top`` predicted, the default
    config and up to ``local_search`` of the default's one-knob neighbours (best
    predicted first), every switch at its default; and the model's prediction (seconds)
    of every feasible point, keyed by its kernel knobs."""
    default = {k: getattr(UniEPConfig(), k) for k in KNOBS}
    switches = default_switches()
    ranked = rank(shape, tokens, spec, top=len(full_space()), ep_size=ep_size)
    predicted = {tuple(k.items()): t for k, t in ranked}
    points = [(f"predicted #{i + 1}", knobs) for i, (knobs, _) in enumerate(ranked[:top])]
    if default not in [knobs for _, knobs in points]:
        points.append(("default", default))
    points = [("default" if knobs == default else label, knobs) for label, knobs in points]
    nearby = sorted(neighbors(default, spec), key=lambda k: predicted.get(tuple(k.items()), float("inf")))
    for knobs in [k for k in nearby if k not in [p for _, p in points]][:local_search]:
        name, value = next((k, v) for k, v in knobs.items() if v != default[k])
        points.append((f"default with {name}={value}", knobs))
    return [(label, {**knobs, **switches}) for label, knobs in points], predicted


def tune(
    shape: MoEShape, tokens: int, spec: DeviceSpec, *, top: int = 8, ep_size: int = 1,
    score_func: str = "softmax", score_before_experts: bool = False, local_search: int = 0,
    cache: TuneCache | None = None, on_result=None, timer=None,
) -> dict:
    """Measure the ``candidates``, then flip each of the ``SWITCHES`` on the fastest
    point so far, one at a time, keeping a flip that measures ``SWITCH_MARGIN`` faster
    than that point timed before and after it, in each of ``SWITCH_ROUNDS`` rounds;
    store the fastest.

    ``timer(knobs)`` gives the forward+backward milliseconds of a layer with ``knobs``
    (default: a bf16 layer of ``shape`` on this GPU, ``time_layer``). Returns
    ``{"best": {knobs, label, predicted_ms, measured_ms}, "default_ms", "results":
    [{knobs, label, predicted_ms, measured_ms}, ...], "median_error", "worst_error"}``,
    with the median of each point's timings as the best and the default's time (the
    best is timed again in every round); errors of the model (which sees only the kernel
    knobs) relative to the measured times. ``on_result(results)`` is called after each
    measurement (e.g. to save progress).
    """
    if timer is None:
        timer = _layer_timer(shape, tokens, score_func, score_before_experts)
    points, predicted = candidates(shape, tokens, spec, top=top, ep_size=ep_size, local_search=local_search)
    total = len(points) + 2 * SWITCH_ROUNDS * sum(len(values) - 1 for values in SWITCHES.values())
    results = []

    def measure(label: str, knobs: dict) -> dict | None:
        best = min((r["measured_ms"] for r in results), default=float("inf"))
        _progress(len(results), total, label, best)
        try:
            measured = timer(knobs)
        except Exception as e:  # a point the model thought feasible that does not compile or fit
            print(f"\n  {label}: skipped ({type(e).__name__}: {str(e)[:120]})")
            return None
        model_ms = predicted.get(tuple((k, knobs[k]) for k in KNOBS), float("nan")) * 1e3
        result = {"knobs": knobs, "label": label, "predicted_ms": model_ms, "measured_ms": measured}
        results.append(result)
        if on_result is not None:
            on_result(results)
        return result

    for label, knobs in points:
        measure(label, knobs)
    if not results:
        raise RuntimeError(f"tune: none of the {len(points)} candidate schedules ran on this device")
    winner = min(results, key=lambda r: r["measured_ms"])
    label = winner["label"]
    for name, values in SWITCHES.items():
        for value in values:
            if value == winner["knobs"][name]:
                continue
            # Rounds of (flip, the fastest point again): the flip has to beat that point
            # timed before and after it in every round, so a drift of the clocks or one
            # lucky timing does not make a flip that changes nothing look faster.
            flipped_knobs, before = {**winner["knobs"], name: value}, winner
            for _ in range(SWITCH_ROUNDS):
                flipped = measure(f"{label}, {name}={value}", flipped_knobs)
                again = measure(f"{label} (again)", winner["knobs"]) or before
                bar = (1 - SWITCH_MARGIN) * min(before["measured_ms"], again["measured_ms"])
                faster = flipped is not None and flipped["measured_ms"] < bar
                before = again
                if not faster:
                    break
            if faster:
                winner, label = flipped, flipped["label"]
            else:
                winner = before
    _progress(total, total, "done", winner["measured_ms"])
    print()

    errors = [abs(r["predicted_ms"] - r["measured_ms"]) / r["measured_ms"] for r in results]

    def median_ms(knobs: dict) -> float | None:  # a point timed several times: the median of its timings
        timings = [r["measured_ms"] for r in results if r["knobs"] == knobs]
        return statistics.median(timings) if timings else None

    best_ms = median_ms(winner["knobs"])
    entry = {"knobs": winner["knobs"], "measured_ms": best_ms, "predicted_ms": winner["predicted_ms"]}
    (cache or TuneCache()).store(spec.name, ep_size, shape, tokens, entry)
    default = next(knobs for point_label, knobs in points if point_label == "default")
    return {"best": {**winner, "label": label, "measured_ms": best_ms}, "default_ms": median_ms(default),
            "results": results, "median_error": statistics.median(errors), "worst_error": max(errors)}


def _layer_timer(shape: MoEShape, tokens: int, score_func: str, score_before_experts: bool):
    """``timer(knobs)`` for ``tune``: a bf16 layer of ``shape`` on this GPU, one input of
    ``tokens`` tokens, the layer's config replaced by ``knobs`` before each timing."""
    torch.manual_seed(0)
    layer = UniEPMoE(shape.dim, shape.hidden, shape.experts, shape.top_k, score_func=score_func,
                     score_before_experts=score_before_experts, load_balance_coeff=None).cuda()
    layer.init_weights(0.02)
    layer.to(torch.bfloat16)
    x = torch.randn(1, tokens, shape.dim, device="cuda", dtype=torch.bfloat16)
    grad = torch.randn_like(x)

    def timer(knobs: dict) -> float:
        layer.config = dataclasses.replace(UniEPConfig(backend="triton"), **POINT_SETS, **knobs)
        return time_layer(layer, x, grad)

    return timer
