"""Row movement with deterministic backward passes (the plain-PyTorch path).

Shape legend: T tokens, K experts per token, P = T*K pairs, M rows (any count), D model dim.

Nothing here accumulates with atomics or scatter-add: a permutation's backward is the
inverse permutation, and a token's K contributions are summed in fp32 in the fixed
order k = 0..K-1. The results are therefore bitwise reproducible and do not depend on
the number of tokens in the batch (every op is row-wise).
"""

from __future__ import annotations

import torch


def sum_topk_fp32(rows_TKD: torch.Tensor, weights_TK: torch.Tensor | None = None) -> torch.Tensor:
    """(T, D) fp32: sum over k = 0..K-1 in that order of ``weights[t, k] * rows[t, k]``."""
    acc_TD = None
    for k in range(rows_TKD.shape[1]):
        term = rows_TKD[:, k].float()
        if weights_TK is not None:
            term = term * weights_TK[:, k : k + 1]
        acc_TD = term if acc_TD is None else acc_TD + term
    return acc_TD


class _PermuteRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_MD, index_M, inverse_M):
        ctx.save_for_backward(inverse_M)
        return x_MD.index_select(0, index_M)

    @staticmethod
    def backward(ctx, grad_MD):
        (inverse_M,) = ctx.saved_tensors
        return grad_MD.index_select(0, inverse_M), None, None


def permute_rows(x_MD: torch.Tensor, index_M: torch.Tensor, inverse_M: torch.Tensor) -> torch.Tensor:
    """``x[index]`` for a permutation ``index`` whose inverse is ``inverse``."""
    return _PermuteRows.apply(x_MD, index_M, inverse_M)


class _ReplicateTopK(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TD, top_k):
        ctx.top_k = top_k
        return x_TD.repeat_interleave(top_k, dim=0)

    @staticmethod
    def backward(ctx, grad_PD):
        grad_TKD = grad_PD.view(-1, ctx.top_k, grad_PD.shape[-1])
        return sum_topk_fp32(grad_TKD).to(grad_PD.dtype), None


def replicate_topk(x_TD: torch.Tensor, top_k: int) -> torch.Tensor:
    """(P, D): row ``t*K + k`` is token ``t``; the backward sums the K copies in fixed order."""
    return _ReplicateTopK.apply(x_TD, top_k)
