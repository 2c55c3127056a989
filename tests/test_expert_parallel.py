"""Expert parallelism over gloo: one global batch, split across W processes in rank
order, gives the same output, input gradient and expert-weight gradients as one
process with the whole batch. The megakernel runs with two processes per "node"
(shared-memory buffers standing in for symmetric memory): one node at W = 2, the
hierarchical transport over two nodes at W = 4."""

import os

import pytest
import torch
import torch.distributed as dist

from tests.helpers import map_peers, spawn_ranks
from uniep import UniEPConfig, UniEPMoE

DIM, HIDDEN, E = 24, 40, 8
ROUTERS = {
    "qwen3": dict(top_k=4, score_func="softmax", route_norm=True, score_before_experts=False),
    "deepseek_v3": dict(top_k=3, num_shared_experts=2, score_func="softmax", score_before_experts=False),
    "score_before": dict(top_k=2, num_shared_experts=1, score_func="sigmoid", score_before_experts=True),
}


# The Triton backend at interpreter-friendly tile sizes.
TRITON = dict(backend="triton", gemm_block_m=16, gemm_block_n=16, gemm_up_block_n=16, gemm_block_k=16,
              wgrad_block_m=16, wgrad_block_n=16, wgrad_up_block_n=16, wgrad_block_k=16, num_programs=2)
MEGAKERNEL = dict(TRITON, transport="megakernel", megakernel_sends_per_task=4, megakernel_tokens_per_task=4)
PROCESSES_PER_NODE = 2


def make_layer(router, seed, backend="torch"):
    torch.manual_seed(seed)
    layer = UniEPMoE(DIM, HIDDEN, E, **ROUTERS[router])
    layer.init_weights(0.02)
    if backend in ("triton", "megakernel"):
        layer.config = UniEPConfig(**(TRITON if backend == "triton" else MEGAKERNEL))
    return layer


def make_batch(seed, batch, skew):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, 5, DIM, generator=gen)
    grad_out = torch.randn(batch, 5, DIM, generator=gen)
    return x, grad_out, skew


def fwd_bwd(layer, x, grad_out, skew):
    if skew:  # every token on rank 0's experts: the other ranks' experts get no rows
        with torch.no_grad():
            layer.expert_bias[: layer.top_k] = 100.0
    x = x.clone().requires_grad_(True)
    out = layer(x)
    out.backward(grad_out)
    w_grads = {n: getattr(layer.experts, n).grad for n in ("w1", "w2", "w3")}
    return out.detach(), x.grad, w_grads


def _pin_outside_tracing(tensor):
    """Stands in for ``Tensor.pin_memory`` (CPU tensors cannot be pinned without CUDA):
    host-side work must never be traced by torch.compile."""
    assert not torch.compiler.is_compiling(), "host-side planning traced by torch.compile"
    return tensor


def compile_layer(layer, monkeypatch_like):
    """``layer`` under ``torch.compile(fullgraph=True)`` with the CUDA-only host branches
    (pinned copies of small host lists) forced on. ``monkeypatch_like``: a callable
    ``(obj, name, value)`` that sets attributes."""
    import uniep.plan

    monkeypatch_like(uniep.plan, "PINNED_COPY_DEVICES", ("cuda", "cpu"))
    monkeypatch_like(torch.Tensor, "pin_memory", _pin_outside_tracing)
    return torch.compile(layer, fullgraph=True, backend="aot_eager")


def _worker(rank, world, shared, barrier, store_path, router, seed, skew, result_path, backend, compiled):
    torch.set_num_threads(1)  # as the one-process reference (``one_thread_reference``)
    store = dist.FileStore(store_path, world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    if backend == "megakernel":
        L = PROCESSES_PER_NODE
        os.environ["LOCAL_WORLD_SIZE"] = str(L)
        map_peers(rank % L, shared[rank // L * L:(rank // L + 1) * L], barrier)
    try:
        layer = make_layer(router, seed, backend)
        layer.keep_local_experts(dist.group.WORLD)
        x, grad_out, _ = make_batch(seed, 2 * world, skew)
        mine = slice(2 * rank, 2 * rank + 2)
        if compiled:
            compiled_layer = compile_layer(layer, setattr)
            if skew:
                layer.expert_bias[: layer.top_k] = 100.0
            x_mine = x[mine].clone().requires_grad_(True)
            out = compiled_layer(x_mine)
            out.backward(grad_out[mine])
            out, gx = out.detach(), x_mine.grad
            w_grads = {n: getattr(layer.experts, n).grad for n in ("w1", "w2", "w3")}
            from uniep.backward_state import held_states

            assert held_states() == 0  # the backward took its saved graph back
        else:
            out, gx, w_grads = fwd_bwd(layer, x[mine], grad_out[mine], skew)
        if backend == "megakernel":
            path = layer.expert_path
            hierarchical = world > PROCESSES_PER_NODE
            assert type(path).__name__ == ("HierarchicalPath" if hierarchical else "MegakernelPath")
            path.peers.raise_pending_errors()
        torch.save({"out": out, "x_grad": gx, "w_grads": w_grads}, f"{result_path}.{rank}")
        dist.barrier()  # leave together: a rank tearing gloo down alone was seen to abort its peer
    finally:
        dist.destroy_process_group()


def one_thread_reference(router, seed, backend, x, grad_out, skew):
    """The one-process result, computed on one CPU thread as each rank's is: on some CPUs
    (an AMD EPYC with 2 cores) a float32 matmul's bits depend on how many threads split it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return fwd_bwd(make_layer(router, seed, backend), x, grad_out, skew)
    finally:
        torch.set_num_threads(threads)


def run_ep(world, router, seed, skew, tmp_path, backend="torch", compiled=False):
    result = str(tmp_path / f"ep{world}")
    spawn_ranks(_worker, world, str(tmp_path / f"store{world}"), router, seed, skew, result, backend, compiled)
    parts = [torch.load(f"{result}.{r}") for r in range(world)]
    return (
        torch.cat([p["out"] for p in parts]),
        torch.cat([p["x_grad"] for p in parts]),
        {n: torch.cat([p["w_grads"][n] for p in parts]) for n in ("w1", "w2", "w3")},
    )


@pytest.mark.parametrize(
    "world, router, skew, backend",
    [
        (2, "qwen3", False, "torch"),
        (4, "deepseek_v3", False, "torch"),
        (4, "score_before", False, "torch"),  # sigmoid and shared experts: batch-invariant blocks
        (4, "qwen3", True, "torch"),  # all rows to rank 0; ranks 1-3 compute nothing
        # Triton experts over all_to_all against the one-rank fused kernels
        (2, "qwen3", False, "triton"),
        (4, "score_before", True, "triton"),
        # the megakernel (one node) and the hierarchical transport (two nodes)
        (2, "qwen3", False, "megakernel"),
        (4, "deepseek_v3", False, "megakernel"),
        (4, "score_before", True, "megakernel"),
    ],
)
def test_ep_matches_one_process_bitwise(world, router, skew, backend, tmp_path):
    seed = 100 + world
    x, grad_out, _ = make_batch(seed, 2 * world, skew)
    ref_out, ref_gx, ref_w = one_thread_reference(router, seed, backend, x, grad_out, skew)
    out, gx, w_grads = run_ep(world, router, seed, skew, tmp_path, backend)
    assert torch.equal(out, ref_out)
    assert torch.equal(gx, ref_gx)
    for name in ref_w:
        assert torch.equal(w_grads[name], ref_w[name]), name


@pytest.mark.parametrize("backend", ["torch", "triton", "megakernel"])
def test_compiled_fullgraph_ep2_matches_one_process_bitwise(backend, tmp_path):
    """TorchTitan compiles each block with fullgraph=True: the layer traces without a
    graph break at EP 2 (the CUDA-only pinned copies forced on, so host-side planning
    traced by the compiler fails the test), and gives the eager one-process bits."""
    world, router, seed, skew = 2, "qwen3", 7, backend == "megakernel"
    x, grad_out, _ = make_batch(seed, 2 * world, skew)
    ref_out, ref_gx, ref_w = one_thread_reference(router, seed, backend, x, grad_out, skew)
    out, gx, w_grads = run_ep(world, router, seed, skew, tmp_path, backend, compiled=True)
    assert torch.equal(out, ref_out)
    assert torch.equal(gx, ref_gx)
    for name in ref_w:
        assert torch.equal(w_grads[name], ref_w[name]), name
