"""The denoiser f_θ(z_t, t, y) -> logits: a bidirectional Transformer with AdaLN.

The model is only a denoiser (DiT habit): all diffusion math lives in
``vqlcmd.diffusion`` and takes the model as an argument. Architecture as in
docs/method.md §12: linear D -> width, fixed sinusoidal positions, a time
embedding (sinusoidal features -> MLP) plus a class embedding with a null row,
blocks whose two LayerNorms are AdaLN ``(1 + a) LN(h) + b``, attention dropout,
a final AdaLN and a linear head to K logits.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from .. import ops
from ..ops._checks import inputs_checked_upstream
from .attention import ATTENTION_BACKENDS, attention

ACTIVATIONS = ("gelu_tanh", "gelu")


NORM_IMPLS = ("torch", "apex")


@dataclass
class DenoiserConfig:
    codebook_size: int = 1024  # K: logits per token
    embed_dim: int = 256  # D: dimension of the token embeddings z lives in
    seq_len: int = 256  # M: tokens per image (16x16)
    num_classes: int = 0  # C; 0 = unconditional. Row C of the class table is the null class.
    width: int = 512
    depth: int = 15
    heads: int = 8
    mlp_ratio: float = 4.0
    attn_dropout: float = 0.1
    time_features: int = 256
    attention_backend: str = "auto"
    # "torch": nn.LayerNorm, run with the AdaLN modulation as one op (vqlcmd.ops.ada_layer_norm, a C++
    # kernel on CPU); "apex": NVIDIA apex's FusedLayerNorm (optional install, not on the package index)
    norm_impl: str = "torch"
    # MLP nonlinearity: "gelu_tanh" (DiT's choice; configs saved before this field existed used it) or
    # "gelu" (exact, erf). The paper does not say. On CPUs PyTorch's tanh form is ~2.5x slower than
    # its erf form (AVX2, 2.4M elements: 5.3 vs 2.0 ms forward, 4.8 vs 2.9 ms backward), so
    # "gelu_tanh" runs through vqlcmd.ops.gelu_tanh, whose CPU kernel is as fast as erf; on GPUs both
    # are one memory-bound pass.
    activation: str = "gelu_tanh"

    def __post_init__(self):
        # checked here, not in the first forward: a training run builds the model only after preparing its
        # data, and a shape mismatch there names no setting
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {sorted(ACTIVATIONS)}, got {self.activation!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}")
        if self.norm_impl not in NORM_IMPLS:
            raise ValueError(f"norm_impl must be one of {NORM_IMPLS}, got {self.norm_impl!r}")
        for name in ("codebook_size", "embed_dim", "seq_len", "width", "depth", "heads", "time_features"):
            if not (isinstance(getattr(self, name), int) and getattr(self, name) >= 1):
                raise ValueError(f"{name} must be an integer >= 1, got {getattr(self, name)!r}")
        if not (isinstance(self.num_classes, int) and self.num_classes >= 0):
            raise ValueError(f"num_classes must be an integer >= 0, got {self.num_classes!r}")
        if not self.mlp_ratio > 0:
            raise ValueError(f"mlp_ratio must be > 0, got {self.mlp_ratio!r}")
        if self.width % self.heads:
            raise ValueError(f"width {self.width} must be divisible by heads {self.heads}")
        for name in ("width", "time_features"):  # sinusoidal features come in cos/sin pairs
            if getattr(self, name) % 2:
                raise ValueError(f"{name} must be even, got {getattr(self, name)}")
        if not 0.0 <= self.attn_dropout < 1.0:
            raise ValueError(f"attn_dropout must be in [0, 1), got {self.attn_dropout}")

    def to_dict(self) -> dict:
        return asdict(self)


def sinusoidal_features(x: torch.Tensor, dim: int, max_period: float = 10000.0) -> torch.Tensor:
    """Transformer sinusoids of a scalar per row. x: (N,) -> (N, dim)."""
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, device=x.device, dtype=torch.float32) / half)
    args = x.float()[:, None] * freqs[None]  # (N, half)
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


def layer_norm(width: int, impl: str) -> nn.Module:
    if impl == "torch":
        return nn.LayerNorm(width, elementwise_affine=False)
    if impl == "apex":
        try:
            from apex.normalization import FusedLayerNorm
        except ImportError as exc:
            raise ImportError("norm_impl='apex' but NVIDIA apex is not installed (build it from source, "
                              "or use norm_impl='torch')") from exc
        return FusedLayerNorm(width, elementwise_affine=False)
    raise ValueError(f"norm_impl must be 'torch' or 'apex', got {impl!r}")


class AdaLayerNorm(nn.Module):
    """``(1 + a) LayerNorm(h) + b`` with (a, b) a linear map of the condition (zero-initialised)."""

    def __init__(self, width: int, cond_dim: int, norm_impl: str = "torch"):
        super().__init__()
        self.norm = layer_norm(width, norm_impl)
        self.to_ab = nn.Linear(cond_dim, 2 * width)
        nn.init.zeros_(self.to_ab.weight)
        nn.init.zeros_(self.to_ab.bias)

    def forward(self, h: torch.Tensor, cond: torch.Tensor, ab: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``ab``: ``to_ab(cond)`` computed already (the denoiser's one matmul for all its AdaLNs)."""
        a, b = (self.to_ab(cond) if ab is None else ab).chunk(2, dim=-1)  # (B, width) each
        if isinstance(self.norm, nn.LayerNorm):
            # the same math fused into one pass (a C++ kernel on CPU, where LayerNorm is slow)
            return ops.ada_layer_norm(h, a, b, eps=self.norm.eps)
        return (1 + a[:, None]) * self.norm(h) + b[:, None]


class GELU(nn.Module):
    """The MLP nonlinearity named by ``DenoiserConfig.activation`` (no parameters)."""

    def __init__(self, activation: str):
        super().__init__()
        self.activation = activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.gelu_tanh(x) if self.activation == "gelu_tanh" else F.gelu(x)

    def extra_repr(self) -> str:
        return self.activation


class Block(nn.Module):
    def __init__(self, cfg: DenoiserConfig):
        super().__init__()
        w = cfg.width
        self.heads = cfg.heads
        self.attn_dropout = cfg.attn_dropout
        self.attention_backend = cfg.attention_backend
        self.norm1 = AdaLayerNorm(w, w, cfg.norm_impl)
        self.qkv = nn.Linear(w, 3 * w)
        self.proj = nn.Linear(w, w)
        self.norm2 = AdaLayerNorm(w, w, cfg.norm_impl)
        hidden = int(cfg.mlp_ratio * w)
        self.mlp = nn.Sequential(nn.Linear(w, hidden), GELU(cfg.activation),
                                 nn.Linear(hidden, w))

    def forward(self, h: torch.Tensor, cond: torch.Tensor, ab1=None, ab2=None, seed=None) -> torch.Tensor:
        B, M, W = h.shape
        q, k, v = self.qkv(self.norm1(h, cond, ab1)).view(B, M, 3, self.heads, W // self.heads).permute(2, 0, 3, 1, 4)
        p = self.attn_dropout if self.training else 0.0
        a = attention(q, k, v, dropout_p=p, backend=self.attention_backend, seed=seed)  # (B, H, M, hd)
        h = h + self.proj(a.transpose(1, 2).reshape(B, M, W))
        return h + self.mlp(self.norm2(h, cond, ab2))  # (B, M, W)


class Denoiser(nn.Module):
    """f_θ(z, t, y): z (B, M, D) float, t (B,) in [0, 1], y (B,) long or None -> logits (B, M, K)."""

    def __init__(self, cfg: DenoiserConfig):
        super().__init__()
        self.cfg = cfg
        w = cfg.width
        self.in_proj = nn.Linear(cfg.embed_dim, w)
        self.register_buffer("pos", sinusoidal_features(torch.arange(cfg.seq_len), w), persistent=False)
        self.time_mlp = nn.Sequential(nn.Linear(cfg.time_features, w), nn.SiLU(), nn.Linear(w, w))
        self.class_emb = nn.Embedding(cfg.num_classes + 1, w) if cfg.num_classes > 0 else None
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.depth))
        self.final_norm = AdaLayerNorm(w, w, cfg.norm_impl)
        self.head = nn.Linear(w, cfg.codebook_size)

    @property
    def null_class(self) -> int:
        return self.cfg.num_classes

    def condition(self, t: torch.Tensor, y: Optional[torch.Tensor]) -> torch.Tensor:
        # t in [0, 1] scaled to [0, 1000] so the sinusoids resolve small steps (as DDPM-style models do)
        feats = sinusoidal_features(1000.0 * t, self.cfg.time_features)  # (B, F) float32
        cond = self.time_mlp(feats.to(self.time_mlp[0].weight.dtype))  # (B, W)
        if self.class_emb is not None:
            if y is None:
                y = torch.full_like(t, self.null_class, dtype=torch.long)
            cond = cond + self.class_emb(y)
        return F.silu(cond)

    def forward(self, z: torch.Tensor, t: torch.Tensor, y: Optional[torch.Tensor] = None, *,
                dropout_seed: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``dropout_seed``: a one-element int64 tensor that keys the attention dropout's masks where the attention
        draws its own (the CPU kernel: ``vqlcmd.ops.short_attention``), block i's with ``seed + i``; drawn with a
        loss's other random numbers, it makes a compiled step drop what the eager one drops. Without it the
        attention draws from the global generator. Other attention paths (SDPA's) ignore it."""
        B, M, D = z.shape
        if D != self.cfg.embed_dim or M > self.cfg.seq_len:
            raise ValueError(
                f"z must be (B, M<={self.cfg.seq_len}, {self.cfg.embed_dim}), got {tuple(z.shape)}"
            )
        if t.shape != (B,):
            raise ValueError(f"t must be (B,) = ({B},), got {tuple(t.shape)}")
        if y is not None:
            if self.class_emb is None:
                raise ValueError("this denoiser is unconditional (num_classes = 0) but was given class labels y")
            if y.shape != (B,):
                raise ValueError(f"y must be (B,) = ({B},), got {tuple(y.shape)}")
            # a host sync and a graph break, so not while compiling: the engine and the pipeline check the
            # labels where they come in (shard headers, the sampler's class_labels)
            if B and not torch.compiler.is_compiling() and not inputs_checked_upstream() \
                    and (y.min() < 0 or y.max() > self.null_class):
                raise IndexError(f"class labels must be in [0, {self.null_class}] ({self.null_class} = null)")
        cond = self.condition(t, y).to(z.dtype)  # (B, W)
        h = self.in_proj(z) + self.pos[:M].to(z.dtype)  # (B, M, W)
        seeds = [None] * len(self.blocks)
        if dropout_seed is not None and self.training and self.cfg.attn_dropout > 0:
            # the low 62 bits, so that adding the block's index cannot overflow int64; one op, then views
            keys = (dropout_seed.reshape(1) & (2 ** 62 - 1)) + torch.arange(len(self.blocks), device=z.device)
            seeds = list(keys.split(1))
        if not torch.compiler.is_compiling():
            for block, seed in zip(self.blocks, seeds):
                h = block(h, cond, seed=seed)
            return self.head(self.final_norm(h, cond))  # (B, M, K)
        # compiled: the 2·depth + 1 AdaLN maps all read cond, so they are one matmul of the stacked weights (the
        # stacking is one copy kernel in the graph, its backward a split): 2·depth fewer matmul launches in the
        # forward and as many in the backward. Eager keeps one per map: the same math, rounded as before
        norms = [n for block in self.blocks for n in (block.norm1, block.norm2)] + [self.final_norm]
        ab = F.linear(cond, torch.cat([n.to_ab.weight for n in norms]), torch.cat([n.to_ab.bias for n in norms]))
        ab = ab.split(2 * self.cfg.width, dim=-1)
        for i, block in enumerate(self.blocks):
            h = block(h, cond, ab[2 * i], ab[2 * i + 1], seed=seeds[i])
        return self.head(self.final_norm(h, cond, ab[-1]))  # (B, M, K)


def num_parameters(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())
