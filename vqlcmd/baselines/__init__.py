"""The math of the VQ-LCMD paper's baselines in the same framework (their registrations as methods, selected
by ``vqlcmd.method``, are in ``vqlcmd.methods``).

``maskgit`` is a discrete masked-token model on the same backbone; ``csdm_fixed``, ``csdm``, ``csdm_l2`` are
continuous baselines expressed as forced switches of the VQ-LCMD loss.
"""
from __future__ import annotations

from .csdm import CSDM_SWITCHES, CSDMConfig, codebook_from_tokenizer
from .maskgit import MaskGITConfig, MaskGITPipeline, maskgit_losses, maskgit_sample, unmask_schedule

__all__ = ["CSDM_SWITCHES", "CSDMConfig", "MaskGITConfig", "MaskGITPipeline", "codebook_from_tokenizer",
           "maskgit_losses", "maskgit_sample", "unmask_schedule"]
