"""Row-wise computations whose bits do not depend on how many rows the batch has.

Expert parallelism splits one global batch across ranks, so a token's router scores and
shared-expert output are computed in batches of different sizes at different EP
degrees. A matmul library may pick its kernel by the number of rows, and a vectorised
elementwise op computes the tail of a buffer with scalar code (seen on CPU: sigmoid and
the shared experts' Linear layers differed in the last bit between 10 and 40 rows).
Calling the op on fixed-size blocks of rows, the last one zero-padded, makes every call
see the same shapes, so each row's bits depend only on the row.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

# Rows per block: a multiple of 64 keeps fp32 buffers free of vector tails on CPU; on
# CUDA a large block keeps the GEMMs efficient (16384 tokens: 4 calls).
ROWS_PER_BLOCK = {"cuda": 4096}
DEFAULT_ROWS_PER_BLOCK = 256
ELEMENTWISE_BATCH_INVARIANT = ("cuda",)
"""Devices whose elementwise and per-row ops (sigmoid, softmax over a row) compute every
row with the same code whatever the rows around it: there they need no blocks (checked
on a GPU by ``tests/kernels/test_gpu.py``)."""


def rows_per_block(device: torch.device) -> int:
    """Rows per block on ``device``."""
    return ROWS_PER_BLOCK.get(device.type, DEFAULT_ROWS_PER_BLOCK)


def padded_to_blocks(x_TD: torch.Tensor, block: int) -> torch.Tensor:
    """``x_TD`` with zero rows appended up to a multiple of ``block`` (itself if none are needed)."""
    pad = -x_TD.shape[0] % block
    return F.pad(x_TD, (0, 0, 0, pad)) if pad else x_TD


def row_blocks(rows: int, block: int) -> list[slice]:
    """The blocks of ``rows`` (a multiple of ``block``) rows."""
    return [slice(start, start + block) for start in range(0, rows, block)]


def blocked_mm(a_pad: torch.Tensor, b: torch.Tensor, out: torch.Tensor, block: int,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """``out = a_pad @ b (+ bias)`` one block of ``block`` rows at a time, each written into
    its rows of ``out`` (``a_pad``'s rows a multiple of ``block``). One block is one call
    on the whole tensors (the same shapes, without the slicing ops' host time)."""
    if a_pad.shape[0] == block:
        pairs = [(a_pad, out)]
    else:
        pairs = [(a_pad[rows], out[rows]) for rows in row_blocks(a_pad.shape[0], block)]
    for a, a_out in pairs:
        if bias is None:
            torch.mm(a, b, out=a_out)
        else:
            torch.addmm(bias, a, b, out=a_out)
    return out


def blocked_linear_backward(grad_TN: torch.Tensor, x_TD: torch.Tensor, weight_ND: torch.Tensor, has_bias: bool,
                            block: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(grad x, grad weight, grad bias or None) of ``x @ weight^T + bias`` from the
    output's gradient ``grad_TN``: the input gradient on fixed row blocks; the weight
    gradient one GEMM over all rows (a sum over the batch, which no split keeps bitwise
    anyway) instead of one per block and their sum."""
    grad_pad = padded_to_blocks(grad_TN.contiguous(), block)
    grad_x = blocked_mm(grad_pad, weight_ND, x_TD.new_empty(grad_pad.shape[0], x_TD.shape[1]), block)
    grad_w = grad_TN.t().mm(x_TD)
    grad_x = grad_x if grad_pad.shape[0] == x_TD.shape[0] else grad_x[:x_TD.shape[0]]
    return grad_x, grad_w, grad_TN.sum(0) if has_bias else None


def in_fixed_row_blocks(
    fn: Callable[[torch.Tensor], torch.Tensor], x_TD: torch.Tensor,
    then: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """``then(fn(x_TD))`` for a row-wise ``fn`` and an elementwise or per-row ``then``
    (optional): ``fn`` computed on blocks of a fixed number of rows, ``then`` too where
    the device needs it (each op costs host time; a block, four ops at 16384 tokens)."""
    block = rows_per_block(x_TD.device)
    if then is not None and x_TD.device.type not in ELEMENTWISE_BATCH_INVARIANT:
        fn, then = _chained(fn, then), None
    T = x_TD.shape[0]
    if T == block:  # one full block: the same call without the split, cat and slice ops
        out = fn(x_TD)
    else:
        padded = padded_to_blocks(x_TD, block)
        out = torch.cat([fn(rows) for rows in padded.split(block)])
        out = out[:T] if padded.shape[0] != T else out
    return out if then is None else then(out)


def _chained(first: Callable[[torch.Tensor], torch.Tensor], second: Callable[[torch.Tensor], torch.Tensor]):
    return lambda rows: second(first(rows))
