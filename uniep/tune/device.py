"""Device peaks the cost model needs, measured once per device and cached on disk.

``DeviceSpec`` holds the measured dense matmul rate, the measured copy bandwidth and the
device's own properties (SMs, shared memory per block). Nothing is hard-coded: the
first call on a device measures (a few hundred milliseconds) and writes
``<cache dir>/device-<name>.json``; later calls read it.
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import asdict, dataclass

import torch

from uniep.kernels.grouped_gemm import smem_limit
from uniep.tune.cache import cache_dir


@dataclass(frozen=True)
class DeviceSpec:
    name: str
    matmul_flops: float
    """Dense matmul rate measured in the GEMMs' dtype (bf16 on GPU, fp32 on CPU), FLOP/s."""
    copy_bytes_per_s: float
    """Device copy bandwidth, bytes read plus written per second."""
    num_sms: int
    smem_per_block: int


def _time(fn, repeats: int) -> float:
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats


def measure(device: torch.device) -> DeviceSpec:
    if device.type == "cuda":
        n, dtype, repeats = 8192, torch.bfloat16, 10
        props = torch.cuda.get_device_properties(device)
        name, sms = props.name, props.multi_processor_count
    else:
        n, dtype, repeats = 512, torch.float32, 5
        name, sms = "cpu", torch.get_num_threads()
    smem = smem_limit(device)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    flops = 2 * n**3 / _time(lambda: a @ b, repeats)
    src = torch.empty(256 * 2**20 if device.type == "cuda" else 16 * 2**20, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    bandwidth = 2 * src.numel() / _time(lambda: dst.copy_(src), repeats)
    return DeviceSpec(name, flops, bandwidth, sms, smem)


def device_spec(device: torch.device | str | None = None, *, refresh: bool = False) -> DeviceSpec:
    """The cached spec of ``device`` (default: the current CUDA device, else the CPU)."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    name = torch.cuda.get_device_properties(device).name if device.type == "cuda" else "cpu"
    path = cache_dir() / f"device-{re.sub(r'[^A-Za-z0-9_.-]+', '_', name)}.json"
    if path.is_file() and not refresh:
        return DeviceSpec(**json.loads(path.read_text()))
    spec = measure(device)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(asdict(spec), indent=2) + "\n")
    tmp.replace(path)  # atomic: ranks measuring at once never leave half a file
    return spec
