"""How many CPU threads torch uses, for the scripts (``--threads N|auto|torch``, or ``VQLCMD_THREADS``).

torch starts one OpenMP thread per core, and OpenMP threads spin at every barrier waiting for each other. When
another process keeps a core busy, the thread that shares that core is descheduled for whole time slices
while the others spin: on a 2-core machine with one core busy, training ran 14-25x slower, and sampling 100
digits took 142 s with 2 threads against 23 s with 1.

- ``auto`` (the default): the cores this process may use (affinity, cgroup quota), shared among the ranks
  started on this machine, less the cores that other work keeps busy at the start (``/proc/stat`` over a
  quarter of a second; the load average where that is not readable). An explicit ``OMP_NUM_THREADS`` wins.
- ``N``: N threads. ``torch``: leave torch's defaults (and OpenMP's wait policy) alone.

The scripts also set ``OMP_WAIT_POLICY=PASSIVE`` (unless it is set, or ``VQLCMD_THREADS=torch``): waiting
threads sleep instead of spinning, so a core that becomes busy later costs time, not a collapse. OpenMP
reads it once, when torch loads it, so it is set at the top of each script, before anything imports torch;
ranks started by the deepspeed launcher run the script's top too.
"""
from __future__ import annotations

import math
import os
import time
from typing import Callable, Optional, Union

ENV = "VQLCMD_THREADS"
CHOICES = "a positive integer, 'auto' or 'torch'"

Setting = Union[int, str]


def parse_setting(value: Union[str, int, None]) -> Setting:
    """``'auto'``, ``'torch'`` or a positive int, from a command-line or environment string (None: auto)."""
    if value is None:
        return "auto"
    if isinstance(value, int) and not isinstance(value, bool):
        n = value
    else:
        text = str(value).strip().lower()
        if text in ("auto", "torch"):
            return text
        try:
            n = int(text)
        except ValueError:
            raise ValueError(f"threads must be {CHOICES}, got {value!r}") from None
    if n < 1:
        raise ValueError(f"threads must be {CHOICES}, got {value!r}")
    return n


def usable_cpus() -> int:
    """The cores this process may run on: its affinity mask, capped by a cgroup v2 CPU quota."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    try:
        quota, period = open("/sys/fs/cgroup/cpu.max").read().split()[:2]
        if quota != "max":
            cpus = min(cpus, max(1, math.ceil(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return max(1, cpus)


def _cpu_times() -> Optional[tuple[int, int]]:
    """(busy, total) jiffies of all cores from /proc/stat, or None."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    total = sum(fields[:8])  # (guest time is counted in user time already)
    return total - idle, total


def busy_cores(sample_s: float = 0.25) -> float:
    """How many cores other work keeps busy now (this process sleeps while it looks)."""
    before = _cpu_times()
    if before is not None:
        time.sleep(sample_s)
        after = _cpu_times()
        if after is not None and after[1] > before[1]:
            machine = os.cpu_count() or 1  # /proc/stat counts every core, not only ours
            return machine * (after[0] - before[0]) / (after[1] - before[1])
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return 0.0


def local_processes() -> int:
    """The ranks started on this machine (the deepspeed launcher's LOCAL_SIZE, torchrun's LOCAL_WORLD_SIZE)."""
    for key in ("LOCAL_SIZE", "LOCAL_WORLD_SIZE"):
        try:
            return max(1, int(os.environ[key]))
        except (KeyError, ValueError):
            continue
    return 1


def decide(setting: Setting, *, cpus: int, busy: float, local: int = 1,
           omp_num_threads: Optional[str] = None) -> tuple[Optional[int], str]:
    """(threads, why): None leaves torch as it is. ``busy``: cores kept busy by other work (a core counts from
    half busy); ``local``: ranks on this machine, which share its cores."""
    if setting == "torch":
        return None, "torch's defaults (threads = cores, OpenMP's own wait policy)"
    if isinstance(setting, int):
        return setting, "as asked"
    if omp_num_threads:
        try:
            n = int(omp_num_threads)
            if n >= 1:
                return n, "OMP_NUM_THREADS"
        except ValueError:
            pass
    share = max(1, cpus // local)
    free = cpus - math.floor(busy + 0.5)
    n = max(1, min(share, free))
    why = f"auto: {cpus} core(s)" + (f" / {local} local ranks" if local > 1 else "")
    return n, why + (f", {busy:.1f} busy with other work" if n < share else "")


def configure(setting: Union[str, int, None] = None, *, log: Optional[Callable[[str], None]] = None,
              measure: Callable[[], float] = busy_cores) -> Optional[int]:
    """Sets torch's thread count from ``setting`` (None: ``VQLCMD_THREADS``, else auto) and exports it as
    ``OMP_NUM_THREADS`` / ``MKL_NUM_THREADS`` for child processes; returns it (None: torch's defaults).
    Raises ValueError (one line) on a bad setting."""
    if setting is None:
        setting = os.environ.get(ENV)
    setting = parse_setting(setting)
    busy = measure() if setting == "auto" and not os.environ.get("OMP_NUM_THREADS") else 0.0
    n, why = decide(setting, cpus=usable_cpus(), busy=busy, local=local_processes(),
                    omp_num_threads=os.environ.get("OMP_NUM_THREADS"))
    if n is not None:
        import torch

        torch.set_num_threads(n)
        os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(n)
    if log is not None:
        policy = os.environ.get("OMP_WAIT_POLICY", "OpenMP's default")
        log(f"threads: {n if n is not None else 'torch default'} ({why}; OMP_WAIT_POLICY {policy}; "
            f"--threads or {ENV} to change)")
    return n
