"""Kernel tests run Triton's interpreter on CPU tensors when there is no GPU.

triton.jit fixes interpreter-or-compiler when a kernel is decorated, and vqlcmd.ops imports the
kernels lazily on first use, so setting the variable while this conftest is imported (before any
test here runs a kernel) is early enough. It stays set for the rest of the session; that is
harmless to other tests because ``auto`` never picks the interpreter (DESIGN.md: CPU tensors go
to Triton only when asked by name). On a GPU machine nothing is changed and kernels compile.
"""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def device():
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
