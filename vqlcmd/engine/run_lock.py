"""One run per output folder: ``RunLock(output_dir)``, held by rank 0 for the run's life.

The lock is an ``flock`` on ``output_dir/.run.lock``; the file names its holder (host, PID, start time,
command) so that a refused run can say who holds the folder. The kernel drops an ``flock`` when its holder
dies, however it dies (``kill -9`` included), so a file whose lock is free was left by a run that is gone and
is taken over, with a log line naming the old holder. The file is never deleted: unlinking it while a second
run has it open would let both hold a lock, each on its own inode.

Forked children (data-loader workers) share the open file, and with it the lock, until they exit. Over NFS,
Linux maps ``flock`` to the server's byte-range locks, so two nodes sharing the folder exclude each other.
"""
from __future__ import annotations

import datetime
import fcntl
import json
import os
import socket
import sys
from pathlib import Path
from typing import Callable, Optional, Union

from .config import ConfigError

LOCK_NAME = ".run.lock"


class RunLockedError(ConfigError):
    """Another live run holds the output folder (a ConfigError: the command must name another folder, or wait)."""

    def __init__(self, folder: Path, holder: dict):
        who = describe(holder) if holder else "a run that has not yet written its name"
        super().__init__(f"train.output_dir {folder} is in use by another run ({who}): two runs in one folder "
                         "write the same checkpoints. Wait for it to end or stop it, or train in another "
                         "train.output_dir")
        self.folder, self.holder = folder, holder


def describe(holder: dict) -> str:
    return (f"host {holder.get('host', '?')}, PID {holder.get('pid', '?')}, started {holder.get('started', '?')}"
            + (f": {holder['command']}" if holder.get("command") else ""))


def read_holder(path: Union[str, Path]) -> dict:
    """What a lock file says of its holder ({} when empty or unreadable)."""
    try:
        text = Path(path).read_text()
        return json.loads(text) if text.strip() else {}
    except (OSError, ValueError):
        return {}


class RunLock:
    """``with RunLock(output_dir, log=...):`` or ``acquire()`` / ``release()``; refuses with
    ``RunLockedError`` while another process holds the folder."""

    def __init__(self, output_dir: Union[str, Path], log: Optional[Callable[[str], None]] = None):
        self.folder = Path(output_dir)
        self.path = self.folder / LOCK_NAME
        self.log = log or (lambda msg: print(msg, file=sys.stderr))
        self._fd: Optional[int] = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> "RunLock":
        if self._fd is not None:
            return self
        self.folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise RunLockedError(self.folder, read_holder(self.path)) from None
        except BaseException:
            os.close(fd)
            raise
        old = read_holder(self.path)
        if old:  # a holder that ended cleanly empties the file: this one died holding the folder
            self.log(f"{self.path}: taking over the lock left by a run that is gone ({describe(old)})")
        me = {"host": socket.gethostname(), "pid": os.getpid(),
              "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
              "command": " ".join(sys.argv)[:500]}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(me) + "\n").encode(), 0)
        os.fsync(fd)
        self._fd, self.holder = fd, me
        return self

    def release(self) -> None:
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            os.ftruncate(fd, 0)  # still under the lock: the next run finds no holder to report as gone
        finally:
            os.close(fd)  # (closing drops the flock)

    def __del__(self):  # a dropped holder (a Trainer deleted before the next one in the same process) lets go
        self.release()

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
