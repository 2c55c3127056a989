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


def in_fixed_row_blocks(fn: Callable[[torch.Tensor], torch.Tensor], x_TD: torch.Tensor) -> torch.Tensor:
    """``fn(x_TD)`` for a row-wise ``fn``, computed on blocks of a fixed number of rows."""
    block = ROWS_PER_BLOCK.get(x_TD.device.type, DEFAULT_ROWS_PER_BLOCK)
    T = x_TD.shape[0]
    if T == block:  # one full block: the same call without the split, cat and slice ops
        return fn(x_TD)
    pad = -T % block
    padded = F.pad(x_TD, (0, 0, 0, pad)) if pad else x_TD
    out = torch.cat([fn(rows) for rows in padded.split(block)])
    return out[:T] if pad else out
