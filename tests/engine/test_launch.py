"""Multi-process runs under the deepspeed launcher on CPU (gloo): what CI can check of distributed training."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _deepspeed(*args, timeout=1500):
    exe = shutil.which("deepspeed")
    if exe is None:
        pytest.fail("the deepspeed launcher is not on PATH (pip install deepspeed)")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    # a free port rather than the launcher's default 29500, which another run on the machine may hold
    from vqlcmd.engine.distributed import free_port

    return subprocess.run([exe, "--master_port", str(free_port()), *args], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout, env=env)


def test_two_rank_zero2_bf16_run_saves_checkpoints(tmp_path, tiny_shards, make_config):
    cfg = make_config(tmp_path, tiny_shards, steps=3, checkpoint_every=2)
    text = cfg.read_text().replace('"zero_optimization"', '"bf16": {"enabled": true}, "zero_optimization"')
    cfg.write_text(text)
    proc = _deepspeed("--num_gpus", "2", "scripts/train.py", "--config", str(cfg), "--no-progress",
                      "--set", "train.resume=false")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ck = tmp_path / "run" / "checkpoints"
    assert (ck / "latest").read_text().strip() == "step_0000003"
    assert {p.name for p in (ck / "step_0000003").glob("rank_*_state.pt")} == {"rank_00000_state.pt",
                                                                              "rank_00001_state.pt"}
    assert (tmp_path / "run" / "pipeline" / "model.safetensors").is_file()


def test_ds_digits_two_ranks_few_steps(tmp_path):
    """The CI run the engine issue asks for: ds_digits.json, ZeRO-2, 2 processes, a few steps.

    The digits tokenizer is trained for 20 steps here (cached apart from the quick start's 1000-step
    one): the run checks the engine, not the tokenizer's quality."""
    proc = _deepspeed("--num_gpus", "2", "scripts/train.py", "--config", "ds_digits.json", "--no-progress",
                      "--set", "data.tokenizer_steps=20",
                      "--set", "train.steps=3", "--set", f"train.output_dir={tmp_path / 'digits'}",
                      "--set", "train.sample_every=0", "--set", "train.checkpoint_every=0")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "ZeRO stage 2" in proc.stdout + proc.stderr
    assert (tmp_path / "digits" / "checkpoints" / "step_0000003").is_dir()
