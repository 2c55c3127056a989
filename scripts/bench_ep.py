"""Expert parallelism across the GPUs of one node, one process per GPU.

    torchrun --nproc-per-node N scripts/bench_ep.py [--shapes qwen3,dsv3_16b] [--tokens-per-gpu 4096]
                                                    [--json out.json]

For each shape (bench_moe.py's layer dims): one global batch, split across the ranks in
rank order. First the checks: UniEP's output, input gradient and expert-weight
gradients, with the megakernel and with the all_to_all transport (Triton experts), must
be bitwise those of UniEP on one GPU with the whole batch (computed on every rank).
Then median forward and forward+backward times (CUDA events, after warm-up; the slowest
rank's) of both and of TorchTitan 0.2.2's own ExpertParallel; ratios against TorchTitan.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys

# NVLink multicast stays off on these hosts.
for _name in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"):
    os.environ.setdefault(_name, "0" if _name == "NCCL_NVLS_ENABLE" else "1")

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from bench_moe import SHAPES, build_layers, rel_err  # noqa: E402

from uniep import UniEPConfig  # noqa: E402
from uniep.tune.measure import median_cuda_ms  # noqa: E402


def fwd_bwd(layer, x, grad):
    xi = x.detach().clone().requires_grad_(True)
    layer.zero_grad(set_to_none=True)
    out = layer(xi)
    out.backward(grad)
    experts = [getattr(layer.experts, n).grad for n in ("w1", "w2", "w3")]
    experts = [g.to_local() if hasattr(g, "to_local") else g for g in experts]
    return [out.detach(), xi.grad] + experts


def slowest(ms: float) -> float:
    t = torch.tensor([ms], device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def run_shape(shape, args, rank, world, mesh):
    from torch.distributed.tensor.parallel import parallelize_module
    from torchtitan.distributed.expert_parallel import ExpertParallel

    titan, uniep, _, D, _, E, _ = build_layers(shape)
    T = args.tokens_per_gpu
    gen = torch.Generator(device="cuda").manual_seed(1)
    x_all = torch.randn(1, T * world, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    grad_all = torch.randn_like(x_all)
    mine = slice(rank * T, (rank + 1) * T)
    x, grad = x_all[:, mine].contiguous(), grad_all[:, mine].contiguous()
    El = E // world

    reference = fwd_bwd(uniep, x_all, grad_all)  # one GPU, the whole batch
    expected = [reference[0][:, mine], reference[1][:, mine]] + [g[rank * El:(rank + 1) * El] for g in reference[2:]]

    layers = {}
    for transport in ("megakernel", "all_to_all"):
        layer = copy.deepcopy(uniep)
        layer.config = UniEPConfig(transport=transport)
        layer.keep_local_experts(dist.group.WORLD)
        layers[f"uniep[{transport}]"] = layer
    titan_ep = copy.deepcopy(titan)
    parallelize_module(titan_ep.experts, mesh, ExpertParallel())
    layers["torchtitan[ExpertParallel]"] = titan_ep

    names = ("out", "grad x", "grad w1", "grad w2", "grad w3")
    all_same = True
    for name in ("uniep[megakernel]", "uniep[all_to_all]"):
        got = fwd_bwd(layers[name], x, grad)
        same = torch.tensor([torch.equal(a, b) for a, b in zip(got, expected)], device="cuda")
        dist.all_reduce(same, op=dist.ReduceOp.MIN)
        if rank == 0:
            print(f"{shape}: {name} EP={world} vs one GPU, bitwise: "
                  + ", ".join(f"{n} {bool(s)}" for n, s in zip(names, same.tolist())), flush=True)
        if not bool(same.all()):
            diffs = [rel_err(a, b) for a, b in zip(got, expected)]
            print(f"  rank {rank}: relative differences {dict(zip(names, diffs))}", flush=True)
        all_same &= bool(same.all())

    rows = []
    for name, layer in layers.items():
        def fwd(layer=layer):
            with torch.no_grad():
                layer(x)

        def step(layer=layer):
            xi = x.detach().requires_grad_(True)
            layer(xi).backward(grad)
            layer.zero_grad(set_to_none=True)

        dist.barrier()
        row = {"shape": shape, "ep": world, "tokens_per_gpu": T, "layer": name,
               "fwd_ms": slowest(median_cuda_ms(fwd, args.warmup, args.iters)),
               "fwd_bwd_ms": slowest(median_cuda_ms(step, args.warmup, args.iters))}
        rows.append(row)
    base = rows[-1]
    for row in rows:
        row["speedup_fwd"] = base["fwd_ms"] / row["fwd_ms"]
        row["speedup_fwd_bwd"] = base["fwd_bwd_ms"] / row["fwd_bwd_ms"]
        if rank == 0:
            print(f"  {row['layer']:28s} fwd {row['fwd_ms']:7.2f} ms (x{row['speedup_fwd']:.2f})  "
                  f"fwd+bwd {row['fwd_bwd_ms']:7.2f} ms (x{row['speedup_fwd_bwd']:.2f})", flush=True)
    return rows, all_same


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default="qwen3,dsv3_16b,dsv3_671b")
    parser.add_argument("--tokens-per-gpu", type=int, default=4096)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--json", help="write the table here (rank 0)")
    args = parser.parse_args()
    shapes = args.shapes.split(",")
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown:
        sys.exit(f"--shapes: unknown {unknown}; allowed: {', '.join(SHAPES)}")
    if "LOCAL_RANK" not in os.environ or not torch.cuda.is_available():
        sys.exit("bench_ep.py runs under torchrun, one process per CUDA GPU")
    from torch.distributed.device_mesh import init_device_mesh

    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cuda", (world,))
    if rank == 0:
        print(f"{world} x {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    rows, all_bitwise = [], True
    for shape in shapes:
        shape_rows, bitwise = run_shape(shape, args, rank, world, mesh)
        rows += shape_rows
        all_bitwise &= bitwise
    if rank == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    dist.destroy_process_group()
    if not all_bitwise:
        sys.exit("expert-parallel results differ from one GPU")


if __name__ == "__main__":
    main()
