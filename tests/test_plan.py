"""The deterministic plan against a brute-force construction of Algorithm 1."""

import pytest
import torch

from tests.helpers import brute_force_rows, routing
from uniep.plan import build_plan, inverse_permutation, local_counts


@pytest.mark.parametrize(
    "kind, W, T, K, E",
    [
        ("random", 1, 7, 2, 4),  # one rank
        ("random", 2, 5, 3, 8),  # odd token count
        ("random", 4, 9, 2, 8),  # EP 4
        ("random", 2, 1, 1, 2),  # T = 1, K = 1
        ("one_expert", 2, 6, 1, 4),  # all tokens to one expert
        ("one_rank", 4, 5, 2, 8),  # skew: three ranks' experts empty
    ],
)
def test_plan_matches_brute_force(kind, W, T, K, E):
    gen = torch.Generator().manual_seed(T * 131 + W)
    topk = routing(kind, W, T, K, E, gen)
    table = torch.stack([local_counts(idx, E) for idx in topk])
    places = brute_force_rows(topk, E)
    arrivals = {r: [] for r in range(W)}  # per owner: rows in arrival order (source-major)
    for src, idx in enumerate(topk):
        plan = build_plan(idx, E, table, ep_rank=src)
        pairs = plan.send_order.tolist()
        # send order is (expert, t, k)
        keys = [(idx.view(-1)[p].item(), p // K, p % K) for p in pairs]
        assert keys == sorted(keys)
        for i, p in enumerate(pairs):
            owner, row = places[(src, p // K, p % K)]
            assert plan.dest_rows[i].item() == row
            arrivals[owner].append(row)
        assert plan.send_splits == [sum(1 for p in pairs if places[(src, p // K, p % K)][0] == r) for r in range(W)]
        assert torch.equal(plan.send_order[plan.send_order_inverse], torch.arange(T * K))
    for r in range(W):
        plan = build_plan(topk[r], E, table, ep_rank=r)
        # rows arrive source by source, each source's rows in its send order
        assert plan.arrival_to_row.tolist() == arrivals[r]
        assert torch.equal(plan.arrival_to_row[plan.row_to_arrival], torch.arange(plan.num_rows))
        assert sum(plan.rows_per_local_expert) == plan.num_rows == sum(plan.recv_splits)


def test_plan_rejects_ep_degree_not_dividing_experts():
    idx = torch.zeros(2, 1, dtype=torch.long)
    table = torch.zeros(3, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="num_experts = 4 is not divisible by ep_size = 3"):
        build_plan(idx, 4, table)


@pytest.mark.parametrize("n, size", [(8, 100), (128, 5000), (3, 0), (6, 7)])
def test_local_counts_match_bincount(n, size):
    """The sync-free count (sort + search) gives torch.bincount's counts, with absent
    values, an empty input and ids up to n - 1."""
    values = torch.randint(0, n, (size,), generator=torch.Generator().manual_seed(n + size))
    if size:
        values[0] = n - 1
    assert torch.equal(local_counts(values, n), torch.bincount(values, minlength=n))
    assert torch.equal(local_counts(values.view(-1, 1), n), local_counts(values, n))  # any shape


def test_expert_order_is_the_plans_send_order_from_one_sort():
    """The layer sorts once (``expert_order``: the order and its inverse) and hands both
    to the plan."""
    from uniep.plan import expert_order

    gen = torch.Generator().manual_seed(3)
    topk = routing("random", 2, 9, 3, 8, gen)
    table = torch.stack([local_counts(idx, 8) for idx in topk])
    for rank, idx in enumerate(topk):
        counts, order_2P = expert_order(idx, 8)
        assert torch.equal(counts, local_counts(idx, 8))
        assert torch.equal(order_2P[0], torch.argsort(idx.reshape(-1), stable=True))
        assert torch.equal(order_2P[1][order_2P[0]], torch.arange(idx.numel()))
        given, own = build_plan(idx, 8, table, rank, order_2P), build_plan(idx, 8, table, rank)
        fields = ("send_order", "send_order_inverse", "dest_rows", "arrival_to_row")
        assert all(torch.equal(getattr(given, f), getattr(own, f)) for f in fields)
    # the control: an order that is not the stable one gives another plan
    order = expert_order(topk[0], 8)[1][0].flip(0)
    wrong = build_plan(topk[0], 8, table, 0, torch.stack((order, inverse_permutation(order))))
    assert not torch.equal(wrong.dest_rows, build_plan(topk[0], 8, table, 0).dest_rows)


def test_inverse_permutation():
    order = torch.tensor([2, 0, 3, 1])
    inverse = inverse_permutation(order)
    assert inverse.tolist() == [1, 3, 0, 2]
    assert torch.equal(inverse_permutation(order, size_varies=True), inverse)
    assert torch.equal(order[inverse], torch.arange(4)) and torch.equal(inverse[order], torch.arange(4))
    assert not torch.equal(order[order], torch.arange(4))  # the permutation is not its own inverse
