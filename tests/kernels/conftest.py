"""Kernel tests run Triton's interpreter on CPU tensors when there is no GPU (tests/conftest.py sets
TRITON_INTERPRET=1 before any kernel is imported); on a GPU machine the kernels compile."""
import pytest
import torch


@pytest.fixture
def device():
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture
def sea():
    """kernels/softmax_embedding_average.py, imported inside the test (after TRITON_INTERPRET is set)."""
    from vqlcmd.kernels import softmax_embedding_average

    return softmax_embedding_average
