"""scripts/gpu_check.sh in its dry-run mode (DRY_RUN=1: CPU, tiny sizes): the lease's script, run end to end in CI
so that a lease is never spent on a script bug. About 3-5 minutes on 2 cores (four short training runs)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                            "MASTER_PORT", "STEPS", "VQLCMD_COMMIT")}
    return {**env, "DRY_RUN": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), **extra}


@pytest.mark.slow
def test_the_dry_run_runs_every_step_and_writes_rows_naming_the_tree(tmp_path):
    out = tmp_path / "out"
    done = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), str(out), "900"], env=_env(),
                          capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    said = done.stdout
    for name in ("train-32", "train-32-ds", "train-32g", "host", "sample", "gpu-tests", "gpu-defaults", "train-128",
                 "bench-softmax", "bench-noise", "train-256"):
        assert f"=== {name}: exit 0" in said, (name, said[-4000:])
    assert "quickstart" not in said  # only when STEPS names it
    commit = next(line.split(": ", 1)[1] for line in (out / "env.txt").read_text().splitlines()
                  if line.startswith("commit: "))
    rows = [json.loads(line) for line in (out / "rows.jsonl").read_text().splitlines()]
    assert rows and all(r["commit"] == commit for r in rows)
    # the host step: DeepSpeed's engine step, then the flat step, on the same tree
    host = [json.loads(line) for line in (out / "host.jsonl").read_text().splitlines()]
    assert len(host) == 2 and all(r["commit"] == commit and r["ms_per_step"] > 0 for r in host)
    assert [r["step"] for r in host] == ["deepspeed", "flat"]
    sampled = [json.loads(line) for line in (out / "sample.jsonl").read_text().splitlines()]
    assert len(sampled) == 2 and all(r["ms_per_step"] > 0 for r in sampled)  # 50 and 2 steps, eager (dry run)
    summaries = [r for r in rows if r["stage"] == "train" and r["case"] == "summary"]
    # the five runs, each with a steady interval after its first: batches 4 (three times: the flat step,
    # DeepSpeed's, CUDA graphs' place; uncompiled on CPU), 8, 16
    assert sorted(r["shape"] for r in summaries) == ["tiny B16 x1 ranks"] + ["tiny B4 x1 ranks"] * 3 + [
        "tiny B8 x1 ranks"]
    assert {r["backend"] for r in summaries} == {"fast-flat", "fast-deepspeed", "fast-flat+graphs"}
    assert all(r["status"] == "ok" and r["extra"]["images/s"] > 0 and r["extra"]["TFLOP/step"] > 0
               for r in summaries)
    assert {(r["stage"], r["backend"]) for r in rows if r["stage"] != "train"} >= {
        ("softmax_embedding_average", "eager"), ("compiled_ops", "compiled")}
    tests = (out / "gpu-tests.log").read_text()  # collected, and skipped without CUDA: none failed or erred
    assert " skipped" in tests and " failed" not in tests and " error" not in tests


@pytest.mark.slow
def test_the_dry_run_of_the_study_step_keeps_its_records_tables_and_plots(tmp_path):
    """STEPS=reproduce (issue 31's 64-token study, not in the default list): both rows, evaluated at each step,
    the records on file with their report beside them, and the runs' checkpoints not sent back."""
    out = tmp_path / "out"
    done = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), str(out), "600"],
                          env=_env(STEPS="reproduce"), capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "=== reproduce: exit 0" in done.stdout and "=== reproduce report: exit 0" in done.stdout, done.stdout[-3000:]
    assert "=== train-32" not in done.stdout  # only the step named
    study = out / "reproduce64"
    records = [json.loads(line) for line in (study / "results.jsonl").read_text().splitlines()]
    assert {(r["row"], r["train_step"]) for r in records if r["kind"] == "curve"} == {
        (row, s) for row in ("vqlcmd", "maskgit") for s in (1, 2)}
    assert "Learning curve" in (study / "tables.md").read_text()
    assert (study / "curves_steps.png").stat().st_size > 1000
    assert not (study / "runs").exists()


def test_a_failed_run_leaves_a_failed_row_naming_its_error(tmp_path):
    """benchmarks/train_rows.py on a run that died before its second log step: one failed summary row whose
    reason is the log's last error line, rows for the intervals it did log."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({
        "train_micro_batch_size_per_gpu": 4, "bf16": {"enabled": True},
        "vqlcmd": {"model": {"preset": "tiny", "overrides": {}}, "loss": {"l0_fraction": 1.0, "beta_cm": 1.0},
                   "train": {"log_every": 4}}}))
    (run / "metrics.jsonl").write_text(json.dumps({"step": 4, "loss": 1.0, "images_per_s": 10.0, "ranks": 1}) + "\n")
    log = tmp_path / "train.log"
    log.write_text("step 4\ntorch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\n")
    out = tmp_path / "rows.jsonl"
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "train_rows.py"), str(run), "--backend", "fast",
                           "--log", str(log), "--out", str(out)], env=_env(), capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["case"] for r in rows] == ["train step", "summary"]
    assert rows[0]["median_ms"] == pytest.approx(400.0) and rows[0]["extra"]["step"] == 4  # 4 images at 10/s
    assert rows[1]["status"] == "failed" and "OutOfMemoryError" in rows[1]["reason"]


def _fake_fa4_parts(tmp_path):
    """What scripts/flash4_prepare.sh leaves in .fa4/: one xz archive of a site folder cut in two halves, here of a
    stand-in flash_attn.cute (and the CUTLASS DSL's dsl_packages folder, which the step puts on the path)."""
    import io
    import lzma
    import tarfile

    files = {"flash_attn/cute/__init__.py": "def flash_attn_func(*a, **k):\n    raise RuntimeError('stand-in')\n",
             "nvidia_cutlass_dsl/dsl_packages/cutlass_stand_in.py": "",
             "flash_attn_4-4.0.0b36.dist-info/METADATA": "Name: flash-attn-4\nVersion: 4.0.0b36\n",
             "nvidia_cutlass_dsl-4.8.1.dist-info/METADATA": "Name: nvidia-cutlass-dsl\nVersion: 4.8.1\n"}
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w") as tar:
        for name, text in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(text.encode())
            tar.addfile(info, io.BytesIO(text.encode()))
    packed = lzma.compress(raw.getvalue())
    parts = tmp_path / "fa4"
    for i, half in enumerate((packed[:len(packed) // 2], packed[len(packed) // 2:])):
        (parts / str(i + 1)).mkdir(parents=True)
        (parts / str(i + 1) / f"site.tar.xz.0{i}").write_bytes(half)
    return parts


@pytest.mark.parametrize("carried", [True, False])
def test_the_flash4_steps_install_what_was_carried_or_say_why_not_and_time_sdpa_either_way(tmp_path, carried):
    """STEPS=flash4,bench-attention, the FA4 lease's command: the halves joined and imported (a stand-in here),
    or, without them, the step names what to carry; the attention stage runs in both cases (FA4 skipped on CPU)."""
    out = tmp_path / "out"
    env = _env(STEPS="flash4,bench-attention", FA4_PARTS=str(_fake_fa4_parts(tmp_path) if carried
                                                              else tmp_path / "none"))
    done = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), str(out), "300"], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    said = done.stdout
    if carried:
        assert "=== flash4: exit 0" in said and "flash-attn-4 4.0.0b36 nvidia-cutlass-dsl 4.8.1" in said, said
    else:
        assert "=== flash4: exit 1" in said and "are not both carried" in said, said
    assert "=== bench-attention: exit 0" in said, said
    rows = [json.loads(line) for line in (out / "rows.jsonl").read_text().splitlines()]
    assert {r["backend"] for r in rows if r["status"] == "ok"} == {"math", "sdpa"}
    fa4 = [r for r in rows if r["backend"] == "flash4"]
    assert [r["status"] for r in fa4] == ["skipped"] and "needs CUDA" in fa4[0]["reason"]
    assert "=== train-32" not in said and "=== build" not in said
