"""The continuous baselines (``vqlcmd.baselines.csdm``): the VQ-LCMD loss with forced switches
(docs/method.md §13, eq. 15).

``csdm_fixed`` (CSDM†) diffuses the tokenizer's frozen codebook vectors; ``csdm`` and ``csdm_l2`` learn
the embeddings on the VLB (the latter ℓ2-normalised).
"""
from __future__ import annotations

import dataclasses

from ..baselines.csdm import CSDM_SWITCHES, codebook_from_tokenizer
from ..diffusion.losses import LOSS_OPS
from ..network import VQLCMDNetwork
from ..pipeline import VQLCMDPipeline
from .registry import Method, register
from .vqlcmd import losses, pipeline_kwargs


def fixed_codebook_network(cfg, den_cfg, tokenizer_dir=None, log=print) -> VQLCMDNetwork:
    """CSDM†'s network: the tokenizer's codebook as the frozen table, and D from it."""
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


_COMMON = dict(losses=losses, pipeline_class=VQLCMDPipeline, pipeline_kwargs=pipeline_kwargs, ops=LOSS_OPS)
register(Method("csdm_fixed", switches=CSDM_SWITCHES["csdm_fixed"], build_network=fixed_codebook_network,
                resume_sections=("csdm",), **_COMMON))  # its csdm section decides the frozen table
register(Method("csdm", switches=CSDM_SWITCHES["csdm"], **_COMMON))
register(Method("csdm_l2", switches=CSDM_SWITCHES["csdm_l2"], **_COMMON))
