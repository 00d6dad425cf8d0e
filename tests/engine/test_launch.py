"""Multi-process runs under the deepspeed launcher on CPU (gloo): what CI can check of distributed training."""
import os
import shutil
import signal
import subprocess
import sys
import time
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


def _shm_buffers() -> set:
    return set(Path("/dev/shm").glob("deepspeed_allreduce_buffer_*"))


def test_two_rank_zero2_bf16_run_saves_checkpoints(tmp_path, tiny_shards, make_config):
    cfg = make_config(tmp_path, tiny_shards, steps=3, checkpoint_every=2)
    text = cfg.read_text().replace('"zero_optimization"', '"bf16": {"enabled": true}, "zero_optimization"')
    cfg.write_text(text)
    before = _shm_buffers()
    proc = _deepspeed("--num_gpus", "2", "scripts/train.py", "--config", str(cfg), "--no-progress",
                      "--set", "train.resume=false")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # DeepSpeed's shared-memory all-reduce never unlinks its 66 MB buffer per rank; training has no use for it
    assert _shm_buffers() - before == set()
    ck = tmp_path / "run" / "checkpoints"
    assert (ck / "latest").read_text().strip() == "step_0000003"
    assert {p.name for p in (ck / "step_0000003").glob("rank_*_state.pt")} == {"rank_00000_state.pt",
                                                                              "rank_00001_state.pt"}
    import torch

    states = [torch.load(ck / "step_0000003" / f"rank_0000{r}_state.pt", weights_only=True) for r in (0, 1)]
    # attention dropout's global generator: one stream per rank (both ranks used to drop the same weights)
    assert not torch.equal(states[0]["torch_rng"], states[1]["torch_rng"])
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


def test_one_rank_cpu_group_does_not_compile_deepspeeds_shm_allreduce(tmp_path):
    """A one-rank CPU run makes no collectives, so it must not spend minutes JIT-building DeepSpeed's
    shared-memory all-reduce (an empty extensions folder would make it compile, and print so)."""
    code = ("from vqlcmd.engine.distributed import init_distributed\n"
            "print(init_distributed())\n"
            "from deepspeed.comm import comm as dc\n"
            "print('shm op:', dc.cdb.shm_comm_op)\n")
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext"), "CUDA_VISIBLE_DEVICES": ""}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "(0, 1, 0, device(type='cpu'))" in proc.stdout
    assert "shm op: None" in proc.stdout
    assert "built successfully" not in proc.stdout + proc.stderr
    assert not (tmp_path / "ext").exists() or not any((tmp_path / "ext").iterdir())


def _launch_long_run(tmp_path, tiny_shards, make_config):
    import psutil

    from vqlcmd.engine.distributed import free_port

    cfg = make_config(tmp_path, tiny_shards, steps=100000, log_every=1)
    proc = subprocess.Popen([shutil.which("deepspeed"), "--master_port", str(free_port()), "--num_gpus", "2",
                             "scripts/train.py", "--config", str(cfg), "--no-progress"], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    deadline = time.time() + 300
    while time.time() < deadline and not (tmp_path / "run" / "tb").is_dir():  # rank 0 writes it once set up
        time.sleep(0.5)
    time.sleep(3)  # some steps in
    ranks = {}
    for p in psutil.Process(proc.pid).children(recursive=True):
        cmd = " ".join(p.cmdline())
        if "scripts/train.py" in cmd and "--local_rank=" in cmd:
            ranks[int(cmd.split("--local_rank=")[1].split()[0])] = p
    assert sorted(ranks) == [0, 1], ranks
    return proc, ranks


def _checkpoint_of_both_ranks(tmp_path):
    ck = tmp_path / "run" / "checkpoints"
    latest = (ck / "latest").read_text().strip()
    assert int(latest[5:]) > 0
    assert {p.name for p in (ck / latest).glob("rank_*_state.pt")} == {"rank_00000_state.pt", "rank_00001_state.pt"}


def test_a_signal_to_one_rank_stops_both_at_the_same_step_with_a_checkpoint(tmp_path, tiny_shards, make_config):
    """The stop flag travels in the per-step collective: rank 0, never signalled, stops at rank 1's step."""
    proc, ranks = _launch_long_run(tmp_path, tiny_shards, make_config)
    ranks[1].send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode != 0, out[-3000:]
    assert "another rank's signal: stopping at step" in out, out[-3000:]  # rank 0's log
    _checkpoint_of_both_ranks(tmp_path)


def test_ctrl_c_under_the_launcher_saves_a_checkpoint(tmp_path, tiny_shards, make_config):
    """Ctrl-C signals the whole foreground group: each rank gets SIGINT, then the launcher's SIGTERM, which used
    to count as a second signal and killed the ranks before they saved."""
    import psutil

    proc, ranks = _launch_long_run(tmp_path, tiny_shards, make_config)
    os.killpg(proc.pid, signal.SIGINT)
    time.sleep(0.5)  # the launcher's SIGTERM comes a moment later (sent here too, so the test does not hang on timing)
    for p in ranks.values():
        try:
            p.send_signal(signal.SIGTERM)
        except psutil.NoSuchProcess:
            pass
    out, _ = proc.communicate(timeout=300)
    assert "SIGINT: stopping at step" in out, out[-3000:]
    _checkpoint_of_both_ranks(tmp_path)
