import os

import pytest
import torch

# Without a GPU, Triton kernels run in the interpreter (DESIGN.md). triton.jit fixes interpreter or
# compiler when a kernel is decorated, and any test may be the first to load vqlcmd.kernels (through
# the op dispatcher), so the variable is set here, before any test module is imported. ``auto`` never
# picks the interpreter, so other tests are unaffected.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(0)
