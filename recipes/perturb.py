"""Initial weights one rounding away: the parity tool's noise runs (``recipes.train
--perturb-weights N``).

A noise run must change rounding, not math, and by as much as a faithful
reimplementation does. UniEP and TorchTitan differ by about one unit in the last place
in every MoE output from the first step on, and training amplifies that: on the CPU
debug DeepSeek-V3 (float32, 20 steps) the two drift 9.5e-4 apart in windowed mean loss,
while TorchTitan with its batch split into two microbatches, which only changes the
rounding of gradient sums, stays within 4.4e-5 of itself. Run in float64, UniEP and
TorchTitan give the same loss to 12 digits over those 20 steps: the drift is rounding,
amplified. Moving every initial weight by one unit in the last place perturbs the
forward pass by the same order, so the band it measures is the one a faithful
candidate needs.

Each element moves up or down by one ulp of its own dtype (``torch.nextafter``). The
direction is a hash of the element's bits and ``N``, so replicas of a parameter
(data-parallel copies, DTensor shards of one tensor laid out differently) move alike,
the same command gives the same run, and noise runs with different ``N`` are different
samples of the noise.
"""

from __future__ import annotations

import torch

_INT_OF = {4: torch.int32, 2: torch.int16}
_CHUNK = 1 << 24


def perturb_(tensor: torch.Tensor, seed: int) -> None:
    """Move each element of a floating-point ``tensor`` one ulp up or down, in place."""
    if seed < 1:
        raise ValueError(f"--perturb-weights = {seed} must be >= 1 (the noise run's number)")
    int_dtype = _INT_OF.get(tensor.element_size())
    if int_dtype is None:
        raise ValueError(f"--perturb-weights: parameters of dtype {tensor.dtype} are not supported "
                         f"(allowed: float32, bfloat16, float16)")
    # A 32-bit integer hash of the bits and the seed (products stay below 2**59: no
    # overflow in int64); one of its bits picks the direction.
    mixed = (tensor.view(int_dtype).to(torch.int64) ^ (seed * 0x9E3779B9)) & 0xFFFFFFFF
    for _ in range(2):
        mixed = (mixed * 0x45D9F3B) & 0xFFFFFFFF
        mixed = mixed ^ (mixed >> 16)
    up = ((mixed >> 7) & 1).bool()
    inf = torch.tensor(float("inf"), dtype=tensor.dtype, device=tensor.device)
    tensor.copy_(torch.where(up, torch.nextafter(tensor, inf), torch.nextafter(tensor, -inf)))


@torch.no_grad()
def perturb_model_(model_parts: list[torch.nn.Module], seed: int) -> int:
    """Perturb every floating-point parameter of ``model_parts`` (local shards of
    DTensors); returns how many elements moved on this rank."""
    moved = 0
    for part in model_parts:
        for param in part.parameters():
            local = param.to_local() if hasattr(param, "to_local") else param
            if local.is_floating_point() and local.numel():
                # in chunks: the hash's int64 temporaries of a whole expert tensor
                # would cost several times its size
                for chunk in local.view(-1).split(_CHUNK) if local.is_contiguous() else [local]:
                    perturb_(chunk, seed)
                moved += local.numel()
    return moved
