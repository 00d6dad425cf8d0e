"""Compiled kernels (csrc/) against the reference backend, measured in the same run.

Issue 4's figures: at N = 16384 rows (B=64, M=256), K = 1024, D = 256 on CPU,
categorical_kl forward+backward >= 3x faster than reference with <= 1/3 of its
extra peak memory, noise_embeddings and ddim_teacher_step >= 2x. On a GPU each
kernel also reports its achieved bandwidth (bytes it must move / time) as a
fraction of the card's measured copy bandwidth (goal >= 0.85).

On CPU also gelu_tanh (the denoiser's MLP nonlinearity; no CUDA kernel) over
(N, 4 D) activations, against PyTorch's tanh GELU, and ada_layer_norm (the
denoiser's AdaLN; no CUDA kernel) at the digits model's shape, (72, 64, 128) per
student forward, against PyTorch's LayerNorm plus the two broadcast ops.
"""
from __future__ import annotations

import functools

import torch

from benchmarks.harness import (Context, Record, Result, StageSkipped, Timing, describe_error, failed_case,
                                kernel_sum_ms, measure, with_graph_timing)
from vqlcmd import ops

STAGE = "compiled_ops"

def _shapes(ctx: Context) -> dict:
    return dict(B=2, M=16, K=64, D=32) if ctx.quick else dict(B=64, M=256, K=1024, D=256)


def _reps(ctx: Context) -> dict:
    return dict(warmup=1, reps=2) if ctx.quick else dict(warmup=2, reps=7)


def copy_bandwidth(device: torch.device, nbytes: int) -> float:
    """Bytes per second of a device-to-device copy (read + write) of nbytes, replayed from a CUDA graph as the
    kernels are: event timing of a launch added its latency (5-10 µs of ~0.37 ms), reading every fraction
    of copy 1.5-3% high."""
    src = torch.empty(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / (_graph_ms(lambda: dst.copy_(src), device) * 1e-3)


def _graph_ms(fn, device: torch.device) -> float:
    """Median time of ``fn`` replayed from a CUDA graph, as the kernels are timed."""
    t, _ = with_graph_timing(fn, device, measure(fn, device, warmup=3, reps=10))
    return t.median_ms


def equal_copy_ms(device: torch.device, nbytes: int) -> float:
    """Graph-replay time of a copy that reads and writes nbytes in all, as the kernels are timed.

    At these sizes (16 MiB tensors) a kernel is a few microseconds, so start-up and tail, and the
    tensors that stay in the 50-60 MB L2 between replays, weigh in: a copy of the same bytes measured
    the same way says how much of that a kernel leaves on the table, beside the card's full bandwidth."""
    src = torch.empty(max(nbytes // 8, 1), device=device)
    dst = torch.empty_like(src)
    return _graph_ms(lambda: dst.copy_(src), device)


def randn_ms(device: torch.device, numel: int) -> float:
    """Graph-replay time of PyTorch's own normal draw (cuRAND's Philox4x32-10 and Box-Muller) filling
    numel floats: the floor for a kernel that draws its noise with the same algorithm. Drawing, not
    memory, bounds that: the drawn-noise kernel moves half the bytes of the noise-given one."""
    buf = torch.empty(numel, device=device)
    return _graph_ms(lambda: buf.normal_(), device)


def _cases(ctx: Context):
    """(op, case, shape, dtype, bytes moved, make) with make(backend) -> (fn, setup)."""
    s, dev = _shapes(ctx), ctx.device
    B, M, K, D = s["B"], s["M"], s["K"], s["D"]
    N, f32 = B * M, 4
    g = torch.Generator(dev).manual_seed(0)
    teacher = torch.randn(N, K, device=dev, generator=g)
    student = torch.randn(N, K, device=dev, generator=g)
    upstream = torch.rand(N, device=dev, generator=g)
    tokens = torch.randint(0, K, (B, M), device=dev, generator=g)
    table = torch.randn(K + 1, D, device=dev, generator=g)
    alpha, sigma = torch.rand(B, device=dev, generator=g), torch.rand(B, device=dev, generator=g)
    noise = torch.randn(B, M, D, device=dev, generator=g)
    drop = torch.rand(B, M, device=dev, generator=g) < 0.2
    up_z = torch.randn(B, M, D, device=dev, generator=g)
    coef = [torch.rand(B, device=dev, generator=g) + 0.1 for _ in range(4)]
    kl_shape, z_shape = f"N={N} K={K}", f"B={B} M={M} D={D} V={K + 1}"

    def kl_fwd(backend):
        return lambda: ops.categorical_kl(teacher, student, backend=backend), None

    # fwd+bwd through autograd.grad, not .backward(): a CUDA graph captures the warm-up's state, and
    # with .backward() that is a second call accumulating into .grad, so each replay timed an extra
    # read-add-write of the whole gradient besides the op (0.134 vs 0.083 ms for categorical_kl on an H200)
    def kl_fwd_bwd(backend):
        s_ = student.clone().requires_grad_()
        return lambda: torch.autograd.grad(ops.categorical_kl(teacher, s_, backend=backend), s_, upstream), None

    # drawn noise takes the default generator: a CUDA graph captures its draws without further setup
    # (another generator would have to be registered with the graph)
    def noise_fwd(drawn):
        def make(backend):
            kw = dict(drop_mask=drop, mask_index=K, noise=None if drawn else noise)
            return lambda: ops.noise_embeddings(tokens, table, alpha, sigma, backend=backend, **kw), None
        return make

    def noise_fwd_bwd(backend):
        tab = table.clone().requires_grad_()

        def fn():
            z = ops.noise_embeddings(tokens, tab, alpha, sigma, noise=noise, drop_mask=drop, mask_index=K,
                                     backend=backend)
            return torch.autograd.grad(z, tab, up_z)

        return fn, None

    def ddim(backend):
        return lambda: ops.ddim_teacher_step(tokens, table, noise, *coef, backend=backend), None

    act = torch.randn(N, 4 * D, device=dev, generator=g)
    up_act = torch.randn(N, 4 * D, device=dev, generator=g)

    def gelu_fwd(backend):
        return lambda: ops.gelu_tanh(act, backend=backend), None

    def gelu_fwd_bwd(backend):
        a = act.clone().requires_grad_()
        return lambda: torch.autograd.grad(ops.gelu_tanh(a, backend=backend), a, up_act), None

    gelu = [("gelu_tanh", "fwd", f"N={N} F={4 * D}", 2 * N * 4 * D * f32, gelu_fwd),
            ("gelu_tanh", "fwd+bwd", f"N={N} F={4 * D}", 5 * N * 4 * D * f32, gelu_fwd_bwd)]

    # the digits model's AdaLN input: 72 images (64 + the L0 rows) x 64 tokens x width 128
    aB, aM, aW = (2, 16, 32) if ctx.quick else (72, 64, 128)
    h = torch.randn(aB, aM, aW, device=dev, generator=g)
    mod = torch.randn(aB, 2 * aW, device=dev, generator=g)
    up_h = torch.randn(aB, aM, aW, device=dev, generator=g)

    def ada_fwd(backend):
        scale, shift = mod.chunk(2, dim=-1)
        return lambda: ops.ada_layer_norm(h, scale, shift, backend=backend), None

    def ada_fwd_bwd(backend):
        leaves = [h.clone().requires_grad_(), mod.clone().requires_grad_()]

        def fn():
            scale, shift = leaves[1].chunk(2, dim=-1)
            return torch.autograd.grad(ops.ada_layer_norm(leaves[0], scale, shift, backend=backend), leaves, up_h)

        return fn, None

    ada_shape = f"B={aB} M={aM} W={aW}"
    gelu += [("ada_layer_norm", "fwd", ada_shape, 2 * aB * aM * aW * f32, ada_fwd),
             ("ada_layer_norm", "fwd+bwd", ada_shape, 5 * aB * aM * aW * f32, ada_fwd_bwd)]
    # bytes each case must move to and from memory at least: each full tensor read or written once, the
    # token ids (int64) and drop mask (bool), and the (K+1, D) table once. A gathered table row is not
    # counted per token: the 1 MiB table stays in L2, so counting it would report more than the card moves.
    ids, tab = N * (8 + 1), (K + 1) * D * f32
    return (gelu if dev.type == "cpu" else []) + [
        ("categorical_kl", "fwd", kl_shape, 2 * N * K * f32 + N * f32, kl_fwd),
        # forward reads both logits and writes the student gradient it emits; backward scales it in place of
        # a second pass over the logits (read + write)
        ("categorical_kl", "fwd+bwd", kl_shape, 5 * N * K * f32, kl_fwd_bwd),
        ("noise_embeddings", "fwd (noise given)", z_shape, 2 * N * D * f32 + ids + tab, noise_fwd(False)),
        ("noise_embeddings", "fwd (noise drawn)", z_shape, N * D * f32 + ids + tab, noise_fwd(True)),
        # noise and z (forward), the upstream gradient (backward), ids twice, table and its gradient
        ("noise_embeddings", "fwd+bwd", z_shape, 3 * N * D * f32 + 2 * ids + 2 * tab, noise_fwd_bwd),
        ("ddim_teacher_step", "fwd", z_shape, 2 * N * D * f32 + N * 8 + tab, ddim),
    ]


# the goal for each compiled kernel: its bandwidth at least this fraction of the card's copy bandwidth
GOAL_FRACTION = 0.85


def _kernel_fraction(build, device: torch.device, nbytes: int, copy_bps: float) -> dict:
    """Where a graph replay falls short of the goal, the fraction of copy bandwidth over the device time of
    the kernels alone (profiler sum). A replay also times what the graph does around them: PyTorch's
    per-replay update of the generator's offsets in graphs that draw random numbers (torch's own
    ``normal_`` replays at 22.4 µs around a 12.3 µs kernel on an H100) and the gaps between kernels."""
    fn, setup = build()
    try:
        k = kernel_sum_ms(fn, device, setup=setup)
    except Exception as exc:  # noqa: BLE001: a figure that cannot be had is reported, not fatal
        return {"kernel_ms": f"n/a: {describe_error(exc)[:80]}"}
    return {"kernel_ms": round(k.median_ms, 4),
            "kernel_fraction_of_copy": round(nbytes / (k.median_ms * 1e-3) / copy_bps, 3)}


def run(ctx: Context) -> list[Record]:
    reason = ops.why_not("categorical_kl", "compiled", torch.empty(1, device=ctx.device))
    if reason is not None:  # not built, or built without CUDA kernels for a CUDA context
        raise StageSkipped(reason)
    copy_bps = copy_bandwidth(ctx.device, 8 << 20 if ctx.quick else 512 << 20) if ctx.device.type == "cuda" else None
    s = _shapes(ctx)
    drawn = s["B"] * s["M"] * s["D"]  # the floats the drawn-noise case draws per call
    results = []
    for op, case, shape, nbytes, make in _cases(ctx):
        timings: dict = {}  # backend -> (Timing, how it was timed)
        # each builds a fresh (fn, setup) for its backend
        makers = {b: functools.partial(make, b) for b in ("reference", "compiled") if b == "reference" or ctx.wants(b)}
        for backend, build in makers.items():
            try:
                fn, setup = build()
                t = measure(fn, ctx.device, setup=setup, **_reps(ctx))
                timings[backend] = with_graph_timing(fn, ctx.device, t, setup) if not ctx.quick else (t, {})
            except Exception as exc:  # noqa: BLE001: one failing case must not end the stage
                results.append(failed_case(exc, stage=STAGE, case=f"{op} {case}", backend=backend, shape=shape))
                ctx.made.append(results[-1])  # (what run.py keeps if a timeout stops the stage)
        timings, how = {b: t for b, (t, _) in timings.items()}, {b: h for b, (_, h) in timings.items()}
        same_copy_ms = equal_copy_ms(ctx.device, nbytes) if copy_bps else None
        draw_ms = randn_ms(ctx.device, drawn) if copy_bps and "drawn" in case else None
        for backend, t in timings.items():
            extra = dict(how[backend])
            if backend != "reference" and "reference" in timings:
                ref = timings["reference"]
                extra["speedup"] = round(ref.median_ms / t.median_ms, 2)
                extra["peak_ratio"] = round(t.peak_mem_bytes / max(ref.peak_mem_bytes, 1), 3)
            if copy_bps:
                bps = nbytes / (t.median_ms * 1e-3)
                extra.update({"GB/s": round(bps / 1e9, 1), "copy GB/s": round(copy_bps / 1e9, 1),
                              "fraction_of_copy": round(bps / copy_bps, 3),
                              "fraction_of_equal_copy": round(same_copy_ms / t.median_ms, 3)})
                if backend != "reference" and bps / copy_bps < GOAL_FRACTION:
                    extra.update(_kernel_fraction(makers[backend], ctx.device, nbytes, copy_bps))
                if draw_ms is not None:  # > 1: gather, draw and combine beat PyTorch's bare draw
                    extra.update({"torch_normal_ms": round(draw_ms, 4),
                                  "torch_normal_over_kernel": round(draw_ms / t.median_ms, 3)})
            results.append(Result(STAGE, f"{op} {case}", backend, shape, "float32", t,
                                  baseline="reference" if backend != "reference" else "", extra=extra))
            ctx.made.append(results[-1])
    return results


if __name__ == "__main__":  # python -m benchmarks.stage_compiled_ops [run.py's options]
    # through run.py, so the malloc settings, profiler quieting and table are the suite's: alone, the
    # reference ops ran without the malloc settings and their speed-ups read several times too high
    import sys

    from benchmarks.run import main

    sys.exit(main(["--stage", "compiled_ops", *sys.argv[1:]]))
