"""Ranks stop when their launcher dies: ``watch_launcher()``, called once at a rank's start.

``deepspeed --num_gpus N scripts/train.py`` is three generations: the runner (``.../bin/deepspeed``, the
process a user sees and ``kill -9``s), ``python -m deepspeed.launcher.launch`` (its child, which starts the
ranks and forwards SIGINT/SIGTERM to them) and the ranks. A SIGKILL gives the launcher no chance to forward
anything: after ``kill -9`` of the runner the launch process and every rank were seen training on as
orphans, and a relaunch into the same folder then wrote the same checkpoints.

So each rank looks after itself:
- ``prctl(PR_SET_PDEATHSIG, SIGTERM)``: the kernel sends the rank SIGTERM the moment its parent (the launch
  process) dies, by any signal;
- a watchdog thread polls every launcher above it (the runner too, which PDEATHSIG cannot cover; each
  known by PID and start time, so a reused PID is not mistaken for it) and sends the rank SIGTERM when one
  is gone.
SIGTERM is what a preempted job gets: the trainer stops at the next step boundary and saves. Should the rank
not have exited ``grace`` seconds later (a collective waiting on ranks that are gone never returns to
Python, where the handler runs), the watchdog ends the process.
"""
from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable, List, Optional

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
EXIT_CODE = 128 + signal.SIGTERM  # what a process ended by SIGTERM reports
_LAUNCHER_NAMES = {"deepspeed", "torchrun"}
_LAUNCHER_MODULES = {"deepspeed.launcher.launch", "deepspeed.launcher.runner", "torch.distributed.run",
                     "torch.distributed.launch"}


@dataclass(frozen=True)
class Proc:
    pid: int
    ppid: int
    start: int  # clock ticks after boot: with the PID, names one process even when PIDs are reused
    argv: tuple

    @property
    def command(self) -> str:
        return " ".join(self.argv)[:200]


def proc(pid: int) -> Optional[Proc]:
    """The process ``pid`` from /proc, or None when it is gone (or a zombie: it has exited)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = tuple(a.decode(errors="replace") for a in f.read().split(b"\0") if a)
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()  # (the command name in parentheses may hold spaces)
    if fields[0] in ("Z", "X"):
        return None
    return Proc(pid, int(fields[1]), int(fields[19]), argv)


def is_launcher(argv) -> bool:
    """A deepspeed runner or launch process, or torchrun (``python -m torch.distributed.run``)."""
    head = list(argv[:4])
    if any(os.path.basename(a) in _LAUNCHER_NAMES for a in head):
        return True
    return any(a == "-m" and i + 1 < len(head) and head[i + 1] in _LAUNCHER_MODULES for i, a in enumerate(head))


def launcher_chain(pid: Optional[int] = None) -> List[Proc]:
    """The launchers above ``pid`` (default: this process), nearest first; empty for a plain ``python``."""
    me = proc(os.getpid() if pid is None else pid)
    chain = []
    parent = proc(me.ppid) if me else None
    while parent is not None and parent.pid > 1 and is_launcher(parent.argv):
        chain.append(parent)
        parent = proc(parent.ppid)
    return chain


def set_parent_death_signal(sig: int = signal.SIGTERM) -> bool:
    """Ask the kernel for ``sig`` when this process's parent dies (Linux); False where there is no prctl."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        return False
    return True


class LauncherWatch(threading.Thread):
    """The watchdog thread (see the module docstring). ``stop()`` ends it."""

    def __init__(self, chain: List[Proc], log: Callable[[str], None], interval: float, grace: float,
                 sig: int = signal.SIGTERM):
        super().__init__(name="launcher-watch", daemon=True)
        self.chain, self.log, self.interval, self.grace, self.sig = chain, log, interval, grace, sig
        self.gone: Optional[Proc] = None
        self._stop_event = threading.Event()

    def _first_gone(self) -> Optional[Proc]:
        for p in self.chain:
            now = proc(p.pid)
            if now is None or now.start != p.start:
                return p
        return None

    def run(self) -> None:
        while not self._stop_event.wait(self.interval):
            self.gone = self._first_gone()
            if self.gone is not None:
                break
        else:
            return
        self.log(f"launcher PID {self.gone.pid} ({self.gone.command}) is gone: stopping this rank (PID "
                 f"{os.getpid()}) with SIGTERM, as its launcher would have")
        os.kill(os.getpid(), self.sig)
        if self._stop_event.wait(self.grace):
            return
        self.log(f"rank PID {os.getpid()} still running {self.grace:.0f} s after its launcher died: exiting")
        os._exit(EXIT_CODE)

    def stop(self) -> None:
        self._stop_event.set()


def watch_launcher(log: Optional[Callable[[str], None]] = None, interval: float = 1.0,
                   grace: float = 120.0) -> Optional[LauncherWatch]:
    """Under a launcher: sets the parent-death signal and starts the watchdog; returns it (None without one).
    ``grace``: seconds a rank gets, after the SIGTERM, to save and exit before it is ended."""
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    chain = launcher_chain()
    if not chain:
        return None
    set_parent_death_signal(signal.SIGTERM)
    # the parent may have died before prctl took effect: then this process was already handed to another one
    if os.getppid() != chain[0].pid:
        log(f"launcher PID {chain[0].pid} died while this rank started: stopping with SIGTERM")
        os.kill(os.getpid(), signal.SIGTERM)
    watch = LauncherWatch(chain, log, interval, grace)
    watch.start()
    return watch
