"""The FLOP count the benchmarks assume, written out, and the peak they divide by for MFU.

Counting convention (Kaplan et al. 2020; PaLM appendix B): a matmul with a
weight of N entries costs 2·N FLOPs per token forward and 4·N backward
(gradients of input and weight), hence 6·N per token for forward+backward.
Element-wise work (LayerNorm, GELU, softmax, the AdaLN modulation) is left out,
as is usual for MFU; the result is a *model* FLOP count, the same for every
backend, so MFU compares backends fairly even where a backend recomputes.

The denoiser (vqlcmd/model/denoiser.py) with width W, depth L, sequence M:

- per-token weights P_tok: ``in_proj`` (D·W), per block ``qkv`` (3W²), ``proj`` (W²),
  ``mlp`` (2·W·hidden), and ``head`` (W·K). The time MLP, the AdaLN maps ``to_ab``
  (4W² per block, a quarter of a block's weights) and the class embedding run once
  per *sequence*, not per token, so counting them per token as 6·params·tokens
  would over-state the work by about a third: they enter as P_seq per sequence.
- attention per layer and sequence, forward: QKᵀ and PV, 2·M²·W each: 4·L·M²·W.
  Backward is twice the forward, as for the matmuls.

    F_fwd(one sequence) = 2·P_tok·M + 4·L·M²·W + 2·P_seq

One VQ-LCMD training step (vqlcmd/diffusion/losses.py) with batch B (the micro-batch of one rank):

- B0 = max(1, ceil(l0_fraction·B)) rows get the L0 input z_0 (``loss.l0_fraction``: L0 is estimated on
  the first B0 images); they join the B rows of z_t in one batched student forward of B + B0 sequences.
  l0_fraction = 1 (the default) gives 2B rows; the quick start's 1/8 of 64 gives 64 + 8.
- student forward+backward on those B + B0 sequences: 3·(B + B0)·F_fwd
- teacher (EMA) forward on B sequences (z̄_s), no backward: B·F_fwd, only when β_CM > 0 (the ablation
  without L_CM runs no teacher)
- Ψ̂ = softmax(logits)·E[:K] over the B·M student tokens of z_t: forward 2·B·M·K·D, backward 4·B·M·K·D
  (the logits' gradient and the table's): 6·B·M·K·D
- not counted (element-wise or gathers): the noise and DDIM teacher inputs, the cross-entropy of L0, the
  KL of L_CM, the optimizer and the EMA updates

    F_step = 3·(B + B0)·F_fwd + [β_CM > 0]·B·F_fwd + 6·B·M·K·D

i.e. 6·P_tok·(B + B0)·M for the student plus 2·P_tok·B·M for the teacher, plus the attention
(12·L·M²·W per student sequence, 4·L·M²·W per teacher one) and per-sequence terms above.
MFU = F_step / step time / the card's dense bf16 peak.
"""
from __future__ import annotations

import math
from typing import Optional

import torch.nn as nn

# Dense (no sparsity) bf16 tensor-core peak from NVIDIA's data sheets, FLOP/s.
H100_SXM_PEAK_BF16_FLOPS = 989.4e12
H100_PCIE_PEAK_BF16_FLOPS = 756.0e12
H200_PEAK_BF16_FLOPS = 989.4e12  # same SXM compute as H100, more and faster memory
A100_PEAK_BF16_FLOPS = 312.0e12
NVL_PEAK_BF16_FLOPS = 835.5e12  # H100 NVL and H200 NVL (PCIe cards, lower clocks): 1671 with sparsity


def peak_bf16_flops(device_name: str) -> Optional[float]:
    """The card's dense bf16 peak, or None for a card not in the table (MFU is then not reported)."""
    name = device_name.upper()
    if ("H100" in name or "H200" in name) and "NVL" in name:  # checked first: their names hold "H100"/"H200"
        return NVL_PEAK_BF16_FLOPS
    if "H200" in name:
        return H200_PEAK_BF16_FLOPS
    if "H100" in name:
        return H100_PCIE_PEAK_BF16_FLOPS if "PCIE" in name else H100_SXM_PEAK_BF16_FLOPS
    if "A100" in name:
        return A100_PEAK_BF16_FLOPS
    return None


def _weights(module: Optional[nn.Module]) -> int:
    if module is None:
        return 0
    return sum(m.weight.numel() for m in module.modules() if isinstance(m, (nn.Linear, nn.Embedding)))


def denoiser_weights(denoiser: nn.Module) -> tuple[int, int]:
    """(P_tok, P_seq): matmul weights applied per token and per sequence."""
    per_token = _weights(denoiser.in_proj) + _weights(denoiser.head)
    per_seq = _weights(denoiser.time_mlp) + _weights(denoiser.final_norm.to_ab)
    for block in denoiser.blocks:
        per_token += _weights(block.qkv) + _weights(block.proj) + _weights(block.mlp)
        per_seq += _weights(block.norm1.to_ab) + _weights(block.norm2.to_ab)
    # the class embedding is a lookup (no multiply-adds): left out
    return per_token, per_seq


def denoiser_forward_flops(denoiser: nn.Module, seq_len: int) -> float:
    """F_fwd for one sequence of ``seq_len`` tokens."""
    cfg = denoiser.cfg
    p_tok, p_seq = denoiser_weights(denoiser)
    return 2.0 * p_tok * seq_len + 4.0 * cfg.depth * seq_len**2 * cfg.width + 2.0 * p_seq


def l0_rows(batch: int, l0_fraction: float) -> int:
    """B0, the rows of the L0 input: as vqlcmd/diffusion/losses.py takes them."""
    return max(1, math.ceil(l0_fraction * batch))


def train_step_flops(denoiser: nn.Module, batch: int, seq_len: int, *, l0_fraction: float = 1.0,
                     teacher: bool = True) -> float:
    """F_step of one VQ-LCMD training step: student fwd+bwd on B + B0 rows, teacher fwd on B (when ``teacher``,
    i.e. β_CM > 0), Ψ̂ fwd+bwd."""
    cfg = denoiser.cfg
    f = denoiser_forward_flops(denoiser, seq_len)
    student = 3.0 * (batch + l0_rows(batch, l0_fraction)) * f
    return student + (batch * f if teacher else 0.0) + 6.0 * batch * seq_len * cfg.codebook_size * cfg.embed_dim
