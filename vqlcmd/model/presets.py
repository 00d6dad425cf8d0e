"""Size presets: one-line factories (DiT habit). Paper sizes from docs/method.md §12."""
from __future__ import annotations

from .denoiser import Denoiser, DenoiserConfig

PAPER_PARAMETERS = {"ffhq-56m": 56e6, "imagenet-246m": 246e6}

PRESETS = {
    # paper, unconditional (FFHQ / LSUN): 15 layers, 8 heads, width 512
    "ffhq-56m": lambda **kw: DenoiserConfig(**{**dict(width=512, depth=15, heads=8, num_classes=0), **kw}),
    # paper, ImageNet class-conditional: 24 layers, 16 heads, width 768
    "imagenet-246m": lambda **kw: DenoiserConfig(**{**dict(width=768, depth=24, heads=16, num_classes=1000), **kw}),
    # embedded digits data set (~1M parameters: the quick start trains it in minutes on a 2-core CPU). No
    # attention dropout: on a CPU it forces the unfused attention path plus a Bernoulli draw per score, ~10% of a
    # step, and it did not change the quick start's sample accuracy (97.8% either way, 1300 steps). GELU in its
    # tanh form, though the erf form makes a CPU step 6% shorter: one quick-start run with it scored 94.6% against
    # 97.8/98.8/99.4% with tanh, too few runs to tell noise from effect, so the tested recipe stays.
    "digits-1m": lambda **kw: DenoiserConfig(**{**dict(width=128, depth=4, heads=4, codebook_size=128, embed_dim=32,
                                                        seq_len=64, num_classes=10, attn_dropout=0.0), **kw}),
    # unit tests
    "tiny": lambda **kw: DenoiserConfig(**{**dict(width=32, depth=2, heads=2, codebook_size=16, embed_dim=8,
                                                   seq_len=16, num_classes=4, time_features=32), **kw}),
}


def preset_config(name: str, **overrides) -> DenoiserConfig:
    if name not in PRESETS:
        raise KeyError(f"unknown denoiser preset {name!r}; known presets: {sorted(PRESETS)}")
    return PRESETS[name](**overrides)


def build_denoiser(name: str, **overrides) -> Denoiser:
    return Denoiser(preset_config(name, **overrides))
