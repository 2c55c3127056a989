"""Pick a schedule: the measured cache first, else the cost model's argmin.

The whole space is evaluated at once (numpy) in well under a second; results are
memoised per (shape, 4096-token bucket, EP degree, device), so later look-ups are free.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from uniep.config import UniEPConfig
from uniep.tune.cache import MoEShape, TuneCache, token_bucket
from uniep.tune.cost_model import predict
from uniep.tune.device import DeviceSpec
from uniep.tune.space import KNOBS, POINT_SETS, Space, feasible, full_space


@functools.lru_cache(maxsize=1)
def _space() -> Space:
    return full_space()


def uniform_rows(shape: MoEShape, tokens: int, ep_size: int = 1) -> np.ndarray:
    """(E/W,) rows per local expert under balanced routing of ``tokens`` per rank."""
    local = shape.experts // ep_size
    return np.full(local, tokens * shape.top_k / local)


def rank(
    shape: MoEShape, tokens: int, spec: DeviceSpec, *, rows_per_expert=None, ep_size: int = 1, top: int = 10,
    space: Space | None = None,
):
    """The ``top`` feasible points of ``space`` (default: the full space) with the lowest
    predicted time, as (knobs, predicted seconds)."""
    space = space or _space()
    rows = uniform_rows(shape, tokens, ep_size) if rows_per_expert is None else np.asarray(rows_per_expert)
    times = predict(space, shape, rows, spec)
    times = np.where(feasible(space, spec.smem_per_block), times, np.inf)
    order = np.argsort(times, kind="stable")[:top]
    return [(space.point(int(i)), float(times[i])) for i in order if np.isfinite(times[i])]


def neighbors(knobs: dict[str, int], spec: DeviceSpec) -> list[dict[str, int]]:
    """Feasible points that differ from ``knobs`` in exactly one knob (a measured local
    search around a known-good point catches what the cost model misranks)."""
    from uniep.tune.space import CHOICES

    points = [
        {**knobs, name: value}
        for name, values in CHOICES.items()
        for value in values
        if value != knobs[name]
    ]
    space = Space({k: np.array([p[k] for p in points]) for k in CHOICES})
    return [p for p, ok in zip(points, feasible(space, spec.smem_per_block)) if ok]


# The model replaces the given knobs only when it predicts at least this gain: below
# it, the difference is within the model's error (6.8% median when predicting a shape
# it was not fitted on), and the measured step of scripts/tune.py decides instead.
MODEL_MARGIN = 0.10


@functools.lru_cache(maxsize=256)
def _model_choice(
    shape: MoEShape, bucket: int, spec: DeviceSpec, ep_size: int, given: tuple[tuple[str, int], ...]
) -> tuple[tuple[tuple[str, int], ...], float]:
    """(knobs, predicted gain over ``given``): the model's argmin, or ``given`` itself
    when the argmin is not predicted to be ``MODEL_MARGIN`` faster."""
    knobs, best = rank(shape, bucket, spec, ep_size=ep_size, top=1)[0]
    one = Space({k: np.array([v]) for k, v in given})
    base = float(predict(one, shape, uniform_rows(shape, bucket, ep_size), spec)[0])
    gain = base / best
    return (tuple(knobs.items()) if gain >= 1 + MODEL_MARGIN else given), gain


def resolve(
    config: UniEPConfig, shape: MoEShape, tokens: int, spec: DeviceSpec, ep_size: int = 1,
    cache: TuneCache | None = None,
) -> tuple[UniEPConfig, str]:
    """A concrete config for ``config.config == "auto"`` and where it came from: a
    "measured" cache entry, the "cost model" argmin, or the config's own knobs when the
    model predicts no gain beyond its error ("cost model: given knobs kept"); other
    configs are returned unchanged."""
    if config.config != "auto":
        return config, "explicit"
    entry = (cache or TuneCache()).lookup(spec.name, ep_size, shape, tokens)
    if entry is not None:
        return dataclasses.replace(config, config="explicit", **POINT_SETS, **entry["knobs"]), "measured"
    given = tuple((k, getattr(config, k)) for k in KNOBS)
    knobs, gain = _model_choice(shape, token_bucket(tokens), spec, ep_size, given)
    source = "cost model" if knobs != given else f"cost model: given knobs kept (best point predicted {gain:.2f}x)"
    return dataclasses.replace(config, config="explicit", **POINT_SETS, **dict(knobs)), source
