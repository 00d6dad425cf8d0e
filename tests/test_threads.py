"""The scripts' thread setting (vqlcmd/threads.py): its decisions, and the wait policy set before torch loads
OpenMP."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from vqlcmd.threads import configure, decide, parse_setting

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("text, value", [("auto", "auto"), ("AUTO", "auto"), ("torch", "torch"), ("3", 3), (2, 2),
                                         (None, "auto")])
def test_settings_parse(text, value):
    assert parse_setting(text) == value


@pytest.mark.parametrize("text", ["0", "-1", "two", "", "1.5"])
def test_bad_settings_are_refused(text):
    with pytest.raises(ValueError, match="threads must be a positive integer, 'auto' or 'torch'"):
        parse_setting(text)


@pytest.mark.parametrize("cpus, busy, local, expected", [
    (2, 0.05, 1, 2),  # idle: every core
    (2, 1.0, 1, 1),  # the machine with one core kept busy: 1 thread (142 s -> 23 s sampling)
    (2, 0.4, 1, 2),  # a core counts as busy from half busy
    (2, 0.6, 1, 1),
    (2, 2.0, 1, 1),  # never fewer than one
    (16, 0.2, 2, 8),  # two ranks share the machine
    (16, 12.0, 2, 4),  # ... and what other work leaves free
    (16, 1.0, 4, 4),  # a sibling rank's start-up does not starve the others
    (1, 0.0, 3, 1),
])
def test_auto_takes_the_free_cores_shared_among_local_ranks(cpus, busy, local, expected):
    n, why = decide("auto", cpus=cpus, busy=busy, local=local)
    assert n == expected
    assert ("busy with other work" in why) == (expected < max(1, cpus // local))


def test_explicit_settings_win():
    assert decide(3, cpus=2, busy=2.0)[0] == 3  # asked for: given, even on busy cores
    assert decide("auto", cpus=8, busy=0.0, omp_num_threads="2")[0] == 2  # the user's OMP_NUM_THREADS
    assert decide("auto", cpus=8, busy=0.0, omp_num_threads="junk")[0] == 8
    assert decide(5, cpus=8, busy=0.0, omp_num_threads="2")[0] == 5
    assert decide("torch", cpus=8, busy=7.0) == (None, "torch's defaults (threads = cores, OpenMP's own wait policy)")


def test_configure_sets_torch_and_the_environment(monkeypatch):
    before = torch.get_num_threads()
    for key in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "VQLCMD_THREADS", "LOCAL_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setattr("vqlcmd.threads.usable_cpus", lambda: 2)
    lines = []
    try:
        assert configure(None, log=lines.append, measure=lambda: 1.0) == 1
        assert torch.get_num_threads() == 1 and os.environ["OMP_NUM_THREADS"] == "1"
        assert lines[0].startswith("threads: 1 (auto: 2 core(s), 1.0 busy with other work")
        monkeypatch.delenv("OMP_NUM_THREADS")
        monkeypatch.setenv("VQLCMD_THREADS", "2")
        assert configure(None, measure=lambda: pytest.fail("an explicit setting measures nothing")) == 2
        assert torch.get_num_threads() == 2
        monkeypatch.setenv("LOCAL_SIZE", "2")
        monkeypatch.delenv("OMP_NUM_THREADS")
        assert configure("auto", measure=lambda: 0.0) == 1  # the deepspeed launcher's two local ranks
        with pytest.raises(ValueError, match="got 'x'"):
            configure("x")
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("script", ["train.py", "train_tokenizer.py", "sample.py"])
def test_the_scripts_set_a_passive_wait_policy_before_torch_loads_openmp(script):
    """libgomp reads OMP_WAIT_POLICY once, as torch loads it; OMP_DISPLAY_ENV=VERBOSE prints what it took
    (GOMP_SPINCOUNT 0: waiting threads sleep; 300000 when the policy is not set)."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "VQLCMD_THREADS")}
    env["OMP_DISPLAY_ENV"] = "VERBOSE"
    run = subprocess.run([sys.executable, str(REPO / "scripts" / script), "--help"], env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0 and "--threads N|auto|torch" in run.stdout
    assert "GOMP_SPINCOUNT = '0'" in run.stderr, run.stderr[-2000:]
    if script == "train.py":  # VQLCMD_THREADS=torch: OpenMP as torch leaves it
        run = subprocess.run([sys.executable, str(REPO / "scripts" / script), "--help"],
                             env={**env, "VQLCMD_THREADS": "torch"}, capture_output=True, text=True, timeout=300)
        assert "GOMP_SPINCOUNT = '300000'" in run.stderr, run.stderr[-2000:]
