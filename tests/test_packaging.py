"""The source distribution holds what building and running the project needs (MANIFEST.in)."""
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_sdist_holds_every_kernel_source_the_build_and_the_configs(tmp_path):
    # it held csrc/module.cpp only: a CUDA build of it failed on a missing header, a CPU-only one imported and
    # then failed on its first op
    subprocess.run([sys.executable, "setup.py", "-q", "sdist", "--dist-dir", str(tmp_path)], cwd=ROOT, check=True,
                   capture_output=True, timeout=600, env={**__import__("os").environ, "VQLCMD_SKIP_CUDA": "1"})
    (archive,) = tmp_path.glob("vqlcmd-*.tar.gz")
    with tarfile.open(archive) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    wanted = [p.relative_to(ROOT).as_posix() for folder in ("csrc", "configs", "kernels")
              for p in (ROOT / folder).rglob("*") if p.is_file() and "__pycache__" not in p.parts]
    wanted += ["CMakeLists.txt", "requirements.txt", "scripts/train.py", "tests/csrc/test_philox.cpp"]
    assert any(w.endswith(".cu") for w in wanted) and any(w.endswith(".h") for w in wanted)
    missing = sorted(set(wanted) - names)
    assert not missing, missing
    assert "vqlcmd/kernels/_launch.py" in names  # the Triton kernels as the sub-package vqlcmd.kernels


def test_setup_refuses_a_tree_without_the_kernel_sources(tmp_path):
    (tmp_path / "setup.py").write_text((ROOT / "setup.py").read_text())
    out = subprocess.run([sys.executable, "setup.py", "--name"], cwd=tmp_path, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode != 0 and "csrc/module.cpp" in out.stderr and "MANIFEST.in" in out.stderr, out.stderr


def test_build_switches_take_yes_no_words_and_refuse_others():
    """VQLCMD_SKIP_CUDA=true was read as "not 1", i.e. build CUDA: a switch read as its default builds what
    was not asked for."""
    import os

    def name(value):
        return subprocess.run([sys.executable, "setup.py", "--name"], cwd=ROOT, capture_output=True, text=True,
                              timeout=300, env={**os.environ, "VQLCMD_SKIP_CUDA": value})

    said = name("true")
    assert said.returncode == 0 and "CPU kernels only (VQLCMD_SKIP_CUDA=1)" in said.stderr, said.stderr
    said = name("maybe")
    assert said.returncode != 0 and "VQLCMD_SKIP_CUDA='maybe' is not a yes/no value" in said.stderr, said.stderr
