"""Helpers shared by the expert-parallel tests (plan, megakernel, hierarchical, layer):
routings, brute-force rows, megakernel inputs and schedules, and the launcher of
processes that stand in for GPUs, with shared-memory buffers standing in for each node's
symmetric memory."""

import torch

from uniep.kernels.fused_experts import fused_experts
from uniep.kernels.grouped_gemm import ExpertTiles, GemmTiles
from uniep.paths.megakernel import Schedule
from uniep.plan import expert_order


def routing(kind, W, T, K, E, gen):
    if kind == "random":
        return [torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)]) for _ in range(W)]
    if kind == "one_expert":  # every pair of every rank on expert E-1 (K = 1)
        return [torch.full((T, K), E - 1) for _ in range(W)]
    if kind == "one_rank":  # all pairs on rank 0's experts; other experts empty
        per_rank = E // W
        return [torch.stack([torch.randperm(per_rank, generator=gen)[:K] for _ in range(T)]) for _ in range(W)]
    raise ValueError(kind)


def brute_force_rows(topk_per_rank, num_experts):
    """{(src, t, k): (owner, row)} by listing every rank's rows in (expert, src, t, k) order."""
    W = len(topk_per_rank)
    per_rank = num_experts // W
    places, next_row = {}, [0] * W
    for e in range(num_experts):
        owner = e // per_rank
        for src, idx in enumerate(topk_per_rank):
            T, K = idx.shape
            for t in range(T):
                for k in range(K):
                    if idx[t, k] == e:
                        places[(src, t, k)] = (owner, next_row[owner])
                        next_row[owner] += 1
    return places


TILES = GemmTiles(block_m=16, block_n=16, block_k=16, num_programs=3)


def schedule(**knobs):
    return Schedule(ExpertTiles.uniform(TILES), **{"sends_per_task": 4, "tokens_per_task": 4, "max_spins": 1000, **knobs})


def make_inputs(W, T, K, E, D, H, kind, gen, dtype):
    if kind == "one_rank":  # every token on virtual rank 0's experts
        topk = torch.cat(routing("one_rank", W, T, K, E, gen))
    else:
        topk = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(W * T)])
    x = torch.randn(W * T, D, generator=gen).to(dtype)
    scores = torch.rand(W * T, K, generator=gen)
    w1, w3 = (torch.randn(E, H, D, generator=gen).to(dtype) * 0.2 for _ in range(2))
    w2 = torch.randn(E, D, H, generator=gen).to(dtype) * 0.2
    return topk, [x, scores, w1, w2, w3], torch.randn(W * T, D, generator=gen).to(dtype)


def run_grads(fn, leaves, grad):
    leaves = [t.clone().requires_grad_(True) for t in leaves]
    out = fn(*leaves)
    out.backward(grad)
    return [out.detach()] + [t.grad for t in leaves]


def assert_parts_match_one_rank(parts, W, T, K, E, kind, score_before, seed=11):
    """Each rank's (out, grad x, grad scores, grad w1, w2, w3) of its share of the batch
    made by ``make_inputs`` (ranks in order) against the one-rank fused path, bitwise."""
    gen = torch.Generator().manual_seed(seed)
    topk, leaves, grad = make_inputs(W, T, K, E, 32, 16, kind, gen, torch.float32)
    counts, order_2P = expert_order(topk, E)

    def one_rank(x, s, w1, w2, w3):
        return fused_experts(x, s, order_2P, counts, w1, w2, w3, score_before_experts=score_before,
                             tiles=ExpertTiles.uniform(TILES))

    reference = run_grads(one_rank, leaves, grad)
    El = E // W
    for i, name in enumerate(["out", "x", "scores"]):
        assert torch.equal(torch.cat([p[i] for p in parts]), reference[i]), name
    for i, name in enumerate(["w1", "w2", "w3"], start=3):
        for r in range(W):
            assert torch.equal(parts[r][i], reference[i][r * El:(r + 1) * El]), (name, r)


class FakeGroup:
    """A process group of ``world`` ranks seen from ``rank``, without torch.distributed
    (see :func:`answer_for_fake_groups`)."""

    group_name = "uniep-test"

    def __init__(self, world: int = 2, rank: int = 0):
        self.world, self.rank = world, rank


def answer_for_fake_groups(setattr=setattr):
    """Make ``torch.distributed.get_world_size`` / ``get_rank`` answer for
    :class:`FakeGroup` (``setattr``: pytest's ``monkeypatch.setattr`` to undo it after
    a test; plain ``setattr`` in a spawned process)."""
    import torch.distributed as dist

    size, rank = dist.get_world_size, dist.get_rank
    setattr(dist, "get_world_size", lambda group=None: group.world if isinstance(group, FakeGroup) else size(group))
    setattr(dist, "get_rank", lambda group=None: group.rank if isinstance(group, FakeGroup) else rank(group))


def map_peers(index, buffers, barrier):
    """Symmetric memory stand-in: the processes' shared-memory ``buffers`` (one per rank
    of the group, this process's at ``index``), each mapped at its own address in every
    process, as symmetric memory maps peer GPUs' buffers."""
    import torch.distributed._symmetric_memory as symm_mem

    class Handle:
        buffer_ptrs = [b.data_ptr() for b in buffers]

        def barrier(self):
            barrier.wait()

    symm_mem.enable_symm_mem_for_group = lambda group_name: None
    symm_mem.empty = lambda total, dtype, device: buffers[index][:total]
    symm_mem.rendezvous = lambda buffer, group_name: Handle()


def spawn_ranks(worker, world, *args, timeout=300):
    """Run ``worker(rank, world, shared, barrier, *args)`` in ``world`` processes (the
    one process launcher of the tests): ``shared`` holds one shared-memory buffer per
    rank, ``barrier`` is for all of them. Fails naming the ranks that failed, and the
    ranks still running after ``timeout`` seconds (killed)."""
    import time

    import torch.multiprocessing as mp

    shared = [torch.zeros(1 << 24, dtype=torch.uint8).share_memory_() for _ in range(world)]
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(world)
    procs = [ctx.Process(target=worker, args=(r, world, shared, barrier, *args)) for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for r in hung:
        procs[r].kill()
        procs[r].join()
    failed = {r: p.exitcode for r, p in enumerate(procs) if r not in hung and p.exitcode != 0}
    assert not hung and not failed, (
        f"ranks still running after {timeout} s (killed): {hung}; ranks failed (exit codes): {failed}"
    )
