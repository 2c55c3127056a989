"""The megakernel path under the Triton interpreter, with virtual ranks on the CPU:
its send lists against a brute-force construction, bitwise equality with the one-rank
fused path (outputs and every gradient) for several EP degrees and schedules, and a
peer that never signals giving an error instead of a hang."""

import copy

import pytest
import torch

from tests.helpers import (
    TILES,
    FakeGroup,
    answer_for_fake_groups,
    assert_parts_match_one_rank,
    brute_force_rows,
    make_inputs,
    map_peers,
    routing,
    run_grads,
    schedule,
    spawn_ranks,
)
from uniep import UniEPConfig, UniEPConfigError, UniEPMoE
from uniep.kernels.dispatch_gemm import dispatch_gemm
from uniep.kernels.flags import MegakernelWaitError
from uniep.kernels.fused_experts import fused_experts
from uniep.kernels.gemm_combine import gemm_combine
from uniep.kernels.grouped_gemm import PLAIN, SWIGLU_FWD, ExpertTiles, GemmTiles
from uniep.paths import build_expert_path
from uniep.paths.megakernel import MegakernelPath, Schedule, megakernel_experts
from uniep.paths.torch_path import TorchPath
from uniep.plan import expert_order, local_counts
from uniep.testing import use_virtual_ranks
from uniep.transport.peer_buffers import DeviceAllocator, PeerBuffers, SymmetricAllocator
from uniep.transport.sends import build_sends, owner_rows


@pytest.mark.parametrize("kind, W, T, K, E", [("random", 2, 9, 3, 8), ("random", 4, 6, 4, 8), ("one_rank", 4, 5, 2, 8)])
def test_sends_against_brute_force(kind, W, T, K, E):
    gen = torch.Generator().manual_seed(W * 10 + T)
    topk = routing(kind, W, T, K, E, gen)
    table = torch.stack([local_counts(t, E) for t in topk])
    places = brute_force_rows(topk, E)
    sends = build_sends(torch.cat(topk), torch.rand(W * T, K, generator=gen), [T] * W, table, 0, 16)
    n = int(sends.num_sends)
    seen = set()
    for i in range(n):
        src, t, dest = int(sends.src[i]), int(sends.token[i]), int(sends.dest[i])
        assert (src, t, dest) not in seen  # a token crosses to an owner once
        seen.add((src, t, dest))
        got = {(int(p) % K, int(r)) for p, r in zip(sends.pairs[i], sends.rows[i]) if p >= 0}
        want = {(k, places[(src, t, k)][1]) for k in range(K) if places[(src, t, k)][0] == dest}
        assert got == want
    owners = {(s, t, places[(s, t, k)][0]) for s in range(W) for t in range(T) for k in range(K)}
    assert seen == owners
    # without relay dedup every pair is its own send
    plain = build_sends(torch.cat(topk), torch.rand(W * T, K, generator=gen), [T] * W, table, 0, 16, relay_dedup=False)
    assert int(plain.num_sends) == W * T * K and int(plain.num_sends) >= n
    # push order: an owner's lower experts first
    lowest = [min(int(topk[int(sends.src[i])][int(sends.token[i]), k]) % (E // W)
                  for k in range(K) if int(sends.pairs[i][k]) >= 0) for i in range(n)]
    assert lowest == sorted(lowest)


@pytest.mark.parametrize(
    "W, T, K, E, D, H, kind, dtype",
    [
        (2, 7, 3, 8, 32, 16, "random", torch.float32),
        (4, 5, 4, 8, 40, 24, "random", torch.float16),  # odd dims
        (4, 6, 2, 8, 32, 16, "one_rank", torch.float32),  # skew: 3 ranks' experts empty
    ],
)
@pytest.mark.parametrize("score_before", [False, True])
def test_virtual_ranks_bitwise_equal_to_one_rank(W, T, K, E, D, H, kind, dtype, score_before):
    gen = torch.Generator().manual_seed(W + T + K + score_before)
    topk, leaves, grad = make_inputs(W, T, K, E, D, H, kind, gen, dtype)
    table = torch.stack([local_counts(t, E) for t in topk.split(T)])
    counts, order_2P = expert_order(topk, E)

    def one_rank(x, s, w1, w2, w3):
        return fused_experts(x, s, order_2P, counts, w1, w2, w3, score_before_experts=score_before,
                             tiles=ExpertTiles.uniform(TILES))

    def megakernel(x, s, w1, w2, w3):
        return megakernel_experts(x, s, topk, [T] * W, table, w1, w2, w3, PeerBuffers(DeviceAllocator(W)), schedule(),
                                  score_before_experts=score_before)

    reference = run_grads(one_rank, leaves, grad)
    got = run_grads(megakernel, leaves, grad)
    for name, a, b in zip(["out", "x", "scores", "w1", "w2", "w3"], got, reference):
        assert torch.equal(a, b), name


def test_layers_sharing_virtual_buffers_backward_after_all_forwards():
    """Training order: every layer's forward, then the backwards in reverse. Layers share
    one buffer set and their owners hold different numbers of rows (random vs skewed
    routing): each backward must use its own call's row regions (it waited forever on
    the last forward's: a MegakernelWaitError on an H200)."""
    W, T, K, E, D, H = 2, 7, 3, 8, 32, 16
    gen = torch.Generator().manual_seed(11)
    peers = PeerBuffers(DeviceAllocator(W))
    layers = [make_inputs(W, T, K, E, D, H, kind, gen, torch.float32) for kind in ("random", "one_rank")]
    references, outs, leaves_of = [], [], []
    for topk, leaves, grad in layers:
        table = torch.stack([local_counts(t, E) for t in topk.split(T)])
        counts, order_2P = expert_order(topk, E)
        references.append(run_grads(
            lambda x, s, w1, w2, w3, counts=counts, order_2P=order_2P: fused_experts(
                x, s, order_2P, counts, w1, w2, w3, score_before_experts=False,
                tiles=ExpertTiles.uniform(TILES)), leaves, grad))
        leaves = [t.clone().requires_grad_(True) for t in leaves]
        outs.append(megakernel_experts(leaves[0], leaves[1], topk, [T] * W, table, *leaves[2:], peers,
                                       schedule(), score_before_experts=False))
        leaves_of.append(leaves)
    for (_, _, grad), out, leaves in reversed(list(zip(layers, outs, leaves_of))):
        out.backward(grad)
    peers.raise_pending_errors()  # no wait gave up
    for reference, out, leaves in zip(references, outs, leaves_of):
        for name, a, b in zip(["out", "x", "scores", "w1", "w2", "w3"], [out.detach()] + [t.grad for t in leaves],
                              reference):
            assert torch.equal(a, b), name


def test_schedule_knobs_do_not_change_bits():
    W, T, K, E = 2, 9, 3, 8
    gen = torch.Generator().manual_seed(3)
    topk, leaves, grad = make_inputs(W, T, K, E, 32, 16, "random", gen, torch.float32)
    table = torch.stack([local_counts(t, E) for t in topk.split(T)])
    peers = PeerBuffers(DeviceAllocator(W))  # one buffer set reused across calls, as in training

    def with_schedule(sched):
        def fn(x, s, w1, w2, w3):
            return megakernel_experts(x, s, topk, [T] * W, table, w1, w2, w3, peers, sched, score_before_experts=False)
        return run_grads(fn, leaves, grad)

    first = with_schedule(schedule())
    for knobs in (dict(sends_per_task=1, tokens_per_task=32), dict(sends_per_task=64, tokens_per_task=1),
                  dict(relay_dedup=False)):
        again = with_schedule(schedule(**knobs))
        assert all(torch.equal(a, b) for a, b in zip(first, again)), knobs
    tiles = GemmTiles(16, 16, 16, num_programs=1)
    again = with_schedule(Schedule(ExpertTiles.uniform(tiles), 8, 8, 1000))
    assert all(torch.equal(a, b) for a, b in zip(first, again))


def test_layer_with_virtual_ranks_matches_one_rank():
    """The whole UniEP layer (router, shared experts) with 2 and 4 virtual ranks gives the
    one-rank layer's output, input gradient and every parameter gradient, bitwise."""
    tiles = dict(gemm_block_m=16, gemm_block_n=16, gemm_up_block_n=16, gemm_block_k=16, wgrad_block_m=16,
                 wgrad_block_n=16, wgrad_up_block_n=16, wgrad_block_k=16, num_programs=3)
    torch.manual_seed(0)
    layer = UniEPMoE(32, 16, 8, 3, num_shared_experts=1, score_func="softmax", route_norm=True)
    layer.init_weights(0.02)
    x, grad = torch.randn(2, 9, 32), torch.randn(2, 9, 32)

    def run(config, virtual_ranks=1):
        copy_ = copy.deepcopy(layer)
        copy_.config = config
        if virtual_ranks > 1:
            use_virtual_ranks(copy_, virtual_ranks)
        xi = x.clone().requires_grad_(True)
        copy_(xi).backward(grad)
        return [xi.grad] + [p.grad for _, p in sorted(copy_.named_parameters())]

    reference = run(UniEPConfig(backend="triton", **tiles))
    for ranks in (2, 4):
        got = run(UniEPConfig(backend="triton", megakernel_sends_per_task=2, **tiles), ranks)
        assert all(torch.equal(a, b) for a, b in zip(got, reference)), ranks


def silent_peer_setup(W=2, T=4, K=2, E=4, D=16, H=16):
    """Buffers and plans of a call whose senders never push (num_sends forced to 0)."""
    gen = torch.Generator().manual_seed(0)
    topk, (x, scores, w1, w2, w3), _ = make_inputs(W, T, K, E, D, H, "random", gen, torch.float32)
    table = torch.stack([local_counts(t, E) for t in topk.split(T)])
    peers = PeerBuffers(DeviceAllocator(W))
    per_owner = table.view(W, W, E // W).sum((0, 2)).tolist()
    peers.prepare(T, K, per_owner, D, x.dtype, x.device)
    sends = build_sends(topk, scores, [T] * W, table, 0, peers.tokens_cap)
    rows = owner_rows(table, per_owner, 0, W, 16, W * peers.tokens_cap)
    return peers, sends, rows, x, (w1, w2, w3)


def test_peer_that_never_pushes_gives_an_error_not_a_hang():
    peers, sends, rows, x, (w1, _, w3) = silent_peer_setup()
    sends.num_sends.zero_()
    error = torch.zeros(4, dtype=torch.int32)
    R = rows.num_rows
    dispatch_gemm(sends, peers, rows, x, w1, w3, mode=SWIGLU_FWD, epoch=peers.next_epoch(), tiles=TILES,
                  sends_per_task=4, max_spins=50, counter=torch.zeros(1, dtype=torch.int32), error=error,
                  a_row=peers.local("a_row")[:R], a_scale=peers.local("scale")[:R], scale_rows=False)
    peers.record_errors(error, "megakernel forward")
    with pytest.raises(MegakernelWaitError, match=r"rank 0 timed out in dispatch .* row flag of owner row 0"):
        peers.raise_pending_errors()


def test_owner_that_never_returns_gives_an_error_not_a_hang():
    peers, sends, rows, _, (_, w2, _) = silent_peer_setup()
    h = torch.zeros(rows.num_rows, w2.shape[2])
    # no rows on the owners, so no GEMM tile ever returns a pair to its sender
    empty = owner_rows(torch.zeros(2, 4, dtype=torch.long), [0, 0], 0, 2, 16, 2 * peers.tokens_cap)
    error = torch.zeros(4, dtype=torch.int32)
    gemm_combine(sends, peers, empty, h, None, w2, None, None, mode=PLAIN, origin=torch.zeros(0, dtype=torch.int32),
                 tiles=TILES, tokens_per_task=4, max_spins=50, counter=torch.zeros(1, dtype=torch.int32), error=error)
    peers.record_errors(error, "megakernel forward")
    with pytest.raises(MegakernelWaitError, match=r"rank 0 timed out in combine .* pair flag"):
        peers.raise_pending_errors()


def test_megakernel_config_errors_when_the_path_is_built(monkeypatch):
    answer_for_fake_groups(monkeypatch.setattr)
    group = FakeGroup(2)
    with pytest.raises(UniEPConfigError, match="megakernel_sends_per_task = 3"):
        UniEPConfig(transport="megakernel", megakernel_sends_per_task=3)
    with pytest.raises(UniEPConfigError, match="megakernel_max_spins = 0"):
        UniEPConfig(megakernel_max_spins=0)
    megakernel = UniEPConfig(transport="megakernel")
    with monkeypatch.context() as outside_the_interpreter:
        outside_the_interpreter.delenv("TRITON_INTERPRET", raising=False)
        with pytest.raises(UniEPConfigError, match="runs on CUDA GPUs; got device 'cpu'"):
            build_expert_path(megakernel, group, 8, False, "cpu")
        # a layer says so when it joins the group, not at its first forward, and keeps its path
        layer = UniEPMoE(16, 8, 8, 2, config=megakernel)
        with pytest.raises(UniEPConfigError, match="runs on CUDA GPUs"):
            layer.ep_group = group
        assert layer.ep_group is None and layer.expert_path.ep_size == 1
    assert isinstance(build_expert_path(megakernel, group, 8, False, "cpu"), MegakernelPath)  # interpreted
    assert isinstance(build_expert_path(UniEPConfig(transport="megakernel", backend="torch"), group, 8, False, "cpu"),
                      TorchPath)
    assert not isinstance(build_expert_path(megakernel, None, 8, False, "cpu"), MegakernelPath)  # EP 1
    with pytest.raises(ValueError, match="virtual ranks = 4 does not divide num_experts = 6"):
        use_virtual_ranks(UniEPMoE(16, 8, 6, 2), 4)


def _real_rank_worker(rank, world, shared, barrier, result_path, score_before, kind):
    """One rank of a real (non-virtual) launch; with kind "silent", rank 1 sets up its
    buffers and never launches, and rank 0 saves the error it gets."""
    map_peers(rank, shared, barrier)
    answer_for_fake_groups()
    W, T, K, E = world, 7, 2, 8
    gen = torch.Generator().manual_seed(11)
    topk, leaves, grad = make_inputs(W, T, K, E, 32, 16, kind, gen, torch.float32)
    table = torch.stack([local_counts(t, E) for t in topk.split(T)])
    mine, El = slice(rank * T, (rank + 1) * T), E // W
    x, scores = leaves[0][mine], leaves[1][mine]
    weights = [w[rank * El:(rank + 1) * El] for w in leaves[2:]]
    peers = PeerBuffers(SymmetricAllocator(FakeGroup(W, rank)))
    silent = kind == "silent"
    if silent and rank == 1:
        peers.prepare(T, K, table.view(W, W, El).sum((0, 2)).tolist(), x.shape[1], x.dtype, x.device)
        return

    def megakernel(x, s, w1, w2, w3):
        return megakernel_experts(x, s, topk[mine], [T], table, w1, w2, w3, peers,
                                  schedule(max_spins=200 if silent else 1 << 22), score_before_experts=score_before)

    if silent:
        megakernel(x, scores, *weights)
        try:
            peers.raise_pending_errors()
        except MegakernelWaitError as e:
            torch.save(str(e), f"{result_path}.error")
        return
    got = run_grads(megakernel, [x, scores, *weights], grad[mine])
    peers.raise_pending_errors()
    torch.save(got, f"{result_path}.{rank}")


@pytest.mark.parametrize(
    "W, kind, score_before",
    [(2, "random", False), (2, "random", True), (2, "one_rank", False), (4, "random", False), (2, "silent", False)],
)
def test_real_ranks_in_processes_match_one_rank(W, kind, score_before, tmp_path):
    """The real peer path (one rank per launch, peers through per-region offsets from the
    local base, pushes, flags and returns across processes, the backward too) against
    the one-rank fused kernels, bitwise; "one_rank": every token on rank 0's experts;
    "silent": rank 1 never launches, and rank 0 gets the wait error instead of hanging."""
    T, K, E = 7, 2, 8
    spawn_ranks(_real_rank_worker, W, str(tmp_path / "r"), score_before, kind)

    if kind == "silent":
        message = torch.load(tmp_path / "r.error")
        assert "megakernel forward: rank 0 timed out in dispatch" in message and "row flag of owner row" in message
        return
    assert_parts_match_one_rank([torch.load(tmp_path / f"r.{r}") for r in range(W)], W, T, K, E, kind, score_before)


