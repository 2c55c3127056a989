"""UniEPConfig: every knob of a UniEP layer, with validation.

A config is built directly, from a dict, or from the ``[uniep]`` table of a TOML job
file. Bad values are rejected before any work starts, with a message that names the
field, the value given and the values allowed.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from typing import Any, Literal, Mapping

Backend = Literal["auto", "torch", "triton"]
Transport = Literal["all_to_all", "megakernel"]
Mode = Literal["explicit", "auto"]


_BLOCK_SIZES = (16, 32, 64, 128, 256)
_WARPS = (1, 2, 4, 8, 16)


class UniEPConfigError(ValueError):
    """A UniEP setting is unknown, of the wrong type, or out of range."""


@dataclass(frozen=True)
class UniEPConfig:
    config: Mode = "explicit"
    """``explicit``: the kernel knobs below are used as written. ``auto``: they are
    picked per layer shape and 4096-token bucket, from the measured cache written by
    ``scripts/tune.py`` if it has the entry, else by the cost model; the choice is
    logged."""

    backend: Backend = "auto"
    """Compute path of the expert block. ``triton``: fused Triton kernels (CUDA; at
    expert-parallel degree > 1 over the ``all_to_all`` transport, with the same bits as
    one rank). ``torch``: plain-PyTorch reference path (runs anywhere). ``auto``:
    ``triton`` on CUDA, else ``torch``."""

    transport: Transport = "all_to_all"
    """How rows move between expert-parallel ranks. ``all_to_all``: torch.distributed
    all-to-all of rows in plan order (NCCL on GPU, gloo on CPU), experts on the chosen
    backend. ``megakernel``: dispatch, expert MLP and combine in two fused Triton
    launches over symmetric-memory peer buffers (CUDA GPUs); a group of several nodes
    joins them with an inter-node all-to-all (hierarchical). Both give the same bits.
    Ignored when the expert-parallel degree is 1."""

    gemm_block_m: int = 128
    """Rows per tile of the forward/input-gradient grouped GEMMs (16..256, power of 2).
    May change the bits of bf16 results."""
    gemm_block_n: int = 256
    """Output columns per tile of the plain GEMMs: the down projection and the down
    and up input gradients (16..256, power of 2). May change bits."""
    gemm_up_block_n: int = 128
    """Output columns per tile of the GEMMs with a SwiGLU epilogue: gate/up (two
    accumulators, w1 and w3), and in the megakernel the down input gradient (16..256,
    power of 2). May change bits."""
    gemm_block_k: int = 64
    """Reduction step (16..256, power of 2). May change bits."""
    gemm_num_warps: int = 8
    """Warps per program (1, 2, 4, 8, 16). Does not change bits."""
    gemm_half_tiles: bool = False
    """An expert's last row tile with at most ``gemm_block_m / 2`` rows runs a dot of
    half the rows (the forward and input-gradient GEMMs). Does not change bits."""
    gemm_num_stages: int = 3
    """Software-pipelining depth (1..8); fewer where the tiles would not fit the
    device's shared memory. On an H200, 3 ran the DeepSeek-V3 shapes' launches faster
    than 4 (benchmarks/RESULTS.md). Does not change bits."""
    gemm_few_rows_num_stages: int = 4
    """The pipelining depth of those GEMMs where a launch's experts average at most
    ``kernels.grouped_gemm.FEW_ROWS_PER_EXPERT`` rows (0..8; 0: ``gemm_num_stages``
    there too; the megakernel's launches keep ``gemm_num_stages``). With few row tiles
    per expert each weight tile is streamed from memory for few rows, and a deeper
    pipeline keeps more of it in flight: at 4096 tokens (Qwen3-30B-A3B, 256 rows per
    expert) 4 stages ran the expert launches 4.7% faster in sum than 3 on an H100 and
    1.4% on an H200 (the gate/up launch 7% and 6%); at 16384 tokens 4.5% slower on the
    H100; the H200's layer took the same time with either (benchmarks/RESULTS.md). A
    tuned config (``config = "auto"``) sets 0: its ``gemm_num_stages`` was measured
    for its own token count. Does not change bits."""
    gemm_prefetch_steps: int = 0
    """Those GEMMs ask L2 for their weights this many reduction steps ahead of the dots
    (0..16; 0: off), beyond the pipeline stages in shared memory; on CUDA with 16-bit
    weights (``kernels.grouped_gemm.prefetch_steps_for``; not the megakernel's
    launches). Meant for few rows per expert, where the launches wait on the weights'
    stream from memory. Not yet timed on a GPU. Does not change bits."""

    wgrad_block_m: int = 128
    """Weight-gradient tile rows (16..256, power of 2). May change bits."""
    wgrad_block_n: int = 128
    """Weight-gradient tile columns (16..256, power of 2). 128 (with 8 warps and 3
    stages) leaves room for two programs per SM (``kernels.grouped_gemm.programs_per_sm``).
    May change bits."""
    wgrad_block_k: int = 64
    """Token rows summed per step of the weight gradient (16..256, power of 2). May change bits."""
    wgrad_up_block_n: int = 128
    """Tile columns of the w1/w3 gradient launch (its w3 tiles follow its w1 tiles, one
    accumulator each) (16..256, power of 2). May change bits."""
    wgrad_num_warps: int = 8
    """Warps per weight-gradient program (1, 2, 4, 8, 16). Does not change bits."""
    wgrad_num_stages: int = 3
    """Weight-gradient pipelining depth (1..8). Does not change bits."""
    wgrad_expert_run: int = -1
    """Weight gradients: 0, tiles dealt round-robin, each expert's partial last chunk of
    rows summed after the pipelined loop; J in 1..64, runs of J consecutive tiles of one
    expert per program, that chunk inside the loop (the copy engine zero-fills past the
    expert; ``kernels.grouped_gemm.GemmTiles.expert_run``); -1, runs of 4 where an expert
    averages at most 384 rows (faster on an H200 at 4096 tokens, slower at 16384),
    else 0. Does not change bits."""
    wgrad_descriptor_stores: bool = False
    """The weight gradients store their tiles through tensor descriptors (TMA on
    Hopper) instead of pointer stores, where each expert's gradient is a whole number
    of tiles high (w2: ``wgrad_block_m`` divides the model dim; w1/w3:
    ``wgrad_up_block_n`` divides the expert hidden dim). On an H100 the layer ran 2%
    faster at the DeepSeek-V3-671B slice and 5% slower at Qwen3-30B-A3B's 32768 tokens;
    the launches alone were slower at the Qwen3 and DeepSeek-V3-16B shapes (a tile of
    shared memory for the store leaves room for one program per SM instead of two;
    benchmarks/RESULTS.md). Does not change bits."""

    megakernel_sends_per_task: int = 16
    """Megakernel: token sends per push task (1..256, power of 2). Does not change bits."""
    megakernel_tokens_per_task: int = 16
    """Megakernel: tokens per combine task (1..256, power of 2). Does not change bits."""
    megakernel_relay_dedup: bool = True
    """Megakernel: a token routed to several experts of one rank crosses to it once and
    feeds all its rows there (True), or once per expert (False: more traffic; for
    comparison). Does not change bits."""
    megakernel_max_spins: int = 1 << 24
    """Megakernel: polls of a ready flag before the wait gives up and the layer raises
    an error naming the rank, stage and flag (a peer that never signals; about 10 s
    on an H200). At least 1."""
    num_programs: int = 0
    """Persistent programs per kernel launch; 0: as many per SM as fit its registers and
    shared memory, up to 3 (``kernels.grouped_gemm.programs_per_sm``). Does not change bits."""
    descriptor_loads: bool = True
    """Grouped GEMMs read their contiguous operands (expert weights; token rows that are
    not gathered) through tensor descriptors, the copy engine (TMA) on Hopper, instead
    of pointer loads. Does not change bits."""
    descriptor_stores: bool = False
    """The forward and input-gradient GEMMs whose outputs stay in plan order (gate/up,
    the down input gradient) store their full row tiles through tensor descriptors
    (TMA on Hopper) instead of pointer stores. Does not change bits."""

    shared_experts_stream: bool = False
    """The shared experts' first half (w1, w3, SwiGLU) runs on a second CUDA stream
    beside the router and routed experts, where the experts run on Triton (not under
    torch.compile): its GEMMs overlap the routed path's memory-bound launches
    (``uniep.streams``). Its backward sums onto their input gradient, so it follows
    them. The router then computes its own logits (on one stream the shared experts'
    launches do, ``uniep.shared_experts``), in its own launch, whose dot products round
    differently from the GEMM's: that changes the bits of the logits and of everything
    after them. On one H200 the layer ran no faster, measured
    when the whole shared forward and backward ran on that stream (the kernels side by
    side slowed each other as much as they overlapped; benchmarks/RESULTS.md)."""

    def __post_init__(self) -> None:
        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):
            _check_value(f.name, getattr(self, f.name), hints[f.name])
        for name in ("gemm_block_m", "gemm_block_n", "gemm_up_block_n", "gemm_block_k",
                     "wgrad_block_m", "wgrad_block_n", "wgrad_block_k", "wgrad_up_block_n"):
            value = getattr(self, name)
            if value not in _BLOCK_SIZES:
                raise UniEPConfigError(f"{name} = {value} is not allowed; allowed values: {_BLOCK_SIZES}")
        for name in ("gemm_num_warps", "wgrad_num_warps"):
            if getattr(self, name) not in _WARPS:
                raise UniEPConfigError(f"{name} = {getattr(self, name)} is not allowed; allowed values: {_WARPS}")
        for name in ("gemm_num_stages", "wgrad_num_stages"):
            if not 1 <= getattr(self, name) <= 8:
                raise UniEPConfigError(f"{name} = {getattr(self, name)} is not allowed; allowed values: 1..8")
        if not 0 <= self.gemm_prefetch_steps <= 16:
            raise UniEPConfigError(f"gemm_prefetch_steps = {self.gemm_prefetch_steps} is not allowed; "
                                   "allowed values: 0 (off), 1..16")
        if not 0 <= self.gemm_few_rows_num_stages <= 8:
            raise UniEPConfigError(f"gemm_few_rows_num_stages = {self.gemm_few_rows_num_stages} is not allowed; "
                                   "allowed values: 0 (gemm_num_stages), 1..8")
        for name in ("megakernel_sends_per_task", "megakernel_tokens_per_task"):
            value = getattr(self, name)
            if value < 1 or value > 256 or value & (value - 1):
                raise UniEPConfigError(f"{name} = {value} is not allowed; allowed values: powers of 2 in 1..256")
        if self.megakernel_max_spins < 1:
            raise UniEPConfigError(f"megakernel_max_spins = {self.megakernel_max_spins} must be >= 1")
        if not -1 <= self.wgrad_expert_run <= 64:
            raise UniEPConfigError(f"wgrad_expert_run = {self.wgrad_expert_run} is not allowed; allowed values: "
                                   "-1 (by rows per expert), 0..64")
        if self.num_programs < 0:
            raise UniEPConfigError(f"num_programs = {self.num_programs} must be >= 0 (0: one per SM)")

    @classmethod
    def from_dict(cls, table: Mapping[str, Any] | None, *, where: str = "uniep") -> "UniEPConfig":
        """Build from a dict (e.g. a TOML ``[uniep]`` table). ``where`` prefixes field
        names in error messages."""
        table = dict(table or {})
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(table) - known)
        if unknown:
            raise UniEPConfigError(
                f"unknown key {where}.{unknown[0]} = {table[unknown[0]]!r}; "
                f"allowed keys in [{where}]: {', '.join(sorted(known))}"
            )
        try:
            return cls(**table)
        except UniEPConfigError as e:
            raise UniEPConfigError(f"{where}.{e}") from None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _check_value(name: str, value: Any, hint: Any) -> None:
    if typing.get_origin(hint) is Literal:
        allowed = typing.get_args(hint)
        if value not in allowed:
            raise UniEPConfigError(
                f"{name} = {value!r} is not allowed; allowed values: "
                + ", ".join(repr(a) for a in allowed)
            )
        return
    # bool is an int subclass: reject True where a number is expected and vice versa.
    if hint is bool and not isinstance(value, bool):
        raise UniEPConfigError(f"{name} = {value!r} must be a bool (true/false)")
    if hint is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise UniEPConfigError(f"{name} = {value!r} must be an integer")
