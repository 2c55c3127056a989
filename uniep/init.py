"""Weight initialisation matching TorchTitan's, so that the same seed gives the same weights."""

import torch
from torch import nn


@torch.no_grad()
def trunc_normal_(tensor: torch.Tensor, mean: float = 0.0, std: float = 1.0) -> None:
    """Truncated normal in [-2, 2] (absolute bounds), sampled in fp32 then cast.

    Sampling in fp32 whatever the parameter dtype keeps the random stream, and so the
    weights, identical to TorchTitan's ``trunc_normal_`` for the same seed.
    """
    sample = tensor.float()
    nn.init.trunc_normal_(sample, mean=mean, std=std, a=-2.0, b=2.0)
    tensor.copy_(sample)
