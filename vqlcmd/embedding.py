"""Learnable token embeddings E ∈ R^{(K+1)×D} (docs/method.md §2, eq. 1).

Row K is the ``[mask]`` embedding used by random dropping. Initialised
N(0, D^{-1/2}) as in the paper. Ablation switches: ``frozen`` (fixed embeddings,
e.g. the VQ codebook for CSDM†) and ``l2_normalize`` (CDCD-style normalised rows).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn


class TokenEmbedding(nn.Module):
    def __init__(self, codebook_size: int, dim: int, *, frozen: bool = False, l2_normalize: bool = False,
                 init: Optional[torch.Tensor] = None):
        super().__init__()
        self.codebook_size = codebook_size
        self.dim = dim
        self.l2_normalize = l2_normalize
        weight = torch.randn(codebook_size + 1, dim) * dim ** -0.25  # variance D^{-1/2}
        if init is not None:
            if init.shape != (codebook_size, dim):
                raise ValueError(f"init must be ({codebook_size}, {dim}), got {tuple(init.shape)}")
            weight[:codebook_size] = init
        self.weight = nn.Parameter(weight, requires_grad=not frozen)

    @property
    def mask_index(self) -> int:
        return self.codebook_size

    def table(self) -> torch.Tensor:
        """The (K+1, D) table the diffusion uses."""
        if not self.l2_normalize:
            return self.weight
        # Normalise to the expected norm of the paper's init, D^{1/4}, so the
        # noise schedule means the same signal-to-noise ratio in both variants.
        return nn.functional.normalize(self.weight, dim=-1) * self.dim ** 0.25


def collapse_indicator(table: torch.Tensor) -> float:
    """Mean pairwise distance between embedding rows relative to their mean norm.

    ≈ √2 for independent random rows; → 0 when the embeddings collapse
    (docs/method.md eq. 2; the paper's ablation "without L_CM the embeddings collapse").
    """
    e = table.detach().float()
    n = e.shape[0]
    if n < 2:
        raise ValueError("collapse_indicator needs at least two rows")
    dist = torch.cdist(e[None], e[None])[0]  # (n, n)
    mean_dist = dist.sum() / (n * (n - 1))
    return float(mean_dist / e.norm(dim=-1).mean().clamp_min(1e-12))
