"""The hierarchical path (inter-node all-to-all + intra-node megakernel) with one
process per rank: gloo between the processes, shared-memory buffers standing in for each
node's symmetric memory, the kernels under the Triton interpreter. Outputs and every
gradient must be bitwise those of one rank, for several node layouts and skewed routing,
and must not change with the schedule knobs."""

import pytest
import torch
import torch.distributed as dist

from tests.helpers import assert_parts_match_one_rank, make_inputs, map_peers, run_grads, schedule, spawn_ranks
from uniep.paths.hierarchical import NodeLayout, hierarchical_megakernel_experts
from uniep.transport.peer_buffers import PeerBuffers, SymmetricAllocator

T, E = 6, 8


def _worker(rank, world, shared, barrier, per_node, K, ep, init_file, result_path, kind, score_before):
    """One rank; the world splits into expert-parallel groups of ``ep`` consecutive ranks
    (as TorchTitan's EP groups inside data parallelism), each solving the same batch."""
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    node = rank // per_node
    map_peers(rank % per_node, shared[node * per_node:(node + 1) * per_node], barrier)
    groups = [dist.new_group(list(range(first, first + ep))) for first in range(0, world, ep)]
    layout = NodeLayout(groups[rank // ep], per_node)
    peers = PeerBuffers(SymmetricAllocator(layout.node_group))
    gen = torch.Generator().manual_seed(11)
    topk, leaves, grad = make_inputs(ep, T, K, E, 32, 16, kind, gen, torch.float32)
    me = rank % ep
    mine, El = slice(me * T, (me + 1) * T), E // ep
    inputs = [leaves[0][mine], leaves[1][mine], *(w[me * El:(me + 1) * El] for w in leaves[2:])]

    def layer(sched):
        def run(x, s, w1, w2, w3):
            return hierarchical_megakernel_experts(x, s, topk[mine], w1, w2, w3, layout, peers, sched,
                                                   score_before_experts=score_before)
        return run

    first = run_grads(layer(schedule()), inputs, grad[mine])
    # another schedule (same tiles), on the flags and epochs the first call left behind
    other = schedule(sends_per_task=1, tokens_per_task=32, relay_dedup=False)
    again = run_grads(layer(other), inputs, grad[mine])
    peers.raise_pending_errors()
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    torch.save(first, f"{result_path}.{rank}")
    dist.barrier()  # leave together: a rank tearing gloo down alone was seen to abort its peer
    dist.destroy_process_group()


def _silent_peer_worker(rank, world, shared, barrier, init_file, result_path):
    """Rank 1 takes part in every collective but never launches its node's kernels; its
    node peer, rank 0, must get the wait error naming the node (the other node is fine)."""
    import uniep.paths.megakernel as megakernel
    from uniep.kernels.flags import MegakernelWaitError

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    per_node, K = 2, 3
    node = rank // per_node
    map_peers(rank % per_node, shared[node * per_node:(node + 1) * per_node], barrier)
    if rank == 1:
        def no_dispatch(sends, peers, rows, x_TD, w_E, w3_E, **_):
            zeros = x_TD.new_zeros(rows.num_rows, w_E.shape[1])
            return zeros, zeros, zeros

        megakernel.dispatch_gemm = no_dispatch
        megakernel.gemm_combine = lambda *args, **kwargs: None
    layout = NodeLayout(dist.group.WORLD, per_node)
    peers = PeerBuffers(SymmetricAllocator(layout.node_group))
    gen = torch.Generator().manual_seed(11)
    topk, leaves, _ = make_inputs(world, T, K, E, 32, 16, "random", gen, torch.float32)
    mine, El = slice(rank * T, (rank + 1) * T), E // world
    weights = [w[rank * El:(rank + 1) * El] for w in leaves[2:]]
    sched = schedule(max_spins=200 if rank == 0 else 1 << 22)
    with torch.no_grad():
        hierarchical_megakernel_experts(leaves[0][mine], leaves[1][mine], topk[mine], *weights, layout, peers, sched,
                                        score_before_experts=False)
    try:
        peers.raise_pending_errors()
    except MegakernelWaitError as e:
        torch.save(str(e), f"{result_path}.{rank}")
    dist.destroy_process_group()


def test_silent_node_peer_gives_an_error_not_a_hang(tmp_path):
    spawn_ranks(_silent_peer_worker, 4, str(tmp_path / "init"), str(tmp_path / "r"))
    message = torch.load(tmp_path / "r.0")
    assert message.startswith("megakernel forward (node 0; ranks numbered within the node): rank 0 timed out in")
    assert not any((tmp_path / f"r.{r}").exists() for r in (2, 3))  # the other node finished normally


@pytest.mark.parametrize(
    "W, per_node, K, ep, kind, score_before",
    [
        (4, 2, 3, 4, "random", False),
        (4, 2, 3, 4, "random", True),
        (4, 2, 2, 4, "one_rank", False),  # every token bound for rank 0's experts: one node gets all
        (4, 1, 3, 4, "random", False),  # four nodes of one rank: the node launch has no peers
        (4, 1, 3, 2, "random", False),  # two EP groups of two nodes: group ranks are not world ranks
    ],
)
def test_hierarchical_ranks_match_one_rank(W, per_node, K, ep, kind, score_before, tmp_path):
    spawn_ranks(_worker, W, per_node, K, ep, str(tmp_path / "init"), str(tmp_path / "r"), kind, score_before)
    for first in range(0, W, ep):
        parts = [torch.load(tmp_path / f"r.{r}") for r in range(first, first + ep)]
        assert_parts_match_one_rank(parts, ep, T, K, E, kind, score_before)


def test_layout_errors():
    with pytest.raises(ValueError, match="expert-parallel degree 6 is not a multiple of the 4 processes per node"):
        NodeLayout.check_layout(6, 4, list(range(6)))
    with pytest.raises(ValueError, match="should share a node"):
        NodeLayout.check_layout(4, 2, [1, 2, 3, 4])
