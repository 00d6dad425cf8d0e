"""One attention function with a fast path and plain paths side by side (nanoGPT habit).

Order under ``backend="auto"``: FlashAttention-3 (``flash_attn_interface``), then
FlashAttention-2 (``flash_attn``), for CUDA fp16/bf16 inputs with head dim <= 256 on GPUs they run on
(FA3: Hopper, FA2: Ampere and later); on CPU, the extension's short-sequence kernel (``"compiled"``,
``vqlcmd.ops.short_attention``, with attention dropout drawn inside it as flash attention draws it); then
PyTorch SDPA (which itself picks flash / memory-efficient / math kernels); ``"math"`` is the
explicit softmax(QKᵀ/√d)V, kept as the readable definition the others are tested against.

``"flash4"`` (FlashAttention-4, the ``flash-attn-4`` package's CuTe DSL kernels, SM90/SM100) runs only when
asked for: ``auto`` does not take it until a GPU lease has timed it faster than SDPA's flash and cuDNN kernels
(``benchmarks/stage_attention.py``). It has no attention dropout, so a call with ``dropout_p > 0`` (training
with ``attn_dropout > 0``) runs SDPA instead; sampling and evaluation (dropout 0) run FA4.
"""
from __future__ import annotations

import importlib
import math
from typing import Optional

import torch
import torch.nn.functional as F

try:  # FlashAttention-3 (Hopper)
    from flash_attn_interface import flash_attn_func as _fa3_func
except ImportError:
    _fa3_func = None
try:  # FlashAttention-2
    from flash_attn import flash_attn_func as _fa2_func
except ImportError:
    _fa2_func = None

ATTENTION_BACKENDS = ("auto", "flash3", "flash2", "flash4", "compiled", "sdpa", "math")

FLASH4_INSTALL = "pip install --pre flash-attn-4"
_fa4_func = None  # flash_attn.cute.flash_attn_func once loaded: the import loads the CuTe DSL compiler (seconds)


def _flash_ok(q: torch.Tensor) -> bool:
    """What both FlashAttention versions take: CUDA, fp16/bf16, head dim <= 256 (they refuse more)."""
    return q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] <= 256


def attention_backend_for(q: torch.Tensor, dropout_p: float) -> str:
    """The backend ``auto`` uses for these inputs (logged by the engine). FA3 runs on Hopper only, FA2 from
    Ampere on: on older GPUs (V100, T4) both refuse, so ``auto`` takes SDPA there."""
    if _flash_ok(q):
        major = torch.cuda.get_device_capability(q.device)[0]
        # FA3 has no dropout, and refuses head dims that are not a multiple of 8 (FA2 pads them)
        if _fa3_func is not None and dropout_p == 0.0 and major == 9 and q.shape[-1] % 8 == 0:
            return "flash3"
        if _fa2_func is not None and major >= 8:
            return "flash2"
    if q.device.type == "cpu" and _compiled_why_not(q) is None:
        return "compiled"
    return "sdpa"


# SDPA's kernels by the aten op each runs as (the names torch dispatches to)
_SDPA_KERNELS = {"_scaled_dot_product_flash_attention": "flash", "_scaled_dot_product_cudnn_attention": "cudnn",
                 "_scaled_dot_product_efficient_attention": "efficient",
                 "_scaled_dot_product_flash_attention_for_cpu": "flash-cpu",
                 "_scaled_dot_product_attention_math": "math", "_scaled_dot_product_fused_attention_overrideable":
                 "overrideable"}


def sdpa_kernel_for(q: torch.Tensor, dropout_p: float) -> str:
    """Which of SDPA's kernels (flash, cudnn, efficient, flash-cpu, math) runs a training call on q, k, v
    shaped like ``q`` with this dropout: one call is made and the aten op it dispatches to is read, so the
    answer is what ran, not a guess at torch's priority rules (which change between releases)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    seen = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.__name__.split(".")[0]
            if name in _SDPA_KERNELS:
                seen.append(_SDPA_KERNELS[name])
            return func(*args, **(kwargs or {}))

    x = torch.zeros_like(q, requires_grad=True)  # grad mode on: the kernel that trains, not inference's
    with torch.random.fork_rng(devices=[q.device] if q.is_cuda else []), Record():
        F.scaled_dot_product_attention(x, x, x, dropout_p=dropout_p, is_causal=False)
    # the math path is composite: it reaches dispatch as matmuls, a softmax and a dropout, no op of its own
    return seen[0] if seen else "math"


def flash4_func():
    """FlashAttention-4's ``flash_attn.cute.flash_attn_func``, imported on first use; a RuntimeError naming the
    package when it cannot be (also when it is installed but its CUTLASS DSL libraries fail to load)."""
    global _fa4_func
    if _fa4_func is None:
        try:
            _fa4_func = importlib.import_module("flash_attn.cute").flash_attn_func
        except Exception as e:  # ImportError, or the DSL's native libraries refusing to load
            raise RuntimeError(f"attention_backend='flash4' needs the flash-attn-4 package ({FLASH4_INSTALL}): "
                               f"importing flash_attn.cute failed with {type(e).__name__}: {e}") from e
    return _fa4_func


def flash4_why_not(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """Why FA4 cannot take these (B, H, M, hd) inputs (None: it can). Its limits: CUDA on compute capability
    9.x or 10.x, fp16/bf16, q, k and v alike, head dim a multiple of 8 in 8..256 on SM90 and 8..128 or 256 on
    SM100 (``flash_attn.cute.interface._validate_head_dims``, which asserts instead of explaining)."""
    if not (q.is_cuda and k.is_cuda and v.is_cuda):
        return f"attention_backend='flash4' needs CUDA tensors, got {q.device}"
    major, minor = torch.cuda.get_device_capability(q.device)
    if major not in (9, 10):
        return f"attention_backend='flash4' needs an SM90 or SM100 GPU, this is SM{major}{minor}"
    if q.dtype not in (torch.float16, torch.bfloat16) or k.dtype != q.dtype or v.dtype != q.dtype:
        return f"attention_backend='flash4' needs fp16 or bf16 q, k and v of one dtype, got {q.dtype}, " \
               f"{k.dtype}, {v.dtype}"
    if not (q.shape == k.shape == v.shape):
        return f"attention_backend='flash4' needs q, k and v of one shape, got {tuple(q.shape)}, " \
               f"{tuple(k.shape)}, {tuple(v.shape)}"
    hd = q.shape[-1]
    if hd % 8 or not (8 <= hd <= 128 or (hd <= 256 and major == 9) or hd == 256):
        limit = "8..256" if major == 9 else "8..128 or 256"
        return f"attention_backend='flash4' needs a head dim that is a multiple of 8 in {limit} on SM{major}0, " \
               f"got {hd}"
    return None


def resolved_backend(backend: str, q: torch.Tensor, dropout_p: float) -> str:
    """The backend a call with this ``backend`` argument runs: ``auto``'s choice, and SDPA for ``flash4`` with
    dropout (FA4 has none)."""
    if backend == "auto":
        return attention_backend_for(q, dropout_p)
    if backend == "flash4" and dropout_p > 0.0:
        return "sdpa"
    return backend


# a graph break under train.compile: Dynamo stays out of the CuTe DSL's Python launch (not yet run compiled on a GPU)
@torch.compiler.disable
def _flash4(q, k, v):
    why = flash4_why_not(q, k, v)
    if why is not None:
        raise RuntimeError(why)
    fn = flash4_func()
    # FA4 takes and returns (B, M, H, hd); a transposed view is enough, it copies only a misaligned input.
    # It returns (out, lse); lse is None unless gradients are needed.
    out = fn(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), softmax_scale=1.0 / math.sqrt(q.shape[-1]),
             causal=False)
    out = out[0] if isinstance(out, tuple) else out
    return out.transpose(1, 2)


def _compiled_why_not(q: torch.Tensor):
    """Why the CPU short-sequence kernel cannot take q, k, v shaped like ``q`` (None: it can)."""
    from .. import ops

    return ops.why_not("short_attention", "compiled", q, q, q)


def math_attention(q, k, v, dropout_p: float = 0.0, generator: Optional[torch.Generator] = None):
    # q, k, v: (B, H, M, hd)
    scores = (q.float() @ k.float().transpose(-2, -1)) / math.sqrt(q.shape[-1])  # (B, H, M, M)
    probs = torch.softmax(scores, dim=-1)
    if dropout_p > 0.0:
        keep = torch.rand(probs.shape, device=probs.device, generator=generator) >= dropout_p
        probs = probs * keep / (1.0 - dropout_p)
    return (probs @ v.float()).to(q.dtype)  # (B, H, M, hd)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0,
              backend: str = "auto", seed: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Bidirectional (unmasked) multi-head attention. q, k, v: (B, H, M, hd) -> (B, H, M, hd). ``flash4`` with
    ``dropout_p > 0`` runs SDPA (FA4 has no dropout). ``seed`` keys the dropout mask of the backend that draws
    its own (``compiled``); the others draw theirs from the global generator."""
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"attention backend must be one of {ATTENTION_BACKENDS}, got {backend!r}")
    backend = resolved_backend(backend, q, dropout_p)
    if backend == "flash4":
        return _flash4(q, k, v)
    if backend in ("flash3", "flash2"):
        fn = _fa3_func if backend == "flash3" else _fa2_func
        if fn is None:
            raise RuntimeError(f"attention backend {backend!r} requested but its package is not installed")
        if not _flash_ok(q):
            raise RuntimeError(f"{backend} needs CUDA fp16/bf16 tensors with head dim <= 256, got {q.dtype} on "
                               f"{q.device}, head dim {q.shape[-1]}")
        # flash-attn takes (B, M, H, hd)
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
        if backend == "flash3":
            if dropout_p:
                raise RuntimeError("flash3 does not support attention dropout")
            out = fn(qt, kt, vt, causal=False)
            out = out[0] if isinstance(out, tuple) else out
        else:
            out = fn(qt, kt, vt, dropout_p=dropout_p, causal=False)
        return out.transpose(1, 2)
    if backend == "compiled":
        from .. import ops

        # its dropout mask is Philox's, keyed by ``seed``, or by one the global generator draws (inside a compiled
        # graph, inductor's draw) as SDPA's math path draws its mask
        return ops.short_attention(q, k, v, dropout_p=dropout_p, seed=seed, backend="compiled")
    if backend == "sdpa":
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=False)
    return math_attention(q, k, v, dropout_p)
