"""Fit the cost model's constants to measured layer times, and report its error.

    python scripts/fit_cost_model.py [--data benchmarks/tune] [--iters 4000]

Data: the ``--json`` files of ``scripts/tune.py`` (every measured point: knobs,
predicted and measured ms) and the device file ``device-<name>.json`` that
``uniep.tune.device_spec`` cached on that GPU. The fit minimises the mean
|log(predicted / measured)| over all points (Nelder-Mead over the constants of
``uniep.tune.cost_model.Calibration``), then reports the relative error per shape for
the current constants, the fitted ones, and the fitted ones when each shape is left out
of the fit (how well the model carries to a shape it has not seen). It prints the
fitted ``Calibration`` to put into ``uniep/tune/cost_model.py``.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import os
import re
import statistics

import numpy as np

from uniep.tune.cache import MoEShape
from uniep.tune.cost_model import DEFAULT_CALIBRATION, Calibration, predict
from uniep.tune.device import DeviceSpec
from uniep.tune.search import uniform_rows
from uniep.tune.space import KNOBS, Space, default_switches

# Fitted constants and how they map to an unconstrained vector (log for positive ones).
FITTED = ("epilogue_steps", "latency_k", "step_overhead_k", "full_rate_area", "shape_exponent",
          "block_k_exponent", "rate_fraction", "per_token_s")
LOG = {"epilogue_steps", "latency_k", "step_overhead_k", "full_rate_area", "rate_fraction"}
SCALE = {"per_token_s": 1e-9}


def load(folder: str):
    """[(setting name, shape, tokens, Space of the measured points, measured seconds)], spec."""
    (device_file,) = glob.glob(os.path.join(folder, "device-*.json"))
    spec = DeviceSpec(**json.load(open(device_file)))
    settings = []
    switches = default_switches()
    for path in sorted(glob.glob(os.path.join(folder, "*.json"))):
        if path == device_file:
            continue
        data = json.load(open(path))
        dim, hidden, experts, top_k = map(int, re.findall(r"\d+", data["shape"]))
        # a point with a switch flipped has the kernel knobs of another: the model does not see it
        points = [p for p in data["results"] if all(p["knobs"].get(k, v) == v for k, v in switches.items())]
        space = Space({k: np.array([p["knobs"][k] for p in points]) for k in KNOBS})
        measured = np.array([p["measured_ms"] for p in points]) / 1e3
        name = f"{data['shape']} T{data['tokens']}"
        settings.append((name, MoEShape(dim, hidden, experts, top_k), data["tokens"], space, measured))
    return settings, spec


def to_vector(cal: Calibration) -> np.ndarray:
    out = []
    for name in FITTED:
        value = getattr(cal, name) / SCALE.get(name, 1.0)
        out.append(np.log(value) if name in LOG else value)
    return np.array(out, dtype=np.float64)


def from_vector(x: np.ndarray, base: Calibration) -> Calibration:
    values = {}
    for name, v in zip(FITTED, x):
        value = float(np.exp(v)) if name in LOG else float(v)
        values[name] = value * SCALE.get(name, 1.0)
    values["rate_fraction"] = min(values["rate_fraction"], 1.0)
    values["per_token_s"] = max(values["per_token_s"], 0.0)
    values["shape_exponent"] = max(values["shape_exponent"], 0.0)
    values["block_k_exponent"] = max(values["block_k_exponent"], 0.0)
    return dataclasses.replace(base, **values)


def errors(settings, spec, cal):
    """{setting: relative errors (N,)} of the model with ``cal``."""
    out = {}
    for name, shape, tokens, space, measured in settings:
        predicted = predict(space, shape, uniform_rows(shape, tokens), spec, cal)
        out[name] = np.abs(predicted - measured) / measured
    return out


def loss(settings, spec, cal) -> float:
    logs = []
    for _, shape, tokens, space, measured in settings:
        logs.append(np.abs(np.log(predict(space, shape, uniform_rows(shape, tokens), spec, cal) / measured)))
    return float(np.mean(np.concatenate(logs)))


def nelder_mead(f, x0: np.ndarray, iters: int, step: float = 0.3) -> np.ndarray:
    """Minimise ``f`` from ``x0`` (plain Nelder-Mead; no SciPy on our machines)."""
    n = len(x0)
    simplex = [x0] + [x0 + step * np.eye(n)[i] for i in range(n)]
    values = [f(x) for x in simplex]
    for _ in range(iters):
        order = np.argsort(values)
        simplex, values = [simplex[i] for i in order], [values[i] for i in order]
        centroid = np.mean(simplex[:-1], axis=0)
        reflected = centroid + (centroid - simplex[-1])
        fr = f(reflected)
        if fr < values[0]:
            expanded = centroid + 2 * (centroid - simplex[-1])
            fe = f(expanded)
            simplex[-1], values[-1] = (expanded, fe) if fe < fr else (reflected, fr)
        elif fr < values[-2]:
            simplex[-1], values[-1] = reflected, fr
        else:
            contracted = centroid + 0.5 * (simplex[-1] - centroid)
            fc = f(contracted)
            if fc < values[-1]:
                simplex[-1], values[-1] = contracted, fc
            else:  # shrink towards the best point
                simplex = [simplex[0]] + [simplex[0] + 0.5 * (x - simplex[0]) for x in simplex[1:]]
                values = [values[0]] + [f(x) for x in simplex[1:]]
    return simplex[int(np.argmin(values))]


def fit(settings, spec, base: Calibration, iters: int) -> Calibration:
    x = nelder_mead(lambda v: loss(settings, spec, from_vector(v, base)), to_vector(base), iters)
    return from_vector(x, base)


def report(title: str, errs: dict) -> None:
    every = np.concatenate(list(errs.values()))
    print(f"{title}: median {np.median(every):.1%}, worst {every.max():.1%} over {every.size} points")
    for name, e in errs.items():
        print(f"  {name:24s} median {statistics.median(e):6.1%}  worst {e.max():6.1%}  ({e.size} points)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", default="benchmarks/tune")
    parser.add_argument("--iters", type=int, default=4000)
    args = parser.parse_args()
    settings, spec = load(args.data)
    print(f"{sum(s[3].values['gemm_block_m'].size for s in settings)} measured points, {len(settings)} settings, "
          f"device {spec.name}")
    report("current constants", errors(settings, spec, DEFAULT_CALIBRATION))
    fitted = fit(settings, spec, DEFAULT_CALIBRATION, args.iters)
    report("fitted on every setting", errors(settings, spec, fitted))
    held_out = {}
    for i, (name, *_rest) in enumerate(settings):
        others = settings[:i] + settings[i + 1:]
        held_out.update({k: v for k, v in errors([settings[i]], spec, fit(others, spec, DEFAULT_CALIBRATION, args.iters)).items()})
    report("fitted without the setting it predicts (leave one out)", held_out)
    print("\n" + repr(fitted))


if __name__ == "__main__":
    main()
