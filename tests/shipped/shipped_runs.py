"""Launching scripts/train.py under the deepspeed launcher and reading back what the run recorded: its per-step losses
and step times (TensorBoard) and each rank's peak memory (the kernel's high-water mark, VmHWM).

``python tests/shipped/shipped_runs.py RUN_DIR [RUN_DIR ...]`` prints a finished run's step times."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

REPO = Path(__file__).resolve().parents[2]


@dataclass
class Launch:
    returncode: int
    output: str
    seconds: float
    peak_rss: dict = field(default_factory=dict)  # rank -> bytes (the highest VmHWM seen)
    rss: list = field(default_factory=list)  # (seconds since the launch, {rank: bytes resident}), every second


def deepspeed_command(*launcher_args: str, script_args=()) -> list:
    exe = shutil.which("deepspeed")
    if exe is None:
        raise RuntimeError("the deepspeed launcher is not on PATH (pip install deepspeed)")
    return [exe, *launcher_args, "scripts/train.py", *script_args]


def rank_processes(launcher_pid: int) -> dict:
    """{global rank: psutil.Process} of the training processes under a launcher (RANK from their environment:
    every node's launcher gives its own rank --local_rank=0)."""
    import psutil

    ranks = {}
    for p in psutil.Process(launcher_pid).children(recursive=True):
        try:
            if "scripts/train.py" in " ".join(p.cmdline()):
                ranks[int(p.environ()["RANK"])] = p
        except (psutil.NoSuchProcess, psutil.AccessDenied, KeyError):
            pass
    return ranks


def _status(pid: int) -> dict:
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return {}
    return dict(line.split(":", 1) for line in text.splitlines() if ":" in line)


def handles_sigterm(pid: int) -> bool:
    """Whether the process has a handler for SIGTERM (the trainer sets one while it trains, and only then)."""
    caught = _status(pid).get("SigCgt")
    return caught is not None and bool(int(caught, 16) >> (signal.SIGTERM - 1) & 1)


def launch(commands: list, *, timeout: float, watch: Optional[Callable[[dict], None]] = None,
           env: Optional[dict] = None) -> Launch:
    """Runs launcher commands side by side (one per node; one for a single node) and waits for all of them.

    Every second the ranks' peak RSS is read; ``watch(ranks)`` is called with the live {rank: process} until it
    returns True (it may send a signal)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    t0 = time.time()
    procs = [subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              start_new_session=True, env=env) for cmd in commands]
    outputs = [[] for _ in procs]
    readers = [threading.Thread(target=lambda p=p, o=o: o.extend(p.stdout), daemon=True)
               for p, o in zip(procs, outputs)]
    for r in readers:
        r.start()
    peak, timeline, watching = {}, [], watch is not None
    try:
        while any(p.poll() is None for p in procs):
            if time.time() - t0 > timeout:
                raise TimeoutError(f"the run took more than {timeout} s:\n" + "".join(sum(outputs, []))[-3000:])
            ranks = {}
            for p in procs:
                if p.poll() is None:
                    ranks.update(rank_processes(p.pid))
            now = {}
            for rank, proc in ranks.items():
                status = _status(proc.pid)
                if "VmHWM" in status:
                    peak[rank] = max(peak.get(rank, 0), int(status["VmHWM"].split()[0]) * 1024)
                    now[rank] = int(status["VmRSS"].split()[0]) * 1024
            timeline.append((time.time() - t0, now))
            if watching and ranks and watch(ranks):
                watching = False
            time.sleep(0.2 if watching else 1.0)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    for r in readers:
        r.join(timeout=10)
    output = "".join(sum(outputs, []))
    rc = next((p.returncode for p in procs if p.returncode != 0), 0)
    return Launch(rc, output, time.time() - t0, peak, timeline)


def scalars(run_dir: Path) -> dict:
    """{tag: {step: value}} of a run's TensorBoard scalars (all event files: a resumed run adds one)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(Path(run_dir) / "tb"))
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def losses(run_dir: Path) -> dict:
    """{step: {term: value}} of every loss term the run logged."""
    out = {}
    for tag, values in scalars(run_dir).items():
        if tag.startswith("loss/"):
            for step, v in values.items():
                out.setdefault(step, {})[tag[5:]] = v
    return dict(sorted(out.items()))


def seconds_per_step(run_dir: Path, images_per_step: int) -> dict:
    """{step: s} of a run logged at every step (train/images_per_s counts the training step only)."""
    rates = scalars(run_dir).get("train/images_per_s", {})
    return {step: images_per_step / rate for step, rate in sorted(rates.items())}


def report(name: str, run_dir: Path, images_per_step: int, result: Optional[Launch] = None) -> str:
    """One line: s/step (the first step apart: it warms up) and each rank's peak RSS."""
    times = seconds_per_step(run_dir, images_per_step)
    first = times.pop(min(times)) if times else float("nan")
    later = ", ".join(f"{t:.1f}" for t in times.values()) or "-"
    rss = ""
    if result is not None and result.peak_rss:
        rss = "; peak RSS " + ", ".join(f"rank {r} {b / 2**30:.2f} GiB" for r, b in sorted(result.peak_rss.items()))
    return f"{name}: step 1 {first:.1f} s, later steps {later} s/step{rss}"


if __name__ == "__main__":
    import json

    for arg in sys.argv[1:]:
        run = Path(arg)
        cfg = json.loads((run / "config.json").read_text())
        latest = run / "checkpoints" / (run / "checkpoints" / "latest").read_text().strip()
        world = len(list(latest.glob("rank_*_state.pt")))  # one per rank
        print(report(arg, run, cfg["train_micro_batch_size_per_gpu"] * cfg["gradient_accumulation_steps"] * world))
