"""Ranks exit when their launcher dies (vqlcmd/engine/parent_watch.py), on a real deepspeed launcher's process
tree: runner (bin/deepspeed) -> python -m deepspeed.launcher.launch -> rank. A SIGKILL of either launcher
process stops the rank with SIGTERM within seconds; a rank that does not end on SIGTERM is ended."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from vqlcmd.engine.distributed import free_port
from vqlcmd.engine.parent_watch import is_launcher, launcher_chain, proc

ROOT = Path(__file__).resolve().parents[2]
RANK = Path(__file__).with_name("launcher_rank.py")


def _wait(pred, timeout, what):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return
        time.sleep(0.05)
    pytest.fail(f"timed out after {timeout} s waiting for {what}")


@pytest.fixture
def launch(tmp_path):
    started = []

    def start(*rank_args):
        out = tmp_path / "rank.json"
        runner = os.path.join(os.path.dirname(sys.executable), "deepspeed")  # the script the shim would exec
        env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
        p = subprocess.Popen([sys.executable, runner, "--num_gpus", "1", "--master_port", str(free_port()),
                              str(RANK), str(out), *rank_args], cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, start_new_session=True)
        started.append(p)
        _wait(out.exists, 120, "the rank to start watching")
        return p, json.loads(out.read_text()), out

    yield start
    for p in started:  # whatever is left of the tree: the session holds runner, launch process and rank
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait()


def _gone(pid):
    return proc(pid) is None


@pytest.mark.parametrize("killed", ["runner", "launch"])
def test_a_rank_stops_within_seconds_of_its_launchers_sigkill(launch, killed):
    runner, rank, out = launch()
    chain = rank["chain"]  # nearest first; the test's own process (pytest) is no launcher
    assert len(chain) == 2 and "deepspeed.launcher.launch" in chain[0][1] and chain[1][0] == runner.pid
    target = runner.pid if killed == "runner" else rank["chain"][0][0]
    os.kill(target, signal.SIGKILL)
    t0 = time.monotonic()
    _wait(lambda: _gone(rank["pid"]), 10, f"the rank to exit after its {killed}'s SIGKILL")
    took = time.monotonic() - t0
    print(f"rank exited {took:.2f} s after the {killed}'s SIGKILL")
    assert took < 5, took
    assert Path(str(out) + ".term").read_text().split() == [str(rank["pid"])]  # by SIGTERM: the trainer saves
    if killed == "runner":  # PDEATHSIG covers the parent; the watchdog the runner above it, and says so
        assert f"launcher PID {runner.pid} (" in Path(str(out) + ".log").read_text()


def test_a_rank_that_ignores_sigterm_is_ended_after_the_grace(launch):
    runner, rank, out = launch("--ignore-term")
    os.kill(runner.pid, signal.SIGKILL)
    _wait(lambda: Path(str(out) + ".term").exists(), 10, "the SIGTERM")
    _wait(lambda: _gone(rank["pid"]), 10, "the rank to be ended after its 2 s grace")
    assert "still running 2 s after its launcher died: exiting" in Path(str(out) + ".log").read_text()


def test_launchers_are_told_from_other_parents():
    assert is_launcher(["/usr/bin/python", "/venv/bin/deepspeed", "--num_gpus", "1"])
    assert is_launcher(["python", "-u", "-m", "deepspeed.launcher.launch", "--world_info=x"])
    assert is_launcher(["torchrun", "--nproc_per_node", "2", "train.py"])
    assert not is_launcher(["bash", "-c", "deepspeed_stuff.sh"]) and not is_launcher(["python", "train.py"])
    assert launcher_chain() == []  # pytest, under a shell: nothing to watch
