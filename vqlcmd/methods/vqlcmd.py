"""VQ-LCMD itself: L0 + β_DM·L_DM + β_CM·L_CM against the EMA teacher (docs/method.md §7-8, eq. 10-15).

Its ablations are switches of the loss, embedding and schedule sections, not methods of their own.
"""
from __future__ import annotations

from ..diffusion import draw_loss_randoms, training_losses, training_losses_drawn
from ..diffusion.losses import LOSS_OPS
from ..pipeline import VQLCMDPipeline
from .registry import Method, register


def losses(net, teacher, schedule, tokens, labels, cfg, generator=None, backend="auto"):
    return training_losses(net, teacher, schedule, tokens, labels, cfg.loss, generator=generator, backend=backend)


def draw(net, tokens, labels, cfg, generator=None, backend="auto"):
    return draw_loss_randoms(net, tokens, labels, cfg.loss, generator=generator, backend=backend)


def losses_drawn(net, teacher, schedule, tokens, labels, cfg, draws, backend="auto"):
    return training_losses_drawn(net, teacher, schedule, tokens, labels, cfg.loss, draws, backend=backend)


def pipeline_kwargs(cfg) -> dict:
    s = cfg.sample
    return {"sample_defaults": {"num_steps": s.num_steps, "guidance_scale": s.guidance_scale, "sampler": s.sampler,
                                "final": s.final, "guidance_interval": s.guidance_interval}}


METHOD = register(Method("vqlcmd", losses=losses, draw=draw, losses_drawn=losses_drawn, pipeline_class=VQLCMDPipeline,
                         pipeline_kwargs=pipeline_kwargs, ops=LOSS_OPS))
