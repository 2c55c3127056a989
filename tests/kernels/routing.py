"""Routing inputs shared by the kernel tests."""

import torch

from uniep.plan import inverse_permutation


def make_routing(T, K, E, kind, gen):
    """(topk_idx (T, K) int64, send_order (P,), rows_per_expert (E,)) for a routing kind:
    random | skewed (every token's first choice is expert 1, experts >= K+1 mostly
    empty) | one_expert (K = 1, all tokens on the last expert)."""
    if kind == "one_expert":
        idx = torch.full((T, K), E - 1)
    else:
        idx = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)])
        if kind == "skewed":
            idx = torch.stack([torch.randperm(K + 1, generator=gen)[:K] for _ in range(T)])
    order = torch.argsort(idx.reshape(-1), stable=True)
    return idx, order, torch.bincount(idx.reshape(-1), minlength=E)


def order_and_inverse(order: torch.Tensor) -> torch.Tensor:
    """(2, P): a send order and its inverse, as the layer hands them to its expert path."""
    return torch.stack((order, inverse_permutation(order)))
