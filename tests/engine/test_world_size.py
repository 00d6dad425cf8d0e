"""A checkpoint written by N ranks resumes on M (CheckpointManager.load, zero_reshard, ds_config's batch
choice, the loader's global position, the slots' random streams): 2 -> 1, 1 -> 2 and 2 -> 4 ranks on gloo,
each compared, loss by loss, with the uninterrupted 2-rank run."""
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from vqlcmd.engine.config import ConfigError
from vqlcmd.engine.config_file import load_config
from vqlcmd.engine.ds_config import derive_batch

REPO = Path(__file__).resolve().parents[2]
TOL = 1e-5  # float sums in another order (see test_resumes_on_another_world_size_train_on_as_the_uninterrupted_run)


def test_the_batch_a_resume_on_another_world_size_chooses():
    ds = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1}
    # the micro-batch only: the checkpoint's global batch (4 x 1 x 2), accumulation adapting
    _, micro, gas, note = derive_batch(ds, 1, resumed=(4, 1, 2))
    assert (micro, gas) == (4, 2) and "global batch 8 (the checkpoint's global batch)" in note
    assert "same random draws" in note
    _, micro, gas, _ = derive_batch(ds, 4, resumed=(4, 2, 2))
    assert (micro, gas) == (4, 1)
    with pytest.raises(ConfigError, match=r"resuming on 4 rank\(s\): the global batch 8 .* no multiple of 4 x "
                                          r"train_micro_batch_size_per_gpu=4"):
        derive_batch(ds, 4, resumed=(4, 1, 2))
    # train_batch_size: the checkpoint's micro-batch where it divides, else a smaller one (streams afresh)
    total = {"train_batch_size": 8}
    assert derive_batch(total, 4, resumed=(4, 1, 2))[1:3] == (2, 1)
    assert "start afresh" in derive_batch(total, 4, resumed=(4, 1, 2))[3]
    assert derive_batch(total, 1, resumed=(4, 1, 2))[1:3] == (4, 2)
    assert derive_batch(ds, 2, resumed=(4, 1, 2))[3] == ""  # the same world: as a fresh run


def _config(tmp_path, shards, out, gas, steps):
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": gas, "gradient_clipping": 1.0,
           "zero_optimization": {"stage": 2},
           "vqlcmd": {"model": {"preset": "tiny"}, "data": {"shards": str(shards)},
                      "optimizer": {"lr": 3e-3, "warmup_steps": 2},
                      "train": {"steps": steps, "output_dir": str(out), "log_every": 1, "sample_every": 0,
                                "checkpoint_every": 2}}}
    path = tmp_path / f"cfg_{out.name}.json"
    path.write_text(json.dumps(cfg))
    return path


def _launch(ranks, cfg):
    from vqlcmd.engine.distributed import free_port

    exe = shutil.which("deepspeed")
    proc = subprocess.run([exe, "--master_port", str(free_port()), "--num_gpus", str(ranks), "scripts/train.py",
                           "--config", str(cfg), "--no-progress"], cwd=REPO, capture_output=True, text=True,
                          timeout=900, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def _in_process(cfg):
    from vqlcmd.engine.trainer import Trainer

    lines = []
    ds, c = load_config(str(cfg))
    Trainer(ds, c, log=lines.append).train(progress=False)
    return "\n".join(map(str, lines))


def _losses(out, steps):
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if r["step"] in steps}


def _from_step_2(src, dst):
    shutil.copytree(src, dst)
    ck = dst / "checkpoints"
    for p in ck.iterdir():
        if p.name.startswith("step_") and p.name != "step_0000002":
            shutil.rmtree(p)
    (ck / "latest").write_text("step_0000002")


def test_resumes_on_another_world_size_train_on_as_the_uninterrupted_run(tmp_path, tiny_shards, capsys):
    """The uninterrupted run: 2 ranks x micro-batch 4 x accumulation 2 (4 data slots), 4 steps. Each resume
    keeps the 4 slots (1 rank x 4, 4 ranks x 1), so the samples and draws are the same; the losses differ
    only by the order of float sums (gradients summed by micro-step on one rank, by all-reduce on several;
    the clipping norm's partial sums per ZeRO partition): equal within TOL, not bit for bit."""
    ref = tmp_path / "ref"
    _launch(2, _config(tmp_path, tiny_shards, ref, 2, 4))
    want = _losses(ref, {1, 2, 3, 4})
    got = {}

    one = tmp_path / "two_to_one"  # 2 -> 1, in this process
    _from_step_2(ref, one)
    log = _in_process(_config(tmp_path, tiny_shards, one, 2, 4))
    assert "written by 2 rank(s), on 1" in log and "micro-batch 4 x accumulation 4" in log
    got["2->1"] = _losses(one, {3, 4})

    four = tmp_path / "two_to_four"
    _from_step_2(ref, four)
    log = _launch(4, _config(tmp_path, tiny_shards, four, 2, 4))
    assert "written by 2 rank(s), on 4" in log
    got["2->4"] = _losses(four, {3, 4})

    back = tmp_path / "one_to_two"  # a 1-rank run of the same 4 slots, resumed on 2
    _in_process(_config(tmp_path, tiny_shards, back, 4, 2))
    got["1 rank"] = _losses(back, {1, 2})
    log = _launch(2, _config(tmp_path, tiny_shards, back, 4, 4))
    assert "written by 1 rank(s), on 2" in log
    got["1->2"] = _losses(back, {3, 4})

    with capsys.disabled():
        for name, losses in got.items():
            print(f"\n{name}: " + ", ".join(f"step {s} {v:.7f} (uninterrupted {want[s]:.7f}, "
                                               f"diff {v - want[s]:+.1e})" for s, v in sorted(losses.items())))
    for name, losses in got.items():
        for s, v in losses.items():
            assert abs(v - want[s]) <= TOL, (name, s, v, want[s])
