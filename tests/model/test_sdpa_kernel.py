"""attention.sdpa_kernel_for: which of SDPA's kernels a training call ran (the trainer's log line names it)."""
import torch

from vqlcmd.model.attention import sdpa_kernel_for


def test_the_kernel_named_is_the_one_dispatched_to_on_cpu():
    """On a CPU, SDPA's fused kernel (flash-cpu) has no dropout: with the paper's attention dropout the call
    runs the composite math path; without dropout, the fused one. Head dim 48, as imagenet-246m's."""
    q = torch.empty(1, 16, 64, 48)
    assert sdpa_kernel_for(q, 0.1) == "math"
    assert sdpa_kernel_for(q, 0.0) == "flash-cpu"


def test_asking_draws_nothing_from_the_global_generator():
    """The probe runs with dropout; the training's random stream must not move for it."""
    torch.manual_seed(0)
    sdpa_kernel_for(torch.empty(1, 2, 8, 48), 0.5)
    after = torch.rand(3)
    torch.manual_seed(0)
    torch.testing.assert_close(after, torch.rand(3), rtol=0, atol=0)
