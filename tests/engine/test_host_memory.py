"""The CPU engine's malloc settings (vqlcmd/engine/host_memory.py), each case in a fresh process:
mallopt is process-wide."""
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc")

STEP = """
import resource, sys, torch
from vqlcmd.engine.host_memory import keep_freed_memory
if sys.argv[1] == "1":
    print(keep_freed_memory())
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
def step():  # a training step's worth of 9 MiB activations alive at once, then freed
    xs = [torch.ones(9 << 18) for _ in range(6)]
    del xs
step(); step()
f0 = faults()
for _ in range(5):
    step()
print((faults() - f0) / 5)
"""


def _faults_per_step(tuned: bool, env=None) -> tuple[float, str]:
    out = subprocess.run([sys.executable, "-c", STEP, "1" if tuned else "0"], capture_output=True, text=True,
                         check=True, env=env).stdout.split("\n")
    lines = [line for line in out if line]
    return float(lines[-1]), (lines[0] if tuned else "")


def test_freed_activation_memory_is_reused_without_page_faults():
    """Without the settings, glibc returns the freed heap top to the OS and every step faults its
    ~14k pages (54 MiB / 4 KiB) back in; with them, the pages stay and a step faults (almost) none."""
    default, _ = _faults_per_step(False)
    tuned, message = _faults_per_step(True)
    assert "keeps freed blocks up to 32 MiB" in message
    assert default > 5000, default  # the problem is real on this libc
    assert tuned < 0.05 * default, (tuned, default)


def test_switch_leaves_malloc_alone():
    env = {**os.environ, "VQLCMD_MALLOC_TUNING": "0"}
    faults, message = _faults_per_step(True, env=env)
    assert "left alone" in message
    assert faults > 5000
