"""Timing and memory measurement shared by every benchmark stage.

A stage module ``benchmarks/stage_<name>.py`` defines ``STAGE = "<name>"`` and
``run(ctx: Context) -> list[Result]``; ``benchmarks/run.py`` discovers them.
Every case is measured with warm-up, several repetitions and the median; CUDA
events on GPU; peak memory per case (CUDA allocator on GPU, tracked allocations
seen by the profiler on CPU).
"""
from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Optional

import torch


@dataclass
class Context:
    device: torch.device
    quick: bool = False  # tiny shapes and few repetitions: proves the harness works (CI)
    backends: Optional[list[str]] = None  # restrict to these backends (None = all available)

    def wants(self, backend: str) -> bool:
        return self.backends is None or backend in self.backends


@dataclass
class Timing:
    median_ms: float
    spread_ms: float  # interquartile range
    peak_mem_bytes: int
    reps: int


@dataclass
class Result:
    stage: str
    case: str  # e.g. "fwd", "fwd+bwd"
    backend: str
    shape: str
    dtype: str
    timing: Timing
    baseline: str = ""  # the backend this case is compared with, measured in the same run
    extra: dict = field(default_factory=dict)  # e.g. {"GB/s": ..., "images/s": ...}

    def row(self) -> dict:
        d = asdict(self)
        d.update(d.pop("timing"))
        return d


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(fn: Callable[[], object], device: torch.device, *, warmup: int = 3, reps: int = 10,
            setup: Optional[Callable[[], None]] = None) -> Timing:
    """Median wall time of ``fn()`` and its peak memory above the starting point."""
    for _ in range(warmup):
        if setup:
            setup()
        fn()
    _sync(device)
    times = []
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        for _ in range(reps):
            if setup:
                setup()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        peak = torch.cuda.max_memory_allocated(device) - base
    else:
        # CPU: time without tracing, then one traced run for the peak (tracemalloc slows the code)
        for _ in range(reps):
            if setup:
                setup()
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        if setup:
            setup()
        peak = cpu_peak_bytes(fn)
    q = statistics.quantiles(times, n=4) if len(times) >= 2 else [times[0]] * 3
    return Timing(statistics.median(times), q[2] - q[0], int(peak), len(times))


def cpu_peak_bytes(fn: Callable[[], object]) -> int:
    """Peak bytes allocated during ``fn()`` on CPU. PyTorch's CPU allocator is not seen by
    tracemalloc, so this uses the profiler's memory accounting."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    # self usage: an op's own allocations minus frees, so nested ops are not counted twice
    events = sorted((e for e in prof.events() if e.self_cpu_memory_usage != 0), key=lambda e: e.time_range.start)
    level = peak = 0
    for e in events:
        level += e.self_cpu_memory_usage
        peak = max(peak, level)
    return peak
