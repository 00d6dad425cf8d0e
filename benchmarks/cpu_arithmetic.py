"""How much of a step measured on a CPU is arithmetic, which a GPU would run on the device, not the host.

``benchmarks/host_overhead.py`` times the step on a CPU at sizes meant to make the math vanish, so that what is
left is the host work a GPU's step pays before its kernels. Two parts of the math do not vanish there:

- the matrix products: oneDNN's AMX kernel runs 5-7 us per call, ~400 calls a step;
- the passes over the weights (AdamW, the EMAs, the norm, the casts between fp32 and bf16): the widths
  shrink, but the 1000-class embedding and the 1024-token head keep the step at ~1.75M weights, ~10 MB each
  pass, memory-bound at 0.3-2 ms each.

This module measures both the same way for any step, so the two steps compared in one run lose the same
kind of time:

- :func:`onednn_exec` adds up the execution times oneDNN itself reports for each primitive
  (``torch.backends.mkldnn.verbose``: the kernel alone, without ATen's and ideep's set-up around it);
- :func:`large_kernels` adds up the self time of every op or compiled kernel that runs for at least
  ``threshold_us`` (100 us by default). At these sizes only a pass over the weights runs that long. The dispatch
  around such a call is a few microseconds, so its self time is its arithmetic. Shorter kernels (inductor's
  dropout masks of 4096 draws take ~70 us) stay counted as host time. That errs against the step with
  fewer, larger kernels.

What is left, the step's time less both, is the host work: Python, dispatch, allocation, and the matmuls'
set-up outside oneDNN's kernel.
"""
from __future__ import annotations

import ctypes
import os
import sys
import tempfile

import torch

# ops whose arithmetic oneDNN reports itself (counted by onednn_exec, not again by large_kernels)
MATMULS = {"aten::" + n for n in ("mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "_addmm_activation")}
THRESHOLD_US = 100.0


def onednn_exec(run, steps: int) -> dict:
    """Per step of ``run()`` (``steps`` steps): oneDNN's primitive executions and their summed time, by kind.

    oneDNN prints one line per execution to the process's stdout (C stdio, not Python's). For the run, fd 1 is
    pointed at a temporary file, and the line's last field is the time in ms."""
    libc = ctypes.CDLL(None)
    with tempfile.TemporaryFile(mode="w+") as log:
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        saved = os.dup(1)
        os.dup2(log.fileno(), 1)
        try:
            with torch.backends.mkldnn.verbose(torch.backends.mkldnn.VERBOSE_ON):
                run()
        finally:
            libc.fflush(None)
            os.dup2(saved, 1)
            os.close(saved)
        log.seek(0)
        return parse_onednn_verbose(log, steps)


def parse_onednn_verbose(lines, steps: int) -> dict:
    """``onednn_verbose,v1,primitive,exec,cpu,matmul,<impl>,...,<ms>`` lines (oneDNN 3.x) per step."""
    calls, ms = {}, {}
    for line in lines:
        fields = line.strip().split(",")
        if len(fields) < 7 or fields[0] != "onednn_verbose" or "exec" not in fields[2:4]:
            continue
        kind = fields[fields.index("exec") + 2]  # after the engine ("cpu")
        try:
            took = float(fields[-1])
        except ValueError as e:
            raise ValueError(f"oneDNN verbose line without a time at its end: {line.strip()!r}") from e
        calls[kind] = calls.get(kind, 0) + 1
        ms[kind] = ms.get(kind, 0.0) + took
    return {"calls": sum(calls.values()) / steps, "ms": sum(ms.values()) / steps,
            "by_primitive": {k: {"calls": calls[k] / steps, "ms": round(ms[k] / steps, 4)} for k in sorted(calls)}}


def large_kernels(prof, steps: int, is_kernel, threshold_us: float = THRESHOLD_US) -> dict:
    """Per step: the ops and compiled kernels of a torch profile (``is_kernel(name)``) whose self time is at
    least ``threshold_us``, matmuls excepted, with their summed self time and the commonest names."""
    total_us, count, names = 0.0, 0, {}
    for ev in prof.events():
        if not is_kernel(ev.name) or ev.name in MATMULS:
            continue
        us = ev.self_cpu_time_total
        if us >= threshold_us:
            total_us += us
            count += 1
            names[ev.name] = names.get(ev.name, 0.0) + us
    top = sorted(names.items(), key=lambda kv: -kv[1])[:8]
    return {"ms": total_us / 1e3 / steps, "count": count / steps, "threshold_us": threshold_us,
            "commonest_ms": {n[:80]: round(us / 1e3 / steps, 3) for n, us in top}}


def matmul_calls_ms(prof, steps: int) -> float:
    """Per step: the matmul calls' whole time in a torch profile (the outermost matmul op, its children with
    it): oneDNN's kernel and ATen's and ideep's set-up around it (as profiled: a little over the real)."""
    total_us = 0.0
    for ev in prof.events():
        if ev.name not in MATMULS:
            continue
        parent = ev.cpu_parent
        while parent is not None and parent.name not in MATMULS:
            parent = parent.cpu_parent
        if parent is None:
            total_us += ev.cpu_time_total
    return total_us / 1e3 / steps


def split(ms_per_step: float, onednn: dict, large: dict, matmul_ms: float = None) -> dict:
    """The step's time as the CPU's arithmetic (oneDNN's kernels, the long passes) and the rest, its host work;
    with ``matmul_ms`` (:func:`matmul_calls_ms`), the part of that host work that is the matmuls' set-up."""
    arithmetic = onednn["ms"] + large["ms"]
    extra = {}
    if matmul_ms is not None:
        exec_ms = onednn["by_primitive"].get("matmul", {}).get("ms", 0.0)
        extra = {"matmul_calls_ms": round(matmul_ms, 3), "matmul_setup_ms": round(max(matmul_ms - exec_ms, 0.0), 3)}
    return {**extra, "onednn_exec_ms": round(onednn["ms"], 3), "onednn_calls": onednn["calls"],
            "onednn_by_primitive": onednn["by_primitive"], "large_kernel_ms": round(large["ms"], 3),
            "large_kernels": large["count"], "large_kernels_commonest_ms": large["commonest_ms"],
            "threshold_us": large["threshold_us"], "arithmetic_ms": round(arithmetic, 3),
            "host_only_ms": round(ms_per_step - arithmetic, 3)}
