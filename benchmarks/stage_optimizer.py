"""One AdamW step on a denoiser's parameters: torch's implementations and DeepSpeed's.

``foreach`` (torch's default multi-tensor AdamW) is the baseline; ``forloop`` is the
per-tensor loop, ``fused`` torch's fused kernel (CPU and CUDA), ``ds-cpu-adam``
DeepSpeed's SIMD CPU Adam (the ZeRO-Offload optimizer) and ``ds-fused-adam``
DeepSpeed's CUDA FusedAdam. Parameters stay fp32, as master weights do under bf16
training. GB/s counts the 28 bytes AdamW moves per parameter (reads p, g, m, v;
writes p, m, v), the figure to hold against the memory bandwidth: the step is
memory-bound.

DeepSpeed's ops are JIT-built on first use (minutes on 2 cores); ``--quick`` only
measures them when the build is already cached, so that CI does not pay for it.
"""
from __future__ import annotations

import os

import torch

from benchmarks.harness import Context, Skip, run_case
from vqlcmd.model import build_denoiser, num_parameters

STAGE = "optimizer"
BASELINE = "foreach"
BYTES_PER_PARAM = 7 * 4


def _presets(ctx: Context) -> list[tuple[str, dict]]:
    if ctx.quick:
        return [("tiny", {})]
    if ctx.is_cuda:
        return [("ffhq-56m", {}), ("imagenet-246m", {})]
    return [("digits-1m", {}), ("ffhq-56m", dict(warmup=1, reps=3))]


def _deepspeed_builder(kind: str):
    """(builder, None) for a usable DeepSpeed op builder, or (None, reason)."""
    try:
        from deepspeed.accelerator import get_accelerator
    except Exception as exc:  # noqa: BLE001: deepspeed can fail at import for many reasons
        return None, f"deepspeed is not importable ({type(exc).__name__}: {exc})"
    builder = get_accelerator().create_op_builder(kind)
    if builder is None:
        return None, f"DeepSpeed's {get_accelerator().device_name()} accelerator has no {kind}"
    if not builder.is_compatible(verbose=False):
        return None, f"{kind} is not compatible with this install"
    return builder, None


def _jit_cached(builder) -> bool:
    from deepspeed.git_version_info import installed_ops
    from torch.utils.cpp_extension import _get_build_directory

    if installed_ops.get(builder.name, False):
        return True
    build_dir = _get_build_directory(builder.name, verbose=False)
    return os.path.exists(os.path.join(build_dir, f"{builder.name}.so"))


def _factories(ctx: Context, out: list) -> dict:
    """backend name -> callable(params) -> optimizer."""
    kw = dict(lr=1e-4, betas=(0.9, 0.99), weight_decay=0.01)
    f = {
        "forloop": lambda p: torch.optim.AdamW(p, foreach=False, fused=False, **kw),
        "foreach": lambda p: torch.optim.AdamW(p, foreach=True, **kw),
        "fused": lambda p: torch.optim.AdamW(p, fused=True, **kw),
    }
    wanted = {"ds-cpu-adam": "CPUAdamBuilder", "ds-fused-adam": "FusedAdamBuilder"}
    for name, kind in wanted.items():
        if not ctx.wants(name):
            continue
        if (name == "ds-cpu-adam") == ctx.is_cuda:
            out.append(Skip(STAGE, "", name, "CPU parameters only (ZeRO-Offload)" if ctx.is_cuda
                            else "CUDA parameters only"))
            continue
        builder, reason = _deepspeed_builder(kind)
        if builder is None:
            out.append(Skip(STAGE, "", name, reason))
            continue
        if ctx.quick and not _jit_cached(builder):
            out.append(Skip(STAGE, "", name, f"DeepSpeed op {builder.name} is not built yet; a run without "
                                             "--quick JIT-builds it (minutes), later quick runs then measure it"))
            continue
        if name == "ds-cpu-adam":
            from deepspeed.ops.adam import DeepSpeedCPUAdam

            f[name] = lambda p: DeepSpeedCPUAdam(p, adamw_mode=True, **kw)
        else:
            from deepspeed.ops.adam import FusedAdam

            f[name] = lambda p: FusedAdam(p, adam_w_mode=True, **kw)
    return {k: v for k, v in f.items() if ctx.wants(k, baseline=k == BASELINE)}


def run(ctx: Context) -> list:
    out: list = []
    factories = _factories(ctx, out)
    for preset, reps in _presets(ctx):
        torch.manual_seed(0)
        model = build_denoiser(preset).to(ctx.device)
        n = num_parameters(model)
        grads = [torch.randn_like(p) * 1e-3 for p in model.parameters()]
        shape = f"{preset} {n / 1e6:.3g}M params"
        for name, make in factories.items():
            params = [p.detach().clone().requires_grad_(True) for p in model.parameters()]
            for p, g in zip(params, grads):
                p.grad = g
            try:
                opt = make(params)
            except Exception as exc:  # noqa: BLE001: e.g. a JIT build that fails
                out.append(Skip(STAGE, "step", name, f"could not build the optimizer: {exc}"[:300], failed=True))
                continue
            run_case(ctx, out, stage=STAGE, case="step", backend=name, shape=shape, dtype="float32", fn=opt.step,
                     baseline=BASELINE, extra=lambda t: {"params(M)": n / 1e6,
                                                         "GB/s": n * BYTES_PER_PARAM / t.median_ms / 1e6}, **reps)
            del opt, params
        del model, grads
    return out
