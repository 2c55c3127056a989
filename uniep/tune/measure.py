"""Measured refinement: time the cost model's best candidates on the real device, keep
the fastest in the cache, and report how far the predictions were off."""

from __future__ import annotations

import dataclasses
import statistics
import sys

import torch

from uniep.config import UniEPConfig
from uniep.moe import UniEPMoE
from uniep.tune.cache import MoEShape, TuneCache
from uniep.tune.device import DeviceSpec
from uniep.tune.search import neighbors, rank
from uniep.tune.space import KNOBS, full_space


def median_cuda_ms(step, warmup: int = 3, iters: int = 10) -> float:
    """Median milliseconds of ``step()`` (CUDA events), after ``warmup`` calls."""
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
    lead at the start of a call is hidden where ``median_cuda_ms`` counts it."""
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
    sys.stdout.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {i}/{n} {label:<28s} best {best:7.3f} ms")
    sys.stdout.flush()


def tune(
    shape: MoEShape, tokens: int, spec: DeviceSpec, *, top: int = 8, ep_size: int = 1,
    score_func: str = "softmax", score_before_experts: bool = False, local_search: int = 0,
    cache: TuneCache | None = None, on_result=None,
) -> dict:
    """Measure the ``top`` predicted points, the default config and up to ``local_search``
    of the default's one-knob neighbours (best predicted first); store the fastest.

    Returns ``{"best": {...}, "results": [{knobs, predicted_ms, measured_ms}, ...],
    "median_error", "worst_error"}`` (errors relative to the measured times).
    ``on_result(results)`` is called after each measurement (e.g. to save progress).
    """
    torch.manual_seed(0)
    layer = UniEPMoE(shape.dim, shape.hidden, shape.experts, shape.top_k, score_func=score_func,
                     score_before_experts=score_before_experts, load_balance_coeff=None).cuda()
    layer.init_weights(0.02)
    layer.to(torch.bfloat16)
    x = torch.randn(1, tokens, shape.dim, device="cuda", dtype=torch.bfloat16)
    grad = torch.randn_like(x)

    default = {k: getattr(UniEPConfig(), k) for k in KNOBS}
    # predictions for every feasible point from one evaluation of the model, best first
    ranked = rank(shape, tokens, spec, top=len(full_space()), ep_size=ep_size)
    all_ranked = {tuple(k.items()): t for k, t in ranked}
    candidates = [knobs for knobs, _ in ranked[:top]]
    if default not in candidates:
        candidates.append(default)
    nearby = sorted(neighbors(default, spec), key=lambda k: all_ranked.get(tuple(k.items()), float("inf")))
    candidates += [k for k in nearby if k not in candidates][:local_search]

    results, best = [], float("inf")
    for i, knobs in enumerate(candidates):
        changed = [f"{k}={v}" for k, v in knobs.items() if v != default[k]]
        label = "default" if not changed else (
            f"default with {changed[0]}" if len(changed) == 1 and i >= top else f"predicted #{i + 1}"
        )
        _progress(i, len(candidates), label, best)
        layer.config = dataclasses.replace(UniEPConfig(backend="triton"), **knobs)
        try:
            measured = time_layer(layer, x, grad)
        except Exception as e:  # a point the model thought feasible that does not compile or fit
            print(f"\n  {label}: skipped ({type(e).__name__}: {str(e)[:120]})")
            continue
        predicted = all_ranked.get(tuple(knobs.items()), float("nan")) * 1e3
        results.append({"knobs": knobs, "label": label, "predicted_ms": predicted, "measured_ms": measured})
        best = min(best, measured)
        if on_result is not None:
            on_result(results)
    _progress(len(candidates), len(candidates), "done", best)
    print()

    errors = [abs(r["predicted_ms"] - r["measured_ms"]) / r["measured_ms"] for r in results]
    winner = min(results, key=lambda r: r["measured_ms"])
    entry = {"knobs": winner["knobs"], "measured_ms": winner["measured_ms"], "predicted_ms": winner["predicted_ms"]}
    (cache or TuneCache()).store(spec.name, ep_size, shape, tokens, entry)
    return {"best": winner, "results": results,
            "median_error": statistics.median(errors), "worst_error": max(errors)}
