"""Roofline cost model of the fused expert block (forward + backward), vectorised over
the schedule space.

For each of the seven launches (gate/up, down, combine, combine backward, down dgrad
with SwiGLU backward, up dgrad, w2 gradient, fused w1/w3 gradient) the predicted time is

    max(padded FLOPs / (matmul rate * efficiency), bytes / copy bandwidth) + launch cost

FLOPs are padded to whole tiles (per expert: rows rounded up to ``block_m``). Efficiency
multiplies waves (tiles spread over SMs), pipeline fill (``stages - 1`` idle steps plus
an epilogue against ``cdiv(K, block_k)`` useful steps per tile), latency hiding (K
elements loaded ahead), per-step overhead, tile shape (small tiles, or large tiles on
one warpgroup, do less work per operand load), a long-K-step penalty and the reachable
fraction of the matmul rate. The constants (:class:`Calibration`) are fitted to
measured layer times (``scripts/fit_cost_model.py``); ``scripts/tune.py`` measures the
model's best candidates before anything is cached. Weight-gradient tiles
are weighted by their expert's rows, so a skewed routing histogram shows up as
imbalance. The two rates come from ``DeviceSpec`` (measured, not assumed).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from uniep.tune.cache import MoEShape
from uniep.tune.device import DeviceSpec
from uniep.tune.space import Space


@dataclass(frozen=True)
class Calibration:
    """The model's constants, fitted to measured layer times by
    ``scripts/fit_cost_model.py`` (data: ``benchmarks/tune/*.json``, H200)."""

    launch_s: float = 6e-6
    """Fixed cost of one launch."""
    epilogue_steps: float = 2.0
    """Epilogue cost of a tile, in main-loop steps."""
    latency_k: float = 256.0
    """K elements in flight (``(stages - 1) * block_k``) that hide global-memory latency."""
    step_overhead_k: float = 16.0
    """Fixed cost of one main-loop step, in K elements (address math, barriers)."""
    full_rate_area: float = 128 * 256
    """Tile area (elements, accumulators included) at which the tensor cores reach the rate."""
    shape_exponent: float = 0.35
    """How fast smaller tiles lose efficiency: ``(area / full_rate_area) ** shape_exponent``."""
    four_warp_penalty: float = 0.5
    """Efficiency of a tile above 64x128 elements on one warpgroup (4 warps)."""
    block_k_exponent: float = 0.0
    """Efficiency ``(64 / block_k) ** block_k_exponent`` for block_k above 64 (register
    and shared-memory pressure of long K steps)."""
    rate_fraction: float = 1.0
    """Fraction of the measured dense matmul rate a grouped GEMM tile can reach."""
    per_token_s: float = 0.0
    """Time per token of everything but the expert GEMMs (router, sort, plan)."""


# Fitted on 65 measured H200 layer times at five shape/token settings (benchmarks/tune,
# scripts/fit_cost_model.py): median error 4.6% (19.2% with the hand-set constants);
# 6.8% when each setting is predicted by a fit that has not seen it. Those points predate
# kernels 20-30% faster: the model now predicts about 1.3-1.5x today's measured times
# (H200 and H100; benchmarks/RESULTS.md, twenty-seventh session); its best point measured
# faster than the defaults at two of four settings there, slower at the other two.
DEFAULT_CALIBRATION = Calibration(
    epilogue_steps=9.39, latency_k=139.9, step_overhead_k=13.67, full_rate_area=34048.0,
    shape_exponent=0.0528, block_k_exponent=0.0, rate_fraction=0.851, per_token_s=6.8e-11,
)
FOUR_WARP_MAX_AREA = 64 * 128


def _efficiency(cal: Calibration, tiles_work, max_tile_work, programs, iters, stages, area, warps, block_k):
    """(N,) work efficiency of a launch whose tiles do ``tiles_work`` in total."""
    waves = np.maximum(tiles_work / programs, max_tile_work)
    wave_eff = tiles_work / (waves * programs)
    pipe_eff = iters / (iters + (stages - 1) + cal.epilogue_steps)
    latency_eff = np.minimum(1.0, (stages - 1) * block_k / cal.latency_k)  # loads in flight ahead
    step_eff = block_k / (block_k + cal.step_overhead_k)
    shape_eff = np.minimum(1.0, area / cal.full_rate_area) ** cal.shape_exponent
    shape_eff = shape_eff * np.where((warps < 8) & (area > FOUR_WARP_MAX_AREA), cal.four_warp_penalty, 1.0)
    k_eff = np.minimum(1.0, 64.0 / block_k) ** cal.block_k_exponent
    return wave_eff * pipe_eff * latency_eff * step_eff * shape_eff * k_eff * cal.rate_fraction


def _programs(spec: DeviceSpec, block_m, block_n):
    return spec.num_sms * np.where(block_m * block_n >= 128 * 128, 1, 2)


def _per_value(values: np.ndarray, fn) -> np.ndarray:
    """``fn(v)`` for each point's knob value, computed once per distinct value."""
    unique, inverse = np.unique(values, return_inverse=True)
    return np.array([fn(u) for u in unique])[inverse]


def _row_gemm(cal, spec, rows_E, n, kd, acc, bm, bn, bk, warps, stages, bytes_moved):
    """Grouped GEMM over expert row blocks (forward / input-gradient launches)."""
    m_tiles = _per_value(bm, lambda b: np.ceil(rows_E / b).sum())
    n_tiles = np.ceil(n / bn)
    tiles = m_tiles * n_tiles
    flops = 2.0 * tiles * bm * bn * kd * acc
    eff = _efficiency(cal, tiles, 1.0, _programs(spec, bm, bn), np.ceil(kd / bk), stages, bm * bn * acc, warps, bk)
    return np.maximum(flops / (spec.matmul_flops * eff), bytes_moved / spec.copy_bytes_per_s) + cal.launch_s


def _wgrad(cal, spec, rows_E, m, n, acc, bm, bn, bk, warps, stages, bytes_moved):
    """Weight-gradient GEMM: one tile per (expert, m, n), its work its expert's rows."""
    per_expert_tiles = np.ceil(m / bm) * np.ceil(n / bn)
    steps = _per_value(bk, lambda b: np.ceil(rows_E / b).sum())  # row steps summed over experts
    max_steps = _per_value(bk, lambda b: np.ceil(rows_E / b).max())
    work = steps * per_expert_tiles
    mean_iters = np.maximum(steps / len(rows_E), 1)
    flops = 2.0 * steps * bk * m * n * acc
    eff = _efficiency(cal, work, max_steps, _programs(spec, bm, bn), mean_iters, stages, bm * bn * acc, warps, bk)
    return np.maximum(flops / (spec.matmul_flops * eff), bytes_moved / spec.copy_bytes_per_s) + cal.launch_s


def predict(space: Space, shape: MoEShape, rows_per_expert: np.ndarray, spec: DeviceSpec,
            cal: Calibration = DEFAULT_CALIBRATION) -> np.ndarray:
    """(N,) predicted forward+backward seconds of each point, for these rows per expert."""
    v = space.values
    rows_E = np.asarray(rows_per_expert, dtype=np.float64)
    P = rows_E.sum()
    T = P / shape.top_k
    D, H, E = shape.dim, shape.hidden, shape.experts
    b = 2.0  # bytes per bf16 element
    g = dict(bm=v["gemm_block_m"], bk=v["gemm_block_k"], warps=v["gemm_num_warps"], stages=v["gemm_num_stages"])
    w = dict(bm=v["wgrad_block_m"], bk=v["wgrad_block_k"], warps=v["wgrad_num_warps"], stages=v["wgrad_num_stages"])
    combine = (3 * P * D * b + T * D * b) / spec.copy_bytes_per_s + cal.launch_s
    total = (
        # forward: gate/up (two weights, three outputs), down (scattered rows), combine
        _row_gemm(cal, spec, rows_E, H, D, 2, bn=v["gemm_up_block_n"], bytes_moved=(P * D + 2 * E * H * D + 3 * P * H) * b, **g)
        + _row_gemm(cal, spec, rows_E, D, H, 1, bn=v["gemm_block_n"], bytes_moved=(P * H + E * H * D + P * D) * b, **g)
        + combine
        # backward: combine backward, down dgrad + SwiGLU backward, up dgrad, weight gradients
        + combine
        + _row_gemm(cal, spec, rows_E, H, D, 1, bn=v["gemm_up_block_n"], bytes_moved=(P * D + E * H * D + 4 * P * H) * b, **g)
        + _row_gemm(cal, spec, rows_E, D, 2 * H, 1, bn=v["gemm_block_n"], bytes_moved=(2 * P * H + 2 * E * H * D + P * D) * b, **g)
        + _wgrad(cal, spec, rows_E, D, H, 1, bn=v["wgrad_block_n"], bytes_moved=(P * D + P * H + E * H * D) * b, **w)
        + _wgrad(cal, spec, rows_E, 2 * H, D, 1, bn=v["wgrad_up_block_n"], bytes_moved=(2 * P * H + P * D + 2 * E * H * D) * b, **w)
    )
    return total + T * cal.per_token_s
