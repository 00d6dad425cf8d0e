"""Continuous-space diffusion baselines of the paper, as switches of the VQ-LCMD loss (no new math).

- ``csdm_fixed`` (CSDM†, Table "unconditional"): diffusion on the frozen VQ codebook vectors; the
  embedding table is the tokenizer's codebook and never trained, D is the codebook's dimension.
- ``csdm`` (Table "effect"): embeddings and denoiser trained jointly on the VLB of eq. (vlb):
  L0 + L_∞ with the weight −½ SNR′(t), no L_CM, no random dropping, plain cosine schedule.
- ``csdm_l2``: the same with ℓ2-normalised embedding rows (CDCD-style, Dieleman et al. 2022).

CSDM† is "CSDM using fixed embeddings", so it is trained on the same objective as CSDM; with frozen
embeddings only the denoiser learns from it.
"""
from __future__ import annotations

from pathlib import Path
from typing import Union

import torch

from ..engine.config import CSDMConfig  # noqa: F401  (the schema; re-exported)

# The switches each method forces, as (section, key) -> value. Applied on top of whatever the config
# file says, so that the resolved config stored with a run shows what actually trained.
_CSDM_COMMON = {("loss", "beta_cm"): 0.0, ("loss", "drop_strategy"): "none", ("loss", "weighting"): "vlb",
                ("schedule", "shift"): 0.0}
CSDM_SWITCHES = {
    "csdm_fixed": {**_CSDM_COMMON, ("embedding", "frozen"): True, ("embedding", "l2_normalize"): False},
    "csdm": {**_CSDM_COMMON, ("embedding", "frozen"): False, ("embedding", "l2_normalize"): False},
    "csdm_l2": {**_CSDM_COMMON, ("embedding", "frozen"): False, ("embedding", "l2_normalize"): True},
}


def codebook_from_tokenizer(tokenizer_dir: Union[str, Path], rescale: bool = True) -> torch.Tensor:
    """The (K, D) codebook of a diffusers VQModel folder (``quantize.embedding.weight``), float32."""
    from ..tokenizer.vqmodel import load_vqmodel

    code = load_vqmodel(tokenizer_dir).quantize.embedding.weight.detach().float().clone()
    if rescale:
        code = code * (code.shape[1] ** 0.25 / code.norm(dim=1).mean().clamp_min(1e-12))
    return code
