"""Where a megakernel layer call spends its time: device time per kernel and host
time (and the host ops that take it), one forward+backward at a bench_moe.py shape,
next to the one-rank fused layer.

    python scripts/profile_megakernel.py [--shape qwen3] [--ranks 2,8]
"""

from __future__ import annotations

import argparse
import sys

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, __import__("os").path.dirname(__file__))
from bench_moe import SHAPES, build_layers  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="qwen3", choices=list(SHAPES))
    parser.add_argument("--ranks", default="2,8", help="virtual ranks to profile (1: the one-rank fused layer)")
    args = parser.parse_args()
    from uniep import UniEPConfig
    from uniep.testing import use_virtual_ranks

    _, uniep, T, D, *_ = build_layers(args.shape)
    x = torch.randn(1, T, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn_like(x)
    for ranks in [1] + [int(r) for r in args.ranks.split(",")]:
        uniep.config = UniEPConfig(backend="triton")
        if ranks > 1:
            use_virtual_ranks(uniep, ranks)
        for _ in range(3):
            uniep(x).backward(grad)
            uniep.zero_grad(set_to_none=True)  # as a training step: no gradient accumulation kernels
        x.grad = None
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            uniep(x).backward(grad)
            torch.cuda.synchronize()
        uniep.zero_grad(set_to_none=True)
        x.grad = None
        # the kernels themselves (an op's or autograd node's self device time repeats its kernels')
        timed = [e for e in prof.key_averages() if e.self_device_time_total > 0]
        kernels = [e for e in timed if e.device_type == DeviceType.CUDA] or timed
        kernels.sort(key=lambda e: -e.self_device_time_total)
        total = sum(e.self_device_time_total for e in kernels)
        host_ms = prof.key_averages().self_cpu_time_total / 1e3
        print(f"== {ranks} rank(s): device {total / 1e3:.2f} ms in kernels, host {host_ms:.1f} ms (profiled)")
        for e in kernels[:14]:
            print(f"   {e.key[:48]:48s} {e.count:4d} launches {e.self_device_time_total / 1e3:7.3f} ms")
        host = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
        print(f"   host: {len(kernels)} kernel kinds, {sum(e.count for e in kernels)} launches; most self CPU time:")
        for e in host[:8]:
            print(f"   {e.key[:48]:48s} {e.count:4d} calls    {e.self_cpu_time_total / 1e3:7.3f} ms")


if __name__ == "__main__":
    main()
