"""One run per output folder (vqlcmd/engine/run_lock.py), with real separate processes: a folder held by
another process is refused by name and holder; the lock of a killed holder is taken over with a log line."""
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from vqlcmd.engine.run_lock import LOCK_NAME, RunLock, RunLockedError, read_holder

ROOT = Path(__file__).resolve().parents[2]
HOLDER = """
import sys, time
from vqlcmd.engine.run_lock import RunLock
lock = RunLock(sys.argv[1]).acquire()
print("held", flush=True)
if sys.argv[2] == "release":
    lock.release()
    print("released", flush=True)
time.sleep(120)
"""


def _holder(folder, then="hold"):
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(folder), then], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT)
    assert proc.stdout.readline().strip() == "held"
    if then == "release":
        assert proc.stdout.readline().strip() == "released"
    return proc


@pytest.fixture
def procs():
    started = []
    yield started
    for p in started:
        if p.poll() is None:
            p.kill()
        p.wait()


def test_a_second_run_into_a_held_folder_is_refused_naming_folder_and_holder(tmp_path, procs):
    folder = tmp_path / "run"
    procs.append(holder := _holder(folder))
    with pytest.raises(RunLockedError) as err:
        RunLock(folder).acquire()
    msg = str(err.value)
    assert f"train.output_dir {folder} is in use by another run" in msg
    assert f"host {socket.gethostname()}, PID {holder.pid}, started " in msg
    assert err.value.holder["pid"] == holder.pid
    assert read_holder(folder / LOCK_NAME)["pid"] == holder.pid  # the refused run left the file as it was


def test_a_killed_holders_lock_is_taken_over_with_a_log_line(tmp_path, procs):
    folder = tmp_path / "run"
    procs.append(holder := _holder(folder))
    old = read_holder(folder / LOCK_NAME)
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    assert read_holder(folder / LOCK_NAME) == old  # the dead run's name is still in the file
    logged = []
    with RunLock(folder, log=logged.append) as lock:
        assert logged == [f"{folder / LOCK_NAME}: taking over the lock left by a run that is gone (host "
                          f"{socket.gethostname()}, PID {holder.pid}, started {old['started']}: {old['command']})"]
        assert read_holder(folder / LOCK_NAME)["pid"] == os.getpid() == lock.holder["pid"]
        # and this process now holds it against another
        other = subprocess.run([sys.executable, "-c", "import sys; from vqlcmd.engine.run_lock import RunLock; "
                                "RunLock(sys.argv[1]).acquire()", str(folder)], capture_output=True, text=True,
                               env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT)
        assert other.returncode != 0 and f"RunLockedError: train.output_dir {folder} is in use" in other.stderr
        assert f"PID {os.getpid()}," in other.stderr
    assert read_holder(folder / LOCK_NAME) == {}  # released: emptied, not deleted


def test_a_cleanly_released_lock_is_taken_without_a_takeover_line(tmp_path, procs):
    folder = tmp_path / "run"
    procs.append(_holder(folder, then="release"))  # released, and still alive
    logged = []
    with RunLock(folder, log=logged.append):
        assert logged == []
    (folder / LOCK_NAME).write_text("not json")  # a damaged file with a free lock: taken, nothing to name
    with RunLock(folder, log=logged.append):
        assert logged == []


def test_a_dropped_lock_object_lets_go(tmp_path):
    lock = RunLock(tmp_path / "run").acquire()
    with pytest.raises(RunLockedError):  # flock is per open file: a second holder in one process is refused too
        RunLock(tmp_path / "run").acquire()
    del lock
    assert RunLock(tmp_path / "run").acquire().held
