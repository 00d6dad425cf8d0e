"""The VQ-LCMD training objective (docs/method.md §7-8, eq. 10-15; paper Algorithm 1).

    L = L0 + β_DM · L_DM + β_CM · L_CM

Takes the networks as arguments (the model is a pure denoiser). Every ablation
switch of the paper is a field of :class:`LossConfig` (defined with the experiment's schema,
``vqlcmd.engine.config``).
"""
from __future__ import annotations

import contextlib
import math
from typing import Optional

import torch
import torch.nn.functional as F

from .. import ops
from ..engine.config import DROP_STRATEGIES, WEIGHTINGS, LossConfig  # noqa: F401  (the schema; re-exported)
from ..network import VQLCMDNetwork
from ..ops.reference import philox_seed
from ..schedule import ShiftedCosineSchedule

# the vqlcmd.ops this loss calls with its backend argument (the run's train.backend must serve each:
# engine.build.check_op_backend); tests/test_losses.py holds the list to the calls below
LOSS_OPS = ("noise_draw", "noise_embeddings", "ddim_teacher_step", "softmax_embedding_average", "categorical_kl")


def _rand(shape, device, generator) -> torch.Tensor:
    return torch.rand(shape, device=device, generator=generator)


def sample_drop_mask(cfg: LossConfig, t: torch.Tensor, seq_len: int, generator=None) -> Optional[torch.Tensor]:
    """Random dropping mask (B, M), True = replaced by [mask] (paper §4.4 and appendix strategies)."""
    B = t.shape[0]
    if cfg.drop_strategy == "none" or (cfg.drop_strategy == "fixed" and cfg.p_drop == 0.0):
        return None
    if cfg.drop_strategy == "fixed":
        ratio = torch.full((B,), cfg.p_drop, device=t.device)
    elif cfg.drop_strategy == "linear":
        ratio = t
    else:  # random_ratio
        ratio = _rand((B,), t.device, generator)
    return _rand((B, seq_len), t.device, generator) < ratio[:, None]


def drop_labels(labels: Optional[torch.Tensor], null_class: int, p: float, generator=None):
    if labels is None or p == 0.0:
        return labels
    drop = _rand(labels.shape, labels.device, generator) < p
    return torch.where(drop, torch.full_like(labels, null_class), labels)


def _teacher_autocast(student_dtype: torch.dtype, teacher: VQLCMDNetwork, device: torch.device):
    """Autocast the fp32 EMA teacher to the student's 16-bit dtype, or nothing.

    Under bf16 training DeepSpeed casts the student to bf16 but the EMA teacher keeps fp32 weights
    (an EMA in bf16 would lose updates smaller than its rounding). Run as fp32 matmuls, its one
    forward cost more than the student's bf16 forward and backward on a GPU (fp32 runs at a tenth of
    the bf16 rate or less), and 2004 against 429 ms per forward of ffhq-56m on the AVX512-BF16 CPU.
    Autocast keeps the weights fp32 and multiplies in the student's precision.
    """
    params = next(teacher.parameters(), None)
    if student_dtype in (torch.bfloat16, torch.float16) and params is not None and params.dtype == torch.float32:
        return torch.autocast(device.type, dtype=student_dtype)
    # nothing, not a disabled autocast: that would switch off an autocast the caller runs the step under
    # (the benchmarks' fp32 weights under bf16 autocast)
    return contextlib.nullcontext()


def draw_loss_randoms(net: VQLCMDNetwork, tokens: torch.Tensor, labels: Optional[torch.Tensor], cfg: LossConfig, *,
                      generator: Optional[torch.Generator] = None, backend: str = "auto") -> dict:
    """Every random number one loss evaluation takes from ``generator``, drawn now, in the order
    :func:`training_losses` draws them: the uniforms of t, s, the dropping mask and the label dropping, then
    the noise of z_t and of z_0 (as :func:`vqlcmd.ops.noise_draw` gives them for the backend), and the key of
    the student's attention dropout (training with ``attn_dropout > 0``). With these,
    :func:`training_losses_drawn` draws nothing, so it can run as one compiled graph (Dynamo cannot trace a
    generator) with the default step's streams."""
    B, M = tokens.shape
    device = tokens.device
    draws = {"t": _rand((B,), device, generator), "s": _rand((B,), device, generator)}  # s = t · U(0, 1)
    if not (cfg.drop_strategy == "none" or (cfg.drop_strategy == "fixed" and cfg.p_drop == 0.0)):
        if cfg.drop_strategy == "random_ratio":
            draws["drop_ratio"] = _rand((B,), device, generator)
        draws["drop"] = _rand((B, M), device, generator)
    if labels is not None and cfg.label_drop != 0.0:
        draws["label_drop"] = _rand(labels.shape, labels.device, generator)
    weight = net.embedding.weight  # what the table's dtype and device resolve the noise backend by
    draws["noise_t"] = ops.noise_draw(tokens, weight, generator=generator, backend=backend)
    draws["noise_0"] = ops.noise_draw(tokens[:_l0_rows(cfg, B)], weight, generator=generator, backend=backend)
    if net.denoiser.training and net.denoiser.cfg.attn_dropout > 0:  # the key of the student's attention dropout
        draws["dropout_seed"] = philox_seed(generator, device)
    return draws


def _l0_rows(cfg: LossConfig, B: int) -> int:
    return max(1, math.ceil(cfg.l0_fraction * B))


def training_losses(
    net: VQLCMDNetwork,
    teacher: VQLCMDNetwork,
    schedule: ShiftedCosineSchedule,
    tokens: torch.Tensor,
    labels: Optional[torch.Tensor],
    cfg: LossConfig,
    *,
    generator: Optional[torch.Generator] = None,
    backend: str = "auto",
) -> dict[str, torch.Tensor]:
    """One VQ-LCMD loss evaluation. tokens (B, M) int64, labels (B,) or None.

    Returns ``loss`` (differentiable) and the detached terms ``l0``, ``l_dm`` and (when β_CM > 0)
    ``l_cm``, each summed over tokens (L_DM also over D) and averaged over the batch.
    ``teacher`` is the EMA copy (θ̄, Ē); it only runs under no_grad.
    """
    draws = draw_loss_randoms(net, tokens, labels, cfg, generator=generator, backend=backend)
    return training_losses_drawn(net, teacher, schedule, tokens, labels, cfg, draws, backend=backend)


def training_losses_drawn(net: VQLCMDNetwork, teacher: VQLCMDNetwork, schedule: ShiftedCosineSchedule,
                          tokens: torch.Tensor, labels: Optional[torch.Tensor], cfg: LossConfig, draws: dict, *,
                          backend: str = "auto") -> dict[str, torch.Tensor]:
    """:func:`training_losses` given its random numbers (:func:`draw_loss_randoms`): no draws, no host reads."""
    B, M = tokens.shape
    device = tokens.device
    K = net.embedding.codebook_size
    table = net.embedding.table()  # (K+1, D), row K = [mask]
    tokens = tokens.long()

    # 1. times, dropping, label dropping
    t = draws["t"]
    s = t * draws["s"]  # s ~ U(0, t)
    alpha_t, sigma_t = schedule.alpha_sigma(t)
    alpha_s, sigma_s = schedule.alpha_sigma(s)
    drop_mask = None
    if "drop" in draws:
        if cfg.drop_strategy == "fixed":
            ratio = torch.full((B,), cfg.p_drop, device=device)
        else:  # "linear": the ratio is t; "random_ratio": a draw of its own
            ratio = draws.get("drop_ratio", t)
        drop_mask = draws["drop"] < ratio[:, None]
    y = labels
    if "label_drop" in draws:
        y = torch.where(draws["label_drop"] < cfg.label_drop, torch.full_like(labels, net.denoiser.null_class), labels)

    # 2. student input z_t = α_t E[x'] + σ_t ε
    z_t = ops.noise_embeddings(tokens, table, alpha_t, sigma_t, drop_mask=drop_mask, mask_index=K, backend=backend,
                               **draws["noise_t"])  # (B, M, D)
    # L0 input: z_0 ~ q(z_0 | x) at t_min for the first B0 images, batched with z_t into one
    # student forward
    B0 = _l0_rows(cfg, B)
    tokens_0 = tokens[:B0]
    t0 = torch.zeros_like(t[:B0])
    alpha_0, sigma_0 = schedule.alpha_sigma(t0)
    z_0 = ops.noise_embeddings(tokens_0, table, alpha_0, sigma_0,
                               drop_mask=drop_mask[:B0] if cfg.drop_in_l0 and drop_mask is not None else None,
                               mask_index=K, backend=backend, **draws["noise_0"])
    y2 = None if y is None else torch.cat([y, y[:B0]])
    logits = net.denoiser(torch.cat([z_t, z_0]), torch.cat([t, t0]), y2,
                          dropout_seed=draws.get("dropout_seed")).float()  # (B + B0, M, K)
    logits_t, logits_0 = logits[:B], logits[B:]

    # 3-4. teacher: one DDIM step with the EMA table, then the EMA denoiser, no gradient; skipped
    # when L_CM is switched off (the ablation), since nothing else reads it
    teacher_logits = None
    if cfg.beta_cm > 0:
        with torch.no_grad(), _teacher_autocast(table.dtype, teacher, device):
            teacher_table = teacher.embedding.table()
            z_s = ops.ddim_teacher_step(tokens, teacher_table, z_t.detach(), alpha_t, sigma_t, alpha_s, sigma_s,
                                        backend=backend)
            teacher_dtype = teacher_table.dtype  # the EMA teacher's weights stay float32 under bf16 training
            teacher_logits = teacher.denoiser(z_s.to(teacher_dtype), s, y).float()  # (B, M, K)

    # 5-6. losses
    target = table[tokens]  # (B, M, D): clean, undropped E[x]; gradient reaches E through it too
    psi = ops.softmax_embedding_average(logits_t, table[:K], backend=backend)  # Ψ̂ (B, M, D)
    sq_err = (target.float() - psi.float()).pow(2).sum(dim=(1, 2))  # (B,)
    if cfg.weighting == "lcmd":
        l_dm = sq_err.mean()
        dm_term = cfg.beta_dm * l_dm
    else:
        # L_∞ = -½ E_t[SNR'(t) ‖E[x] − Ψ̂‖²], SNR' = SNR·λ'(t)  (paper eq. vlb)
        lam = schedule.log_snr(t)
        weight = -0.5 * torch.exp(lam) * schedule.dlog_snr_dt(t)
        l_dm = sq_err.mean()
        dm_term = (weight * sq_err).mean()
    l0 = F.cross_entropy(logits_0.reshape(-1, K), tokens_0.reshape(-1), reduction="sum") / B0
    loss = l0 + dm_term
    out = {"loss": loss, "l0": l0.detach(), "l_dm": l_dm.detach()}
    if cfg.beta_cm > 0:  # without it no l_cm is reported: a logged 0 read as a perfectly consistent model
        l_cm = ops.categorical_kl(teacher_logits, logits_t, backend=backend).sum() / B
        out["loss"] = loss + cfg.beta_cm * l_cm
        out["l_cm"] = l_cm.detach()
    if cfg.weighting == "vlb":  # the weighted term the loss is made of (≈1e6-1e9: the weight at t_min is ~1e11)
        out["l_vlb"] = dm_term.detach()
    return out
