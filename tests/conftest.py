import pytest
import torch

from recipes.cpu import apply_cpu_shims

# TorchTitan's own MoE (the reference) needs the CPU shims to run without CUDA.
apply_cpu_shims()


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
