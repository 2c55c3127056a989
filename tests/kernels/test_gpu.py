"""On a CUDA GPU: bf16 parity of the Triton expert block with TorchTitan's MoE (against
an fp32 computation), bitwise repeatability, and bitwise invariance to the schedule
knobs (persistent programs, descriptor or pointer loads, stages, warps, the shared
experts' stream)."""

import copy

import pytest
import torch

from tests.helpers import spawn_ranks

pytestmark = pytest.mark.gpu


def build(num_experts=16, top_k=4, dim=256, hidden=128, shared=1, score_before=False):
    from torchtitan.models.moe import MoE, MoEArgs

    from uniep import UniEPConfig, UniEPMoE

    torch.manual_seed(0)
    args = MoEArgs(num_experts=num_experts, num_shared_experts=shared, top_k=top_k, score_func="softmax",
                   route_norm=True, score_before_experts=score_before)
    with torch.device("cuda"):
        titan = MoE(args, dim=dim, hidden_dim=hidden)
        with torch.no_grad():
            titan.init_weights(0.02, torch.device("cuda"))
    titan.to(torch.bfloat16)
    return titan, UniEPMoE.from_torchtitan(copy.deepcopy(titan), UniEPConfig(backend="triton"))


def fwd_bwd(layer, x, grad, topk_idx=None):
    xi = x.clone().requires_grad_(True)
    layer.zero_grad(set_to_none=True)
    out = layer(xi) if topk_idx is None else layer(xi, topk_idx=topk_idx)
    out.backward(grad)
    return [out.detach(), xi.grad] + [p.grad.clone() for _, p in sorted(layer.named_parameters())]


def rel_err(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_router_scores_do_not_depend_on_the_batch_on_gpu(score_func):
    """On CUDA only the router's GEMM runs in fixed row blocks (its activation once on the
    whole batch, ``ELEMENTWISE_BATCH_INVARIANT``), and the shared experts' SwiGLU once on
    the whole batch (``uniep.shared_experts``, its sums into a routed part in the GEMMs'
    epilogue): each token's scores, shared-experts output and its input gradient must
    still have the same bits whatever the rows around it, as expert parallelism needs."""
    from uniep import UniEPMoE
    from uniep.batch_invariant import ROWS_PER_BLOCK, in_fixed_row_blocks
    from uniep.shared_experts import add_shared_output, shared_hidden

    torch.manual_seed(0)
    layer = UniEPMoE(256, 128, 16, 4, num_shared_experts=1, score_func=score_func).cuda().to(torch.bfloat16)
    layer.init_weights(0.02)
    block = ROWS_PER_BLOCK["cuda"]
    x = torch.randn(2 * block + 37, 256, device="cuda", dtype=torch.bfloat16)
    grad = torch.randn_like(x)
    assert layer._on_triton  # the shared experts' fused launches (uniep.shared_experts)

    def fused_shared(t, with_logits=False):  # with a routed part (doubling: exact), and the router's logits
        h_pad, logits, t_on = shared_hidden(t, layer.shared_experts, layer.router.gate)
        out = add_shared_output(h_pad, layer.shared_experts, t_on * 2.0)
        return (out, logits) if with_logits else out

    def shared_input_grad(t, g):
        t = t.clone().requires_grad_(True)
        out, logits = fused_shared(t, with_logits=True)
        torch.autograd.backward([out, logits], [g, g[:, :logits.shape[1]]])
        return t.grad

    sizes = (7, 1000, block, block + 1)
    with torch.no_grad():
        for fn in (lambda t: layer.router(t)[0], lambda t: in_fixed_row_blocks(layer.shared_experts, t),
                   fused_shared):
            whole = fn(x)
            for size in sizes:
                assert torch.equal(torch.cat([fn(part) for part in x.split(size)]), whole), size
    whole = shared_input_grad(x, grad)
    for size in sizes:
        parts = [shared_input_grad(xp, gp) for xp, gp in zip(x.split(size), grad.split(size))]
        assert torch.equal(torch.cat(parts), whole), size


@pytest.mark.parametrize("score_before", [False, True])
def test_bf16_error_no_worse_than_torchtitan(score_before):
    from uniep import UniEPConfig

    titan, uniep = build(score_before=score_before)
    x = torch.randn(2, 1000, 256, device="cuda", dtype=torch.bfloat16)
    grad = torch.randn_like(x)
    ref_layer = copy.deepcopy(uniep).float()
    ref_layer.config = UniEPConfig(backend="torch")
    with torch.no_grad():  # replay the bf16 routing: an fp32 router flips near ties
        _, topk_idx = uniep.router(x.view(-1, 256), uniep.expert_bias)
    ref = fwd_bwd(ref_layer, x.float(), grad.float(), topk_idx)
    got, theirs = fwd_bwd(uniep, x, grad), fwd_bwd(titan, x, grad)
    for i, (g, t, r) in enumerate(zip(got, theirs, ref)):
        assert rel_err(g, r) <= max(1.5 * rel_err(t, r), 1e-2), i


def test_bitwise_repeatable_and_schedule_invariant():
    from uniep import UniEPConfig

    _, uniep = build(num_experts=32, top_k=8)
    x = torch.randn(4, 777, 256, device="cuda", dtype=torch.bfloat16)
    grad = torch.randn_like(x)
    first = fwd_bwd(uniep, x, grad)
    schedules = [dict(num_programs=p) for p in (0, 0, 7, 300)] + [
        dict(descriptor_loads=False),
        dict(gemm_num_stages=4, wgrad_num_stages=2),
        dict(gemm_num_warps=4, wgrad_num_warps=4),
        dict(gemm_half_tiles=not UniEPConfig().gemm_half_tiles),
        dict(descriptor_stores=not UniEPConfig().descriptor_stores),
        dict(wgrad_descriptor_stores=not UniEPConfig().wgrad_descriptor_stores),
        dict(wgrad_expert_run=4),
        dict(wgrad_expert_run=0),
        dict(gemm_prefetch_steps=4),
    ]
    for schedule in schedules:
        uniep.config = UniEPConfig(backend="triton", **schedule)
        again = fwd_bwd(uniep, x, grad)
        assert all(torch.equal(a, b) for a, b in zip(first, again)), schedule


@pytest.mark.parametrize("virtual_ranks", [0, 2])
def test_scores_before_the_experts_repeat_bitwise(virtual_ranks):
    """Scores applied before the experts (each row copy scaled; in the megakernel, with
    ``virtual_ranks``, each landed row): twenty forward+backward calls give the same
    bits, with the allocator's free memory overwritten with NaN bytes between them
    (scaling A inside the gate/up GEMM's loads gave a few tiles' rows other bits, or
    inf, from call to call on an H100)."""
    from uniep.testing import use_virtual_ranks

    _, uniep = build(score_before=True)
    x = torch.randn(2, 1000, 256, device="cuda", dtype=torch.bfloat16)
    grad = torch.randn_like(x)
    path = use_virtual_ranks(uniep, virtual_ranks) if virtual_ranks else None
    first = fwd_bwd(uniep, x, grad)
    assert all(torch.isfinite(t).all() for t in first)
    for _ in range(20):
        torch.full((256 << 20,), -1, dtype=torch.int8, device="cuda")  # NaN bytes, freed at once
        again = fwd_bwd(uniep, x, grad)
        assert all(torch.equal(a, b) for a, b in zip(first, again))
    if path is not None:
        path.peers.raise_pending_errors()


def test_few_rows_depth_keeps_the_bits():
    """At 250 rows per expert the row GEMMs run ``gemm_few_rows_num_stages`` deep (the
    default 4, or 2) instead of ``gemm_num_stages``: the same bits."""
    from uniep import UniEPConfig
    from uniep.kernels.grouped_gemm import FEW_ROWS_PER_EXPERT

    _, uniep = build(num_experts=32, top_k=8)
    x = torch.randn(1, 1000, 256, device="cuda", dtype=torch.bfloat16)
    assert 1000 * 8 <= FEW_ROWS_PER_EXPERT * 32
    grad = torch.randn_like(x)
    outs = []
    for stages in (0, UniEPConfig().gemm_few_rows_num_stages, 2):
        uniep.config = UniEPConfig(backend="triton", gemm_few_rows_num_stages=stages)
        outs.append(fwd_bwd(uniep, x, grad))
    assert all(torch.equal(a, b) for other in outs[1:] for a, b in zip(outs[0], other))


def test_direct_launch_matches_the_jit(monkeypatch):
    """After a layer call has compiled its kernels, the next calls launch them directly
    (``uniep.kernels.launch``: no JIT dispatch at all), with the bits of launches through
    Triton's JIT; another batch size (other integer specializations) is handled too."""
    import triton.runtime.jit as jit

    from uniep.kernels import launch

    _, uniep = build(num_experts=32, top_k=8)
    for tokens in (777, 1024):
        x = torch.randn(2, tokens, 256, device="cuda", dtype=torch.bfloat16)
        grad = torch.randn_like(x)
        fwd_bwd(uniep, x, grad)
        fwd_bwd(uniep, x, grad)  # every specialization of this size now cached
        dispatches = []
        real_run = jit.JITFunction.run
        monkeypatch.setattr(jit.JITFunction, "run", lambda self, *a, **k: dispatches.append(self) or real_run(self, *a, **k))
        direct = fwd_bwd(uniep, x, grad)
        monkeypatch.setattr(jit.JITFunction, "run", real_run)
        assert dispatches == [], [f.fn.__name__ for f in dispatches]
        launchers = [c for c in launch._LAUNCHERS.values() if c.direct]
        assert len(launchers) >= 6
        for c in launchers:
            monkeypatch.setattr(c, "direct", False)
        through_jit = fwd_bwd(uniep, x, grad)
        monkeypatch.undo()
        assert all(torch.equal(a, b) for a, b in zip(direct, through_jit)), tokens


def test_skewed_routing_on_gpu():
    titan, uniep = build()
    with torch.no_grad():
        for layer in (titan, uniep):
            layer.expert_bias[:4] = 100.0  # every token on experts 0-3; 12 experts empty
    x = torch.randn(1, 513, 256, device="cuda", dtype=torch.bfloat16)
    grad = torch.randn_like(x)
    got, theirs = fwd_bwd(uniep, x, grad), fwd_bwd(titan, x, grad)
    for g, t in zip(got, theirs):
        assert rel_err(g, t) < 2e-2


@pytest.mark.parametrize("ranks", [2, 4, 8])
@pytest.mark.parametrize("score_before", [False, True])
def test_megakernel_virtual_ranks_bitwise_equal_to_one_rank(ranks, score_before):
    """The megakernel with W virtual ranks (pushes, flags, remote epilogues on one GPU)
    gives the sequential one-rank layer's bits, for several schedules."""
    from uniep import UniEPConfig
    from uniep.testing import use_virtual_ranks

    _, uniep = build(num_experts=32, top_k=8, score_before=score_before)
    x = torch.randn(2, 1531, 256, device="cuda", dtype=torch.bfloat16)
    grad = torch.randn_like(x)
    reference = fwd_bwd(uniep, x, grad)
    schedules = [dict(), dict(num_programs=5, megakernel_sends_per_task=1, megakernel_tokens_per_task=128),
                 dict(num_programs=700, megakernel_sends_per_task=64, gemm_num_warps=4)]
    for knobs in schedules:
        path = use_virtual_ranks(uniep, ranks, UniEPConfig(**knobs))
        got = fwd_bwd(uniep, x, grad)
        path.peers.raise_pending_errors()
        assert all(torch.equal(a, b) for a, b in zip(got, reference)), knobs


def test_megakernel_skewed_routing_no_deadlock():
    """Every token on the experts of virtual rank 0: correct, and no wait times out."""
    from uniep.testing import use_virtual_ranks

    _, uniep = build(num_experts=16, top_k=4)
    with torch.no_grad():
        uniep.expert_bias[:4] = 100.0
    x = torch.randn(1, 2049, 256, device="cuda", dtype=torch.bfloat16)
    grad = torch.randn_like(x)
    reference = fwd_bwd(uniep, x, grad)
    path = use_virtual_ranks(uniep, 4)
    assert all(torch.equal(a, b) for a, b in zip(fwd_bwd(uniep, x, grad), reference))
    path.peers.raise_pending_errors()


def test_float32_runs_at_the_default_tiles():
    """float32 layers (the debug configs) launch the default tiles fitted to shared
    memory (they once died with OutOfResources) and match the PyTorch backend."""
    from uniep import UniEPConfig

    _, uniep = build()
    uniep.float()
    x = torch.randn(1, 600, 256, device="cuda")
    grad = torch.randn_like(x)
    got = fwd_bwd(uniep, x, grad)
    reference = copy.deepcopy(uniep)
    reference.config = UniEPConfig(backend="torch")
    for g, r in zip(got, fwd_bwd(reference, x, grad)):
        assert rel_err(g, r) < 1e-5  # IEEE float32 dots (PyTorch's TF32 switch is off)


def test_compiled_layer_matches_eager():
    """``torch.compile(fullgraph=True)`` with Inductor: the routed experts stay one opaque
    op (the same kernels), the router and shared experts are compiled."""
    _, uniep = build()
    x = torch.randn(2, 700, 256, device="cuda", dtype=torch.bfloat16)
    grad = torch.randn_like(x)
    eager = fwd_bwd(uniep, x, grad)
    compiled = fwd_bwd(torch.compile(uniep, fullgraph=True), x, grad)
    for c, e in zip(compiled, eager):
        assert rel_err(c, e) < 1e-2


def test_one_rank_layer_never_waits_for_the_device():
    """The one-rank Triton layer's forward and backward make no host sync (one stalls
    the host behind the device: the layer then costs host time plus device time; at
    4096 tokens that made it slower than compiled TorchTitan). CUDA's sync debug mode
    raises at any synchronizing call."""
    _, uniep = build()
    x = torch.randn(2, 700, 256, device="cuda", dtype=torch.bfloat16)
    grad = torch.randn_like(x)
    fwd_bwd(uniep, x, grad)  # first call: compiles, allocates
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        xi = x.clone().requires_grad_(True)
        uniep(xi).backward(grad)
        with pytest.raises(RuntimeError, match="synchroniz"):  # the mode does catch a sync
            torch.bincount(torch.zeros(4, dtype=torch.long, device="cuda"))
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_compiled_layer_on_virtual_ranks_matches_eager():
    """The megakernel path under ``torch.compile(fullgraph=True)`` (4 virtual ranks): it
    runs, no wait gives up, and it agrees with the eager one-rank layer (the compiled
    router rounds differently)."""
    from uniep.testing import use_virtual_ranks

    _, uniep = build(num_experts=16, top_k=4)
    x = torch.randn(2, 700, 256, device="cuda", dtype=torch.bfloat16)
    grad = torch.randn_like(x)
    eager = fwd_bwd(uniep, x, grad)
    path = use_virtual_ranks(uniep, 4)
    compiled = fwd_bwd(torch.compile(uniep, fullgraph=True), x, grad)
    path.peers.raise_pending_errors()
    for c, e in zip(compiled, eager):
        assert rel_err(c, e) < 1e-2


def _symmetric_worker(rank, world, shared, barrier, per_node, init_file, result_path):
    torch.save(_symmetric_run(rank, world, per_node, init_file), f"{result_path}.{rank}")


def _symmetric_run(rank, world, per_node, init_file):
    import os

    import torch.distributed as dist

    from uniep import UniEPConfig

    os.environ["LOCAL_WORLD_SIZE"] = str(per_node)  # "nodes" of per_node GPUs: hierarchical when < world
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world)
    _, uniep = build(num_experts=16, top_k=4)
    gen = torch.Generator(device="cuda").manual_seed(1)
    x_all = torch.randn(1, 600 * world, 256, device="cuda", dtype=torch.bfloat16, generator=gen)
    grad_all = torch.randn_like(x_all)
    reference = fwd_bwd(uniep, x_all, grad_all)  # the whole batch on one rank
    mine = slice(rank * 600, (rank + 1) * 600)
    uniep.config = UniEPConfig(transport="megakernel")
    uniep.keep_local_experts(dist.group.WORLD)
    got = fwd_bwd(uniep, x_all[:, mine].contiguous(), grad_all[:, mine].contiguous())
    path = uniep.expert_path
    path.peers.raise_pending_errors()
    El = 16 // world
    expected_kind = "HierarchicalPath" if per_node < world else "MegakernelPath"
    same = {"path": type(path).__name__ == expected_kind,
            "out": torch.equal(got[0], reference[0][:, mine]), "grad x": torch.equal(got[1], reference[1][:, mine])}
    for i, (name, _) in enumerate(sorted(uniep.named_parameters())):
        if name.startswith("experts."):
            same[name] = torch.equal(got[2 + i], reference[2 + i][rank * El:(rank + 1) * El])
    dist.destroy_process_group()
    return same


@pytest.mark.parametrize("world, per_node", [(2, 2), (2, 1), (4, 2)])
def test_megakernel_symmetric_memory(world, per_node, tmp_path):
    """The real transport: one process per GPU, symmetric-memory peer buffers inside
    each "node" of ``per_node`` GPUs (the hierarchical transport's all-to-all between
    them), give the one-GPU layer's output, input gradient and expert gradients,
    bitwise (rows and flags cross the NVLink peer mappings)."""
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs (symmetric memory allows one rank per GPU)")
    spawn_ranks(_symmetric_worker, world, per_node, str(tmp_path / "init"), str(tmp_path / "r"), timeout=600)
    for rank in range(world):
        same = torch.load(tmp_path / f"r.{rank}")
        assert all(same.values()), (rank, same)


def _silent_peer_worker(rank, world, shared, barrier, init_file, result_path):
    torch.save(_silent_peer_run(rank, world, init_file), f"{result_path}.{rank}")


def _silent_peer_run(rank, world, init_file):
    """Rank 1 allocates its symmetric buffers (a collective) and never launches; rank 0
    launches the forward megakernels and must get the wait error, not hang."""
    import time

    import torch.distributed as dist

    from uniep.kernels.flags import MegakernelWaitError
    from uniep.kernels.grouped_gemm import ExpertTiles, GemmTiles
    from uniep.paths.megakernel import Schedule, megakernel_experts
    from uniep.plan import local_counts
    from uniep.transport.peer_buffers import PeerBuffers, SymmetricAllocator

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world)
    T, K, E, D, H = 512, 4, 16, 256, 128
    El = E // world
    gen = torch.Generator().manual_seed(0)
    topk = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(world * T)]).cuda()
    table = torch.stack([local_counts(t, E) for t in topk.split(T)])
    peers = PeerBuffers(SymmetricAllocator(dist.group.WORLD))
    outcome = {"rank": rank}
    if rank == 1:
        peers.prepare(T, K, table.view(world, world, El).sum((0, 2)).tolist(), D, torch.bfloat16, torch.device("cuda"))
    else:
        x = torch.randn(T, D, device="cuda", dtype=torch.bfloat16)
        w1, w3 = (torch.randn(El, H, D, device="cuda", dtype=torch.bfloat16) * 0.05 for _ in range(2))
        w2 = torch.randn(El, D, H, device="cuda", dtype=torch.bfloat16) * 0.05
        schedule = Schedule(ExpertTiles.uniform(GemmTiles()), 16, 16, 1 << 16, True)
        start = time.monotonic()
        megakernel_experts(x, torch.rand(T, K, device="cuda"), topk[:T], [T], table, w1, w2, w3, peers, schedule,
                           score_before_experts=False)
        torch.cuda.synchronize()
        outcome["seconds"] = time.monotonic() - start
        try:
            peers.raise_pending_errors()
        except MegakernelWaitError as e:
            outcome["wait_error"] = str(e)
    dist.barrier()
    dist.destroy_process_group()
    return outcome


def test_megakernel_peer_that_never_launches_gives_an_error_not_a_hang(tmp_path):
    """Two GPUs: a peer that sets up its buffers but never launches makes the waiting
    rank's kernel give up after max_spins polls and the layer raise MegakernelWaitError;
    both processes then leave cleanly."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    spawn_ranks(_silent_peer_worker, 2, str(tmp_path / "init"), str(tmp_path / "r"))  # both leave cleanly
    outcome = [torch.load(tmp_path / f"r.{rank}") for rank in range(2)]
    assert "timed out" in outcome[0].get("wait_error", ""), outcome
    assert outcome[0]["seconds"] < 60, outcome


@pytest.mark.parametrize("T, K, E", [(16384, 8, 128), (16384, 6, 64), (8192, 8, 256), (4097, 2, 8)])
def test_expert_order_launch_on_gpu(T, K, E):
    """The one-launch expert order has the PyTorch sort's bits at the models' sizes."""
    from uniep.kernels.expert_order import expert_order_triton
    from uniep.plan import expert_order

    idx = torch.rand(T, E, device="cuda").topk(K, dim=1).indices
    got, ref = expert_order_triton(idx, E), expert_order(idx, E)
    assert all(torch.equal(a, b) for a, b in zip(got, ref))
