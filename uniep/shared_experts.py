"""The shared experts' SwiGLU MLP, its output summed into the routed experts' output
and its input gradient into theirs without a separate add, each row's bits
independent of the batch.

Shape legend: T tokens, D model dim, H the shared experts' hidden dim (all of them
together); ``_pad``: rows padded up to a multiple of the row block.

    out = routed + (silu(x w1^T) * (x w3^T)) w2^T

A layer with shared experts calls them twice, around its router and routed experts:

- ``shared_hidden`` first (its GEMMs keep the device busy while the host issues the
  router's small ops): h = silu(a1) * a3 with a1 = x w1^T, a3 = x w3^T, and, given the
  fused router's gate, its logits l = x g^T (a GEMM on the same row blocks), which the
  router then only turns into its choice (``router_op.choice_of_logits``).
  It hands x on, and the routed experts take that x: the gradient they send back
  through it arrives in its backward, which adds ``[d_a1 | d_a3 | d_l] [w1; w3; g]`` onto
  it in place, in the GEMM's epilogue. The SwiGLU backward writes d a1 and d a3 side by
  side, beside the logits' gradient, so that sum is one GEMM over 2H + E per row block
  (on the weights stacked for it) and the w1, w3 and gate gradients one (2H + E, D)
  GEMM, whose parts they are.
- ``add_shared_output`` last: ``routed += h w2^T`` in place, the routed output added in
  the GEMMs' epilogue (rounded once). Its backward hands the output gradient on to the
  routed experts as it is.

So the layer's output and its input gradient take no separate add (there were three,
each moving three (T, D) tensors through memory; ``benchmarks/RESULTS.md`` has their
time), and the router's input and weight gradients no GEMMs of their own. Without the
gate (a router that is not fused; the side stream, where the router cannot wait for
these GEMMs) the router sends its input gradient through x too, and autograd adds it.

The row-wise GEMMs (each row's a1, a3 and output, and in the backward each row's input
gradient) run on fixed blocks of rows, the last zero-padded (``uniep.batch_invariant``),
so every call sees the same shapes; where a sum target's last block is partial, the
block is summed on a zero-padded copy (the same GEMM) and copied back. The elementwise
SwiGLU and its backward run once over all rows (Triton launches, fp32 math: an
elementwise launch computes every element with the same code), and each weight gradient
is one GEMM over all rows (a sum over the batch, which no split of the batch keeps
bitwise anyway). The layer uses this where its experts run on Triton, outside
torch.compile (where Inductor fuses the module's ops and the sum).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from uniep.batch_invariant import blocked_mm, in_fixed_row_blocks, padded_to_blocks, row_blocks, rows_per_block
from uniep.kernels.swiglu import swiglu_backward, swiglu_forward


def _add_product_(acc_TD: torch.Tensor, a_pad: torch.Tensor, b: torch.Tensor, block: int) -> torch.Tensor:
    """``acc_TD += a_pad @ b`` in place, one block of ``block`` rows at a time (``a_pad``'s
    rows: ``acc_TD``'s, padded to a multiple of ``block``)."""
    T = acc_TD.shape[0]
    for rows in row_blocks(a_pad.shape[0], block):
        partial = rows.stop > T
        target = F.pad(acc_TD[rows.start:], (0, 0, 0, rows.stop - T)) if partial else acc_TD[rows]
        target.addmm_(a_pad[rows], b)
        if partial:
            acc_TD[rows.start:] = target[:T - rows.start]
    return acc_TD


class _SharedHidden(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TD, w1_HD, w3_HD, gate_ED, gate_bias_E, block: int):
        T = x_TD.shape[0]
        x_pad = padded_to_blocks(x_TD.contiguous(), block)
        rows = x_pad.shape[0]
        a = x_pad.new_empty(2, rows, w1_HD.shape[0])  # a1, a3
        blocked_mm(x_pad, w1_HD.t(), a[0], block)
        blocked_mm(x_pad, w3_HD.t(), a[1], block)
        h_pad = swiglu_forward(a[0], a[1])
        # the router's logits, on the row blocks of the other GEMMs here
        E = 0 if gate_ED is None else gate_ED.shape[0]
        logits_pad = x_pad.new_empty(rows, E)
        if gate_ED is not None:
            blocked_mm(x_pad, gate_ED.t(), logits_pad, block, gate_bias_E)
        logits_TE = logits_pad[:T]
        if gate_ED is None:
            ctx.mark_non_differentiable(logits_TE)
        if not ctx.needs_input_grad[0]:
            ctx.mark_non_differentiable(x_TD)
        ctx.save_for_backward(x_pad, a, w1_HD, w3_HD, gate_ED)
        ctx.tokens, ctx.block, ctx.has_gate_bias = T, block, gate_bias_E is not None
        return h_pad, logits_TE, x_TD

    @staticmethod
    def backward(ctx, grad_h_pad, grad_logits_TE, grad_x_TD):
        x_pad, a, w1_HD, w3_HD, gate_ED = ctx.saved_tensors
        T, block = ctx.tokens, ctx.block
        rows, H = a.shape[1], a.shape[2]
        E = 0 if gate_ED is None else gate_ED.shape[0]
        # [d a1 | d a3 | d logits], the padded rows' zero: one operand over 2H + E
        d_a = grad_h_pad.new_empty(rows, 2 * H + E)
        swiglu_backward(grad_h_pad.contiguous(), a[0], a[1], d_a[:, :H], d_a[:, H:2 * H])
        del grad_h_pad
        if E:
            d_a[:T, 2 * H:] = grad_logits_TE
            d_a[T:, 2 * H:] = 0
        grad_x = None
        if ctx.needs_input_grad[0]:  # onto what the router's choice and the routed experts sent through x
            stacked = torch.cat([w1_HD, w3_HD] + ([gate_ED] if E else []))
            grad_x = _add_product_(grad_x_TD.contiguous(), d_a, stacked, block)
        grads_w = [None, None, None]
        needs_w = ctx.needs_input_grad[1:4]
        if any(needs_w):
            grad_all = d_a[:T].t().mm(x_pad[:T])  # (2H + E, D): w1's rows, w3's, the gate's
            parts = (grad_all[:H], grad_all[H:2 * H], grad_all[2 * H:])
            grads_w = [part if needs else None for part, needs in zip(parts, needs_w)]
        grad_bias = grad_logits_TE.sum(0) if ctx.has_gate_bias and ctx.needs_input_grad[4] else None
        return grad_x, *grads_w, grad_bias, None


class _SharedOutput(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h_pad, w2_DH, routed_TD, block: int):
        _add_product_(routed_TD, h_pad, w2_DH.t(), block)
        ctx.mark_dirty(routed_TD)
        ctx.save_for_backward(h_pad, w2_DH)
        ctx.block = block
        return routed_TD

    @staticmethod
    def backward(ctx, grad_TD):
        h_pad, w2_DH = ctx.saved_tensors
        T = grad_TD.shape[0]
        grad_h_pad = None
        if ctx.needs_input_grad[0]:
            grad_pad = padded_to_blocks(grad_TD.contiguous(), ctx.block)
            grad_h_pad = blocked_mm(grad_pad, w2_DH, torch.empty_like(h_pad), ctx.block)
        grad_w2 = grad_TD.t().mm(h_pad[:T]) if ctx.needs_input_grad[1] else None
        return grad_h_pad, grad_w2, grad_TD, None


def shared_hidden(x_TD: torch.Tensor, ffn: torch.nn.Module,
                  gate: torch.nn.Linear | None = None) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """``(h_pad, logits_TE or None, x_TD handed on)`` of the shared-experts module ``ffn``
    (``w1``, ``w2``, ``w3`` linear layers without bias, as TorchTitan's ``FeedForward``)
    and, with ``gate``, the router's logits (for ``TopKRouter(..., logits_TE=)``): the
    caller passes h_pad to :func:`add_shared_output` and the x returned here, not its
    own, to the rest of the layer (see the module docstring)."""
    weights = {"w1": ffn.w1.weight, "w2": ffn.w2.weight, "w3": ffn.w3.weight}
    if gate is not None:
        weights["gate"] = gate.weight
    if any(w.dtype != x_TD.dtype for w in weights.values()):
        raise ValueError(f"shared_hidden: x and the weights must share a dtype; got x {x_TD.dtype}, "
                         + ", ".join(f"{name} {w.dtype}" for name, w in weights.items()))
    h_pad, logits_TE, x_TD = _SharedHidden.apply(x_TD, weights["w1"], weights["w3"], weights.get("gate"),
                                                 None if gate is None else gate.bias, rows_per_block(x_TD.device))
    return h_pad, (logits_TE if gate is not None else None), x_TD


def add_shared_output(h_pad: torch.Tensor, ffn: torch.nn.Module, routed_TD: torch.Tensor) -> torch.Tensor:
    """(T, D): ``routed_TD + h w2^T``, written over ``routed_TD`` (the routed experts'
    output, taken over) where it is contiguous, else over a contiguous copy."""
    if routed_TD.dtype != h_pad.dtype or routed_TD.shape[1] != ffn.w2.weight.shape[0]:
        raise ValueError(f"add_shared_output: the routed output must be (tokens, {ffn.w2.weight.shape[0]}) in "
                         f"{h_pad.dtype}; got {tuple(routed_TD.shape)} in {routed_TD.dtype}")
    return _SharedOutput.apply(h_pad, ffn.w2.weight, routed_TD.contiguous(), rows_per_block(routed_TD.device))


class ModuleSharedExperts:
    """The module on fixed row blocks, its output added to the routed output (the
    PyTorch backend; and under torch.compile, whose Inductor fuses the module's ops and
    the add). ``start(ffn, x, gate) -> (x for the rest of the layer, pending, the
    router's logits or None)``, then ``finish(ffn, pending, routed) -> out``, as
    :class:`FusedSharedExperts`."""

    def start(self, ffn: torch.nn.Module, x_TD: torch.Tensor,
              gate: torch.nn.Linear | None) -> tuple[torch.Tensor, torch.Tensor, None]:
        return x_TD, in_fixed_row_blocks(ffn, x_TD), None

    def finish(self, ffn: torch.nn.Module, shared_TD: torch.Tensor, routed_TD: torch.Tensor) -> torch.Tensor:
        return shared_TD + routed_TD


class FusedSharedExperts:
    """:func:`shared_hidden` on ``streams`` (``uniep.streams``: the current stream, or a
    side stream that the sum waits for), then :func:`add_shared_output`. With
    ``router_logits`` they compute the router's logits too, where ``start`` is given a
    gate (the fused router's); not on a side stream, whose work the router would wait for."""

    def __init__(self, streams, router_logits: bool):
        self.streams, self.router_logits = streams, router_logits

    def start(self, ffn: torch.nn.Module, x_TD: torch.Tensor,
              gate: torch.nn.Linear | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        h_pad, logits_TE, x_TD = self.streams.start(shared_hidden, x_TD, ffn, gate if self.router_logits else None)
        return x_TD, h_pad, logits_TE

    def finish(self, ffn: torch.nn.Module, h_pad: torch.Tensor, routed_TD: torch.Tensor) -> torch.Tensor:
        return add_shared_output(self.streams.wait(h_pad), ffn, routed_TD)


MODULE_SHARED_EXPERTS = ModuleSharedExperts()
