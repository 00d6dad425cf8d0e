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


# A Trainer built inside the test process sets up a one-rank process group and writes RANK,
# MASTER_PORT, ... into os.environ (DeepSpeed reads them from there). A later test that starts
# scripts/train.py as a subprocess would inherit them, skip its own free-port choice and fail with
# EADDRINUSE on the port this process still holds; so each test leaves these as it found them.
_LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture(autouse=True)
def _launcher_env_restored():
    saved = {k: os.environ.get(k) for k in _LAUNCHER_VARS}
    yield
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(0)
