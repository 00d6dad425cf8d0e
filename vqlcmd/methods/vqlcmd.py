"""VQ-LCMD itself: L0 + β_DM·L_DM + β_CM·L_CM against the EMA teacher (docs/method.md §7-8, eq. 10-15).

Its ablations are switches of the loss, embedding and schedule sections, not methods of their own.
"""
from __future__ import annotations

from ..diffusion import training_losses
from ..pipeline import VQLCMDPipeline
from .registry import Method, register


def losses(net, teacher, schedule, tokens, labels, cfg, generator=None, backend="auto"):
    return training_losses(net, teacher, schedule, tokens, labels, cfg.loss, generator=generator, backend=backend)


def pipeline_kwargs(cfg) -> dict:
    s = cfg.sample
    return {"sample_defaults": {"num_steps": s.num_steps, "guidance_scale": s.guidance_scale, "sampler": s.sampler,
                                "final": s.final, "guidance_interval": s.guidance_interval}}


METHOD = register(Method("vqlcmd", losses=losses, pipeline_class=VQLCMDPipeline, pipeline_kwargs=pipeline_kwargs))
