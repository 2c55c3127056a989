import os

import pytest
import torch

# Without a GPU, Triton kernels run in its interpreter; it must be chosen before the
# kernels are defined (at import).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

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
