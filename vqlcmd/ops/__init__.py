"""Public API of the fused ops of VQ-LCMD.

Each function takes ``backend="auto" | "reference" | "compiled" | "triton"``.
``reference`` is plain PyTorch and always available; ``compiled`` is the C++/CUDA
extension ``vqlcmd._C`` (``csrc/``); ``triton`` is ``vqlcmd.kernels``. Shapes and
semantics are fixed by this module's docstrings; every backend implements the
same contract and is tested against ``reference``.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from . import _checks, reference
from ._dispatch import BACKENDS, available_backends, register, resolve, resolve_impl, why_not

__all__ = [
    "BACKENDS",
    "available_backends",
    "why_not",
    "softmax_embedding_average",
    "guided_embedding_average",
    "categorical_kl",
    "noise_embeddings",
    "noise_draw",
    "ddim_teacher_step",
    "gelu_tanh",
    "ada_layer_norm",
    "short_attention",
    "ema_update_",
]

OPS = ("softmax_embedding_average", "guided_embedding_average", "categorical_kl", "noise_embeddings", "noise_draw",
       "ddim_teacher_step", "gelu_tanh", "ada_layer_norm",
       "short_attention", "ema_update_")
for _op in OPS:
    register(_op, "reference", getattr(reference, _op), priority=lambda device: -1)


def _resolve_for_ids(op: str, backend: str, tokens: torch.Tensor, table: torch.Tensor, like: torch.Tensor,
                     drop_mask: Optional[torch.Tensor] = None):
    """The implementation of a token-id op for ``backend`` (resolved on ``like``'s device and dtype), with the
    ids' range checked first unless the implementation checks each id itself (``checks_ids``). Only the ids
    that are read are checked, as the kernels check them: a dropped position reads the [mask] row, so its
    id is never used (and the check must not depend on the backend)."""
    impl = resolve_impl(op, backend, like, tokens)
    if not impl.checks_ids:
        read = tokens if drop_mask is None else tokens.masked_fill(drop_mask, 0)
        _checks.check_token_range("tokens", read, table.shape[0])
    return impl.fn


def softmax_embedding_average(logits: torch.Tensor, table: torch.Tensor, *, backend: str = "auto") -> torch.Tensor:
    """``softmax(logits) @ table``: logits (..., K), table (K, D) -> (..., D).

    The predicted embedding Ψ̂ of docs/method.md (eq. 9). Differentiable in both inputs;
    float32 math; the result has the promoted dtype of the inputs.
    """
    _checks.check_average_inputs(logits, table)
    return resolve("softmax_embedding_average", backend, logits, table)(logits, table)


def guided_embedding_average(
    cond_logits: torch.Tensor,
    uncond_logits: torch.Tensor,
    table: torch.Tensor,
    guidance_scale: float,
    *,
    backend: str = "auto",
) -> torch.Tensor:
    """Embedding average under the classifier-free-guided distribution.

    ``softmax((1+ω) log_softmax(cond) - ω log_softmax(uncond)) @ table``
    (docs/method.md §10, eq. 17); ω = 0 is :func:`softmax_embedding_average` of ``cond``.
    Used by the samplers, so no gradient is promised. A class both logits rule out (-inf) stays out; one
    that only ``uncond`` rules out has an infinite guided weight, and its row is NaN for ω > 0 (a network's
    logits are finite, so the kernels do not spend a pass on it).
    """
    _checks.check_average_inputs(cond_logits, table)
    _checks.check_logits_pair(cond_logits, uncond_logits, ("cond_logits", "uncond_logits"))
    guidance_scale = _checks.checked_guidance(guidance_scale)
    if guidance_scale == 0:  # exactly the plain op, also where only uncond is -inf (0 · inf would be NaN)
        return softmax_embedding_average(cond_logits, table, backend=backend)
    fn = resolve("guided_embedding_average", backend, cond_logits, table)
    return fn(cond_logits, uncond_logits, table, guidance_scale)


def categorical_kl(
    teacher_logits: torch.Tensor, student_logits: torch.Tensor, *, backend: str = "auto"
) -> torch.Tensor:
    """Per-row ``KL(softmax(teacher) || softmax(student))``: (..., K), (..., K) -> (...), float32 (float64
    for float64 inputs).

    The consistency-matching term L_CM of docs/method.md (eq. 13). The teacher is a fixed
    target: the gradient flows to ``student_logits`` only.
    """
    _checks.check_logits_pair(teacher_logits, student_logits)
    return resolve("categorical_kl", backend, teacher_logits, student_logits)(teacher_logits, student_logits)


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
    backend: str = "auto",
) -> torch.Tensor:
    """Forward process with random dropping: tokens (B, M), table (V, D) -> z (B, M, D).

    ``z[b,i] = alpha[b] * table[mask_index if drop_mask[b,i] else tokens[b,i]] + sigma[b] * noise[b,i]``.
    When ``noise`` is None it is drawn from ``generator`` (backends draw with
    their own generator algorithm, so the numbers differ between backends).
    Differentiable in ``table``; the result has ``table``'s dtype. ``noise_key`` (the compiled backend's):
    the Philox key it would draw from ``generator``, drawn before (:func:`noise_draw`).
    """
    _checks.check_noise_inputs(tokens, table, alpha, sigma, noise, drop_mask, mask_index)
    fn = _resolve_for_ids("noise_embeddings", backend, tokens, table, table, drop_mask)
    return fn(tokens, table, alpha, sigma, noise=noise, drop_mask=drop_mask, mask_index=mask_index, generator=generator,
              noise_key=noise_key)


def noise_draw(tokens: torch.Tensor, table: torch.Tensor, *, generator: Optional[torch.Generator] = None,
               backend: str = "auto") -> dict:
    """The random numbers :func:`noise_embeddings` with these inputs would draw from ``generator``, drawn now,
    as the keyword arguments (``noise=`` or ``noise_key=``) that make the same call draw nothing and give the
    same result. So a caller can take every draw of a step before a compiled region (Dynamo cannot trace a
    generator) and keep the generator's stream: the same numbers in the same order."""
    # registered beside noise_embeddings with the same rules: these inputs resolve to the same backend
    return resolve("noise_draw", backend, table, tokens)(tokens, table, generator=generator)


def ddim_teacher_step(
    tokens: torch.Tensor,
    table: torch.Tensor,
    z_t: torch.Tensor,
    alpha_t: torch.Tensor,
    sigma_t: torch.Tensor,
    alpha_s: torch.Tensor,
    sigma_s: torch.Tensor,
    *,
    backend: str = "auto",
) -> torch.Tensor:
    """One DDIM step toward the EMA embeddings: ``z_s = α_s e + (σ_s/σ_t)(z_t − α_t e)``, ``e = table[tokens]``.

    tokens (B, M), table (V, D), z_t (B, M, D), α/σ (B,) -> (B, M, D) in ``z_t``'s dtype. No gradient
    (the teacher is a fixed target).
    """
    _checks.check_ddim_inputs(tokens, table, z_t, alpha_t, sigma_t, alpha_s, sigma_s)
    fn = _resolve_for_ids("ddim_teacher_step", backend, tokens, table, z_t)
    return fn(tokens, table, z_t, alpha_t, sigma_t, alpha_s, sigma_s)


def gelu_tanh(x: torch.Tensor, *, backend: str = "auto") -> torch.Tensor:
    """``0.5 x (1 + tanh(√(2/π) (x + 0.044715 x³)))``, the denoiser's MLP nonlinearity (DiT's GELU).

    Same values as ``F.gelu(x, approximate="tanh")`` to float32 rounding; differentiable. Not a
    VQ-LCMD op: the compiled backend exists because PyTorch's CPU kernel of it is slow (csrc/gelu_tanh).
    """
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError(f"gelu_tanh takes a floating-point tensor, got "
                        f"{x.dtype if isinstance(x, torch.Tensor) else type(x).__name__}")
    return resolve("gelu_tanh", backend, x)(x)


def ada_layer_norm(h: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, *, eps: float = 1e-5,
                   backend: str = "auto") -> torch.Tensor:
    """``(1 + scale) · LayerNorm(h) + shift``, the denoiser's adaptive LayerNorm (AdaLN).

    h (B, M, W); scale and shift (B, W), one modulation per image; LayerNorm over W without affine
    parameters (``F.layer_norm(h, (W,), eps=eps)``); the output has h's dtype whatever the modulation's.
    Differentiable in all three inputs. Not a
    VQ-LCMD op: the compiled backend exists because PyTorch's CPU LayerNorm is slow at small widths
    (csrc/ada_layer_norm).
    """
    _checks.check_ada_layer_norm_inputs(h, scale, shift, eps)
    return resolve("ada_layer_norm", backend, h, scale, shift)(h, scale, shift, eps)


def short_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, dropout_p: float = 0.0,
                    seed: Optional[torch.Tensor] = None, generator: Optional[torch.Generator] = None,
                    backend: str = "auto") -> torch.Tensor:
    """Bidirectional multi-head attention ``softmax(q kᵀ / √hd) v`` for short sequences.

    q, k, v (B, H, M, hd), one shape and dtype -> (B, H, M, hd); differentiable in all three; float32
    math. Not a VQ-LCMD op: the compiled backend is a CPU kernel for the sequence lengths of small
    token grids (M up to 1024), where PyTorch's CPU flash attention spends more on blocking than on
    the products (csrc/attention). The denoiser reaches it through ``vqlcmd.model.attention``.

    ``dropout_p > 0`` drops attention probabilities, ``(P ∘ Z / (1 − p)) v``, with the keep mask Z a
    function of ``seed`` (a one-element int64 tensor; drawn from ``generator`` when not given): score
    (b, h, i, j) is kept where Philox4x32-10 element ((b H + h) M + i) M + j of that key, its top 24 bits
    as a uniform, is at least p (``reference.dropout_keep``). Every backend draws the same mask for a seed,
    and the backward regenerates it.
    """
    _checks.check_attention_inputs(q, k, v)
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    if dropout_p > 0.0 and seed is None:
        seed = reference.philox_seed(generator, q.device)
    if seed is not None and (seed.dtype != torch.int64 or seed.numel() != 1 or seed.device != q.device):
        raise ValueError(f"seed must be a one-element int64 tensor on {q.device}, got {seed.dtype} "
                         f"{tuple(seed.shape)} on {seed.device}")
    return resolve("short_attention", backend, q, k, v)(q, k, v, dropout_p, seed)


def ema_update_(shadows: list, source: torch.Tensor, weights: list, copies: Sequence[torch.Tensor] = (),
                copy_of: Sequence[int] = (), *, backend: str = "auto") -> None:
    """The EMA update (docs/method.md §9, eq. 16) of flat float32 shadows toward one source, in place.

    For each shadow k, ``θ̄_k ← θ̄_k + w_k (θ − θ̄_k)`` with ``w_k = 1 − η_k``, rounded as ``torch.lerp``
    rounds it (the compiled kernel equals ``shadow.lerp_(source.float(), w)`` bit for bit on AVX2 builds);
    then ``copies[j] ← shadows[copy_of[j]]`` in the copy's dtype (a 16-bit compute copy of a shadow).
    shadows: contiguous float32, each of the source's numel; source: contiguous float32, bf16 or fp16;
    copies: contiguous, the source's numel. Not differentiable (an update). The compiled backend is one
    pass over the source on CPU (csrc/ema), where the reference's cast, lerps and copies are a pass each.
    """
    copies, copy_of = list(copies), [int(k) for k in copy_of]
    _checks.check_ema_update_inputs(shadows, source, weights, copies, copy_of)
    resolve("ema_update_", backend, source)(shadows, source, [float(w) for w in weights], copies, copy_of)


def _register_optional_backends() -> None:
    """Compiled (csrc/) and Triton (kernels/) backends register themselves when importable."""
    from . import _compiled, _triton  # noqa: F401  (import registers)


_register_optional_backends()
