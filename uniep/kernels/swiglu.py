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

The backward launch overwrites g with d a1 and writes d a3 into a second buffer: the
routed experts pass the two halves of a (2, R, H) pair buffer (the layout their w1/w3
weight gradient reads as one stacked operand), the shared experts two tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from uniep.kernels.launch import cdiv, launcher

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
def _swiglu_backward_kernel(g_ptr, d_a3_ptr, a1_ptr, a3_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(g_ptr + offs, mask=mask).to(tl.float32)
    d_a1, d_a3 = swiglu_backward_math(g, tl.load(a1_ptr + offs, mask=mask), tl.load(a3_ptr + offs, mask=mask))
    tl.store(g_ptr + offs, d_a1.to(g_ptr.dtype.element_ty), mask=mask)
    tl.store(d_a3_ptr + offs, d_a3.to(d_a3_ptr.dtype.element_ty), mask=mask)


def swiglu_backward_(g: torch.Tensor, a1: torch.Tensor, a3: torch.Tensor,
                     d_a3: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """In place: ``g``, the gradient of h, becomes d a1, and ``d_a3`` receives d a3
    (four contiguous tensors of one shape and dtype); returns (d a1, d a3), that is
    ``(g, d_a3)``."""
    buffers = {"g": g, "a1": a1, "a3": a3, "d_a3": d_a3}
    bad = [name for name, t in buffers.items()
           if t.shape != g.shape or t.dtype != g.dtype or not t.is_contiguous()]
    if bad:
        raise ValueError("swiglu_backward_: g, a1, a3 and d_a3 must be contiguous tensors of one shape and dtype; got "
                         + ", ".join(f"{name} {tuple(t.shape)} {t.dtype}" for name, t in buffers.items()))
    n = g.numel()
    if n:
        launcher(_swiglu_backward_kernel)[(cdiv(n, _BLOCK),)](g, d_a3, a1, a3, n, BLOCK=_BLOCK, num_warps=8)
    return g, d_a3


def swiglu_backward_reference(g: torch.Tensor, a1: torch.Tensor, a3: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 PyTorch (d a1, d a3) through autograd of ``silu(a1) * a3``."""
    a1f, a3f = a1.float().requires_grad_(True), a3.float().requires_grad_(True)
    torch.autograd.backward(torch.nn.functional.silu(a1f) * a3f, g.float())
    return a1f.grad, a3f.grad
