"""``pip install .`` (not editable) gives commands that work from any directory: ``vqlcmd-train --config
ds_digits.json`` finds the shipped config by name and writes its run and the digits cache under the working
directory, with nothing written into the source tree it was installed from."""
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
COMMANDS = ("vqlcmd-train", "vqlcmd-sample", "vqlcmd-evaluate", "vqlcmd-tokenize", "vqlcmd-train-tokenizer")
# what the source tree may gain from building the wheel, and caches
BUILD_OUTPUTS = {"build", "vqlcmd.egg-info", "__pycache__", ".pytest_cache", ".git"}


def _env(**extra):
    """The environment of a user's shell: no PYTHONPATH to the checkout (tests/conftest.py sets one), no launcher
    variables left by in-process trainers, the default cache."""
    drop = ("PYTHONPATH", "VQLCMD_CACHE", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
            "MASTER_PORT", "OMP_WAIT_POLICY", "VQLCMD_THREADS")
    return {**{k: v for k, v in os.environ.items() if k not in drop}, "OMP_NUM_THREADS": "1", **extra}


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """The bin/ folder of a virtual environment holding ``pip install .`` of this tree (torch and the other
    dependencies from the running environment: --system-site-packages, --no-deps, --no-build-isolation)."""
    venv = tmp_path_factory.mktemp("install") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)], check=True,
                   timeout=300)
    # (the running environment's pip, seen through --system-site-packages)
    run = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "--no-build-isolation", "--no-deps",
                          "--no-cache-dir", "--disable-pip-version-check", "-q", str(ROOT)],
                         cwd=venv.parent, env=_env(VQLCMD_SKIP_CUDA="1"), capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return venv / "bin"


def _files_changed_since(start: float) -> list:
    changed = []
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if d not in BUILD_OUTPUTS]
        changed += [os.path.join(folder, f) for f in files + dirs
                    if os.lstat(os.path.join(folder, f)).st_mtime >= start]
    return changed


def test_the_installed_package_is_imported_with_the_shipped_configs(installed, tmp_path):
    run = subprocess.run([str(installed / "python"), "-c", "import vqlcmd, vqlcmd.engine.config_file as c; "
                          "print(vqlcmd.__file__); print(c.resolve_config_path('ds_digits.json'))"],
                         cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    module, config = run.stdout.split()
    site = installed.parent / "lib"
    assert Path(module).is_relative_to(site) and Path(config).is_relative_to(site), run.stdout
    assert Path(config).read_text() == (ROOT / "configs" / "ds_digits.json").read_text()


@pytest.mark.parametrize("command", COMMANDS)
def test_each_command_starts_and_sets_the_wait_policy_before_torch_loads(installed, tmp_path, command):
    """The entry point imports the package before the command's module: that import must not load torch
    (OpenMP reads OMP_WAIT_POLICY once, as torch loads it; GOMP_SPINCOUNT 0: waiting threads sleep)."""
    run = subprocess.run([str(installed / command), "--help"], cwd=tmp_path, env=_env(OMP_DISPLAY_ENV="VERBOSE"),
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.startswith("usage: "), run.stdout[-2000:] + run.stderr[-2000:]
    if command in ("vqlcmd-train", "vqlcmd-sample", "vqlcmd-train-tokenizer"):  # those with --threads
        assert "--threads N|auto|torch" in run.stdout
        assert "GOMP_SPINCOUNT = '0'" in run.stderr, run.stderr[-2000:]


@pytest.mark.slow
def test_vqlcmd_train_from_another_directory_writes_there(installed, tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    start = time.time() - 1  # (file times may be coarser than time.time())
    # a 2-step digits tokenizer: the run checks the install, not the tokenizer's quality
    run = subprocess.run([str(installed / "vqlcmd-train"), "--config", "ds_digits.json", "--no-progress",
                          "--set", "data.tokenizer_steps=2", "--set", "train.steps=2", "--set", "train.sample_every=0"],
                         cwd=work, env=_env(), capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    run_dir = work / "runs" / "digits"  # ds_digits.json's output_dir, from the working directory
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_0000002"
    assert (run_dir / "pipeline" / "model.safetensors").is_file()
    assert (work / ".cache" / "digits" / "tokenizer-32px-2steps-seed0" / "config.json").is_file()
    assert _files_changed_since(start) == []
