"""The trained parameters of VQ-LCMD: the denoiser θ and the token embeddings φ.

A plain container so that one optimizer, one EMA and one checkpoint cover both;
no diffusion math here (that is ``vqlcmd.diffusion``).
"""
from __future__ import annotations

import torch.nn as nn

from .embedding import TokenEmbedding
from .model import Denoiser, DenoiserConfig


class VQLCMDNetwork(nn.Module):
    def __init__(self, cfg: DenoiserConfig, *, frozen_embeddings: bool = False, l2_normalize: bool = False,
                 embedding_init=None):
        super().__init__()
        self.denoiser = Denoiser(cfg)
        self.embedding = TokenEmbedding(cfg.codebook_size, cfg.embed_dim, frozen=frozen_embeddings,
                                        l2_normalize=l2_normalize, init=embedding_init)

    @property
    def config(self) -> DenoiserConfig:
        return self.denoiser.cfg
