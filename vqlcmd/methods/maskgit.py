"""MaskGIT on the same tokens and backbone (``vqlcmd.baselines.maskgit``): masked-token prediction, sampled
by iterative confident unmasking (docs/method.md §13)."""
from __future__ import annotations

from ..baselines.maskgit import MaskGITPipeline, maskgit_losses
from .registry import Method, register


def losses(net, teacher, schedule, tokens, labels, cfg, generator=None, backend="auto"):
    # no teacher, no schedule: MaskGIT's objective is cross-entropy on the masked positions
    return maskgit_losses(net, tokens, labels, cfg.maskgit, label_drop=cfg.loss.label_drop, generator=generator)


def pipeline_kwargs(cfg) -> dict:
    return {"maskgit": cfg.maskgit,
            "sample_defaults": {"num_steps": cfg.maskgit.num_steps, "guidance_scale": cfg.sample.guidance_scale}}


METHOD = register(Method(
    "maskgit", losses=losses, pipeline_class=MaskGITPipeline, pipeline_kwargs=pipeline_kwargs,
    # MaskGIT's section is mostly its sampler's; these two keys are its training's
    objective={"loss": None, "maskgit": ("train_schedule", "label_smoothing")},
    grid_steps=lambda cfg: None))  # previews at MaskGIT's own step count (the pipeline's default)
