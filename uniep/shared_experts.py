"""The shared experts' SwiGLU MLP in few launches, with the bits of a row independent of
the batch.

Shape legend: T tokens, D model dim, H the shared experts' hidden dim (all of them together).

    out = (silu(x w1^T) * (x w3^T)) w2^T

The row-wise GEMMs (each row's a1, a3 and output, and in the backward each row's input
gradient) run on fixed blocks of rows, the last zero-padded (``uniep.batch_invariant``),
so every call sees the same shapes. The elementwise SwiGLU and its backward run once
over all rows (Triton launches, fp32 math: an elementwise launch computes every element
with the same code), and each weight gradient is one GEMM over all rows (a sum over the
batch, which no split of the batch keeps bitwise anyway). Against the module run block by
block under autograd, this drops the per-block elementwise ops, the cat of the blocks'
outputs and the sums of the blocks' weight gradients. The layer uses it where its
experts run on Triton, outside torch.compile (where Inductor fuses the module's ops).
"""

from __future__ import annotations

import torch

from uniep.batch_invariant import blocked_mm, padded_to_blocks, row_blocks, rows_per_block
from uniep.kernels.swiglu import swiglu_backward_, swiglu_forward


class _SharedSwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TD, w1_HD, w2_DH, w3_HD, block: int):
        T = x_TD.shape[0]
        x_pad = padded_to_blocks(x_TD.contiguous(), block)
        rows = x_pad.shape[0]
        a = x_pad.new_empty(2, rows, w1_HD.shape[0])  # a1, a3
        out = x_pad.new_empty(rows, w2_DH.shape[0])
        blocked_mm(x_pad, w1_HD.t(), a[0], block)
        blocked_mm(x_pad, w3_HD.t(), a[1], block)
        h = swiglu_forward(a[0], a[1])
        blocked_mm(h, w2_DH.t(), out, block)
        ctx.save_for_backward(x_pad, a, h, w1_HD, w2_DH, w3_HD)
        ctx.tokens, ctx.block = T, block
        return out[:T]

    @staticmethod
    def backward(ctx, grad_TD):
        x_pad, a, h, w1_HD, w2_DH, w3_HD = ctx.saved_tensors
        T, block = ctx.tokens, ctx.block
        rows = x_pad.shape[0]
        grad_pad = padded_to_blocks(grad_TD.contiguous(), block)
        pair = torch.empty_like(a)  # d h, then d a1 and d a3 in place
        blocked_mm(grad_pad, w2_DH, pair[0], block)
        d_a1, d_a3 = swiglu_backward_(pair, a[0], a[1])
        grad_x = torch.empty_like(x_pad)
        for b in row_blocks(rows, block):
            torch.mm(d_a1[b], w1_HD, out=grad_x[b])
            grad_x[b].addmm_(d_a3[b], w3_HD)
        grad_w2 = grad_TD.t().mm(h[:T]) if ctx.needs_input_grad[2] else None
        grad_w1 = d_a1[:T].t().mm(x_pad[:T]) if ctx.needs_input_grad[1] else None
        grad_w3 = d_a3[:T].t().mm(x_pad[:T]) if ctx.needs_input_grad[3] else None
        return grad_x[:T], grad_w1, grad_w2, grad_w3, None


def shared_swiglu(x_TD: torch.Tensor, ffn: torch.nn.Module) -> torch.Tensor:
    """(T, D): the shared-experts module ``ffn`` (``w1``, ``w2``, ``w3`` linear layers
    without bias, as TorchTitan's ``FeedForward``) applied to ``x_TD`` (see the module
    docstring)."""
    w1, w2, w3 = ffn.w1.weight, ffn.w2.weight, ffn.w3.weight
    if not (w1.dtype == w2.dtype == w3.dtype == x_TD.dtype):
        raise ValueError(f"shared_swiglu: x and the weights must share a dtype; got x {x_TD.dtype}, "
                         f"w1 {w1.dtype}, w2 {w2.dtype}, w3 {w3.dtype}")
    return _SharedSwiGLU.apply(x_TD, w1, w2, w3, rows_per_block(x_TD.device))
