"""A small VQModel the project trains itself (the embedded digits data set's tokenizer).

Default: 3 down blocks of 16/32/64 channels, 128 codes of 8 dims, 32x32 -> 8x8 tokens,
~0.68M parameters. The quick start trains it to PSNR 33.7 dB with 124 of 128 codes in use
(docs/archive/quickstart.md); codes that go unused are re-initialised from encoder outputs early in
training, which is what keeps most of the codebook alive.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F


def small_vqmodel(channels: int = 1, image_size: int = 32, block_channels=(16, 32, 64), codebook_size: int = 128,
                  code_dim: int = 8, layers_per_block: int = 1, groups: int = 8):
    from diffusers import VQModel

    n = len(block_channels)
    return VQModel(in_channels=channels, out_channels=channels, down_block_types=("DownEncoderBlock2D",) * n,
                   up_block_types=("UpDecoderBlock2D",) * n, block_out_channels=tuple(block_channels),
                   layers_per_block=layers_per_block, latent_channels=code_dim, num_vq_embeddings=codebook_size,
                   vq_embed_dim=code_dim, norm_num_groups=groups, sample_size=image_size)


@dataclass
class TrainConfig:
    steps: int = 1000
    batch_size: int = 64
    lr: float = 2e-3
    final_lr: float = 1e-4  # cosine decay: the last steps polish the decoder
    warmup: int = 20
    reinit_every: int = 25  # dead-code check period, in steps
    reinit_until: float = 0.6  # fraction of training during which dead codes are re-initialised
    seed: int = 0
    threads: int | None = None


def psnr(a: torch.Tensor, b: torch.Tensor) -> float:
    """PSNR in dB of images in [-1, 1] (peak-to-peak 2), over the whole set."""
    mse = F.mse_loss(a.float(), b.float()).item()
    return float("inf") if mse == 0 else 10 * math.log10(4.0 / mse)


@torch.no_grad()
def evaluate(model, images: torch.Tensor, batch_size: int = 256) -> dict:
    """Reconstruction PSNR through the token path (encode -> ids -> decode) and codebook usage.
    ``model`` is left as it came: its modules' train/eval modes and its parameters' requires_grad."""
    from .vqmodel import VQModelTokenizer

    modes = [(m, m.training) for m in model.modules()]
    grads = [(p, p.requires_grad) for p in model.parameters()]
    try:
        tok = VQModelTokenizer(model, identifier="eval")  # freezes and evals the model it wraps
        recon, used = [], torch.zeros(tok.codebook_size, dtype=torch.bool)
        for i in range(0, len(images), batch_size):
            ids = tok.encode(images[i:i + batch_size])
            used[ids.flatten().cpu()] = True
            recon.append(tok.decode(ids).cpu())
    finally:  # the caller may go on training it
        for m, training in modes:
            m.training = training
        for p, requires_grad in grads:
            p.requires_grad_(requires_grad)
    return {"psnr": psnr(torch.cat(recon), images), "codebook_usage": int(used.sum()),
            "codebook_size": tok.codebook_size}


def train_vqmodel(model, images: torch.Tensor, config: TrainConfig = TrainConfig(), *, progress: bool = True,
                  log=print) -> dict:
    """Trains ``model`` in place on ``images`` (N, C, H, W) in [-1, 1]; returns the final metrics."""
    if config.threads:
        torch.set_num_threads(config.threads)
    g = torch.Generator().manual_seed(config.seed)
    torch.manual_seed(config.seed)
    model.train()
    opt = torch.optim.Adam(model.parameters(), lr=config.lr)
    codebook = model.quantize.embedding.weight
    k = codebook.shape[0]
    hits = torch.zeros(k)
    n = len(images)

    def lr_at(step):
        if step < config.warmup:
            return config.lr * (step + 1) / config.warmup
        p = (step - config.warmup) / max(1, config.steps - config.warmup)
        return config.final_lr + 0.5 * (config.lr - config.final_lr) * (1 + math.cos(math.pi * p))

    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=config.steps, desc="tokenizer", unit="step")
    t0 = time.perf_counter()
    for step in range(config.steps):
        x = images[torch.randint(0, n, (config.batch_size,), generator=g)]
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        z = model.encode(x).latents
        quant, commit, (_, _, ids) = model.quantize(z)
        recon = model.decoder(model.post_quant_conv(quant))
        loss = F.mse_loss(recon, x) + commit
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        hits += torch.bincount(ids.flatten(), minlength=k).float()
        if (step + 1) % config.reinit_every == 0:
            if step < config.reinit_until * config.steps:
                _reinit_dead_codes(codebook, hits, z.detach(), g)
            hits.zero_()
        if bar is not None:
            bar.update(1)
            if step % 20 == 0:
                bar.set_postfix(loss=f"{loss.item():.4f}")
    if bar is not None:
        bar.close()
    metrics = evaluate(model, images)
    metrics["train_seconds"] = time.perf_counter() - t0
    metrics["steps"] = config.steps
    return metrics


@torch.no_grad()
def _reinit_dead_codes(codebook: torch.Tensor, hits: torch.Tensor, latents: torch.Tensor, g) -> int:
    """Moves codes no latent chose in the last window onto random encoder outputs (plus a little noise),
    so that they start competing for data instead of staying dead forever."""
    dead = (hits == 0).nonzero().flatten()
    if len(dead) == 0:
        return 0
    z = latents.permute(0, 2, 3, 1).reshape(-1, codebook.shape[1])
    pick = torch.randint(0, len(z), (len(dead),), generator=g)
    noise = torch.randn(len(dead), codebook.shape[1], generator=g) * 0.01 * z.std()
    codebook[dead] = z[pick] + noise
    return len(dead)
