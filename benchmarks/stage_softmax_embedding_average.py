"""Ψ̂ = softmax(logits) @ table: the Triton kernels against PyTorch eager and torch.compile.

``eager`` (the baseline) is what one writes in PyTorch, ``softmax(logits, -1) @ table`` in the
inputs' dtype, which keeps the (N, K) probabilities for the backward; ``compile`` is
``torch.compile`` of the same function; ``triton`` is ``vqlcmd.ops`` with ``backend="triton"`` and
its default kernels (for 16-bit inputs: the "first-tile" forward, the product against a fixed per-row
max; in the backward "mm", whose "rows" dlogits kernel also writes P for cuBLAS to compute dtable);
``triton-one-pass`` is the default with ``VQLCMD_TRITON_FORWARD=fused`` (the one-pass online-softmax
forward, the float32 default), timed in every case; ``triton-tiles`` the default with
``VQLCMD_TRITON_DLOGITS=tiles`` (dlogits one (rows, classes) tile per program, after a delta kernel;
the float32 default), timed for ``fwd+bwd`` only; ``triton-fused`` is the default with
``VQLCMD_TRITON_BACKWARD=fused`` (one FlashAttention-2-style backward kernel) and ``triton-split``
with ``VQLCMD_TRITON_BACKWARD=split`` (separate dlogits and dtable kernels, the float32 default),
each timed for ``fwd+bwd`` only, the one case it changes; ``triton-chunked`` sets
``VQLCMD_TRITON_FORWARD`` and ``VQLCMD_TRITON_BACKWARD`` to ``chunked`` (the softmax parts in
Triton, the products in cuBLAS, chunk by chunk; ``VQLCMD_TRITON_CHUNK_ROWS`` sets the chunk). So
one GPU run says which variant is faster; the forward and the dlogits choices are separate kernels,
so their savings add.
Cases: ``fwd`` (no grad), ``fwd+bwd`` (both inputs, non-unit upstream gradient) and ``guided``
(the samplers' classifier-free-guided variant, ω = 1). The goal case of issue 5 is
N = 32768 (B 128 × M 256), K = 1024, D = 256 in bf16 on a GPU: fwd+bwd ≥ 1.5× eager, and at
least 2× less activation memory. ``activation_bytes`` counts the tensors autograd keeps between
forward and backward, apart from the inputs themselves.

Without CUDA the triton backend is not timed: it would run in Triton's interpreter, whose
timings say nothing about the kernels. Its rows are skips that say so.
"""
from __future__ import annotations

import os

import torch

from benchmarks.harness import Context, Skip, environment, run_case
from vqlcmd import ops

STAGE = "softmax_embedding_average"
BASELINE = "eager"
GUIDANCE = 1.0
# triton backends -> the variant switches they run under (read by the kernels' launchers at each call);
# every one is set, so that the caller's environment does not change what a name measures
_DEFAULTS = {"VQLCMD_TRITON_FORWARD": "auto", "VQLCMD_TRITON_BACKWARD": "auto", "VQLCMD_TRITON_DLOGITS": "auto"}
VARIANTS = {
    "triton": _DEFAULTS,
    "triton-one-pass": {**_DEFAULTS, "VQLCMD_TRITON_FORWARD": "fused"},
    "triton-tiles": {**_DEFAULTS, "VQLCMD_TRITON_DLOGITS": "tiles"},
    "triton-fused": {**_DEFAULTS, "VQLCMD_TRITON_BACKWARD": "fused"},
    "triton-chunked": {**_DEFAULTS, "VQLCMD_TRITON_FORWARD": "chunked", "VQLCMD_TRITON_BACKWARD": "chunked"},
    "triton-split": {**_DEFAULTS, "VQLCMD_TRITON_BACKWARD": "split"},
}
# the variants that change only the backward: their forward and guided rows would repeat triton's
BACKWARD_ONLY = ("triton-fused", "triton-split", "triton-tiles")


def _shapes(ctx: Context) -> list[tuple[int, int, int]]:
    """(N, K, D); N = batch × 256 tokens."""
    if ctx.quick:
        return [(64, 128, 32)]
    if ctx.is_cuda:
        if os.environ.get("VQLCMD_BENCH_SHAPES") == "goal":  # the goal case alone (scripts/gpu_check.sh)
            return [(32768, 1024, 256)]
        return [(32768, 1024, 256), (8192, 1024, 256), (4096, 128, 32)]
    return [(2048, 1024, 256)]


def eager_average(logits, table):
    return torch.softmax(logits, dim=-1) @ table


def eager_guided(cond, uncond, table, scale):
    guided = (1 + scale) * torch.log_softmax(cond, -1) - scale * torch.log_softmax(uncond, -1)
    return torch.softmax(guided, dim=-1) @ table


def _backends(ctx: Context, out: list) -> dict:
    """name -> (average fn, guided fn)."""
    backends = {
        "eager": (eager_average, eager_guided),
        "compile": (torch.compile(eager_average, dynamic=False), torch.compile(eager_guided, dynamic=False)),
    }
    reason = ops.why_not("softmax_embedding_average", "triton", torch.empty(1, 1, device=ctx.device),
                         torch.empty(1, 1, device=ctx.device))
    if not ctx.is_cuda:
        reason = "no CUDA device: Triton would run in its interpreter, whose timings say nothing about the kernels"
    for name in VARIANTS:
        if reason is None:
            backends[name] = (
                lambda logits, table: ops.softmax_embedding_average(logits, table, backend="triton"),
                lambda c, u, table, scale: ops.guided_embedding_average(c, u, table, scale, backend="triton"),
            )
        elif ctx.wants(name):
            out.append(Skip(STAGE, "", name, reason))
    return {k: v for k, v in backends.items() if ctx.wants(k, baseline=k == BASELINE)}


def autotuned(N: int, K: int, D: int) -> dict:
    """Kernel name -> the configurations its autotuner chose at (N, K, D) so far (empty where none ran):
    which tiles a time came from, to read it against the card's limits."""
    from vqlcmd.kernels import softmax_embedding_average as sea

    return {name: picks for name, tuned in sea._TUNED.items() if (picks := tuned.picks(N, K, D))}


def activation_bytes(fn, *inputs) -> int:
    """Bytes autograd saves for the backward of ``fn(*inputs)``, not counting the inputs' storage."""
    seen = {t.untyped_storage().data_ptr() for t in inputs}
    total = 0

    def pack(t):
        nonlocal total
        ptr = t.untyped_storage().data_ptr()
        if ptr not in seen:
            seen.add(ptr)
            total += t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*inputs)
    return total


def run(ctx: Context) -> list:
    out: list = []
    dtype = torch.bfloat16 if ctx.is_cuda else torch.float32
    backends = _backends(ctx, out)
    gen = torch.Generator(device=ctx.device).manual_seed(0)
    for N, K, D in _shapes(ctx):
        shape = f"N{N} K{K} D{D}"

        def randn(*size, scale=1.0):
            return (scale * torch.randn(*size, device=ctx.device, generator=gen)).to(dtype)

        logits, uncond, table, grad = randn(N, K, scale=3.0), randn(N, K, scale=3.0), randn(K, D), randn(N, D)
        leaves = [x.detach().requires_grad_() for x in (logits, table)]
        esize = logits.element_size()
        fwd_gbs = (N * K + K * D + N * D) * esize / 1e9  # least traffic of the forward
        # the three products of fwd+bwd (P·table, dY·tableᵀ, Pᵀ·dY), to read how close each backend
        # runs to the card's matrix throughput
        fwd_bwd_gflop = 3 * 2 * N * K * D / 1e9
        for name, (average, guided) in backends.items():
            common = dict(stage=STAGE, backend=name, shape=shape, dtype=str(dtype)[6:], baseline=BASELINE, graph=True)

            variants = VARIANTS.get(name)

            def fwd(average=average, variants=variants):
                with torch.no_grad(), environment(variants):
                    return average(logits, table)

            def fwd_bwd(average=average, variants=variants):
                for x in leaves:
                    x.grad = None
                with environment(variants):
                    average(*leaves).backward(grad)

            def guided_fwd(guided=guided, variants=variants):
                with torch.no_grad(), environment(variants):
                    return guided(logits, uncond, table, GUIDANCE)

            only_backward = name in BACKWARD_ONLY
            if not only_backward:
                run_case(ctx, out, case="fwd", fn=fwd, extra=lambda t: {"GB/s": fwd_gbs / t.median_ms * 1e3},
                         **common)
            try:
                with environment(variants):
                    saved = activation_bytes(average, *leaves)
            except Exception:  # noqa: BLE001: the figure is optional; the timing below still runs
                saved = -1
            run_case(ctx, out, case="fwd+bwd", fn=fwd_bwd, **common,
                     extra=lambda t, s=saved, name=name: {
                         "activation_bytes": s, "TFLOP/s": round(fwd_bwd_gflop / t.median_ms, 3),
                         **({"autotuned": autotuned(N, K, D)} if name in VARIANTS else {})})
            if not only_backward:
                run_case(ctx, out, case="guided", fn=guided_fwd,
                         extra=lambda t: {"GB/s": (fwd_gbs + N * K * esize / 1e9) / t.median_ms * 1e3}, **common)
    return out
