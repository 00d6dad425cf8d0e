"""Client optimizer and LR schedule handed to DeepSpeed.

PyTorch's AdamW is the default, ``fused=True`` on CUDA and CPU alike: one kernel, one pass over each
parameter's weights and moments. On a CPU the multi-tensor ``foreach`` form writes each intermediate out and
took 2.3x as long (6.3 against 2.7 ms a step, Python included, over imagenet-246m's 2 M-parameter structure at
width 64: ``benchmarks/host_overhead.py``). The two round differently by a few ulps, so a CPU run started
before fused became the CPU default does not repeat bit for bit; its checkpoints resume as they were written
(foreach: the setting is in the optimizer's saved param groups, which a resume restores). NVIDIA apex's
FusedAdam is used when asked for (``optimizer.impl = "apex"``) and installed; it is not on the package
index, so it stays optional.
"""
from __future__ import annotations

import math

import torch

from .config import ConfigError, OptimizerSection


def build_optimizer(params, cfg: OptimizerSection, device: torch.device) -> torch.optim.Optimizer:
    params = [p for p in params if p.requires_grad]
    kw = dict(lr=cfg.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay, eps=cfg.eps)
    if cfg.impl == "torch":
        return torch.optim.AdamW(params, fused=True, **kw)
    if cfg.impl == "apex":
        try:
            from apex.optimizers import FusedAdam
        except ImportError as exc:
            raise ConfigError("optimizer.impl='apex' but NVIDIA apex is not installed (it is not on the package "
                              "index; build it from source, or use impl='torch')") from exc
        return FusedAdam(params, adam_w_mode=True, **kw)
    raise ConfigError(f"optimizer.impl must be 'torch' or 'apex', got {cfg.impl!r}")


def build_scheduler(optimizer, cfg: OptimizerSection, total_steps: int):
    """Linear warm-up, then cosine decay to ``lr * min_lr_ratio`` at ``total_steps``."""
    warmup = max(0, cfg.warmup_steps)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
