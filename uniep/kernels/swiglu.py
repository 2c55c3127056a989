"""SwiGLU forward and backward as their own elementwise launches.

Shape legend: R rows (the plan's order, or tokens), H hidden dim.

Forward: ``h = silu(a1) * a3`` in fp32, rounded to the storage dtype
(``swiglu_forward_math``, also the gate/up GEMM's epilogue). Given the gradient ``g``
of h (rounded to the storage dtype, as the down input-gradient GEMM stores it)::

    d a1 = g * a3 * sigmoid(a1) * (1 + a1 * (1 - sigmoid(a1)))
    d a3 = g * silu(a1)

in fp32, rounded to the storage dtype. ``swiglu_backward_math`` is the one formula: the
fused epilogue of the SwiGLU-backward GEMM (``grouped_gemm``'s ``SWIGLU_BWD``, used by
the megakernel) and this launch both call it, so the separate and the fused backward
give the same bits.

The backward launch writes d a1 and d a3 where it is told: the routed experts pass the
two halves of a (2, R, H) pair buffer, the first holding g (in place; the layout their
w1/w3 weight gradient reads as one stacked operand), the shared experts the first two
column blocks of an (R, 2H + E) buffer (the operand of one input-gradient and one
weight-gradient GEMM, the router's logits' gradient beside them).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from uniep.kernels.launch import cdiv, launcher, next_power_of_2

_BLOCK = 2048  # elements per program

@triton.jit
def swiglu_forward_math(a1, a3):
    """h in fp32 from the pre-activations."""
    a1f = a1.to(tl.float32)
    return a1f * tl.sigmoid(a1f) * a3.to(tl.float32)


@triton.jit
def _swiglu_forward_kernel(a1_ptr, a3_ptr, h_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    h = swiglu_forward_math(tl.load(a1_ptr + offs, mask=mask), tl.load(a3_ptr + offs, mask=mask))
    tl.store(h_ptr + offs, h.to(h_ptr.dtype.element_ty), mask=mask)


def swiglu_forward(a1: torch.Tensor, a3: torch.Tensor) -> torch.Tensor:
    """h = silu(a1) * a3 of two contiguous tensors of one shape (computed in fp32)."""
    if a1.shape != a3.shape or not (a1.is_contiguous() and a3.is_contiguous()):
        raise ValueError(f"swiglu_forward: a1, a3 must be contiguous and of one shape; "
                         f"got {tuple(a1.shape)}, {tuple(a3.shape)}")
    h = torch.empty_like(a1)
    if a1.numel():
        launcher(_swiglu_forward_kernel)[(cdiv(a1.numel(), _BLOCK),)](a1, a3, h, a1.numel(), BLOCK=_BLOCK, num_warps=8)
    return h


@triton.jit
def swiglu_backward_math(g, a1, a3):
    """(d a1, d a3) in fp32 from fp32 ``g`` and the saved pre-activations."""
    a1f = a1.to(tl.float32)
    a3f = a3.to(tl.float32)
    sig = tl.sigmoid(a1f)
    silu = a1f * sig
    return g * a3f * (sig + silu * (1.0 - sig)), g * silu


@triton.jit
def _swiglu_backward_kernel(g_ptr, a1_ptr, a3_ptr, d_a1_ptr, d_a3_ptr, n, R, H, out_row_stride,
                            STRIDED_OUT: tl.constexpr, BLOCK: tl.constexpr, BLOCK_H: tl.constexpr):
    if STRIDED_OUT:  # (rows, columns) tiles: the outputs' rows out_row_stride apart (no division)
        rows = tl.program_id(0).to(tl.int64) * (BLOCK // BLOCK_H) + tl.arange(0, BLOCK // BLOCK_H)
        cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        mask = (rows < R)[:, None] & (cols < H)[None, :]
        offs = rows[:, None] * H + cols[None, :]
        out = rows[:, None] * out_row_stride + cols[None, :]
    else:  # flat: the outputs contiguous like g
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        out = offs
    g = tl.load(g_ptr + offs, mask=mask).to(tl.float32)
    d_a1, d_a3 = swiglu_backward_math(g, tl.load(a1_ptr + offs, mask=mask), tl.load(a3_ptr + offs, mask=mask))
    tl.store(d_a1_ptr + out, d_a1.to(d_a1_ptr.dtype.element_ty), mask=mask)
    tl.store(d_a3_ptr + out, d_a3.to(d_a3_ptr.dtype.element_ty), mask=mask)


def swiglu_backward(g: torch.Tensor, a1: torch.Tensor, a3: torch.Tensor, d_a1: torch.Tensor,
                    d_a3: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(d a1, d a3) written into ``d_a1`` and ``d_a3`` and returned, from the gradient
    ``g`` of h and the pre-activations: ``g``, ``a1``, ``a3`` contiguous (R, H) of one
    dtype; ``d_a1``, ``d_a3`` (R, H) in it with unit column stride and one row stride
    (contiguous, or column blocks of one wider buffer). ``d_a1`` may be ``g`` itself
    (in place)."""
    inputs = {"g": g, "a1": a1, "a3": a3}
    outputs = {"d_a1": d_a1, "d_a3": d_a3}
    if any(t.shape != g.shape or t.dtype != g.dtype or not t.is_contiguous() for t in inputs.values()) or g.dim() != 2:
        raise ValueError("swiglu_backward: g, a1 and a3 must be contiguous (R, H) tensors of one dtype; got "
                         + ", ".join(f"{name} {tuple(t.shape)} {t.dtype}" for name, t in inputs.items()))
    if any(t.shape != g.shape or t.dtype != g.dtype or t.stride(1) != 1 for t in outputs.values()) or \
            d_a1.stride(0) != d_a3.stride(0):
        raise ValueError(f"swiglu_backward: d_a1 and d_a3 must be {tuple(g.shape)} in {g.dtype} with unit column "
                         "stride and one row stride; got "
                         + ", ".join(f"{name} {tuple(t.shape)} {t.dtype} strides {t.stride()}"
                                     for name, t in outputs.items()))
    n = g.numel()
    if n:
        R, H = g.shape
        strided = R > 1 and d_a1.stride(0) != H
        block_h = min(_BLOCK, 128, next_power_of_2(H))
        grid = (cdiv(R, _BLOCK // block_h), cdiv(H, block_h)) if strided else (cdiv(n, _BLOCK),)
        launcher(_swiglu_backward_kernel)[grid](g, a1, a3, d_a1, d_a3, n, R, H, d_a1.stride(0), STRIDED_OUT=strided,
                                                BLOCK=_BLOCK, BLOCK_H=block_h, num_warps=8)
    return d_a1, d_a3


def swiglu_backward_reference(g: torch.Tensor, a1: torch.Tensor, a3: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 PyTorch (d a1, d a3) through autograd of ``silu(a1) * a3``."""
    a1f, a3f = a1.float().requires_grad_(True), a3.float().requires_grad_(True)
    torch.autograd.backward(torch.nn.functional.silu(a1f) * a3f, g.float())
    return a1f.grad, a3f.grad
