"""Configures, builds and runs the C++ tests of the torch-free kernel math (ctest).

CMakeLists.txt builds tests/csrc/test_*.cpp against csrc/ headers; here only those
tests are built (VQLCMD_BUILD_EXTENSION=OFF), in a temporary directory, so
`python -m pytest` runs them without touching the Python build.
"""
import os
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.skipif(shutil.which("cmake") is None or shutil.which("ctest") is None, reason="cmake not installed")
def test_ctest_kernel_math(tmp_path):
    build = tmp_path / "build"

    def run(*cmd):
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
        return proc.stdout

    run("cmake", "-S", ROOT, "-B", str(build), "-DVQLCMD_BUILD_EXTENSION=OFF", "-DCMAKE_BUILD_TYPE=Release")
    run("cmake", "--build", str(build), "-j", "2")
    out = run("ctest", "--test-dir", str(build), "--output-on-failure")
    assert "100% tests passed" in out
    for name in ("test_philox", "test_categorical_kl_math", "test_elementwise_math"):
        assert name in out
