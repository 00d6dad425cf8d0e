"""Denoiser forward (inference) and forward+backward (training mode) per preset.

The backend column is the attention backend the blocks use: ``math`` (baseline),
``sdpa``, ``auto`` (flash-attn where installed on CUDA; measured only when it
picks a backend not already in the table, so not on CPU, where it means SDPA)
and, on CUDA outside quick mode, ``auto+compile`` (``torch.compile`` of the whole
denoiser; compile time is spent in the warm-up). GPU runs the paper presets under
bf16 autocast (fp32 weights, as in mixed-precision training); CPU runs fp32 and,
outside quick mode, ``ffhq-56m`` at batch 1 with few repetitions (each rep takes
seconds there); ``imagenet-246m`` is GPU-only.
"""
from __future__ import annotations

import importlib

import torch

from benchmarks import flops
from benchmarks.harness import Context, Skip, run_case
from vqlcmd.model import build_denoiser, num_parameters

STAGE = "denoiser"
BASELINE = "math"
attn_mod = importlib.import_module("vqlcmd.model.attention")


def _cases(ctx: Context) -> list[tuple[str, int, dict]]:
    """(preset, batch, repetitions)."""
    few = dict(warmup=1, reps=3)
    if ctx.quick:
        return [("tiny", 4, {})]
    if ctx.is_cuda:
        return [("digits-1m", 256, {}), ("ffhq-56m", 64, {}), ("imagenet-246m", 64, {})]
    return [("tiny", 16, {}), ("digits-1m", 64, dict(warmup=2, reps=5)), ("ffhq-56m", 1, few)]


CPU_LEFT_OUT = {"imagenet-246m": "runs on GPU only: one fwd+bwd takes tens of seconds on 2 shared CPU cores"}


def set_attention_backend(model: torch.nn.Module, backend: str) -> None:
    for block in model.blocks:
        block.attention_backend = backend


def _backends(ctx: Context, out: list) -> list[str]:
    names = ["math", "sdpa", "auto"]
    if ctx.is_cuda and not ctx.quick:
        names.append("auto+compile")
    elif ctx.wants("auto+compile"):
        out.append(Skip(STAGE, "", "auto+compile", "runs on CUDA outside --quick only: on a 2-core CPU the "
                                                   "compile takes minutes and says little about the GPU"))
    return [n for n in names if ctx.wants(n, baseline=n == BASELINE)]


def run(ctx: Context) -> list:
    out: list = []
    dtype = torch.bfloat16 if ctx.is_cuda else torch.float32  # of the logits
    dtype_name = "bf16-autocast" if ctx.is_cuda else "float32"
    gen = torch.Generator(device=ctx.device).manual_seed(0)
    peak = flops.peak_bf16_flops(torch.cuda.get_device_name(ctx.device)) if ctx.is_cuda else None
    backends = _backends(ctx, out)
    if not ctx.quick and not ctx.is_cuda:
        out += [Skip(STAGE, "", "", f"preset {name} {why}") for name, why in CPU_LEFT_OUT.items()]
    for preset, B, reps in _cases(ctx):
        torch.manual_seed(0)
        model = build_denoiser(preset).to(ctx.device)
        cfg = model.cfg
        M = cfg.seq_len
        z = torch.randn(B, M, cfg.embed_dim, device=ctx.device, generator=gen)
        t = torch.rand(B, device=ctx.device, generator=gen)
        y = (torch.randint(0, cfg.num_classes + 1, (B,), device=ctx.device, generator=gen)
             if cfg.num_classes else None)
        grad = torch.randn(B, M, cfg.codebook_size, device=ctx.device, dtype=dtype, generator=gen)
        fwd_flops = B * flops.denoiser_forward_flops(model, M)
        shape = f"{preset} B{B} M{M}"
        for name in backends:
            set_attention_backend(model, name.split("+")[0])
            net = torch.compile(model) if name.endswith("+compile") else model
            dropout = cfg.attn_dropout
            for case, mult in (("fwd", 1.0), ("fwd+bwd", 3.0)):
                training = case == "fwd+bwd"
                chosen = name
                if name.startswith("auto"):
                    # the model's own (1, heads, M, head dim): FlashAttention-3 takes head dims divisible by 8
                    # only, so a (1, 1, 1, 1) probe never saw what auto picks for the model on a Hopper GPU
                    q = torch.empty(1, cfg.heads, M, cfg.width // cfg.heads, device=ctx.device, dtype=dtype)
                    chosen = attn_mod.attention_backend_for(q, dropout if training else 0.0)
                    if name == "auto" and chosen in backends:
                        continue  # the same computation is measured under its own name

                def fn(net=net, training=training):
                    with torch.autocast(ctx.device.type, dtype=torch.bfloat16, enabled=ctx.is_cuda):
                        if not training:
                            with torch.no_grad():
                                return net(z, t, y)
                        model.zero_grad(set_to_none=True)
                        logits = net(z, t, y)
                    logits.backward(grad)

                def extra(timing, f=mult * fwd_flops, chosen=chosen):
                    s = timing.median_ms / 1e3
                    figs = {"tokens/s": B * M / s, "params(M)": num_parameters(model) / 1e6,
                            ("TFLOP/s" if ctx.is_cuda else "GFLOP/s"): f / s / (1e12 if ctx.is_cuda else 1e9)}
                    if peak:
                        figs["MFU%"] = 100.0 * f / s / peak
                    if chosen != name:
                        figs["attention"] = chosen
                    return figs

                model.train(training)
                run_case(ctx, out, stage=STAGE, case=case, backend=name, shape=shape, dtype=dtype_name, fn=fn,
                         baseline=BASELINE, extra=extra, **reps)
        del model, z, grad
    return out
