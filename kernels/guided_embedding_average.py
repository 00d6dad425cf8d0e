"""Triton kernel for the classifier-free-guided embedding average used by the samplers.

``softmax((1+ω) log_softmax(cond) − ω log_softmax(uncond)) @ table`` (docs/method.md eq. 17) in
one pass: the forward kernel of ``softmax_embedding_average`` with GUIDED set reads both logit
tiles and mixes them before its online softmax; the two log-softmax normalisers are per-row
constants, so they cancel in the renormalisation and are never computed. No gradient: the
samplers run without one.
"""
from __future__ import annotations

import torch

from . import softmax_embedding_average as _sea


def guided_embedding_average(cond: torch.Tensor, uncond: torch.Tensor, table: torch.Tensor,
                             guidance_scale: float) -> torch.Tensor:
    """cond, uncond (N, K), table (K, D), ω >= 0 -> (N, D) in the promoted dtype of cond and table."""
    out, _ = _sea.forward(cond, table, uncond=uncond, guidance=guidance_scale)
    return out.to(torch.promote_types(cond.dtype, table.dtype))
