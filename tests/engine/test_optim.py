"""vqlcmd/engine/optim.py against its docstring: AdamW with the config's hyper-parameters, linear warm-up then
cosine decay to lr * min_lr_ratio at total_steps (and no further)."""
import math

import pytest
import torch

from vqlcmd.engine.config import OptimizerSection
from vqlcmd.engine.optim import build_optimizer, build_scheduler


def test_the_optimizer_takes_the_configs_hyper_parameters_and_trainable_parameters_only():
    cfg = OptimizerSection(lr=2e-3, betas=(0.8, 0.95), weight_decay=0.05, eps=1e-6)
    trained, frozen = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2), requires_grad=False)
    opt = build_optimizer([trained, frozen], cfg, torch.device("cpu"))
    assert isinstance(opt, torch.optim.AdamW)
    (group,) = opt.param_groups
    assert group["params"] == [trained]
    assert (group["lr"], tuple(group["betas"]), group["weight_decay"], group["eps"]) == (2e-3, (0.8, 0.95), 0.05, 1e-6)
    assert group["fused"] is True  # on a CPU too: one pass, no intermediates written out
    # one step against the AdamW formula in float64: decoupled decay, bias-corrected moments
    g = torch.tensor([0.5, -2.0, 1e-3], dtype=torch.float64)
    trained.grad = g.float()
    opt.step()
    m, v = (1 - 0.8) * g / (1 - 0.8), (1 - 0.95) * g * g / (1 - 0.95)
    want = 1.0 * (1 - 2e-3 * 0.05) - 2e-3 * m / (v.sqrt() + 1e-6)
    torch.testing.assert_close(trained.detach().double(), want, rtol=1e-6, atol=1e-7)


def _factors(cfg, total, n):
    p = torch.nn.Parameter(torch.zeros(1))
    opt = build_optimizer([p], cfg, torch.device("cpu"))
    sched = build_scheduler(opt, cfg, total)
    out = []
    for _ in range(n):
        out.append(opt.param_groups[0]["lr"] / cfg.lr)
        opt.step()
        sched.step()
    return out


def _reference(k, warmup, total, floor):
    if k < warmup:
        return (k + 1) / warmup
    progress = min(1.0, (k - warmup) / max(1, total - warmup))
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))


@pytest.mark.parametrize("warmup, total, floor", [(3, 10, 0.1), (0, 6, 0.0), (2, 3, 0.25)])
def test_the_schedule_is_warm_up_then_cosine_to_the_floor_and_stays_there(warmup, total, floor):
    cfg = OptimizerSection(lr=1e-3, warmup_steps=warmup, min_lr_ratio=floor)
    got = _factors(cfg, total, total + 5)  # a resumed run with more steps, or DeepSpeed's skipped steps
    assert got == pytest.approx([_reference(k, warmup, total, floor) for k in range(total + 5)], rel=1e-12)
    assert got[-5:] == pytest.approx([floor] * 5)
    if warmup == 0:
        assert got[0] == pytest.approx(1.0)  # no warm-up: the full rate from the first step
