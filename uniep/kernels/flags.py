"""Ready flags between the programs (and the GPUs) of a megakernel, with bounded waits.

A writer stores its data, makes every thread of the program finish (barrier), then
publishes with a release atomic at system scope; a reader polls with acquire atomics
until every flag it needs reaches its target, then barriers before touching the data.

No wait is unbounded: after ``max_spins`` polls the reader records the first missing
flag in the launch's error word and goes on (with garbage); the launcher reads the word
after the launch and raises :class:`MegakernelWaitError` naming the rank, the stage and
the flag. A peer that never signals therefore gives an error, never a hang.

``SCOPE`` is "sys" when peers are other GPUs, "gpu" when every rank is on this device
(virtual ranks): a narrower release is cheaper.

Error word (int32[4]): ``[1 if set, rank, stage, flag index]``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

STAGE_DISPATCH, STAGE_COMBINE = 1, 2
# Kernels may only read globals that are constexpr objects.
_STAGE_DISPATCH, _STAGE_COMBINE = tl.constexpr(STAGE_DISPATCH), tl.constexpr(STAGE_COMBINE)
STAGE_NAMES = {
    STAGE_DISPATCH: ("dispatch (the owner waits for rows from their senders)", "row flag of owner row"),
    STAGE_COMBINE: ("combine (the sender waits for expert outputs from their owners)", "pair flag of (token*K + k)"),
}


class MegakernelWaitError(RuntimeError):
    """A megakernel wait ran past its bound: a peer never signalled."""


@triton.jit
def wait_flags(flag_base, index, mask, target, max_spins, error_ptr, rank, stage, SCOPE: tl.constexpr):
    """Spin until every masked ``flag_base[index] >= target`` (acquire at ``SCOPE``), at
    most ``max_spins`` polls."""
    flag_ptrs = flag_base + index
    ready = tl.atomic_add(flag_ptrs, 0, mask=mask, sem="acquire", scope=SCOPE)
    missing = mask & (ready < target)
    spins = 0
    while (tl.sum(missing.to(tl.int32)) > 0) & (spins < max_spins):
        ready = tl.atomic_add(flag_ptrs, 0, mask=missing, sem="acquire", scope=SCOPE)
        missing = missing & (ready < target)
        spins += 1
    if tl.sum(missing.to(tl.int32)) > 0:
        # the first wait to give up owns the error word
        if tl.atomic_cas(error_ptr, 0, 1) == 0:
            first = tl.min(tl.where(missing, index, 1 << 30))
            tl.atomic_xchg(error_ptr + 1, rank)
            tl.atomic_xchg(error_ptr + 2, stage)
            tl.atomic_xchg(error_ptr + 3, first.to(tl.int32))
    # Every thread of the program reads the data only after the flags were seen.
    tl.debug_barrier()


@triton.jit
def publish_flags(flag_ptrs, mask, value, ADD: tl.constexpr, SCOPE: tl.constexpr):
    """Publish after a barrier: ``*flag_ptrs = value`` (or ``+= value`` with ADD),
    release at ``SCOPE``."""
    tl.debug_barrier()
    if ADD:
        tl.atomic_add(flag_ptrs, value, mask=mask, sem="release", scope=SCOPE)
    else:
        tl.atomic_xchg(flag_ptrs, value, mask=mask, sem="release", scope=SCOPE)


def new_error_word(device: torch.device) -> torch.Tensor:
    return torch.zeros(4, dtype=torch.int32, device=device)


def raise_on_error(error_word: torch.Tensor, kernel: str) -> None:
    """Raise MegakernelWaitError if a wait of the launch that wrote ``error_word`` timed out."""
    is_set, rank, stage, index = error_word.tolist()
    if is_set:
        stage_name, flag_name = STAGE_NAMES.get(stage, (f"stage {stage}", "flag"))
        raise MegakernelWaitError(
            f"{kernel}: rank {rank} timed out in {stage_name}; first missing flag: {flag_name} {index}. "
            "A peer never signalled: it crashed, did not launch the same layer, or max_spins is too small."
        )
