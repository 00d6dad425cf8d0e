"""Reference implementations: plain PyTorch, float32 math, the source of truth.

Every other backend is tested against these. Inputs are validated by the public
functions in ``vqlcmd.ops`` before any backend runs.
"""
from __future__ import annotations

import functools
import math
from typing import Optional

import torch
import torch.nn.functional as F


def math_dtype(*xs: torch.Tensor) -> torch.dtype:
    """float32 math for fp32/bf16/fp16 inputs; float64 stays float64 (gradcheck)."""
    return torch.float64 if any(x.dtype == torch.float64 for x in xs) else torch.float32


def float32_math(fn):
    """Runs ``fn`` with autocast off on its first tensor's device: a matmul under an enclosing bf16/fp16
    autocast (the 16-bit pipeline's, a benchmark's) ran in 16 bits, while these ops promise float32 math,
    as the compiled and Triton kernels do whatever the autocast state (7e-3 error against 1e-6)."""
    @functools.wraps(fn)
    def wrapped(x: torch.Tensor, *args, **kwargs):
        device_type = x.device.type
        if device_type in ("cpu", "cuda") and torch.is_autocast_enabled(device_type):
            with torch.autocast(device_type, enabled=False):
                return fn(x, *args, **kwargs)
        return fn(x, *args, **kwargs)
    return wrapped


def _per_batch(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return x.to(dtype)[:, None, None]  # (B, 1, 1)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


def ada_layer_norm(h: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, eps: float) -> torch.Tensor:
    n = F.layer_norm(h, (h.shape[-1],), eps=eps)  # (B, M, W)
    # h's dtype, as LayerNorm's and the fused kernel's output: type promotion gave float32 for bf16 h with
    # float32 modulation, so the backends disagreed
    return ((1 + scale[:, None]) * n + shift[:, None]).to(h.dtype)


def philox_seed(generator: Optional[torch.Generator], device: torch.device) -> torch.Tensor:
    """A fresh 64-bit key for an in-kernel Philox stream, drawn by the torch generator into a one-element
    tensor on ``device`` that the kernel reads (the counter starts at 0).

    Drawn on the device rather than read from the generator on the host, so that a CUDA graph
    captures the draw itself: each replay gets a new key from the generator's graph-safe state,
    where a host-side (seed, offset) pair would be frozen into the graph at capture (PyTorch forbids
    reading a CUDA generator's offset while capturing for that reason). A seeded generator
    reproduces; successive calls differ.
    """
    return torch.randint(-2**63, 2**63 - 1, (1,), generator=generator, dtype=torch.int64, device=device)


_PHILOX_M = (0xD2511F53, 0xCD9E8D57)
_PHILOX_W = (0x9E3779B9, 0xBB67AE85)
_LOW32 = 0xFFFFFFFF


def _mulhilo32(m: int, x: torch.Tensor) -> tuple:
    """(low, high) 32-bit words of m · x for words x held in int64, without overflowing int64: m in 16-bit
    halves, each partial product below 2^48."""
    low_part, high_part = x * (m & 0xFFFF), x * (m >> 16)
    low = (((high_part & 0xFFFF) << 16) + low_part) & _LOW32
    high = (high_part + (low_part >> 16)) >> 16
    return low, high


def philox_words(seed: torch.Tensor, count: int) -> torch.Tensor:
    """Words 0 .. count-1 of the Philox4x32-10 stream keyed by ``seed`` (counter from 0; element n is word
    n % 4 of block n / 4), as int64 in [0, 2^32): the C++ kernels' stream (csrc/common/philox.h), written with
    tensor ops so that it runs on any device without reading the seed back."""
    blocks = torch.arange((count + 3) // 4, dtype=torch.int64, device=seed.device)
    key = seed.reshape(()).to(torch.int64)
    k0, k1 = key & _LOW32, (key >> 32) & _LOW32
    c0, c1 = blocks & _LOW32, blocks >> 32
    c2 = c3 = torch.zeros_like(blocks)
    for round_ in range(10):
        if round_ > 0:
            k0, k1 = (k0 + _PHILOX_W[0]) & _LOW32, (k1 + _PHILOX_W[1]) & _LOW32
        lo0, hi0 = _mulhilo32(_PHILOX_M[0], c0)
        lo1, hi1 = _mulhilo32(_PHILOX_M[1], c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return torch.stack((c0, c1, c2, c3), dim=1).reshape(-1)[:count]


def dropout_keep(seed: torch.Tensor, shape: tuple, dropout_p: float) -> torch.Tensor:
    """The keep mask of dropout with probability ``dropout_p`` over a tensor of ``shape`` (row-major element
    n takes stream word n): kept where the word's top 24 bits, a uniform in [0, 1) on a 2^-24 grid, are at least
    p, compared in integers (p rounded up to the grid: csrc/common/philox.h, dropout_threshold)."""
    threshold = math.ceil(dropout_p * 2 ** 24)
    return (philox_words(seed, math.prod(shape)) >> 8).ge(threshold).reshape(shape)


@float32_math
def short_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0,
                    seed: Optional[torch.Tensor] = None) -> torch.Tensor:
    """softmax(q kᵀ / √d) v, float32 math; q, k, v (B, H, M, hd). Dropout: P ∘ Z / (1 − p), Z the
    ``dropout_keep`` mask of ``seed`` over the (B, H, M, M) probabilities."""
    dt = math_dtype(q, k, v)
    scores = q.to(dt) @ k.to(dt).transpose(-2, -1) / q.shape[-1] ** 0.5  # (B, H, M, M)
    probs = torch.softmax(scores, dim=-1)
    if dropout_p > 0.0:
        probs = probs * dropout_keep(seed, tuple(probs.shape), dropout_p) / (1.0 - dropout_p)
    return (probs @ v.to(dt)).to(q.dtype)


@float32_math
def softmax_embedding_average(logits: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    dt = math_dtype(logits, table)
    probs = torch.softmax(logits.to(dt), dim=-1)  # (..., K)
    out = probs @ table.to(dt)  # (..., D)
    return out.to(torch.promote_types(logits.dtype, table.dtype))


def guided_log_probs(cond_logits: torch.Tensor, uncond_logits: torch.Tensor, guidance_scale: float) -> torch.Tensor:
    """Classifier-free guidance on log-probabilities (docs/method.md §10, eq. 17), renormalised."""
    dt = math_dtype(cond_logits, uncond_logits)
    lc = torch.log_softmax(cond_logits.to(dt), dim=-1)
    if guidance_scale == 0:  # cond's own distribution, also where uncond alone is -inf (0 · inf is NaN)
        return lc
    lu = torch.log_softmax(uncond_logits.to(dt), dim=-1)
    guided = (1.0 + guidance_scale) * lc - guidance_scale * lu
    # a class the conditional model rules out (-inf) stays out, whatever ω: where the unconditional one
    # rules it out too, -inf + inf made the whole row NaN, even at ω = 0
    return torch.log_softmax(torch.where(lc == float("-inf"), lc, guided), dim=-1)


@float32_math
def guided_embedding_average(
    cond_logits: torch.Tensor, uncond_logits: torch.Tensor, table: torch.Tensor, guidance_scale: float
) -> torch.Tensor:
    guided = guided_log_probs(cond_logits, uncond_logits, guidance_scale)  # (..., K), normalised
    out = guided.exp() @ table.to(guided.dtype)
    return out.to(torch.promote_types(cond_logits.dtype, table.dtype))


def categorical_kl(teacher_logits: torch.Tensor, student_logits: torch.Tensor) -> torch.Tensor:
    dt = math_dtype(teacher_logits, student_logits)
    log_p = torch.log_softmax(teacher_logits.detach().to(dt), dim=-1)  # teacher: fixed target
    log_q = torch.log_softmax(student_logits.to(dt), dim=-1)
    p = log_p.exp()
    # p = 0 terms contribute 0 (0 log 0 = 0), also where log_q = -inf, and a -inf teacher logit is such a
    # term even in a row of -inf (whose log_softmax is NaN); any other NaN p (a NaN or +inf teacher logit)
    # keeps the row's KL NaN, so the engine's non-finite check sees it
    zero = (p == 0) | (teacher_logits.detach() == -math.inf)
    return torch.where(zero, torch.zeros_like(p), p * (log_p - log_q)).sum(-1)


def noise_embeddings(
    tokens: torch.Tensor,
    table: torch.Tensor,
    alpha: torch.Tensor,
    sigma: torch.Tensor,
    *,
    noise: Optional[torch.Tensor] = None,
    drop_mask: Optional[torch.Tensor] = None,
    mask_index: Optional[int] = None,
    generator: Optional[torch.Generator] = None,
    noise_key: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    if noise_key is not None:
        raise ValueError("noise_key is the compiled backend's Philox key: the reference backend takes noise= "
                         "(ops.noise_draw gives each backend's own)")
    dt = math_dtype(table, alpha, sigma)
    ids = tokens.long()
    if drop_mask is not None:
        ids = torch.where(drop_mask, torch.full_like(ids, int(mask_index)), ids)
    # the table cast first: the embedding's backward then sums a row's many gradients in float32 (in a bf16
    # table's own dtype, 512 uses of a row were about 2-3% off)
    e = F.embedding(ids, table.to(dt))  # (B, M, D)
    if noise is None:
        noise = torch.randn(e.shape, generator=generator, device=e.device, dtype=torch.float32)
    z = _per_batch(alpha, dt) * e + _per_batch(sigma, dt) * noise.to(dt)
    return z.to(table.dtype)


def noise_draw(tokens: torch.Tensor, table: torch.Tensor, *, generator: Optional[torch.Generator] = None) -> dict:
    """What ``noise_embeddings`` draws from ``generator``: ε itself, as ``noise``."""
    return {"noise": torch.randn((*tokens.shape, table.shape[1]), generator=generator, device=table.device,
                                 dtype=torch.float32)}


@torch.no_grad()
def ddim_teacher_step(
    tokens: torch.Tensor,
    table: torch.Tensor,
    z_t: torch.Tensor,
    alpha_t: torch.Tensor,
    sigma_t: torch.Tensor,
    alpha_s: torch.Tensor,
    sigma_s: torch.Tensor,
) -> torch.Tensor:
    dt = math_dtype(table, z_t)
    e = F.embedding(tokens.long(), table).to(dt)  # (B, M, D)
    ratio = _per_batch(sigma_s, dt) / _per_batch(sigma_t, dt)
    z_s = _per_batch(alpha_s, dt) * e + ratio * (z_t.to(dt) - _per_batch(alpha_t, dt) * e)
    return z_s.to(z_t.dtype)


@torch.no_grad()
def ema_update_(shadows: list, source: torch.Tensor, weights: list, copies: list, copy_of: list) -> None:
    """θ̄_k ← lerp(θ̄_k, θ, w_k) for each shadow, then each copy ← its shadow (docs/method.md §9, eq. 16)."""
    src = source if source.dtype == torch.float32 else source.float()
    for shadow, w in zip(shadows, weights):
        shadow.lerp_(src, w)
    for copy, k in zip(copies, copy_of):
        copy.copy_(shadows[k])
