"""scripts/reproduce.py --quick runs every row end to end (tiny preset, tiny tokenizer) and writes its outputs."""
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_reproduce_quick_runs_every_row(tiny_config, tmp_path):
    cfg = tiny_config()
    out = tmp_path / "repro"
    cmd = [sys.executable, str(REPO / "scripts" / "reproduce.py"), "--quick", "--config", str(cfg), "--out", str(out)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    from importlib.util import module_from_spec, spec_from_file_location

    spec = spec_from_file_location("reproduce", REPO / "scripts" / "reproduce.py")
    mod = module_from_spec(spec)
    spec.loader.exec_module(mod)
    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert {r["row"] for r in records} == set(mod.ROWS)
    for r in records:
        for key in ("fid", "precision", "recall", "accuracy", "collapse"):
            assert r[key] == r[key], (r["row"], key)  # present and not NaN
    few = {(r["row"], r["sample_steps"]) for r in records if r["kind"] == "few_steps"}
    assert few == {(row, n) for row in ("vqlcmd", "maskgit") for n in (1, 2, 4)}
    assert {r["method"] for r in records} == {"vqlcmd", "maskgit", "csdm_fixed", "csdm", "csdm_l2"}
    tables = (out / "tables.md").read_text()
    for title in ("Baselines", "Ablations", "Dropping strategies", "Loss weights", "Embedding dimension",
                  "Few sampling steps"):
        assert title in tables
    assert (out / "few_steps.png").stat().st_size > 1000
    # a second invocation reuses the finished runs instead of training again
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and len((out / "results.jsonl").read_text().splitlines()) == len(records)
    assert f"{len(mod.ROWS)} of {len(mod.ROWS)} runs already in" in again.stdout


def test_reproduce_parallel_jobs_and_time_limit(tiny_config, tmp_path):
    """--jobs 2 trains two runs in worker processes and records both; --time-limit 0 starts nothing new."""
    cfg = tiny_config()
    out = tmp_path / "repro"
    base = [sys.executable, str(REPO / "scripts" / "reproduce.py"), "--quick", "--config", str(cfg), "--out", str(out),
            "--no-few-steps"]
    res = subprocess.run(base + ["--rows", "vqlcmd", "no_cm", "--jobs", "2"], capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert sorted(r["row"] for r in records) == ["no_cm", "vqlcmd"]
    late = subprocess.run(base + ["--rows", "vqlcmd", "no_cm", "no_rd", "--jobs", "2", "--time-limit", "0"],
                          capture_output=True, text=True, timeout=300)
    assert late.returncode == 0, late.stderr[-3000:]
    assert "not started" in late.stdout and "no_rd" in late.stdout
    assert "2 of 3 runs already in" in late.stdout  # no worker process for the finished runs
    line = next(line for line in late.stdout.splitlines() if "not started" in line)
    assert "1 runs not started" in line and "no_cm" not in line, line
    assert len((out / "results.jsonl").read_text().splitlines()) == len(records)
    assert "VQ-LCMD w/o L_CM" in (out / "tables.md").read_text()
    assert all(r["bf16"] is False for r in records) and "per run in fp32" in (out / "tables.md").read_text()
    # the precision is part of a record's budget: a bf16 run of a finished fp32 row trains anew, apart
    bf16 = subprocess.run(base + ["--rows", "vqlcmd", "--bf16", "true"], capture_output=True, text=True, timeout=300)
    assert bf16.returncode == 0, bf16.stderr[-3000:]
    after = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert [(r["row"], r["bf16"]) for r in after[len(records):]] == [("vqlcmd", True)]
    assert sorted(p.name for p in (out / "runs" / "vqlcmd").iterdir()) == ["seed0-steps2-batch8",
                                                                         "seed0-steps2-batch8-bf16"]
    tables = (out / "tables.md").read_text()
    assert "per run in bf16" in tables and "VQ-LCMD w/o L_CM" not in tables  # the fp32 rows are another budget
