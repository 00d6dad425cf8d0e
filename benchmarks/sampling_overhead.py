#!/usr/bin/env python
"""The host's share of a guided sampling step: ``sample_latents`` at imagenet-246m's structure, tiny tensors.

    python benchmarks/sampling_overhead.py                 # eager, ancestral, guided (ω = 1)
    python benchmarks/sampling_overhead.py --compile       # the step compiled whole (sample_latents(compile=True))
    python benchmarks/sampling_overhead.py --json rows.jsonl

``size="tiny"`` keeps the preset's structure (depth 24, K = 1024, 1000 classes) with width, heads, embedding
and tokens shrunk as ``benchmarks/host_overhead.py`` shrinks them, so a step's cost is the Python and
dispatch work around the math; ``size="full"`` is the preset itself. Per sampling step (the difference
between a run of ``steps`` steps and a run of one, so the first draw and the final call do not count),
guided:

- ``top_level_ops``: ops dispatched from Python (no op above them, as ``host_overhead.count_ops`` counts
  aten's; here this package's custom ops ``vqlcmd::*`` count too, as the model calls them on the CPU); on
  a GPU each launches at least one kernel, 5-20 us of host time each; ``ops``: all of them, nested too;
- ``kernel_ops``: those of them that would launch a kernel (not views or allocations);
- ``inductor_kernels``: the compiled step's own generated C++ kernels (``enable_kernel_profile`` makes
  each one a profiler event), counted apart from the aten ops;
- ``ms_per_step``: host wall time (the device synchronised at the ends only), with the machine's load.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks import synthetic_shards  # noqa: E402
from benchmarks.host_overhead import NO_KERNEL, TINY  # noqa: E402  (the training step's stage: the same sizes)

SIZES = ("tiny", "full")


def build(size: str = "tiny", device="cpu", **overrides):
    """(denoiser, embedding table (K+1, D)) with imagenet-246m's structure, random weights."""
    from vqlcmd.model import Denoiser, preset_config

    if size not in SIZES:
        raise ValueError(f"size must be one of {SIZES}, got {size!r}")
    layout = dict(synthetic_shards.LAYOUTS["imagenet-246m"])
    cfg = preset_config("imagenet-246m", **{**layout, **(TINY if size == "tiny" else {}), **overrides})
    torch.manual_seed(0)
    denoiser = Denoiser(cfg).to(device).eval()
    table = torch.randn(cfg.codebook_size + 1, cfg.embed_dim, device=device)
    return denoiser, table


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# the ops a step dispatches: aten's and this package's own (its C++/CUDA and Triton kernels, custom ops)
OP_PREFIXES = ("aten::", "vqlcmd::", "vqlcmd_triton::")


def _is_kernel_event(name: str) -> bool:
    """An inductor-generated C++ kernel's profiler event (``graph_0_cpp_fused_*``, as its code generator
    names them under ``cpp.enable_kernel_profile``)."""
    return "cpp_fused_" in name


def _counts(prof) -> dict:
    top = kernel = inductor = total = 0
    for ev in prof.events():
        if _is_kernel_event(ev.name):
            inductor += 1
            continue
        if not ev.name.startswith(OP_PREFIXES):
            continue
        total += 1
        parent = ev.cpu_parent
        while parent is not None and not parent.name.startswith(OP_PREFIXES):
            parent = parent.cpu_parent
        if parent is None:
            top += 1
            kernel += ev.name not in NO_KERNEL
    return {"top_level_ops": top, "kernel_ops": kernel, "ops": total, "inductor_kernels": inductor}


def measure(size: str = "tiny", batch: int = 2, steps: int = 5, guidance: float = 1.0, sampler: str = "ancestral",
            compile: bool = False, device=None, repeats: int = 3, **overrides) -> dict:
    """One JSON-able row: per guided sampling step, the ops, kernels and host ms (see the module docstring).

    ``steps`` >= 2 sampling steps per timed run; ``repeats`` timed runs (the fastest counts: the others' extra
    is other jobs' load); ``overrides``: model config fields (``depth=2``) over the preset's."""
    from torch._inductor import config as inductor_config
    from torch.profiler import ProfilerActivity, profile

    from benchmarks.run import device_name, git_commit
    from vqlcmd.samplers import sample_latents
    from vqlcmd.schedule import ShiftedCosineSchedule

    if steps < 2:
        raise ValueError(f"steps must be >= 2 (a step's cost is a run of `steps` less a run of 1), got {steps}")
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    denoiser, table = build(size, device, **overrides)
    labels = torch.arange(batch, device=device) % denoiser.cfg.num_classes
    schedule = ShiftedCosineSchedule()

    def run(n: int):
        sample_latents(denoiser, table, schedule, class_labels=labels, num_steps=n, sampler=sampler,
                       guidance_scale=guidance, generator=torch.Generator(device).manual_seed(0), compile=compile)

    # set before the first compile: the flag is part of the generated code (a profiler event per kernel)
    with inductor_config.patch({"cpp.enable_kernel_profile": True}):
        t0 = time.perf_counter()
        run(steps)  # compiles (compile=True) and warms up
        _sync(device)
        first_s = time.perf_counter() - t0

        def timed(n: int) -> float:
            best = float("inf")
            for _ in range(repeats):
                t0 = time.perf_counter()
                run(n)
                _sync(device)
                best = min(best, time.perf_counter() - t0)
            return best

        ms = 1e3 * (timed(steps) - timed(1)) / (steps - 1)
        counted = {}
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        for n in (1, steps):
            with profile(activities=acts) as prof:
                run(n)
                _sync(device)
            counted[n] = _counts(prof)
    per_step = {k: (counted[steps][k] - counted[1][k]) / (steps - 1) for k in counted[1]}
    cfg = denoiser.cfg
    return {"stage": "sampling", "device_name": device_name(device), "device": str(device),
            "torch": torch.__version__, "commit": git_commit(), "size": size, "batch": batch,
            "guidance": guidance, "sampler": sampler, "compile": compile, "steps": steps,
            "depth": cfg.depth, "width": cfg.width, "threads": torch.get_num_threads(), "load": os.getloadavg()[0],
            **per_step, "ms_per_step": ms, "first_run_s": first_s}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", choices=SIZES, default="tiny")
    p.add_argument("--batch", type=int, default=2, help="images per call (guidance doubles the denoiser's rows)")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--guidance", type=float, default=1.0)
    p.add_argument("--sampler", choices=("ancestral", "ddim"), default="ancestral")
    p.add_argument("--compile", action="store_true", help="sample_latents(compile=True)")
    p.add_argument("--device", default=None)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", type=Path, help="append the row to this .jsonl file")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    row = measure(args.size, args.batch, args.steps, args.guidance, args.sampler, args.compile, args.device)
    print(json.dumps(row, indent=1))
    print(f"sampling_overhead: {row['top_level_ops']:.0f} ops/step from Python ({row['kernel_ops']:.0f} that run a "
          f"kernel), {row['inductor_kernels']:.0f} inductor kernels, {row['ms_per_step']:.2f} ms/step "
          f"({row['size']}, batch {row['batch']}, ω={row['guidance']}, {row['sampler']}, "
          f"{'compiled' if row['compile'] else 'eager'}, load {row['load']:.1f})")
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
