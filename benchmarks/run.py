#!/usr/bin/env python
"""Per-stage profiling of the VQ-LCMD engine: every backend against its baseline, in one run.

    python benchmarks/run.py                       # all stages, full sizes, CUDA if present
    python benchmarks/run.py --quick --device cpu  # tiny sizes: proves the harness works (CI)
    python benchmarks/run.py --stage attention,denoiser --backend sdpa

Stages are the modules ``benchmarks/stage_<name>.py`` (``STAGE``, ``run(ctx)``).
The table goes to stdout, progress to stderr, and one long-format row per case
(skipped and failed ones included, with the reason) is appended to ``--out``
(JSON lines, or CSV when the name ends in ``.csv``). See benchmarks/README.md.
"""
from __future__ import annotations

import argparse
import csv
import datetime as dt
import importlib
import json
import os
import platform
import signal
import subprocess
import sys
import traceback
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
# run as a script from anywhere: the stage modules import ``benchmarks.harness`` and ``vqlcmd``
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# the CPU peak-memory probe starts the profiler once per case; without this, kineto prints
# start/stop lines (and a GPU-count error on CPU machines) to stderr every time
os.environ.setdefault("KINETO_LOG_LEVEL", "6")

import torch  # noqa: E402

from benchmarks.harness import Context, Result, Skip, StageSkipped, describe_error  # noqa: E402
from vqlcmd.cli import positive_int  # noqa: E402

# cheap, self-contained stages first so that a slow or crashing one late in the run costs least
PREFERRED_ORDER = ("attention", "compiled_ops", "softmax_embedding_average", "denoiser", "optimizer", "train_step",
                   "sampling", "data", "zero", "checkpoint")
DEFAULT_OUT = HERE / "results" / "results.local.jsonl"
ROW_FIELDS = ("stage", "case", "backend", "shape", "dtype", "status", "median_ms", "spread_ms", "peak_mem_bytes",
              "reps", "baseline", "speedup", "extra", "reason", "device", "device_name", "torch", "commit",
              "timestamp", "quick", "host_threads")


def discover() -> list[str]:
    names = sorted(p.stem[len("stage_"):] for p in HERE.glob("stage_*.py"))
    rank = {n: i for i, n in enumerate(PREFERRED_ORDER)}
    return sorted(names, key=lambda n: (rank.get(n, len(rank)), n))


def split_list(values: list[str] | None) -> list[str] | None:
    if not values:
        return None
    return [v.strip() for item in values for v in item.split(",") if v.strip()]


class Terminated(BaseException):
    """SIGTERM, raised where the stage is: a BaseException, so the stages' per-case handlers let it through."""


def _terminated(signum, frame):
    raise Terminated()


def missing_dependency(exc: ImportError) -> bool:
    """A third-party package that is not installed (a SKIPPED stage), not an import error of the project's own
    code (a renamed vqlcmd function must read FAILED, not look like an optional dependency)."""
    name = getattr(exc, "name", None) or ""
    return isinstance(exc, ModuleNotFoundError) and name.split(".")[0] not in ("", "vqlcmd", "benchmarks", "kernels")


def _failed(stage: str, what: str, exc: Exception) -> list:
    traceback.print_exception(exc, file=sys.stderr)  # the row keeps one line; the traceback says where
    return [Skip(stage, "", "", f"{what} {describe_error(exc)}", failed=True)]


def run_stage(name: str, ctx: Context) -> list:
    """Import and run one stage; whatever goes wrong becomes a stage-level Skip row."""
    try:
        module = importlib.import_module(f"benchmarks.stage_{name}")
    except ImportError as exc:
        if missing_dependency(exc):
            return [Skip(name, "", "", f"missing dependency: {describe_error(exc)}")]
        return _failed(name, "import failed:", exc)
    except Exception as exc:  # noqa: BLE001: a broken stage file must not end the run
        return _failed(name, "import failed:", exc)
    stage = getattr(module, "STAGE", name)
    if not callable(getattr(module, "run", None)):
        return [Skip(stage, "", "", "stage module has no run(ctx)", failed=True)]
    try:
        records = list(module.run(ctx))
    except StageSkipped as exc:
        return [Skip(stage, "", "", str(exc))]
    except ImportError as exc:
        if missing_dependency(exc):
            return [Skip(stage, "", "", f"missing dependency: {describe_error(exc)}")]
        return _failed(stage, "stage raised", exc)
    except Exception as exc:  # noqa: BLE001
        return _failed(stage, "stage raised", exc)
    finally:
        if ctx.is_cuda:
            torch.cuda.empty_cache()
    bad = [r for r in records if not isinstance(r, (Result, Skip))]
    if bad:
        return [Skip(stage, "", "", f"run(ctx) returned {type(bad[0]).__name__}, not Result/Skip", failed=True)]
    return records


def _key(r: Result, backend: str) -> tuple:
    return (r.stage, r.case, r.shape, r.dtype, backend)


def speedups(records: list) -> dict[int, float]:
    """Speed-up of each Result over its baseline: same stage, case, shape and dtype, measured in this run.

    A baseline row gets 1.0, whether it names itself as baseline or leaves ``baseline`` empty.
    """
    results = [r for r in records if isinstance(r, Result)]
    by_key = {_key(r, r.backend): r for r in results}
    out = {}
    for r in results:
        if r.baseline:
            base = by_key.get(_key(r, r.baseline))
            if base is not None and r.timing.median_ms > 0 and timing_method(r) == timing_method(base):
                out[id(r)] = base.timing.median_ms / r.timing.median_ms
                out[id(base)] = 1.0
    return out


def timing_method(r: Result) -> str:
    """How a GPU row was timed ("graph replay", "kernel sum", "launch"; "" for plain timing): a ratio of two
    methods (replay against a profiler kernel sum, which reads a little lower) is no speed-up, so none is
    given."""
    return str((r.extra or {}).get("timing", "")).split(" (")[0]


def is_baseline(r: Result, ups: dict[int, float]) -> bool:
    return r.backend == r.baseline or (not r.baseline and ups.get(id(r)) == 1.0)


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            name = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{name} ({os.cpu_count()} logical cores)"


def git_commit() -> str:
    """``git describe --dirty``, or ``VQLCMD_COMMIT`` where set: scripts/gpu_check.sh sets it from the tree
    manifest the lease carries (a lent machine's copy of the tree has no .git to describe)."""
    if os.environ.get("VQLCMD_COMMIT"):
        return os.environ["VQLCMD_COMMIT"]
    try:
        return subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=12"], cwd=ROOT,
                              capture_output=True, text=True, timeout=10).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def to_rows(records: list, ups: dict[int, float], meta: dict) -> list[dict]:
    rows = []
    for r in records:
        if isinstance(r, Result):
            row = r.row()
            row.update(status="ok", speedup=ups.get(id(r)), reason="")
        else:
            row = dict(stage=r.stage, case=r.case, backend=r.backend, shape="", dtype="", status=r.status,
                       median_ms=None, spread_ms=None, peak_mem_bytes=None, reps=0, baseline="", speedup=None,
                       extra={}, reason=r.reason)
        row.update(meta)
        rows.append({k: row.get(k) for k in ROW_FIELDS})
    return rows


def append_rows(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix.lower() == ".csv":
        new = not path.exists() or path.stat().st_size == 0
        with open(path, "a", newline="") as f:
            w = csv.DictWriter(f, fieldnames=ROW_FIELDS)
            if new:
                w.writeheader()
            for row in rows:
                w.writerow({**row, "extra": json.dumps(row["extra"], sort_keys=True)})
    else:
        with open(path, "a") as f:
            for row in rows:
                f.write(json.dumps(row, sort_keys=False) + "\n")


def out_problem(path: Path) -> str | None:
    """Why ``--out`` cannot be appended to, or None; checked before any stage runs, so a bad path
    does not end in a traceback after minutes of measuring."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a"):
            pass
    except OSError as exc:
        return f"--out {path}: cannot append to it ({exc.strerror or exc})"
    return None


def _fmt_ms(x: float) -> str:
    return f"{x:.3g}" if x < 100 else f"{x:.0f}"


def _fmt_bytes(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def _fmt_num(v) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1e5 else f"{v:.3e}"
    return str(v)


def format_table(records: list, ups: dict[int, float]) -> str:
    header = ("stage", "case", "backend", "shape", "dtype", "median ms", "IQR ms", "peak mem", "speed-up", "figures")
    lines = []
    for r in records:
        if not isinstance(r, Result):
            continue
        up = ups.get(id(r))
        up_s = "base" if is_baseline(r, ups) else (f"{up:.2f}x" if up is not None else "-")
        # structured figures (the autotuner's picks) go to the results file only: too long for a cell
        figures = "  ".join(f"{k}={_fmt_num(v)}" for k, v in r.extra.items() if not isinstance(v, (dict, list)))
        lines.append((r.stage, r.case, r.backend, r.shape, r.dtype, _fmt_ms(r.timing.median_ms),
                      _fmt_ms(r.timing.spread_ms), _fmt_bytes(r.timing.peak_mem_bytes), up_s, figures))
    widths = [max(len(h), *(len(line[i]) for line in lines)) if lines else len(h) for i, h in enumerate(header)]
    numeric = {5, 6, 7, 8}

    def fmt(cols):
        cells = (c.rjust(w) if i in numeric else c.ljust(w) for i, (c, w) in enumerate(zip(cols, widths)))
        return "  ".join(cells).rstrip()

    out = [fmt(header), fmt(["-" * w for w in widths])]
    prev_stage = None
    for line in lines:
        if prev_stage is not None and line[0] != prev_stage:
            out.append("")
        out.append(fmt(line))
        prev_stage = line[0]
    skips = [r for r in records if isinstance(r, Skip)]
    if skips:
        out += ["", "Not measured:"]
        for s in skips:
            what = "/".join(x for x in (s.stage, s.case, s.backend) if x)
            out.append(f"  {s.status.upper():7s} {what}: {s.reason}")
    return "\n".join(out)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stage", action="append", help="stage(s) to run; repeat or comma-separate (default: all)")
    p.add_argument("--backend", action="append",
                   help="backend(s) to measure; repeat or comma-separate. Baselines are always measured.")
    p.add_argument("--quick", action="store_true", help="tiny sizes and few repetitions (CI); timings mean little")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--out", type=Path, default=DEFAULT_OUT,
                   help=f"results file to append to: .jsonl or .csv (default {DEFAULT_OUT.relative_to(ROOT)})")
    p.add_argument("--threads", type=positive_int, default=None,
                   help="CPU threads for torch (default: torch's choice). On a machine shared with other jobs, "
                        "1 avoids OpenMP threads waiting on each other for whole time slices")
    p.add_argument("--list", action="store_true", help="list the stages and exit")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    known = discover()
    if args.list:
        print("\n".join(known))
        return 0
    stages = split_list(args.stage)
    if args.stage and not stages:
        print(f"--stage {args.stage}: no stage named; known: {', '.join(known)}", file=sys.stderr)
        return 2
    # once each: a stage given twice paired its rows with the other run's baseline in the printed table
    stages = list(dict.fromkeys(stages or known))
    unknown = [s for s in stages if s not in known]
    if unknown:
        print(f"unknown stage(s) {unknown}; known: {', '.join(known)}", file=sys.stderr)
        return 2
    problem = out_problem(args.out)
    if problem:
        print(problem, file=sys.stderr)
        return 2
    if args.device == "cuda" and not torch.cuda.is_available():
        print("--device cuda: no CUDA device is available", file=sys.stderr)
        return 2
    device = torch.device("cuda" if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
                          else "cpu")
    if args.threads:
        torch.set_num_threads(args.threads)
    malloc = ""
    if device.type == "cpu":
        # DeepSpeed would otherwise find no GPU, pick its CPU accelerator anyway and say so on stdout
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        # the malloc settings training and sampling run under: without them each large temporary faults its
        # pages in afresh, which made a reference op with several temporaries look up to 5x slower than it
        # runs in training (noise_embeddings fwd: 32.8 ms here, 6.3 ms with them)
        from vqlcmd.engine.host_memory import keep_freed_memory

        malloc = " | " + keep_freed_memory().partition(" (")[0]
    ctx = Context(device=device, quick=args.quick, backends=split_list(args.backend))
    meta = dict(device=device.type, device_name=device_name(device), torch=torch.__version__, commit=git_commit(),
                timestamp=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), quick=args.quick,
                host_threads=torch.get_num_threads())
    print(f"# {meta['device_name']} | torch {meta['torch']} | {meta['host_threads']} threads | commit {meta['commit']}"
          f" | {meta['timestamp']}{' | quick' if args.quick else ''}{malloc}", flush=True)

    previous = signal.signal(signal.SIGTERM, _terminated)  # timeout(1)'s first signal: keep what was measured
    try:
        return _run_stages(args, stages, ctx, meta)
    except Terminated:  # between stages or in the final table: the finished stages' rows are written already
        print("stopped by SIGTERM", file=sys.stderr)
        return 128 + signal.SIGTERM
    finally:
        signal.signal(signal.SIGTERM, previous)


def _run_stages(args, stages: list, ctx: Context, meta: dict) -> int:
    records: list = []
    per_stage: list = []
    for name in stages:
        t0 = time.perf_counter()
        print(f"[{name}] running ...", file=sys.stderr, flush=True)
        ctx.made.clear()
        try:
            stage_records = run_stage(name, ctx)
        except Terminated:
            kept = list(ctx.made)
            append_rows(args.out, to_rows(kept, speedups(kept), meta))
            print(f"[{name}] stopped by SIGTERM: appended the {len(kept)} row(s) it had measured to {args.out}",
                  file=sys.stderr, flush=True)
            return 128 + signal.SIGTERM
        n_ok = sum(isinstance(r, Result) for r in stage_records)
        n_not = len(stage_records) - n_ok
        print(f"[{name}] {n_ok} measured, {n_not} not measured, {time.perf_counter() - t0:.1f} s",
              file=sys.stderr, flush=True)
        records += stage_records
        per_stage.append(stage_records)
        # append as we go: a run killed late still leaves the finished stages on disk
        append_rows(args.out, to_rows(stage_records, speedups(stage_records), meta))

    print(format_table(records, {k: v for recs in per_stage for k, v in speedups(recs).items()}))
    print(f"\nappended {len(records)} rows to {args.out}")
    seen = ctx.asked | {r.backend for r in records}
    unheard = [b for b in ctx.backends or [] if b not in seen]
    if unheard:
        # a typo would otherwise look like a run that measured only the baselines. A warning, not exit 2:
        # stages only ask about the backends this machine could run (no sdpa-flash on a CPU)
        print(f"warning: --backend {', '.join(unheard)}: no stage of this run measured or skipped a backend of "
              f"that name; they know {', '.join(sorted(seen))} here", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
