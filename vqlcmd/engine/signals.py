"""SIGINT / SIGTERM as a request to stop at the next step boundary, after a checkpoint."""
from __future__ import annotations

import contextlib
import signal
import threading
from pathlib import Path
from typing import Callable, Optional


def signal_name(signum: Optional[int]) -> str:
    return signal.Signals(signum).name if signum else "another rank's signal"  # None: learnt from another rank


class TrainingInterrupted(RuntimeError):
    """SIGINT or SIGTERM (Ctrl-C, a preempted job) stopped the run at a step boundary, after a checkpoint."""

    def __init__(self, signum: Optional[int], step: int, where: Path):
        self.signum = signum  # None on a rank that learnt of another rank's signal
        super().__init__(f"stopped by {signal_name(signum)} after step {step}; checkpoint {where}: launch the same "
                         "command again to resume")


def stop_on_signals(on_signal: Callable[[int], None]):
    """While installed, SIGINT and SIGTERM only call ``on_signal(signum)``: the loop stops at the next step
    boundary and the run saves a checkpoint, instead of losing the work since the last one (a preempted job
    gets SIGTERM; under the deepspeed launcher Ctrl-C reaches each rank as SIGINT and then as the launcher's
    SIGTERM, and SLURM may send several). A second SIGINT (Ctrl-C again) stops at once."""
    if threading.current_thread() is not threading.main_thread():  # handlers can only be set there
        return contextlib.nullcontext()
    # (None: a handler set outside Python, which could not be put back)
    previous = {s: h for s in (signal.SIGINT, signal.SIGTERM) if (h := signal.getsignal(s)) is not None}
    sigints = []

    def ask_to_stop(signum, frame):  # no I/O here: the loop says what happened
        if signum == signal.SIGINT:
            if sigints:  # Ctrl-C again, whatever came between
                raise KeyboardInterrupt
            sigints.append(signum)
        on_signal(signum)

    @contextlib.contextmanager
    def installed():
        for s in previous:
            signal.signal(s, ask_to_stop)
        try:
            yield
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)

    return installed()
