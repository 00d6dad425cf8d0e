"""One full VQ-LCMD training step: losses, backward, clipping, AdamW, teacher EMA update.

``reference`` (every fused op on its reference backend, attention on the math
path) is the baseline; ``auto`` lets the op dispatcher and the attention function
pick. The optimizer (torch's fused AdamW) and the rest of the step are the same in
both, so the speed-up is that of the ops and attention alone. On GPU the step
runs under bf16 autocast with fp32 weights, and the figures include the model
FLOPs utilisation with the FLOP count it assumes (benchmarks/flops.py derives it).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from benchmarks import flops
from benchmarks.harness import Context, run_case
from vqlcmd.diffusion import LossConfig, training_losses
from vqlcmd.ema import EMA
from vqlcmd.model import preset_config
from vqlcmd.network import VQLCMDNetwork
from vqlcmd.schedule import ShiftedCosineSchedule

STAGE = "train_step"
BASELINE = "reference"
TEACHER_DECAY = 0.99  # docs/method.md eq. 16
GRAD_CLIP = 1.0

# backend name -> (fused-op backend, attention backend)
BACKENDS = {"reference": ("reference", "math"), "auto": ("auto", "auto")}


@dataclass
class Training:
    """Everything one step needs, built the same way for every backend (same seed, same data)."""

    net: VQLCMDNetwork
    teacher: EMA
    schedule: ShiftedCosineSchedule
    loss_cfg: LossConfig
    tokens: torch.Tensor  # (B, M)
    labels: Optional[torch.Tensor]  # (B,)
    generator: torch.Generator
    ops_backend: str
    amp_dtype: Optional[torch.dtype]

    def losses(self, net: Optional[torch.nn.Module] = None) -> dict:
        with torch.autocast(self.tokens.device.type, dtype=self.amp_dtype or torch.bfloat16,
                            enabled=self.amp_dtype is not None):
            return training_losses(net or self.net, self.teacher.module, self.schedule, self.tokens, self.labels,
                                   self.loss_cfg, generator=self.generator, backend=self.ops_backend)


def build_training(preset: str, batch: int, device: torch.device, *, ops_backend: str, attention_backend: str,
                   amp_dtype: Optional[torch.dtype] = None) -> Training:
    torch.manual_seed(0)
    cfg = preset_config(preset, attention_backend=attention_backend)
    net = VQLCMDNetwork(cfg).to(device)
    gen = torch.Generator(device=device).manual_seed(0)
    tokens = torch.randint(0, cfg.codebook_size, (batch, cfg.seq_len), device=device, generator=gen)
    labels = (torch.randint(0, cfg.num_classes, (batch,), device=device, generator=gen)
              if cfg.num_classes else None)
    return Training(net, EMA(net, TEACHER_DECAY), ShiftedCosineSchedule(), LossConfig(), tokens, labels, gen,
                    ops_backend, amp_dtype)


def step_figures(ctx: Context, tr: Training, median_ms: float) -> dict:
    """images/s, tokens/s, and the FLOP rate with the FLOP count it assumes (MFU on GPUs with a known peak)."""
    B, M = tr.tokens.shape
    s = median_ms / 1e3
    step_flops = flops.train_step_flops(tr.net.denoiser, B, M, l0_fraction=tr.loss_cfg.l0_fraction,
                                        teacher=tr.loss_cfg.beta_cm > 0)
    figs = {"images/s": B / s, "tokens/s": B * M / s}
    if ctx.is_cuda:
        figs.update({"TFLOP/step": step_flops / 1e12, "TFLOP/s": step_flops / s / 1e12})
        peak = flops.peak_bf16_flops(torch.cuda.get_device_name(ctx.device))
        if peak:
            figs["MFU%"] = 100.0 * step_flops / s / peak
            figs["peak TFLOP/s"] = peak / 1e12
    else:
        figs.update({"GFLOP/step": step_flops / 1e9, "GFLOP/s": step_flops / s / 1e9})
    return figs


# per-GPU batch sweep of the paper presets on CUDA: the paper's 32 per GPU, and up to 256 (MFU grows with
# the batch until the GPU is full); the reference baseline is timed at the first size only
CUDA_SWEEP = {"ffhq-56m": (32, 64, 128), "imagenet-246m": (32, 64, 128, 256)}


def _cases(ctx: Context) -> list[tuple[str, tuple, dict]]:
    if ctx.quick:
        return [("tiny", (4, 8), {})]
    if ctx.is_cuda:
        return [("digits-1m", (256,), {})] + [(preset, sizes, {}) for preset, sizes in CUDA_SWEEP.items()]
    return [("digits-1m", (64,), dict(warmup=1, reps=5))]


def run(ctx: Context) -> list:
    out: list = []
    amp = torch.bfloat16 if ctx.is_cuda else None
    runs = [(preset, B, reps, B == sizes[0]) for preset, sizes, reps in _cases(ctx) for B in sizes]
    for preset, B, reps, first in runs:
        for name, (ops_backend, attention_backend) in BACKENDS.items():
            if not ctx.wants(name, baseline=name == BASELINE) or (name == BASELINE and not first):
                continue
            tr = build_training(preset, B, ctx.device, ops_backend=ops_backend, attention_backend=attention_backend,
                                amp_dtype=amp)
            opt = torch.optim.AdamW(tr.net.parameters(), lr=1e-4, weight_decay=0.01, fused=True)

            def step(tr=tr, opt=opt):
                opt.zero_grad(set_to_none=True)
                tr.losses()["loss"].backward()
                torch.nn.utils.clip_grad_norm_(tr.net.parameters(), GRAD_CLIP)
                opt.step()
                tr.teacher.update(tr.net)

            run_case(ctx, out, stage=STAGE, case="loss+bwd+adamw+ema", backend=name,
                     shape=f"{preset} B{B} M{tr.tokens.shape[1]}", dtype="bf16-autocast" if amp else "float32",
                     fn=step, baseline=BASELINE, extra=lambda t, tr=tr: step_figures(ctx, tr, t.median_ms), **reps)
            del tr, opt
    return out
