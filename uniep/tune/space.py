"""The unified parameter space of a UniEP layer's schedule, and its feasibility rules.

Every point is a complete set of kernel knobs (a ``UniEPConfig`` minus the fields that
are not schedule: backend, transport, config). Points that cannot launch on the device
(shared memory over the limit, accumulators over the register budget) are filtered out
before any cost is computed.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from uniep.config import UniEPConfig
from uniep.kernels.grouped_gemm import shared_memory_bytes

# knob -> candidate values; the product is the space
CHOICES: dict[str, tuple[int, ...]] = {
    "gemm_block_m": (64, 128),
    "gemm_block_n": (64, 128, 256),
    "gemm_up_block_n": (64, 128),
    "gemm_block_k": (32, 64, 128),
    "gemm_num_warps": (4, 8),
    "gemm_num_stages": (2, 3, 4, 5),
    "wgrad_block_m": (64, 128),
    "wgrad_block_n": (64, 128, 256),
    "wgrad_up_block_n": (128, 256),
    "wgrad_block_k": (32, 64, 128),
    "wgrad_num_warps": (4, 8),
    "wgrad_num_stages": (2, 3, 4),
}
KNOBS = tuple(CHOICES)
POINT_SETS = {"gemm_few_rows_num_stages": 0}
"""Knobs every point of the space sets besides ``KNOBS``: a point's ``gemm_num_stages``
holds at every row count (it was measured or modelled for its own token count)."""

# Expert-parallel knobs (EP > 1): how rows move and how the megakernel splits its work.
# None changes bits. The cost model ranks the kernel knobs above; these are chosen by
# measurement (scripts/bench_moe.py --ep, scripts/bench_ep.py).
TRANSPORT_CHOICES: dict[str, tuple] = {
    "transport": ("all_to_all", "megakernel"),
    "megakernel_sends_per_task": (4, 8, 16, 32, 64),
    "megakernel_tokens_per_task": (4, 8, 16, 32, 64),
    "megakernel_relay_dedup": (True, False),
}

# Switches that keep the bits and that the cost model does not rank (what they change
# is occupancy and how tiles leave through the copy engine, which a roofline does not
# see): ``scripts/tune.py`` measures each one flipped on its fastest point and keeps a
# flip that measures faster (``uniep.tune.measure.SWITCH_MARGIN``). On an H100, ``wgrad_descriptor_stores`` ran the DeepSeek-V3-671B
# slice faster and the Qwen3-30B-A3B shapes slower (benchmarks/RESULTS.md).
SWITCHES: dict[str, tuple] = {
    "wgrad_descriptor_stores": (False, True),
    "descriptor_stores": (False, True),
    "gemm_half_tiles": (False, True),
}


def default_switches() -> dict:
    """Each switch at its ``UniEPConfig`` default."""
    default = UniEPConfig()
    return {name: getattr(default, name) for name in SWITCHES}


# Accumulator registers per thread above which a tile spills (fp32, of 255 per thread).
MAX_ACC_REGS_PER_THREAD = 128


@dataclass(frozen=True)
class Space:
    """All points as one int array per knob (vectorised cost evaluation)."""

    values: dict[str, np.ndarray]

    def __len__(self) -> int:
        return len(next(iter(self.values.values())))

    def point(self, i: int) -> dict[str, int]:
        return {k: int(v[i]) for k, v in self.values.items()}

    def index_of(self, point: dict[str, int]) -> int | None:
        mask = np.ones(len(self), dtype=bool)
        for k, v in self.values.items():
            mask &= v == point[k]
        hits = np.flatnonzero(mask)
        return int(hits[0]) if hits.size else None


def full_space() -> Space:
    grid = np.array(list(itertools.product(*CHOICES.values())), dtype=np.int64)
    return Space({k: grid[:, i] for i, k in enumerate(KNOBS)})


def feasible(space: Space, smem_limit: int) -> np.ndarray:
    """(N,) bool: the points whose every launch fits the device."""
    v = space.values
    ok = np.ones(len(space), dtype=bool)
    # (block_m, block_n, block_k, warps, stages, A tiles, B tiles) of each launch kind, in bf16;
    # accumulators = the more numerous operand tiles (two B tiles: gate/up)
    launches = [
        (v["gemm_block_m"], v["gemm_up_block_n"], v["gemm_block_k"], v["gemm_num_warps"], v["gemm_num_stages"], 1, 2),
        (v["gemm_block_m"], v["gemm_block_n"], v["gemm_block_k"], v["gemm_num_warps"], v["gemm_num_stages"], 1, 1),
        (v["wgrad_block_m"], v["wgrad_block_n"], v["wgrad_block_k"], v["wgrad_num_warps"], v["wgrad_num_stages"], 1, 1),
        (v["wgrad_block_m"], v["wgrad_up_block_n"], v["wgrad_block_k"], v["wgrad_num_warps"], v["wgrad_num_stages"], 1, 1),
    ]
    for bm, bn, bk, warps, stages, a_tiles, b_tiles in launches:
        ok &= shared_memory_bytes(bm, bn, bk, stages, 2, a_tiles, b_tiles) <= smem_limit
        ok &= bm * bn * max(a_tiles, b_tiles) / (32 * warps) <= MAX_ACC_REGS_PER_THREAD
    return ok


def describe() -> str:
    """The space, knob by knob, and its size."""
    lines = ["UniEP schedule space (kernel knobs of UniEPConfig, ranked by the cost model):"]
    for k, vals in CHOICES.items():
        lines.append(f"  {k:26s} {', '.join(map(str, vals))}")
    size = len(full_space())
    lines.append(f"size: {size} points (before the device's shared-memory and register limits)")
    lines.append("measured switches (the cost model does not rank them; tune.py flips each on its best point):")
    for k, vals in SWITCHES.items():
        lines.append(f"  {k:26s} {', '.join(map(str, vals))}")
    lines.append("expert-parallel knobs (EP > 1; chosen by measurement, none changes bits):")
    transport_size = 1 + int(np.prod([len(v) for k, v in TRANSPORT_CHOICES.items() if k != "transport"]))
    for k, vals in TRANSPORT_CHOICES.items():
        lines.append(f"  {k:26s} {', '.join(map(str, vals))}")
    lines.append(f"size with them: {size * transport_size} points "
                 f"(all_to_all, or the megakernel with {transport_size - 1} settings)")
    return "\n".join(lines)
