"""Sampling throughput: ancestral and DDIM, 5 and 50 steps, classifier-free guidance ω = 1.

Each case draws one batch of token grids with ``vqlcmd.samplers.sample_tokens``
(guided: conditional and unconditional logits in one batched forward per step, so a
step costs a forward on 2B sequences). ``reference`` runs the fused ops on their
reference backend and attention on the math path (the baseline); ``auto`` lets
both dispatchers pick. The VQ decoder is not included: images/s counts token
grids. CPU uses the ``digits-1m`` preset in fp32, GPU ``imagenet-246m`` under bf16 autocast.
"""
from __future__ import annotations

import torch

from benchmarks.harness import Context, run_case
from vqlcmd.embedding import TokenEmbedding
from vqlcmd.model import build_denoiser
from vqlcmd.samplers import SAMPLERS, sample_tokens
from vqlcmd.schedule import ShiftedCosineSchedule

STAGE = "sampling"
BASELINE = "reference"
GUIDANCE = 1.0  # the paper's best ImageNet FID
BACKENDS = {"reference": ("reference", "math"), "auto": ("auto", "auto")}


def _setting(ctx: Context) -> tuple[str, int, tuple[int, ...]]:
    """(preset, batch, step counts)."""
    if ctx.quick:
        return "tiny", 2, (5,)
    if ctx.is_cuda:
        return "imagenet-246m", 64, (5, 50)
    return "digits-1m", 4, (5, 50)


def run(ctx: Context) -> list:
    out: list = []
    preset, B, step_counts = _setting(ctx)
    torch.manual_seed(0)
    model = build_denoiser(preset).to(ctx.device).eval()
    cfg = model.cfg
    table = TokenEmbedding(cfg.codebook_size, cfg.embed_dim).weight.detach().to(ctx.device)
    schedule = ShiftedCosineSchedule()
    dtype_name = "bf16-autocast" if ctx.is_cuda else "float32"
    labels = torch.arange(B, device=ctx.device) % cfg.num_classes
    for name, (ops_backend, attention_backend) in BACKENDS.items():
        if not ctx.wants(name, baseline=name == BASELINE):
            continue
        for block in model.blocks:
            block.attention_backend = attention_backend

        def denoiser(z, t, y):
            with torch.autocast(ctx.device.type, dtype=torch.bfloat16, enabled=ctx.is_cuda):
                return model(z, t, y)

        denoiser.cfg = cfg  # sample_tokens reads the sizes from .cfg
        for sampler in SAMPLERS:
            for n in step_counts:
                gen = torch.Generator(device=ctx.device)

                def fn(sampler=sampler, n=n, gen=gen):
                    gen.manual_seed(0)
                    return sample_tokens(denoiser, table, schedule, class_labels=labels, num_steps=n,
                                         sampler=sampler, guidance_scale=GUIDANCE, generator=gen, backend=ops_backend)

                # the 50-step cases take seconds per rep on CPU: fewer repetitions there
                reps = dict(warmup=1, reps=3) if n >= 50 and not ctx.is_cuda else dict(warmup=2, reps=5)
                run_case(ctx, out, stage=STAGE, case=f"{sampler} {n} steps w={GUIDANCE:g}", backend=name,
                         shape=f"{preset} B{B} M{cfg.seq_len}", dtype=dtype_name, fn=fn, baseline=BASELINE,
                         extra=lambda t, n=n: {"images/s": B / (t.median_ms / 1e3),
                                               "ms/step": t.median_ms / (n + 1)}, **reps)
    return out
