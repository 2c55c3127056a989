"""Roofline cost model of the fused expert block (forward + backward), vectorised over
the schedule space.

For each of the seven launches (gate/up, down, combine, combine backward, down dgrad
with SwiGLU backward, up dgrad, w2 gradient, fused w1/w3 gradient) the predicted time is

    max(padded FLOPs / (matmul rate * efficiency), bytes / copy bandwidth) + launch cost

FLOPs are padded to whole tiles (per expert: rows rounded up to ``block_m``). Efficiency
multiplies five factors: waves (tiles spread over SMs), pipeline fill (``stages - 1``
idle steps plus an epilogue against ``cdiv(K, block_k)`` useful steps per tile), latency
hiding (K elements loaded ahead), per-step overhead, and tile shape (small tiles, or
large tiles on one warpgroup, do less work per operand load). The constants are rough
fits to the H200 sweeps in benchmarks/RESULTS.md; ``scripts/tune.py`` measures the
model's best candidates before anything is cached. Weight-gradient tiles
are weighted by their expert's rows, so a skewed routing histogram shows up as
imbalance. The two rates come from ``DeviceSpec`` (measured, not assumed).
"""

from __future__ import annotations

import numpy as np

from uniep.tune.cache import MoEShape
from uniep.tune.device import DeviceSpec
from uniep.tune.space import Space

LAUNCH_S = 6e-6
EPILOGUE_STEPS = 2.0
# K elements in flight (stages * block_k) needed to hide global-memory latency, and the
# fixed cost of one main-loop step in K elements (address math, barriers).
LATENCY_K = 256.0
STEP_OVERHEAD_K = 16.0
# Below this tile area (elements) one warpgroup (4 warps) keeps up; above it 4 warps
# leave the tensor cores idle (H200 sweeps: 64x256 tiles with 4 warps ran ~3x slower).
FOUR_WARP_MAX_AREA = 64 * 128
# Tile area (elements, accumulators included) at which the tensor cores reach the
# measured matmul rate.
FULL_RATE_AREA = 128 * 256


def _efficiency(tiles_work, max_tile_work, programs, iters, stages, area, warps, block_k):
    """(N,) work efficiency of a launch whose tiles do ``tiles_work`` in total."""
    waves = np.maximum(tiles_work / programs, max_tile_work)
    wave_eff = tiles_work / (waves * programs)
    pipe_eff = iters / (iters + (stages - 1) + EPILOGUE_STEPS)
    latency_eff = np.minimum(1.0, (stages - 1) * block_k / LATENCY_K)  # loads in flight ahead
    step_eff = block_k / (block_k + STEP_OVERHEAD_K)
    shape_eff = np.minimum(1.0, area / FULL_RATE_AREA) ** 0.35
    shape_eff = shape_eff * np.where((warps < 8) & (area > FOUR_WARP_MAX_AREA), 0.5, 1.0)
    return wave_eff * pipe_eff * latency_eff * step_eff * shape_eff


def _programs(spec: DeviceSpec, block_m, block_n):
    return spec.num_sms * np.where(block_m * block_n >= 128 * 128, 1, 2)


def _per_value(values: np.ndarray, fn) -> np.ndarray:
    """``fn(v)`` for each point's knob value, computed once per distinct value."""
    unique, inverse = np.unique(values, return_inverse=True)
    return np.array([fn(u) for u in unique])[inverse]


def _row_gemm(spec, rows_E, n, kd, acc, bm, bn, bk, warps, stages, bytes_moved):
    """Grouped GEMM over expert row blocks (forward / input-gradient launches)."""
    m_tiles = _per_value(bm, lambda b: np.ceil(rows_E / b).sum())
    n_tiles = np.ceil(n / bn)
    tiles = m_tiles * n_tiles
    flops = 2.0 * tiles * bm * bn * kd * acc
    eff = _efficiency(tiles, 1.0, _programs(spec, bm, bn), np.ceil(kd / bk), stages, bm * bn * acc, warps, bk)
    return np.maximum(flops / (spec.matmul_flops * eff), bytes_moved / spec.copy_bytes_per_s) + LAUNCH_S


def _wgrad(spec, rows_E, m, n, acc, bm, bn, bk, warps, stages, bytes_moved):
    """Weight-gradient GEMM: one tile per (expert, m, n), its work its expert's rows."""
    per_expert_tiles = np.ceil(m / bm) * np.ceil(n / bn)
    steps = _per_value(bk, lambda b: np.ceil(rows_E / b).sum())  # row steps summed over experts
    max_steps = _per_value(bk, lambda b: np.ceil(rows_E / b).max())
    work = steps * per_expert_tiles
    mean_iters = np.maximum(steps / len(rows_E), 1)
    flops = 2.0 * steps * bk * m * n * acc
    eff = _efficiency(work, max_steps, _programs(spec, bm, bn), mean_iters, stages, bm * bn * acc, warps, bk)
    return np.maximum(flops / (spec.matmul_flops * eff), bytes_moved / spec.copy_bytes_per_s) + LAUNCH_S


def predict(space: Space, shape: MoEShape, rows_per_expert: np.ndarray, spec: DeviceSpec) -> np.ndarray:
    """(N,) predicted forward+backward seconds of each point, for these rows per expert."""
    v = space.values
    rows_E = np.asarray(rows_per_expert, dtype=np.float64)
    P = rows_E.sum()
    T = P / shape.top_k
    D, H, E = shape.dim, shape.hidden, shape.experts
    b = 2.0  # bytes per bf16 element
    g = dict(bm=v["gemm_block_m"], bk=v["gemm_block_k"], warps=v["gemm_num_warps"], stages=v["gemm_num_stages"])
    w = dict(bm=v["wgrad_block_m"], bk=v["wgrad_block_k"], warps=v["wgrad_num_warps"], stages=v["wgrad_num_stages"])
    combine = (3 * P * D * b + T * D * b) / spec.copy_bytes_per_s + LAUNCH_S
    total = (
        # forward: gate/up (two weights, three outputs), down (scattered rows), combine
        _row_gemm(spec, rows_E, H, D, 2, bn=v["gemm_up_block_n"], bytes_moved=(P * D + 2 * E * H * D + 3 * P * H) * b, **g)
        + _row_gemm(spec, rows_E, D, H, 1, bn=v["gemm_block_n"], bytes_moved=(P * H + E * H * D + P * D) * b, **g)
        + combine
        # backward: combine backward, down dgrad + SwiGLU backward, up dgrad, weight gradients
        + combine
        + _row_gemm(spec, rows_E, H, D, 1, bn=v["gemm_block_n"], bytes_moved=(P * D + E * H * D + 4 * P * H) * b, **g)
        + _row_gemm(spec, rows_E, D, 2 * H, 1, bn=v["gemm_block_n"], bytes_moved=(2 * P * H + 2 * E * H * D + P * D) * b, **g)
        + _wgrad(spec, rows_E, D, H, 1, bn=v["wgrad_block_n"], bytes_moved=(P * D + P * H + E * H * D) * b, **w)
        + _wgrad(spec, rows_E, H, D, 2, bn=v["wgrad_up_block_n"], bytes_moved=(2 * P * H + P * D + 2 * E * H * D) * b, **w)
    )
    return total
