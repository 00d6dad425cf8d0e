"""Injected faults, driving the real scripts/train.py under the deepspeed launcher (2 ranks, gloo): what the
run resumed from, that nothing that had verified was lost (byte for byte), and the exact losses afterwards,
against one uninterrupted run per module. A resume on another number of ranks: test_world_size.py.

Where a fault must strike at one point (a rank inside step 4, inside a save, a full disk at the second save),
the launcher runs ``_HOOK`` instead of scripts/train.py: the same ``vqlcmd.cli.train.main``, with ``torch.save``
or the step wrapped to hold there (for the test to ``kill -9`` the process) or to raise ENOSPC."""
import errno
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from test_world_size import _config, _from_step_2, _losses
from vqlcmd.engine.checkpoint import CheckpointManager, verify_checkpoints_cli
from vqlcmd.engine.distributed import free_port

REPO = Path(__file__).resolve().parents[2]
STEP_2, STEP_4 = "step_0000002", "step_0000004"

_HOOK = r'''
import errno, os, sys, time
from pathlib import Path

from vqlcmd.cli import train as cli  # first: it sets OpenMP's wait policy before torch loads
import torch
from vqlcmd.engine.step import TrainStep

fault, at, me = os.environ["FAULT"], int(os.environ["FAULT_STEP"]), os.environ.get("RANK", "0")
mine = me == os.environ.get("FAULT_RANK", me)
partial = f"step_{at:07d}.partial"


def hold():  # tell the test which process to kill, then wait for it
    Path(os.environ["FAULT_MARKER"]).write_text(str(os.getpid()))
    time.sleep(600)


if fault == "in_step" and mine:
    call = TrainStep.__call__

    def in_step(self, batches, step):
        if step == at:
            hold()
        return call(self, batches, step)

    TrainStep.__call__ = in_step
save = torch.save


def faulty_save(obj, f, *args, **kwargs):
    if partial in str(f) and mine:
        if fault == "in_save" and "optim_states" in str(f):
            Path(f).write_bytes(b"PK\x03\x04 cut short")  # the file half written when the kill came
            hold()
        if fault == "enospc":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(f))
    return save(obj, f, *args, **kwargs)


torch.save = faulty_save
sys.exit(cli.main())
'''


def _argv(script, cfg):
    return [shutil.which("deepspeed"), "--master_port", str(free_port()), "--num_gpus", "2", str(script),
            "--config", str(cfg), "--no-progress"]


def _env(**extra):
    # the launched ranks import this checkout's vqlcmd, not whichever one is installed
    return {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO), **extra}


def _launch(cfg, ok=True, script="scripts/train.py", **env):
    proc = subprocess.run(_argv(script, cfg), cwd=REPO, capture_output=True, text=True, timeout=900, env=_env(**env))
    log = proc.stdout + proc.stderr
    assert (proc.returncode == 0) == ok, (proc.returncode, log[-4000:])
    return proc.returncode, log


def _files(folder: Path) -> dict:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tiny_shards_module):
    """The uninterrupted run, 2 ranks x micro-batch 4 x accumulation 2, 4 steps, checkpoints at 2 and 4."""
    tmp = tmp_path_factory.mktemp("faults")
    ref = tmp / "ref"
    _launch(_config(tmp, tiny_shards_module, ref, 2, 4))
    return ref, _losses(ref, {3, 4})


@pytest.fixture
def run(tmp_path, reference, tiny_shards_module):
    """(a copy of the reference's output, its config file): each test damages its own copy."""
    out = tmp_path / "run"
    shutil.copytree(reference[0], out)
    return out, _config(tmp_path, tiny_shards_module, out, 2, 4)


def _resumed_step_2(log, out, ref):
    ck = out / "checkpoints"
    assert f"resumed from {ck / STEP_2} at step 2" in log, log[-3000:]
    assert _files(ck / STEP_2) == _files(ref / "checkpoints" / STEP_2)  # the one that verified: untouched
    assert (ck / "latest").read_text().strip() == STEP_4 and verify_checkpoints_cli(out, out=lambda _: None) == 0


def test_a_byte_flip_and_a_save_killed_midway_fall_back_to_the_previous_checkpoint(run, reference):
    (out, cfg), (ref, want) = run, reference
    ck = out / "checkpoints"
    victim = ck / STEP_4 / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x01  # one bit of an Adam moment: no NaN, DeepSpeed would load it silently
    victim.write_bytes(bytes(data))
    flipped = bytes(data)
    partial = ck / "step_0000006.partial"  # a save SIGKILLed midway: the folder never published
    shutil.copytree(ck / STEP_2, partial)
    (partial / "mp_rank_00_model_states.pt").write_bytes(b"cut short")

    _, log = _launch(cfg)
    assert "failed verification" in log and victim.name in log
    assert "resuming from" in log and STEP_2 in log
    aside = ck / "step_0000004.corrupt"
    assert (aside / victim.name).read_bytes() == flipped  # set aside whole, nothing deleted
    _resumed_step_2(log, out, ref)
    assert not partial.exists()  # the stale .partial goes once a newer checkpoint is in
    assert _losses(out, {3, 4}) == want  # same ranks: bit for bit the uninterrupted run's


def _flip(path: Path) -> bytes:
    data = bytearray(path.read_bytes())
    if path.name == "config.json":  # a flip that leaves valid JSON: the micro-batch 4 reads 5
        at = data.index(b'"train_micro_batch_size_per_gpu": 4') + len(b'"train_micro_batch_size_per_gpu": ')
    else:
        at = len(data) // 2
    data[at] ^= 0x01
    return bytes(data)


DAMAGE = {  # name: (file of step_0000004, what it becomes; None: deleted)
    "flip-model": ("mp_rank_00_model_states.pt", _flip),
    "flip-rank-state": ("rank_00001_state.pt", _flip),
    "flip-config": ("config.json", _flip),
    "truncated": ("zero_pp_rank_0_mp_rank_00_optim_states.pt", lambda p: p.read_bytes()[:p.stat().st_size // 2]),
    "deleted": ("zero_pp_rank_1_mp_rank_00_optim_states.pt", lambda p: None),
}


@pytest.mark.parametrize("kind", DAMAGE)
def test_a_damaged_file_sets_its_checkpoint_aside_and_the_run_resumes_the_previous_one(run, reference, kind):
    (out, cfg), (ref, want) = run, reference
    name, damage = DAMAGE[kind]
    victim = out / "checkpoints" / STEP_4 / name
    before = _files(victim.parent)
    after = damage(victim)
    if after is None:
        victim.unlink()
    else:
        victim.write_bytes(after)
        assert after != before[name]

    _, log = _launch(cfg)
    assert f"{STEP_4}/{name}: " in log and "failed verification" in log and "step_0000004.corrupt" in log
    aside = _files(out / "checkpoints" / "step_0000004.corrupt")
    assert aside.pop(name, None) == after  # the damaged file as it was, nothing deleted
    assert aside == {k: v for k, v in before.items() if k != name}
    _resumed_step_2(log, out, ref)
    assert _losses(out, {3, 4}) == want


def test_the_batch_a_resume_keeps_comes_from_a_checkpoint_that_verifies(run):
    """With step_0000004's rank_00000_state.pt deleted, the newest checkpoint read as written by 1 rank: the
    2-rank resume took global batch 8 (ds_config.derive_batch) and was refused against the checkpoint that
    verifies, step_0000002's 16 (exit 2), instead of falling back to it. The trainer now verifies (claim)
    before it reads the batch. Checked in this process: no launch."""
    out, _ = run
    (out / "checkpoints" / STEP_4 / "rank_00000_state.pt").unlink()
    manager = CheckpointManager(out, rank=0, world=2, keep=0, resume=True, log=lambda _: None)
    manager.claim()
    try:
        assert manager.resumed_batch() == (4, 2, 2)  # micro-batch, accumulation, ranks of the one a resume takes
        assert (out / "checkpoints" / (STEP_4 + ".corrupt")).is_dir()
    finally:
        manager.release()


def _wait_for(marker: Path, proc, timeout=300) -> int:
    t0 = time.monotonic()
    while not marker.is_file() or not marker.read_text():
        assert proc.poll() is None, f"the run ended ({proc.returncode}) before the fault struck"
        assert time.monotonic() - t0 < timeout, "the fault never struck"
        time.sleep(0.1)
    return int(marker.read_text())


def _kill_one_rank(tmp_path, cfg, fault):
    """Start the hooked run, wait until a rank holds at the fault, SIGKILL it: (the log, seconds until the
    launcher and the other rank were gone)."""
    hook, marker, log = tmp_path / "hook.py", tmp_path / "marker", tmp_path / "launch.log"
    hook.write_text(_HOOK)
    with open(log, "w") as f:
        proc = subprocess.Popen(_argv(hook, cfg), cwd=REPO, stdout=f, stderr=subprocess.STDOUT,
                                env=_env(FAULT=fault, FAULT_STEP="4", FAULT_RANK="1", FAULT_MARKER=str(marker)))
        try:
            pid = _wait_for(marker, proc)
            ranks = [p for p in psutil.Process(proc.pid).children(recursive=True)
                     if any(a.startswith("--local_rank") for a in p.cmdline())]
            assert len(ranks) == 2 and pid in [p.pid for p in ranks]  # the launcher's two rank processes
            os.kill(pid, signal.SIGKILL)
            t0 = time.monotonic()
            assert proc.wait(timeout=60) != 0
            _, alive = psutil.wait_procs(ranks, timeout=10)
            gone = time.monotonic() - t0
            assert not alive, f"rank process(es) {[p.pid for p in alive]} outlived the killed one"
            print(f"\n{fault}: rank 1 (pid {pid}) SIGKILLed; the launcher and rank 0 gone after {gone:.1f} s, "
                  f"launcher exit {proc.returncode}")
        finally:
            if proc.poll() is None:
                proc.kill()
    return log.read_text(), gone


def _at_step_2(tmp_path, reference, shards, name):
    """(a copy of the reference's output as it was at step 2, its config file)."""
    out = tmp_path / name
    _from_step_2(reference[0], out)
    return out, _config(tmp_path, shards, out, 2, 4)


def test_sigkill_of_one_rank_mid_step_resumes_the_last_checkpoint(tmp_path, reference, tiny_shards_module):
    (ref, want), (out, cfg) = reference, _at_step_2(tmp_path, reference, tiny_shards_module, "mid_step")
    _, gone = _kill_one_rank(tmp_path, cfg, "in_step")
    assert gone < 15
    assert 3 in _losses(out, {3})  # the run had logged a step after the checkpoint it resumed
    assert (out / "checkpoints" / "latest").read_text().strip() == STEP_2 and not list((out / "checkpoints").glob("*.partial"))

    _, log = _launch(cfg)
    _resumed_step_2(log, out, ref)
    assert _losses(out, {3, 4}) == want


def test_sigkill_mid_save_leaves_a_partial_folder_that_the_resume_ignores(tmp_path, reference, tiny_shards_module):
    (ref, want), (out, cfg) = reference, _at_step_2(tmp_path, reference, tiny_shards_module, "mid_save")
    _, gone = _kill_one_rank(tmp_path, cfg, "in_save")
    assert gone < 15
    ck = out / "checkpoints"
    partial = ck / "step_0000004.partial"
    assert (partial / "zero_pp_rank_1_mp_rank_00_optim_states.pt").read_bytes().endswith(b"cut short")
    assert (ck / "latest").read_text().strip() == STEP_2 and not (ck / STEP_4).exists()

    _, log = _launch(cfg)
    assert "failed verification" not in log  # never a candidate: not published
    _resumed_step_2(log, out, ref)
    assert not partial.exists()
    assert _losses(out, {3, 4}) == want


def test_a_full_disk_at_a_save_stops_the_run_by_name_and_keeps_the_previous_checkpoint(tmp_path, reference,
                                                                                        tiny_shards_module):
    (ref, _), (out, cfg) = reference, _at_step_2(tmp_path, reference, tiny_shards_module, "full_disk")
    hook = tmp_path / "hook.py"
    hook.write_text(_HOOK)
    rc, log = _launch(cfg, ok=False, script=hook, FAULT="enospc", FAULT_STEP="4", FAULT_MARKER=str(tmp_path / "m"))
    ck = out / "checkpoints"
    lines = [line for line in log.splitlines() if os.strerror(errno.ENOSPC) in line]
    assert lines and "Traceback" not in log, log[-3000:]
    print("\n" + lines[0])
    assert str(ck / "step_0000004.partial") in lines[0] and f"{ck / STEP_2}, is intact" in lines[0]
    assert (ck / "latest").read_text().strip() == STEP_2 and not (ck / STEP_4).exists()
    assert _files(ck / STEP_2) == _files(ref / "checkpoints" / STEP_2)
    said = []
    assert verify_checkpoints_cli(out, out=said.append) == 0 and said == [f"{STEP_2} (resumed first): ok"]
