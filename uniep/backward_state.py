"""What an autograd function's backward needs beyond its saved tensors, held so that
activation checkpointing can drop it.

The Triton paths keep their forward activations in a state object rather than in
``ctx.save_for_backward``, so that the backward can release each one as soon as it is
used; the routed-expert custom op keeps the graph it built (``uniep.routed_op``). Kept
on ``ctx``, such state would live as long as the graph, also under activation
checkpointing, which discards what a forward saved and recomputes it. So the state is
held here, under a small handle tensor that the function *does* save for backward: the
state goes when its handle goes (checkpointing dropped it, or the graph was freed) or
when the backward takes it. A recomputed forward holds a new state under a new handle,
and checkpointing hands that handle to the backward.
"""

from __future__ import annotations

import itertools
import weakref

import torch

_HELD: dict[int, object] = {}
_KEYS = itertools.count()


def hold_for_backward(state: object) -> torch.Tensor:
    """A handle (a (1,) int64 CPU tensor) to save for backward in place of ``state``."""
    key = next(_KEYS)
    _HELD[key] = state
    handle = torch.full((1,), key, dtype=torch.int64)  # (torch.tensor parses a list: more host time)
    weakref.finalize(handle, _HELD.pop, key, None)
    return handle


def take_for_backward(handle: torch.Tensor) -> object:
    """The state held under ``handle``; it is no longer held."""
    key = int(handle.item())
    if key not in _HELD:
        raise RuntimeError(
            f"the state of forward call {key} is gone: its backward already ran (retain_graph or a double "
            "backward through a UniEP layer is not supported)"
        )
    return _HELD.pop(key)


def held_states() -> int:
    """States held now (forward calls whose backward has not run and whose handle lives)."""
    return len(_HELD)
