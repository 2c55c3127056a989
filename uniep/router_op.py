"""The router's gate and expert choice as one differentiable call on Triton launches:
eagerly an autograd function; under torch.compile the opaque custom ops
``uniep::router_choice`` and ``uniep::router_choice_bwd``. Both run the same launches in
the same order, so a compiled layer keeps the eager bits.

Forward: the gate's logits, scores, choice, route norm and scale in one launch
(``kernels.router_select.router_gate_select``; each token's logits one dot product per
expert, so its bits do not depend on the batch). Backward: the logits' gradient in one
launch, the input gradient on fixed row blocks (``batch_invariant``), the gate's weight
gradient in one GEMM. ``choice_of_logits`` is the choice alone, for a layer whose
shared experts compute the logits with their own GEMMs, and its input and weight
gradients with theirs.

Shape legend: T tokens, D model dim, E experts, K experts per token.
"""

from __future__ import annotations

import torch
from torch import nn

from uniep.batch_invariant import blocked_linear_backward, rows_per_block
from uniep.kernels.router_select import router_gate_select, router_select_backward, router_select_forward


def _forward(x_TD, weight_ED, bias_E, expert_bias_E, given_TK, top_k, sigmoid, route_norm, route_scale):
    return router_gate_select(x_TD, weight_ED, bias_E, top_k, sigmoid=sigmoid, route_norm=route_norm,
                              route_scale=route_scale, expert_bias_E=expert_bias_E, topk_idx_TK=given_TK)


def _backward(grad_top_TK, x_TD, weight_ED, logits_TE, idx_TK, has_bias, sigmoid, route_norm, route_scale, block):
    grad_logits_TE = router_select_backward(logits_TE, idx_TK, grad_top_TK, sigmoid=sigmoid, route_norm=route_norm,
                                            route_scale=route_scale)
    return blocked_linear_backward(grad_logits_TE, x_TD, weight_ED, has_bias, block)


class _RouterChoice(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TD, weight_ED, bias_E, expert_bias_E, given_TK, top_k, sigmoid, route_norm, route_scale,
                block):
        top_TK, idx_TK, logits_TE = _forward(x_TD, weight_ED, bias_E, expert_bias_E, given_TK, top_k, sigmoid,
                                             route_norm, route_scale)
        ctx.save_for_backward(x_TD, weight_ED, logits_TE, idx_TK)
        ctx.settings = (bias_E is not None, sigmoid, route_norm, route_scale, block)
        ctx.mark_non_differentiable(idx_TK)
        return top_TK, idx_TK

    @staticmethod
    def backward(ctx, grad_top_TK, _grad_idx):
        x_TD, weight_ED, logits_TE, idx_TK = ctx.saved_tensors
        grad_x, grad_w, grad_b = _backward(grad_top_TK, x_TD, weight_ED, logits_TE, idx_TK, *ctx.settings)
        return grad_x, grad_w, grad_b, None, None, None, None, None, None, None


@torch.library.custom_op("uniep::router_choice", mutates_args=())
def _router_choice(
    x_TD: torch.Tensor, weight_ED: torch.Tensor, bias_E: torch.Tensor | None, expert_bias_E: torch.Tensor | None,
    given_TK: torch.Tensor | None, top_k: int, sigmoid: bool, route_norm: bool, route_scale: float, block: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(top scores, expert ids, logits: kept for the backward)."""
    return _forward(x_TD, weight_ED, bias_E, expert_bias_E, given_TK, top_k, sigmoid, route_norm, route_scale)


@_router_choice.register_fake
def _(x_TD, weight_ED, bias_E, expert_bias_E, given_TK, top_k, sigmoid, route_norm, route_scale, block):
    T, E = x_TD.shape[0], weight_ED.shape[0]
    return (x_TD.new_empty(T, top_k, dtype=torch.float32), x_TD.new_empty(T, top_k, dtype=torch.int64),
            x_TD.new_empty(T, E))


@torch.library.custom_op("uniep::router_choice_bwd", mutates_args=())
def _router_choice_bwd(
    grad_top_TK: torch.Tensor, x_TD: torch.Tensor, weight_ED: torch.Tensor, logits_TE: torch.Tensor,
    idx_TK: torch.Tensor, has_bias: bool, sigmoid: bool, route_norm: bool, route_scale: float, block: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of x, the gate's weight and its bias (empty without one)."""
    grad_x, grad_w, grad_b = _backward(grad_top_TK, x_TD, weight_ED, logits_TE, idx_TK, has_bias, sigmoid,
                                       route_norm, route_scale, block)
    return grad_x, grad_w, grad_w.new_empty(0) if grad_b is None else grad_b


@_router_choice_bwd.register_fake
def _(grad_top_TK, x_TD, weight_ED, logits_TE, idx_TK, has_bias, sigmoid, route_norm, route_scale, block):
    return torch.empty_like(x_TD), torch.empty_like(weight_ED), weight_ED.new_empty(weight_ED.shape[0] if has_bias else 0)


def _setup_context(ctx, inputs, output):
    x_TD, weight_ED, bias_E, _, _, _, sigmoid, route_norm, route_scale, block = inputs
    _, idx_TK, logits_TE = output
    ctx.mark_non_differentiable(idx_TK, logits_TE)
    ctx.save_for_backward(x_TD, weight_ED, logits_TE, idx_TK)
    ctx.settings = (bias_E is not None, sigmoid, route_norm, route_scale, block)


def _op_backward(ctx, grad_top_TK, _grad_idx, _grad_logits):
    x_TD, weight_ED, logits_TE, idx_TK = ctx.saved_tensors
    has_bias = ctx.settings[0]
    grad_x, grad_w, grad_b = _router_choice_bwd(grad_top_TK.contiguous(), x_TD, weight_ED, logits_TE, idx_TK,
                                                *ctx.settings)
    return grad_x, grad_w, grad_b if has_bias else None, None, None, None, None, None, None, None


_router_choice.register_autograd(_op_backward, setup_context=_setup_context)


class _ChoiceOfLogits(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits_TE, expert_bias_E, given_TK, top_k, sigmoid, route_norm, route_scale):
        top_TK, idx_TK = router_select_forward(logits_TE, top_k, sigmoid=sigmoid, route_norm=route_norm,
                                               route_scale=route_scale, expert_bias_E=expert_bias_E, topk_idx_TK=given_TK)
        ctx.save_for_backward(logits_TE, idx_TK)
        ctx.settings = dict(sigmoid=sigmoid, route_norm=route_norm, route_scale=route_scale)
        ctx.mark_non_differentiable(idx_TK)
        return top_TK, idx_TK

    @staticmethod
    def backward(ctx, grad_top_TK, _grad_idx):
        logits_TE, idx_TK = ctx.saved_tensors
        return router_select_backward(logits_TE, idx_TK, grad_top_TK, **ctx.settings), None, None, None, None, None, None


def choice_of_logits(logits_TE: torch.Tensor, top_k: int, *, sigmoid: bool, route_norm: bool, route_scale: float,
                     expert_bias_E: torch.Tensor | None = None,
                     topk_idx_TK: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`router_choice`'s choice of logits that other launches computed (the shared
    experts' first half, ``uniep.shared_experts``, with the gate's GEMM on fixed row
    blocks), differentiable in them; eagerly only."""
    return _ChoiceOfLogits.apply(logits_TE, expert_bias_E, topk_idx_TK, top_k, sigmoid, route_norm, float(route_scale))


def router_choice(x_TD: torch.Tensor, gate: nn.Linear, top_k: int, *, sigmoid: bool, route_norm: bool,
                  route_scale: float, expert_bias_E: torch.Tensor | None = None,
                  topk_idx_TK: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(top_scores_TK fp32, topk_idx_TK int64)`` of the tokens ``x_TD`` (see the module
    docstring); ``topk_idx_TK``, if given, replaces the choice."""
    args = (x_TD.contiguous(), gate.weight, gate.bias, expert_bias_E, topk_idx_TK, top_k, sigmoid, route_norm,
            float(route_scale), rows_per_block(x_TD.device))
    if torch.compiler.is_compiling():
        return _router_choice(*args)[:2]
    return _RouterChoice.apply(*args)
