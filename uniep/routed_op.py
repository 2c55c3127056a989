"""The routed-expert call of a UniEP layer: under torch.compile one opaque
``torch.library`` custom op, so that TorchTitan's ``--compile.enable`` traces a UniEP
layer without graph breaks; eagerly, the expert path itself.

Everything a routed-expert call does on the host (count all-gathers, ``.tolist()``,
pinned copies, NCCL all-to-alls, symmetric-memory launches) runs inside
``uniep::routed_experts``, eagerly, whatever compiles around it: its output has the
input's shape, so the fake implementation needs no data. Inside, the expert path runs
with autograd on detached copies of the inputs; the graph it builds is held for the
backward (``uniep.backward_state``) under a small handle tensor that the op returns, and
``uniep::routed_experts_bwd`` takes it back and differentiates it. The graph goes away
with its handle: after the backward, or at once when nothing will differentiate (no
grad, or an activation-checkpoint forward whose result is recomputed).

Outside torch.compile the layer calls the path directly: the same kernels in the same
order (so the same bits), without the op's dispatch and nested backward, which cost
host time (``scripts/host_time.py``; measured in ``benchmarks/RESULTS.md``).
The paths' autograd functions hold their activations in ``uniep.backward_state`` too,
where activation checkpointing can drop them.

Shape legend: T tokens, K experts per token, D model dim, E experts (El local), H hidden.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import torch
from torch._C import DispatchKey

from uniep.backward_state import hold_for_backward, take_for_backward

_PATHS: list[Callable] = []


def register_path(path: Callable) -> int:
    """The id under which the op calls ``path(x_TD, scores_TK, topk_TK, counts_E, order_2P,
    w1, w2, w3) -> (T, D)``. Register each path once (layers that share one share its id, so a
    compiled block is reused across layers)."""
    _PATHS.append(path)
    return len(_PATHS) - 1


def registered_path(path: int) -> Callable:
    """The path registered under id ``path``."""
    return _PATHS[path]


@contextlib.contextmanager
def _autograd_recording() -> Iterator[None]:
    """Autograd on inside an op's implementation: the dispatcher runs a custom op below
    its autograd keys (they are excluded for the call), and grad mode is off there."""
    exclude = torch._C._dispatch_tls_local_exclude_set()
    for key in (DispatchKey.AutogradFunctionality, DispatchKey.AutogradOther, DispatchKey.AutogradNestedTensor):
        exclude = exclude.remove(key)
    with torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), exclude), torch.enable_grad():
        yield


@torch.library.custom_op("uniep::routed_experts", mutates_args=())
def _routed_experts(
    x_TD: torch.Tensor, scores_TK: torch.Tensor, topk_TK: torch.Tensor, counts_E: torch.Tensor,
    order_2P: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor, path: int, differentiable: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (out (T, D), handle (1,) int64 on the CPU; -1 when not ``differentiable``)."""
    if not differentiable:  # no grad (evaluation): no graph to keep
        with torch.no_grad():
            out_TD = _PATHS[path](x_TD, scores_TK, topk_TK, counts_E, order_2P, w1, w2, w3)
        return out_TD, torch.tensor([-1], dtype=torch.int64)
    leaves = tuple(t.detach().requires_grad_() for t in (x_TD, scores_TK, w1, w2, w3))
    with _autograd_recording():
        out_TD = _PATHS[path](leaves[0], leaves[1], topk_TK, counts_E, order_2P, *leaves[2:])
    return out_TD.detach(), hold_for_backward((leaves, out_TD))


@_routed_experts.register_fake
def _(x_TD, scores_TK, topk_TK, counts_E, order_2P, w1, w2, w3, path, differentiable):
    return torch.empty_like(x_TD), torch.empty(1, dtype=torch.int64)


@torch.library.custom_op("uniep::routed_experts_bwd", mutates_args=())
def _routed_experts_bwd(
    grad_out_TD: torch.Tensor, handle: torch.Tensor,
    x_TD: torch.Tensor, scores_TK: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of x, scores, w1, w2, w3 (the inputs are passed for their shapes)."""
    leaves, out_TD = take_for_backward(handle)
    with _autograd_recording():
        grads = torch.autograd.grad(out_TD, leaves, grad_out_TD, allow_unused=True)
    return tuple(torch.zeros_like(t) if g is None else g for g, t in zip(grads, leaves))


@_routed_experts_bwd.register_fake
def _(grad_out_TD, handle, x_TD, scores_TK, w1, w2, w3):
    return tuple(torch.empty_like(t) for t in (x_TD, scores_TK, w1, w2, w3))


def _setup_context(ctx, inputs, output):
    x_TD, scores_TK, _, _, _, w1, w2, w3, _, _ = inputs
    handle = output[1]
    ctx.mark_non_differentiable(handle)
    ctx.save_for_backward(handle, x_TD, scores_TK, w1, w2, w3)


def _backward(ctx, grad_out_TD, _grad_handle):
    handle, x_TD, scores_TK, w1, w2, w3 = ctx.saved_tensors
    grad_x, grad_scores, grad_w1, grad_w2, grad_w3 = _routed_experts_bwd(
        grad_out_TD.contiguous(), handle, x_TD, scores_TK, w1, w2, w3
    )
    return grad_x, grad_scores, None, None, None, grad_w1, grad_w2, grad_w3, None, None


_routed_experts.register_autograd(_backward, setup_context=_setup_context)


def routed_experts(x_TD, scores_TK, topk_TK, counts_E, order_2P, w1, w2, w3, path: int) -> torch.Tensor:
    """(T, D): the registered path ``path`` over these inputs; behind the op boundary
    when torch.compile traces the call."""
    if not torch.compiler.is_compiling():
        return _PATHS[path](x_TD, scores_TK, topk_TK, counts_E, order_2P, w1, w2, w3)
    differentiable = torch.is_grad_enabled() and any(t.requires_grad for t in (x_TD, scores_TK, w1, w2, w3))
    return _routed_experts(x_TD, scores_TK, topk_TK, counts_E, order_2P, w1, w2, w3, path, differentiable)[0]
