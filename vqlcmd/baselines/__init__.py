"""Baselines of the VQ-LCMD paper in the same framework, selected by the config key ``vqlcmd.method``.

``vqlcmd`` (default) is the method itself, whose ablations are the switches of ``LossConfig`` and the
embedding / schedule sections; ``maskgit`` is a discrete masked-token model on the same backbone;
``csdm_fixed``, ``csdm``, ``csdm_l2`` are continuous baselines expressed as forced switches.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

from .csdm import CSDM_SWITCHES, CSDMConfig, codebook_from_tokenizer
from .maskgit import MaskGITConfig, MaskGITPipeline, maskgit_losses, maskgit_sample, unmask_schedule

METHODS = ("vqlcmd", "maskgit", "csdm_fixed", "csdm", "csdm_l2")

__all__ = ["METHODS", "CSDM_SWITCHES", "CSDMConfig", "MaskGITConfig", "MaskGITPipeline", "apply_method",
           "build_network", "codebook_from_tokenizer", "maskgit_losses", "maskgit_sample", "unmask_schedule"]


def apply_method(cfg):
    """The config with the method's defining switches forced (a ``VQLCMDConfig``; returns a new one)."""
    if cfg.method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {cfg.method!r}")
    switches = CSDM_SWITCHES.get(cfg.method, {})
    sections = {}
    for (section, key), value in switches.items():
        sections.setdefault(section, {})[key] = value
    return dataclasses.replace(cfg, **{name: dataclasses.replace(getattr(cfg, name), **kv)
                                       for name, kv in sections.items()})


def build_network(cfg, den_cfg, tokenizer_dir: Optional[str] = None, log=print):
    """The trained network for ``cfg.method``. CSDM† takes the tokenizer's codebook as its frozen table and
    D from it; every other method builds ``VQLCMDNetwork`` from the embedding switches."""
    from ..network import VQLCMDNetwork

    if cfg.method == "csdm_fixed":
        if tokenizer_dir is None:
            raise ValueError("method 'csdm_fixed' diffuses the tokenizer's codebook vectors: give "
                             "vqlcmd.data.tokenizer (or data.dataset='digits')")
        code = codebook_from_tokenizer(tokenizer_dir, cfg.csdm.codebook_rescale)
        if code.shape[0] != den_cfg.codebook_size:
            raise ValueError(f"the tokenizer's codebook has {code.shape[0]} codes, the model {den_cfg.codebook_size}")
        if "embed_dim" in cfg.model.overrides and cfg.model.overrides["embed_dim"] != code.shape[1]:
            raise ValueError(f"method 'csdm_fixed': model.overrides.embed_dim={cfg.model.overrides['embed_dim']} "
                             f"but the codebook vectors have {code.shape[1]} dimensions")
        if den_cfg.embed_dim != code.shape[1]:
            log(f"csdm_fixed: embedding dimension D = {code.shape[1]} (the codebook's), not the preset's "
                f"{den_cfg.embed_dim}")
            den_cfg = dataclasses.replace(den_cfg, embed_dim=code.shape[1])
        return VQLCMDNetwork(den_cfg, frozen_embeddings=True, embedding_init=code)
    return VQLCMDNetwork(den_cfg, frozen_embeddings=cfg.embedding.frozen, l2_normalize=cfg.embedding.l2_normalize)
