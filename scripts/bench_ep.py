"""Expert parallelism across GPUs, one process per GPU.

    torchrun --nproc-per-node N scripts/bench_ep.py [--shapes qwen3,dsv3_16b,dsv3_671b]
                                                    [--tokens-per-gpu 4096,16384] [--json out.json]
    TRITON_INTERPRET=1 torchrun --nproc-per-node 2 scripts/bench_ep.py --device cpu --shapes tiny

For each shape and number of tokens per GPU (bench_moe.py's layer dims): one global
batch, split across the ranks in rank order. First the checks: UniEP's output, input
gradient and expert-weight gradients, with the megakernel and with the all_to_all
transport (Triton experts), must be bitwise those of UniEP on one GPU with the whole
batch (computed on every rank). Then median forward and forward+backward times (the
slowest rank's, after warm-up) of both, of TorchTitan 0.2.2's own ExpertParallel and of
UniEP on one GPU with only the rank's own tokens (the compute alone, for balanced
routing), with:

- the ratio against TorchTitan's ExpertParallel;
- the unique bytes crossing between GPUs per GPU (a token once to each other GPU that
  owns one of its experts, each expert output row of another GPU back) and the
  algorithmic bandwidth they give over each transport's forward;
- ``hidden``: the share of the all_to_all transport's exposed communication that the
  megakernel hides, ``1 - (t_megakernel - t_compute) / (t_all_to_all - t_compute)``
  (forward+backward times).

``--device cpu`` (gloo, fp32, the Triton kernels under the interpreter) is a smoke test
of this script; the megakernel is left out there (it needs CUDA GPUs).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import statistics
import sys
import time

# NVLink multicast stays off on these hosts.
for _name in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"):
    os.environ.setdefault(_name, "0" if _name == "NCCL_NVLS_ENABLE" else "1")

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from bench_moe import SHAPES, build_layers, cross_rank_bytes, rel_err  # noqa: E402

from uniep.tune.measure import median_cuda_ms  # noqa: E402

COMPUTE = "uniep[one GPU, own tokens]"
TITAN = "torchtitan[ExpertParallel]"


def fmt_bytes(n: float) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


def fwd_bwd(layer, x, grad):
    xi = x.detach().clone().requires_grad_(True)
    layer.zero_grad(set_to_none=True)
    out = layer(xi)
    out.backward(grad)
    experts = [getattr(layer.experts, n).grad for n in ("w1", "w2", "w3")]
    experts = [g.to_local() if hasattr(g, "to_local") else g for g in experts]
    return [out.detach(), xi.grad] + experts


def median_ms(step, warmup: int, iters: int, device: str) -> float:
    if device == "cuda":
        return median_cuda_ms(step, warmup, iters)
    for _ in range(warmup):
        step()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        step()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def slowest(ms: float, device: str) -> float:
    t = torch.tensor([ms], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def check_bitwise(name, layer, x, grad, expected, rank, world, device, label) -> bool:
    names = ("out", "grad x", "grad w1", "grad w2", "grad w3")
    got = fwd_bwd(layer, x, grad)
    same = torch.tensor([torch.equal(a, b) for a, b in zip(got, expected)], dtype=torch.int32, device=device)
    dist.all_reduce(same, op=dist.ReduceOp.MIN)
    if rank == 0:
        print(f"{label}: {name} EP={world} vs one GPU, bitwise: "
              + ", ".join(f"{n} {bool(s)}" for n, s in zip(names, same.tolist())), flush=True)
    if not bool(same.all()):
        diffs = [rel_err(a, b) for a, b in zip(got, expected)]
        print(f"  rank {rank}: relative differences {dict(zip(names, diffs))}", flush=True)
    return bool(same.all())


def run_shape(shape, T, args, rank, world, mesh):
    from torch.distributed.tensor.parallel import parallelize_module
    from torchtitan.distributed.expert_parallel import ExpertParallel

    device = args.device
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    titan, uniep, _, D, _, E, _ = build_layers(shape, dtype, device)
    label = f"{shape}, {T} tokens per GPU"
    gen = torch.Generator(device=device).manual_seed(1)
    x_all = torch.randn(1, T * world, D, device=device, dtype=dtype, generator=gen)
    grad_all = torch.randn_like(x_all)
    mine = slice(rank * T, (rank + 1) * T)
    x, grad = x_all[:, mine].contiguous(), grad_all[:, mine].contiguous()
    El = E // world

    reference = fwd_bwd(uniep, x_all, grad_all)  # one GPU, the whole batch
    expected = [reference[0][:, mine], reference[1][:, mine]] + [g[rank * El:(rank + 1) * El] for g in reference[2:]]

    layers, bitwise = {}, {}
    for transport in ("megakernel", "all_to_all") if device == "cuda" else ("all_to_all",):
        name = f"uniep[{transport}]"
        layer = copy.deepcopy(uniep)
        layer.config = dataclasses.replace(uniep.config, transport=transport)
        layer.keep_local_experts(dist.group.WORLD)
        layers[name] = layer
        bitwise[name] = check_bitwise(name, layer, x, grad, expected, rank, world, device, label)
    layers[COMPUTE] = uniep
    titan_ep = copy.deepcopy(titan)
    parallelize_module(titan_ep.experts, mesh, ExpertParallel())
    # its GPU path (grouped GEMMs) looks the dim up by name; the CPU smoke test checks it here
    assert "ep" in titan_ep.experts.w1.device_mesh.mesh_dim_names, titan_ep.experts.w1.device_mesh
    layers[TITAN] = titan_ep

    dispatch, combine = cross_rank_bytes(uniep, x_all, world)
    bytes_per_gpu = (dispatch + combine) / world
    rows = {}
    for name, layer in layers.items():
        def fwd(layer=layer):
            with torch.no_grad():
                layer(x)

        def step(layer=layer):
            xi = x.detach().requires_grad_(True)
            layer(xi).backward(grad)
            layer.zero_grad(set_to_none=True)

        dist.barrier()
        rows[name] = {"shape": shape, "ep": world, "tokens_per_gpu": T, "layer": name,
                      "fwd_ms": slowest(median_ms(fwd, args.warmup, args.iters, device), device),
                      "fwd_bwd_ms": slowest(median_ms(step, args.warmup, args.iters, device), device)}
    base, compute = rows[TITAN], rows[COMPUTE]
    for name, row in rows.items():
        row["speedup_fwd"] = base["fwd_ms"] / row["fwd_ms"]
        row["speedup_fwd_bwd"] = base["fwd_bwd_ms"] / row["fwd_bwd_ms"]
        if name in bitwise:
            row["bitwise_vs_one_gpu"] = bitwise[name]
            row["cross_gpu_bytes_per_gpu"] = bytes_per_gpu
            row["alg_bandwidth_fwd_gb_s"] = bytes_per_gpu / row["fwd_ms"] / 1e6
    megakernel, a2a = rows.get("uniep[megakernel]"), rows["uniep[all_to_all]"]
    exposed_a2a = a2a["fwd_bwd_ms"] - compute["fwd_bwd_ms"]
    if megakernel is not None and exposed_a2a > 0:
        megakernel["hidden"] = 1 - (megakernel["fwd_bwd_ms"] - compute["fwd_bwd_ms"]) / exposed_a2a
    if rank == 0:
        print(f"  cross-GPU bytes per GPU per forward: {fmt_bytes(bytes_per_gpu)} "
              f"(dispatch {fmt_bytes(dispatch / world)}, combine {fmt_bytes(combine / world)})", flush=True)
        for row in rows.values():
            extra = ""
            if "alg_bandwidth_fwd_gb_s" in row:
                extra = f"  {row['alg_bandwidth_fwd_gb_s']:7.2f} GB/s"
            if "hidden" in row:
                extra += f"  hidden {row['hidden']:.0%}"
            print(f"  {row['layer']:28s} fwd {row['fwd_ms']:8.2f} ms (x{row['speedup_fwd']:.2f})  "
                  f"fwd+bwd {row['fwd_bwd_ms']:8.2f} ms (x{row['speedup_fwd_bwd']:.2f}){extra}", flush=True)
    return list(rows.values()), all(bitwise.values())


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default="qwen3,dsv3_16b,dsv3_671b")
    parser.add_argument("--tokens-per-gpu", default="4096", help="comma-separated, e.g. 4096,16384,32768")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                        help="cpu: gloo, fp32, kernels under the Triton interpreter (a smoke test)")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--json", help="write the table here (rank 0)")
    args = parser.parse_args()
    args.shapes = args.shapes.split(",")
    unknown = [s for s in args.shapes if s not in SHAPES]
    if unknown:
        sys.exit(f"--shapes: unknown {unknown}; allowed: {', '.join(SHAPES)}")
    try:
        args.tokens_per_gpu = [int(t) for t in args.tokens_per_gpu.split(",")]
    except ValueError:
        sys.exit(f"--tokens-per-gpu = {args.tokens_per_gpu!r}: expected comma-separated positive integers")
    if any(t < 1 for t in args.tokens_per_gpu):
        sys.exit(f"--tokens-per-gpu = {args.tokens_per_gpu}: expected positive integers")
    if "LOCAL_RANK" not in os.environ:
        sys.exit("bench_ep.py runs under torchrun, one process per GPU")
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("bench_ep.py needs CUDA GPUs (--device cpu runs a smoke test)")
    if args.device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("bench_ep.py --device cpu needs TRITON_INTERPRET=1 (UniEP's and TorchTitan's Triton kernels "
                 "run under the interpreter)")
    return args


def main() -> None:
    args = parse_args()
    from torch.distributed.device_mesh import init_device_mesh

    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    else:
        from recipes.cpu import apply_cpu_shims

        apply_cpu_shims()
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    # TorchTitan's experts find the expert-parallel dim by name (its grouped-GEMM path
    # skips the padding that ExpertParallel already did only on a mesh dim called "ep").
    mesh = init_device_mesh(args.device, (world,), mesh_dim_names=("ep",))
    if rank == 0:
        name = torch.cuda.get_device_name() if args.device == "cuda" else "CPU processes"
        print(f"{world} x {name}, torch {torch.__version__}", flush=True)
    rows, all_bitwise = [], True
    for shape in args.shapes:
        for tokens in args.tokens_per_gpu:
            shape_rows, bitwise = run_shape(shape, tokens, args, rank, world, mesh)
            rows += shape_rows
            all_bitwise &= bitwise
    if rank == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    dist.barrier()  # leave together: a gloo rank tearing down alone was seen to abort its peer
    dist.destroy_process_group()
    if not all_bitwise:
        sys.exit("expert-parallel results differ from one GPU")


if __name__ == "__main__":
    main()
