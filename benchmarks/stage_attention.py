"""Attention: every available backend of ``vqlcmd.model.attention`` against the math path.

``math`` (explicit softmax(QKᵀ/√d)V in fp32) is the baseline. ``sdpa`` lets PyTorch
pick its kernel; on CUDA its flash, memory-efficient and cuDNN kernels are also
measured one by one (``sdpa-flash`` ...), and flash-attn 2/3 where installed, and FlashAttention-4
(``flash4``, the flash-attn-4 package, SM90/SM100) where it imports: the lease decides by these rows whether
``auto`` should take it (it does not yet). On CPU the extension's short-sequence kernel (``compiled``).
Shapes are those of the paper presets (M = 256 tokens, head dim 64 and 48), imagenet-246m's at the paper's 32
images per GPU (16 heads of 48) and at its width with head dim 64 (12 heads), plus a longer sequence on GPU
and the digits model's training shape (72 images x 4 heads, M = 64, hd 32) on CPU. Dropout is 0 so that every
backend, FA3 and FA4 included, runs the same computation (training uses 0.1). On CUDA the figure is the
CUDA-graph replay time (kernels only; ``launch_ms`` keeps the launch-bound time, which for FA4 includes its
Python-side argument checks on every call).
"""
from __future__ import annotations

import contextlib
import importlib

import torch

from benchmarks.harness import Context, Skip, run_case

# the package re-exports the function ``attention`` under the module's name, so fetch the module itself
attn_mod = importlib.import_module("vqlcmd.model.attention")

STAGE = "attention"
BASELINE = "math"


def _shapes(ctx: Context) -> list[tuple[int, int, int, int]]:
    """(B, H, M, hd)."""
    if ctx.quick:
        return [(2, 2, 16, 16)]
    if ctx.is_cuda:
        return [(32, 16, 256, 48), (32, 12, 256, 64), (64, 8, 256, 64), (64, 16, 256, 48), (16, 16, 1024, 64)]
    return [(72, 4, 64, 32), (4, 8, 256, 64), (2, 16, 256, 48)]


def _sdpa_kernels() -> dict:
    """SDPA restricted to one kernel (CUDA only): name -> context manager factory."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    kernels = {"sdpa-flash": SDPBackend.FLASH_ATTENTION, "sdpa-efficient": SDPBackend.EFFICIENT_ATTENTION}
    if hasattr(SDPBackend, "CUDNN_ATTENTION"):
        kernels["sdpa-cudnn"] = SDPBackend.CUDNN_ATTENTION
    return {name: (lambda k=k: sdpa_kernel(k)) for name, k in kernels.items()}


def _backends(ctx: Context, out: list) -> dict:
    """name -> (attention backend argument, context manager factory)."""
    backends = {"math": ("math", contextlib.nullcontext), "sdpa": ("sdpa", contextlib.nullcontext)}
    if ctx.is_cuda:
        backends.update({name: ("sdpa", cm) for name, cm in _sdpa_kernels().items()})
    if not ctx.is_cuda:
        from vqlcmd import ops

        probe = torch.empty(1, 1, 1, 8)
        why = ops.why_not("short_attention", "compiled", probe, probe, probe)
        if why is None:
            backends["compiled"] = ("compiled", contextlib.nullcontext)
        elif ctx.wants("compiled"):  # (a --backend that leaves it out asks for no row of it)
            out.append(Skip(STAGE, "", "compiled", why))
    for name, fn in (("flash3", attn_mod._fa3_func), ("flash2", attn_mod._fa2_func)):
        if fn is None:
            package = "flash_attn_interface (FlashAttention-3)" if name == "flash3" else "flash_attn"
            if ctx.wants(name):
                out.append(Skip(STAGE, "", name, f"{package} is not installed"))
        elif not ctx.is_cuda:
            if ctx.wants(name):
                out.append(Skip(STAGE, "", name, "needs CUDA fp16/bf16 tensors"))
        else:
            backends[name] = (name, contextlib.nullcontext)
    if ctx.wants("flash4"):
        why = _flash4_why_not(ctx)
        if why is None:
            backends["flash4"] = ("flash4", contextlib.nullcontext)
        else:
            out.append(Skip(STAGE, "", "flash4", why))
    return {k: v for k, v in backends.items() if ctx.wants(k, baseline=k == BASELINE)}


def _flash4_why_not(ctx: Context):
    """Why FA4 gets no rows here (None: it does). Asked only after the device: importing the package loads
    the CUTLASS DSL, seconds of work a CPU run need not do."""
    if not ctx.is_cuda:
        return "needs CUDA (an SM90 or SM100 GPU)"
    probe = torch.empty(1, 1, 8, 64, device=ctx.device, dtype=torch.bfloat16)
    why = attn_mod.flash4_why_not(probe, probe, probe)
    if why is None:
        try:
            attn_mod.flash4_func()
        except RuntimeError as exc:
            why = str(exc)
    return why


def run(ctx: Context) -> list:
    out: list = []
    dtype = torch.bfloat16 if ctx.is_cuda else torch.float32
    backends = _backends(ctx, out)
    gen = torch.Generator(device=ctx.device).manual_seed(0)
    for B, H, M, hd in _shapes(ctx):
        shape = f"B{B} H{H} M{M} hd{hd}"
        q, k, v, grad = (torch.randn(B, H, M, hd, device=ctx.device, dtype=dtype, generator=gen) for _ in range(4))
        fwd_flops = 4.0 * B * H * M * M * hd  # QKᵀ and PV
        for case, flops, with_grad in (("fwd", fwd_flops, False), ("fwd+bwd", 3.5 * fwd_flops, True)):
            # 3.5: the backward recomputes the scores and has four more matmuls (flash-attn's convention)
            leaves = [x.detach().requires_grad_(with_grad) for x in (q, k, v)]
            for name, (arg, kernel) in backends.items():
                def fn(arg=arg, kernel=kernel, leaves=leaves, with_grad=with_grad):
                    with kernel():
                        if not with_grad:
                            with torch.no_grad():
                                return attn_mod.attention(*leaves, backend=arg)
                        for x in leaves:
                            x.grad = None
                        attn_mod.attention(*leaves, backend=arg).backward(grad)

                run_case(ctx, out, stage=STAGE, case=case, backend=name, shape=shape, dtype=str(dtype)[6:], fn=fn,
                         baseline=BASELINE, extra=lambda t, f=flops: {"GFLOP/s": f / t.median_ms / 1e6},
                         warmup=3, reps=10, graph=True)
    return out
