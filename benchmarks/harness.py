"""Timing and memory measurement shared by every benchmark stage.

A stage module ``benchmarks/stage_<name>.py`` defines ``STAGE = "<name>"`` and
``run(ctx: Context) -> list[Result]``; ``benchmarks/run.py`` discovers them.
Every case is measured with warm-up, several repetitions and the median; CUDA
events on GPU; peak memory per case (CUDA allocator on GPU, tracked allocations
seen by the profiler on CPU).

A stage returns :class:`Result` rows and, for what it could not measure,
:class:`Skip` rows with the reason; :func:`run_case` turns an exception inside
one case into a ``failed`` Skip so that one broken backend does not end the stage.
A stage that cannot run at all raises :class:`StageSkipped`.
"""
from __future__ import annotations

import contextlib
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Optional, Union

import torch


@contextlib.contextmanager
def environment(env: Optional[dict] = None):
    """Run the body with ``env`` set in os.environ (the kernels' variant switches, read at each call),
    restoring what was there before; None leaves the environment alone."""
    env = env or {}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@dataclass
class Context:
    device: torch.device
    quick: bool = False  # tiny shapes and few repetitions: proves the harness works (CI)
    backends: Optional[list[str]] = None  # restrict to these backends (None = all available)
    asked: set = field(default_factory=set)  # every backend a stage asked about: run.py names --backend typos
    # every row run_case made in the current stage, as it was made: what run.py keeps of a stage cut short
    # (a stage returns its rows only when it ends, and a timed-out step on a lent GPU lost them all)
    made: list = field(default_factory=list)

    def wants(self, backend: str, *, baseline: bool = False) -> bool:
        """Whether to measure ``backend``. A stage passes ``baseline=True`` for its baseline,
        which is measured whatever ``--backend`` says, so every speed-up has its reference."""
        self.asked.add(backend)
        return baseline or self.backends is None or backend in self.backends

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    # Full runs stop repeating a case after this many seconds once MIN_REPS are in: on a 2-core
    # machine a single paper-size step takes seconds and a stage would otherwise take many minutes.
    time_budget_s: float = 20.0

    def repetitions(self, warmup: int = 3, reps: int = 10) -> dict:
        """``measure`` keyword arguments: the given counts, or the least that still gives a median in quick mode."""
        if self.quick:
            return dict(warmup=1, reps=2)
        return dict(warmup=warmup, reps=reps, budget_s=self.time_budget_s)


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


@dataclass
class Skip:
    """A case (or a whole stage, with empty case and backend) that was not measured."""

    stage: str
    case: str
    backend: str
    reason: str
    failed: bool = False  # True: it raised; False: not applicable here (not installed, wrong device)

    @property
    def status(self) -> str:
        return "failed" if self.failed else "skipped"


class StageSkipped(Exception):
    """Raised by a stage's ``run`` when the stage cannot run at all here (missing dependency, no GPU)."""


Record = Union[Result, Skip]


def describe_error(exc: BaseException) -> str:
    msg = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {msg[0] if msg else ''}"[:300]


def failed_case(exc: BaseException, *, stage: str, case: str, backend: str, shape: str) -> Skip:
    """The failed Skip row for a case that raised ``exc``, said on stderr as it happens."""
    print(f"  {stage} | {case} | {backend} | {shape}: FAILED {describe_error(exc)}", file=sys.stderr, flush=True)
    return Skip(stage, case, backend, describe_error(exc), failed=True)


def run_case(ctx: Context, out: list, *, stage: str, case: str, backend: str, shape: str, dtype: str,
             fn: Callable[[], object], baseline: str = "", setup: Optional[Callable[[], None]] = None,
             extra: Optional[Callable[[Timing], dict]] = None, warmup: int = 3, reps: int = 10,
             budget_s: Optional[float] = None, graph: bool = False) -> Optional[Timing]:
    """Measure one case and append its Result to ``out``; on an exception append a failed Skip instead.

    ``extra(timing)`` turns the timing into figures such as images/s; ``warmup``/``reps``
    are the full-run counts (quick mode uses fewer); ``budget_s`` overrides ``ctx.time_budget_s``.
    ``graph``: on CUDA, report the CUDA-graph replay time (kernels only) and keep the launch-bound
    time as the figure ``launch_ms`` (see ``graph_replay_ms``).
    Passing ``**ctx.repetitions(...)`` works too.
    """
    counts = ctx.repetitions(warmup, reps)
    if budget_s is not None and "budget_s" in counts:
        counts["budget_s"] = budget_s
    try:
        timing = measure(fn, ctx.device, setup=setup, **counts)
        how = {}
        if graph and not ctx.quick:
            timing, how = with_graph_timing(fn, ctx.device, timing, setup)
        figures = {**(extra(timing) if extra else {}), **how}
    except Exception as exc:  # noqa: BLE001: one failing case must not end the stage
        out.append(failed_case(exc, stage=stage, case=case, backend=backend, shape=shape))
        ctx.made.append(out[-1])
        return None
    out.append(Result(stage, case, backend, shape, dtype, timing, baseline, figures))
    ctx.made.append(out[-1])
    # progress for long runs (stderr: the table on stdout stays clean)
    print(f"  {stage} | {case} | {backend} | {shape}: {timing.median_ms:.3g} ms", file=sys.stderr, flush=True)
    return timing


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


MIN_REPS = 3


def summarize(times_ms: list[float], peak_mem_bytes: int = 0) -> Timing:
    """Median and interquartile range of repeated timings (one timing: no spread)."""
    # inclusive: the default "exclusive" method extrapolates past the range for 2-3 repetitions
    q = statistics.quantiles(times_ms, n=4, method="inclusive") if len(times_ms) >= 2 else [times_ms[0]] * 3
    return Timing(statistics.median(times_ms), q[2] - q[0], peak_mem_bytes, len(times_ms))


def graph_replay_ms(fn: Callable[[], object], device: torch.device, *, reps: int = 10, inner: int = 10) -> Timing:
    """Device time of ``fn`` with launch overhead taken out: ``fn`` captured once into a CUDA graph,
    then replayed ``inner`` times between two events, ``reps`` times (median per replay).

    The event timing of ``measure`` includes the host's time to launch every kernel, which for
    sub-millisecond ops on a slow host is most of what it sees; in training the host runs ahead of
    the GPU, so kernel time is what a step pays. Raises if ``fn`` cannot be captured (it syncs).
    """
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):  # warm-up off the capture stream, as torch.cuda.graph asks
        for _ in range(2):
            fn()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize(device)
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(inner):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / inner)
    del graph
    return summarize(times)


def kernel_sum_ms(fn: Callable[[], object], device: torch.device, *, reps: int = 5,
                  setup: Optional[Callable[[], None]] = None) -> Timing:
    """Device time of the kernels, copies and fills one ``fn()`` launches, summed from the profiler's
    CUDA activity (CUPTI); median over ``reps`` calls, each profiled on its own.

    The kernel-time figure for work a CUDA graph cannot capture: like a graph replay it leaves the
    host's launch time out, but it also leaves out the gaps between kernels, so it reads a little
    lower than a replay of the same kernels would.
    """
    from torch.profiler import ProfilerActivity, profile

    if setup:
        setup()
    fn()  # warm: no first-call compilation or autotuning inside the profiled calls
    torch.cuda.synchronize(device)
    sums = []
    for _ in range(reps):
        if setup:
            setup()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize(device)
        # CUDA activity only: every event is device work, none a host op enclosing it
        sums.append(sum(e.device_time_total for e in prof.key_averages()) / 1e3)
    if not any(sums):
        raise RuntimeError("the profiler recorded no CUDA activity")
    return summarize(sums)


def with_graph_timing(fn: Callable[[], object], device: torch.device, timing: Timing,
                      setup: Optional[Callable[[], None]] = None) -> tuple[Timing, dict]:
    """On CUDA: (graph-replay timing with ``timing``'s peak memory, figures naming both times);
    where capture fails, the profiler's kernel sum (``kernel_sum_ms``) and the reason, and where
    that fails too, ``timing`` itself (launch-bound)."""
    if device.type != "cuda":
        return timing, {}
    try:
        if setup:
            setup()
        g = graph_replay_ms(fn, device)
    except Exception as exc:  # noqa: BLE001: a syncing op cannot be captured
        torch.cuda.synchronize(device)
        why = "graph capture failed: " + describe_error(exc)[:120]
        # Seen on an H100 (torch 2.11): no fwd+bwd of softmax_embedding_average could be captured,
        # eager included, and launch-bound timing of a 0.3 ms op read 0.4-2 ms, nothing like its kernels.
        try:
            k = kernel_sum_ms(fn, device, setup=setup)
        except Exception as exc2:  # noqa: BLE001: keep the launch timing, and say why
            torch.cuda.synchronize(device)
            return timing, {"timing": f"launch ({why}; profiler: {describe_error(exc2)[:80]})"}
        return (Timing(k.median_ms, k.spread_ms, timing.peak_mem_bytes, k.reps),
                {"timing": f"kernel sum ({why})", "launch_ms": round(timing.median_ms, 4)})
    return (Timing(g.median_ms, g.spread_ms, timing.peak_mem_bytes, g.reps),
            {"timing": "graph replay", "launch_ms": round(timing.median_ms, 4)})


def measure(fn: Callable[[], object], device: torch.device, *, warmup: int = 3, reps: int = 10,
            setup: Optional[Callable[[], None]] = None, budget_s: Optional[float] = None) -> Timing:
    """Median wall time of ``fn()`` and its peak memory above the starting point.

    With ``budget_s``, the repetitions stop early once ``MIN_REPS`` are done and the timed
    runs have taken that long; ``Timing.reps`` says how many ran.
    """
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
            if _spent(times, budget_s):
                break
        peak = torch.cuda.max_memory_allocated(device) - base
    else:
        # CPU: time without tracing, then one traced run for the peak (tracemalloc slows the code)
        for _ in range(reps):
            if setup:
                setup()
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
            if _spent(times, budget_s):
                break
        peak = cpu_peak_bytes(fn, setup)
    return summarize(times, int(peak))


def _spent(times_ms: list, budget_s: Optional[float]) -> bool:
    return budget_s is not None and len(times_ms) >= MIN_REPS and sum(times_ms) > 1e3 * budget_s


_MEASURED = "vqlcmd::measured_call"


def cpu_peak_bytes(fn: Callable[[], object], setup: Optional[Callable[[], object]] = None) -> int:
    """Peak bytes held during ``fn()`` on CPU above what was held when it started: the running maximum of
    the allocations minus the frees, in the order they happened. PyTorch's CPU allocator is not seen by
    tracemalloc, so this uses the profiler's memory accounting.

    The profiler sees no free of a block allocated before it started, so a call that drops a tensor it
    held (``x.grad = None``, ``zero_grad(set_to_none=True)``) and allocates a new one read as holding both
    (sdpa fwd+bwd 10.2 MiB against 4.2). So one warm-up call runs inside the same profile, and the level
    is measured from the measured call's start, where the warm-up's own tensors are known."""
    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        if setup:
            setup()
        fn()
        if setup:
            setup()
        with record_function(_MEASURED):
            fn()
    start = min((e.time_range.start for e in prof.events() if e.name == _MEASURED), default=None)
    if start is None:
        raise RuntimeError(f"the profiler recorded no {_MEASURED} range: benchmarks/harness.py needs updating")
    start_ns = start * 1000 + prof.profiler.kineto_results.trace_start_ns()  # events are in µs from the trace start
    level = peak = base = 0
    measuring = False
    for t, nbytes in sorted(_cpu_memory_records(prof), key=lambda r: r[0]):  # stable: ties keep their order
        if not measuring and t >= start_ns:
            measuring, base, peak = True, level, level
        level += nbytes
        if measuring:
            peak = max(peak, level)
    return max(0, peak - base)


def _cpu_memory_records(prof) -> list[tuple[int, int]]:
    """(time ns, bytes: + allocated, - freed) of every CPU allocation and free the profiler saw.

    The public events cannot give the peak: they attach memory to ops by time interval, and an
    op's self usage, placed at its start, counts its frees before its children's allocations
    (0 B for a foreach AdamW step that allocates MBs). The raw "[memory]" records are reached
    only through the private ``kineto_results``; if that moves, fail here rather than report 0.
    """
    try:
        events = prof.profiler.kineto_results.events()
        records = [(e.start_ns(), e.nbytes(), e.device_type()) for e in events if e.name() == "[memory]"]
    except AttributeError as exc:
        raise RuntimeError(f"this torch's profiler no longer exposes its memory records ({exc}); "
                           "benchmarks/harness.py:_cpu_memory_records needs updating") from exc
    from torch.autograd import DeviceType

    cpu = (DeviceType.CPU, DeviceType.MKLDNN, DeviceType.IDEEP)  # what torch counts as CPU memory
    return [(t, n) for t, n, d in records if d in cpu]
