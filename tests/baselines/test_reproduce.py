"""studies/reproduce.py --quick runs every row end to end (tiny preset, tiny tokenizer) and writes its outputs."""
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# run as its docs say, ``python -m studies.reproduce`` from the repository root (hence cwd=REPO below)
STUDY = ["-m", "studies.reproduce"]


def test_reproduce_quick_runs_every_row(tiny_config, tmp_path):
    cfg = tiny_config()
    out = tmp_path / "repro"
    cmd = [sys.executable, *STUDY, "--quick", "--config", str(cfg), "--out", str(out)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=REPO)
    assert res.returncode == 0, res.stderr[-3000:]
    import studies.reproduce as mod

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
                  "Teacher EMA rate", "Few sampling steps"):
        assert title in tables
    # each row trained with its switch: the η rows' teacher rate, as the run's own resolved config says
    for row, eta in (("vqlcmd", 0.99), ("eta_0.9", 0.9), ("eta_0.999", 0.999)):
        (run_config,) = (out / "runs" / row).glob("*/config.json")
        assert json.loads(run_config.read_text())["vqlcmd"]["ema"]["teacher"] == eta, row
    assert (out / "few_steps.png").stat().st_size > 1000
    # a second invocation reuses the finished runs instead of training again
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert again.returncode == 0 and len((out / "results.jsonl").read_text().splitlines()) == len(records)
    assert f"{len(mod.ROWS)} of {len(mod.ROWS)} runs already in" in again.stdout


def test_reproduce_parallel_jobs_and_time_limit(tiny_config, tmp_path):
    """--jobs 2 trains two runs in worker processes and records both; --time-limit 0 starts nothing new."""
    cfg = tiny_config()
    out = tmp_path / "repro"
    base = [sys.executable, *STUDY, "--quick", "--config", str(cfg), "--out", str(out),
            "--no-few-steps"]
    res = subprocess.run(base + ["--rows", "vqlcmd", "no_cm", "--jobs", "2"], capture_output=True, text=True,
                         timeout=600, cwd=REPO)
    assert res.returncode == 0, res.stderr[-3000:]
    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert sorted(r["row"] for r in records) == ["no_cm", "vqlcmd"]
    late = subprocess.run(base + ["--rows", "vqlcmd", "no_cm", "no_rd", "--jobs", "2", "--time-limit", "0"],
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    assert late.returncode == 0, late.stderr[-3000:]
    assert "not started" in late.stdout and "no_rd" in late.stdout
    assert "2 of 3 runs already in" in late.stdout  # no worker process for the finished runs
    line = next(line for line in late.stdout.splitlines() if "not started" in line)
    assert "1 runs not started" in line and "no_cm" not in line, line
    assert len((out / "results.jsonl").read_text().splitlines()) == len(records)
    assert "VQ-LCMD w/o L_CM" in (out / "tables.md").read_text()
    assert all(r["bf16"] is False for r in records) and "per run in fp32" in (out / "tables.md").read_text()
    # the precision is part of a record's budget: a bf16 run of a finished fp32 row trains anew, apart
    bf16 = subprocess.run(base + ["--rows", "vqlcmd", "--bf16", "true"], capture_output=True, text=True, timeout=300,
                          cwd=REPO)
    assert bf16.returncode == 0, bf16.stderr[-3000:]
    after = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert [(r["row"], r["bf16"]) for r in after[len(records):]] == [("vqlcmd", True)]
    setup = after[-1]["setup"]  # one setup: the folders differ by precision only
    assert sorted(p.name for p in (out / "runs" / "vqlcmd").iterdir()) == sorted(
        [f"seed0-steps2-batch8-{setup}", f"seed0-steps2-batch8-bf16-{setup}"])
    tables = (out / "tables.md").read_text()
    assert "per run in bf16" in tables and "VQ-LCMD w/o L_CM" not in tables  # the fp32 rows are another budget


def _module():
    import studies.reproduce as mod

    return mod


def _args(mod, *extra):
    import argparse

    ns = argparse.Namespace(config="ds_digits.json", ns_shift=-1.0, per_class=20, model_overrides={}, eval_batch=None,
                            digits_size=16, tokenizer_steps=400, steps=1100, batch=64, bf16=False, main_steps=50,
                            main_steps_maskgit=8, guidance=1.0)
    for key, value in extra:
        setattr(ns, key, value)
    ns.setup = mod.setup_id(ns)
    return ns


def test_records_are_reused_and_tabled_only_under_the_setup_that_made_them(tmp_path):
    """A rerun with another shift took the old records under a header naming the new shift, and two image
    sizes or two main step counts were averaged in one row as if they were seeds; a repeated seed counted
    twice. Records from before the setup field (docs/) count as the current setup's."""
    mod = _module()
    a, b = _args(mod), _args(mod, ("ns_shift", 0.0))
    assert a.setup != b.setup and a.setup == _args(mod).setup
    rec = dict(row="vqlcmd", seed=0, train_steps=1100, batch=64, bf16=False, kind="main", sample_steps=50,
               sampler="ancestral")
    records = [dict(rec, setup=a.setup, fid=1.0), dict(rec, setup=b.setup, fid=2.0), dict(rec, setup=a.setup, fid=3.0),
               dict(rec, sample_steps=4, setup=a.setup, fid=4.0), dict(rec, seed=1, fid=5.0)]  # the last: no setup
    cur = mod._current(records, a)
    assert sorted(r["fid"] for r in cur) == [3.0, 4.0, 5.0]  # b's dropped, seed 0's repeat kept once (the last)
    a.out, a.image_size = tmp_path, 16  # the real-data floor, cached: not fitted here
    (tmp_path / "real_reference_16px.json").write_text(json.dumps(dict(fid=0.1, precision=0.9, recall=0.9,
                                                                         num_samples=899)))
    table = mod.write_tables(records + [dict(rec, row="maskgit", sample_steps=8, sampler="maskgit", setup=a.setup,
                                              fid=6.0)], a, "h")
    assert "| VQ-LCMD | 2 | ancestral 50 |" in table  # seeds 0 and 1 at 50 steps: not the 4-step evaluation
    # a table is shown where a row besides its VQ-LCMD reference has records: Baselines, not the ablations
    assert "### Baselines" in table and "| MaskGIT | 1 | maskgit 8 |" in table
    assert "### Ablations" not in table and "### Loss weights" not in table


def test_a_cut_short_last_record_is_dropped_and_a_bad_earlier_one_named(tmp_path, capsys):
    import pytest

    mod = _module()
    path = tmp_path / "results.jsonl"
    path.write_text('{"row": "a"}\n{"row": "b"}\n{"row": "c", "fi')  # a kill during the append
    assert [r["row"] for r in mod.read_records(path)] == ["a", "b"]
    assert "results.jsonl:3 is cut short" in capsys.readouterr().err
    mod.append_records(path, [{"row": "d"}])  # it continued the cut-short line, which the next run refused
    assert [r["row"] for r in mod.read_records(path)] == ["a", "b", "d"]
    path.write_text('{"row": "a"}\n{"ro\n{"row": "c"}\n')
    with pytest.raises(SystemExit, match=r"results\.jsonl:2: not a JSON record"):
        mod.read_records(path)


def test_bad_arguments_are_refused_before_any_work(tmp_path):
    for extra, said in ((["--seeds", "-1"], "must be an integer in [0, 2**31)"),
                        (["--digits-size", "10"], "--digits-size must be a multiple of 4"),
                        (["--model-overrides", "[1]"], "must be a JSON object"),
                        (["--time-limit", "nan"], "must be a finite number >= 0"),
                        (["--checkpoint-every", "-1"], "must be a non-negative integer")):
        res = subprocess.run([sys.executable, *STUDY, "--out", str(tmp_path / "o"),
                              *extra], capture_output=True, text=True, timeout=300, cwd=REPO)
        assert res.returncode == 2 and said in res.stderr, (extra, res.stderr[-500:])


def test_a_failing_run_does_not_stop_the_sweep(tiny_config, tmp_path):
    """One run's error ended a sequential sweep (no results, no tables); now it is logged, the other runs
    are trained and recorded, and the exit code says one failed."""
    out = tmp_path / "repro"
    cmd = [sys.executable, *STUDY, "--quick", "--config", str(tiny_config()),
           "--out", str(out), "--no-few-steps", "--rows", "csdm_fixed", "vqlcmd",
           "--model-overrides", '{"embed_dim": 16}']  # CSDM† diffuses the tokenizer's 4-d codes: it refuses 16
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert res.returncode == 1, res.stderr[-3000:]
    assert "csdm_fixed seed 0 failed: ConfigError" in res.stdout and "1 run(s) failed: csdm_fixed seed 0" in res.stderr
    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert [r["row"] for r in records] == ["vqlcmd"] and (out / "tables.md").is_file()


def _records(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_learning_curves_few_steps_and_report_only(tiny_config, tmp_path):
    """--eval-every trains in resumed segments and evaluates at each step (ω = 0 and 1), the runs taking turns;
    the end-of-run evaluations are those of one unbroken run; a rerun with more evaluations trains nothing and
    adds only those; --report-only rebuilds the tables and plots from the records alone."""
    cfg = tiny_config()
    out = tmp_path / "curves"
    base = [sys.executable, *STUDY, "--quick", "--config", str(cfg),
            "--rows", "vqlcmd", "maskgit"]
    res = subprocess.run(base + ["--out", str(out), "--eval-every", "1", "--no-few-steps"], capture_output=True,
                         text=True, timeout=600, cwd=REPO)
    assert res.returncode == 0, res.stderr[-3000:]
    records = _records(out / "results.jsonl")
    curve = [r for r in records if r["kind"] == "curve"]
    # the runs take turns an eval step at a time: both methods are evaluated at step 1 before either at step 2
    assert [(r["row"], r["train_step"], r["guidance"]) for r in curve] == [
        (row, step, g) for step in (1, 2) for row in ("vqlcmd", "maskgit") for g in (0.0, 1.0)]
    head = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=REPO, capture_output=True,
                          text=True).stdout.strip()
    for r in records:
        assert r["seed"] == 0 and r["train_steps"] == 2 and r["method"] == r["row"]
        assert head in r["commit"], r["commit"]  # the tree it was made from ("-dirty" if it had changes)
        assert (r["sampler"], r["sample_steps"]) == (("maskgit", 2) if r["row"] == "maskgit" else ("ancestral", 4))
        for key in ("fid", "precision", "recall", "accuracy", "spread_ratio"):
            assert r[key] == r[key], (r["row"], key)
    for row in ("vqlcmd", "maskgit"):  # cumulative training time, growing along the curve
        secs = [r["train_seconds"] for r in curve if r["row"] == row and r["guidance"] == 0.0]
        assert 0 < secs[0] < secs[1]
    main = {r["row"]: r for r in records if r["kind"] == "main"}
    assert {r["train_step"] for r in main.values()} == {2} and all(r["stopped"] == "budget" for r in main.values())
    # main (ω = 1 at the last step) is the curve's last ω = 1 evaluation, not a second sampling
    assert main["vqlcmd"]["fid"] == next(r["fid"] for r in curve if (r["row"], r["train_step"], r["guidance"])
                                         == ("vqlcmd", 2, 1.0))

    # a training in one piece gives the same model: the segments resumed bit-exactly
    whole = tmp_path / "whole"
    res = subprocess.run(base + ["--out", str(whole), "--no-few-steps"], capture_output=True, text=True, timeout=600,
                         cwd=REPO)
    assert res.returncode == 0, res.stderr[-3000:]
    assert {r["row"]: r["fid"] for r in _records(whole / "results.jsonl")} == {k: r["fid"] for k, r in main.items()}

    # the few-step evaluations added later: nothing trained again, no finished evaluation redone
    log_before = (out / "train.log").read_text()
    res = subprocess.run(base + ["--out", str(out), "--eval-every", "1"], capture_output=True, text=True, timeout=600,
                         cwd=REPO)
    assert res.returncode == 0, res.stderr[-3000:]
    after = _records(out / "results.jsonl")
    assert after[:len(records)] == records
    assert sorted((r["row"], r["sampler"], r["sample_steps"], r["train_step"]) for r in after[len(records):]) == sorted(
        [("maskgit", "maskgit", n, 2) for n in (1, 2, 4)] + [("vqlcmd", s, n, 2) for s in ("ancestral", "ddim")
                                                             for n in (1, 2, 4)])  # --quick's few steps
    assert "nothing to train" in (out / "train.log").read_text()[len(log_before):]

    # the report from the records alone, in a fresh folder
    report = tmp_path / "report"
    report.mkdir()
    (report / "results.jsonl").write_text((out / "results.jsonl").read_text())
    (report / "real_reference_16px.json").write_text(json.dumps(dict(fid=0.1, precision=0.9, recall=0.9,
                                                                     num_samples=899)))
    res = subprocess.run(base + ["--out", str(report), "--report-only"], capture_output=True, text=True, timeout=300,
                         cwd=REPO)
    assert res.returncode == 0, res.stderr[-3000:]
    assert not (report / "runs").exists()
    tables = (report / "tables.md").read_text()
    for title in ("Learning curve: VQ-LCMD, ω = 0 (ancestral 4 steps)", "Learning curve: MaskGIT, ω = 1 (maskgit 2",
                  "VQ-LCMD (ancestral) fid", "VQ-LCMD (DDIM) fid", "MaskGIT fid", "At training step 2"):
        assert title in tables, title
    for png in ("curves_steps.png", "curves_time.png", "few_steps.png"):
        assert (report / png).stat().st_size > 1000, png


def _curve_record(seed, step, fid, guidance=0.0, **kw):
    return dict(row="vqlcmd", seed=seed, train_steps=8, batch=64, bf16=False, kind="curve", train_step=step,
                sample_steps=50, sampler="ancestral", guidance=guidance, fid=fid, train_seconds=10.0 * step, **kw)


def test_convergence_is_read_off_the_fid_at_guidance_zero():
    mod = _module()
    args = _args(mod, ("steps", 8), ("eval_every", 2), ("patience", 2), ("curve_guidance", [0.0, 1.0]),
                 ("no_few_steps", True), ("few_steps", []), ("guidance", 1.0))
    assert mod.eval_steps(args) == [2, 4, 6, 8]
    # best at step 4; 6 and 8 are worse: two evaluations without improvement -> converged at 8
    recs = [_curve_record(0, s, f) for s, f in ((2, 3.0), (4, 2.0), (6, 2.5), (8, 2.1))]
    assert mod.converged_at("vqlcmd", 0, args, recs) == 8
    # nor a record of another setup (another shift, sample count...)
    assert mod.converged_at("vqlcmd", 0, args, recs + [_curve_record(0, 6, 0.01, setup="other")]) == 8
    assert mod.converged_at("vqlcmd", 0, args, recs[:3]) is None  # one evaluation without improvement so far
    # the ω = 1 curve does not decide it, nor does another seed
    worse = [_curve_record(0, s, 9.0 + s, guidance=1.0) for s in (2, 4, 6)] + [_curve_record(1, 6, 0.1)]
    assert mod.converged_at("vqlcmd", 0, args, recs[:3] + worse) is None
    args.patience = 1
    assert mod.converged_at("vqlcmd", 0, args, recs) == 6


def test_curve_table_is_the_mean_and_std_over_seeds():
    mod = _module()
    args = _args(mod, ("steps", 8), ("curve_guidance", [0.0]))
    recs = [_curve_record(0, 2, 1.0, precision=0.5, recall=0.25, accuracy=0.5, spread_ratio=0.5),
            _curve_record(1, 2, 3.0, precision=0.7, recall=0.75, accuracy=0.7, spread_ratio=0.7),
            _curve_record(0, 4, 0.5, precision=0.9, recall=0.5, accuracy=1.0, spread_ratio=0.6)]
    for r in recs:
        r["setup"] = args.setup
    lines = mod.curve_tables(recs, args)
    assert lines[0] == "### Learning curve: VQ-LCMD, ω = 0 (ancestral 50 steps)"
    # seeds 0 and 1 at step 2: FID mean 2, sample std sqrt(2); recall mean 0.5, std 0.354
    assert "| 2 | 2 | 20 ± 0 | 2.00 ± 1.41 | 0.60 ± 0.14 | 0.50 ± 0.35 | 0.600 ± 0.141 | 0.60 ± 0.14 |" in lines
    assert "| 4 | 1 | 40 | 0.50 | 0.90 | 0.50 | 1.000 | 0.60 |" in lines


def _children(pid: int) -> set[int]:
    kids = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        kids.update(int(k) for k in (task / "children").read_text().split())
    return kids


def _running(pid: int) -> bool:
    """Alive and not a zombie (a container's init may be slow to reap an orphan that has exited)."""
    try:
        state = next(line for line in Path(f"/proc/{pid}/status").read_text().splitlines() if line.startswith("State:"))
    except (FileNotFoundError, ProcessLookupError):
        return False
    return "Z" not in state.split()[1]


def test_reproduce_workers_end_with_a_killed_sweep(tiny_config, tmp_path):
    """SIGTERM to a --jobs sweep (a scheduler's time limit, a shell's kill) ends its workers too: they used to
    train on, unwatched, and a rerun's worker then trained the same run folder beside them."""
    import os
    import signal
    import time

    out = tmp_path / "repro"
    cmd = [sys.executable, *STUDY, "--config", str(tiny_config()), "--out", str(out),
           "--rows", "vqlcmd", "no_cm", "--seeds", "0", "--steps", "1000000", "--jobs", "2", "--threads", "1",
           "--no-few-steps", "--per-class", "1"]
    sweep = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=REPO)
    workers: set[int] = set()
    try:
        deadline = time.monotonic() + 300
        # both workers are training once each run's folder exists (the trainer makes it)
        while not all((out / "runs" / row).is_dir() for row in ("vqlcmd", "no_cm")):
            assert sweep.poll() is None and time.monotonic() < deadline, "the sweep did not start its runs"
            time.sleep(0.5)
        workers = _children(sweep.pid)
        assert len(workers) >= 2, workers
        sweep.send_signal(signal.SIGTERM)
        sweep.wait(timeout=30)
        deadline = time.monotonic() + 30
        while any(_running(pid) for pid in workers) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [pid for pid in workers if _running(pid)], "workers kept running after their sweep was killed"
    finally:
        for pid in [sweep.pid, *workers]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _whole_records(path: Path) -> list[dict]:
    """The records on file so far (a line being written, or cut by a kill, is left out)."""
    records = []
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return records


def test_parallel_workers_write_each_evaluation_as_it_is_made(tiny_config, tmp_path):
    """A --jobs sweep with --eval-every cut off mid-run (a lent GPU's time limit) keeps the evaluations its
    workers had made: they used to reach results.jsonl only when a whole run finished."""
    import os
    import signal
    import time

    out = tmp_path / "repro"
    cmd = [sys.executable, *STUDY, "--config", str(tiny_config()), "--out", str(out),
           "--rows", "vqlcmd", "maskgit", "--seeds", "0", "--steps", "1000000", "--eval-every", "2", "--jobs", "2",
           "--threads", "1", "--no-few-steps", "--per-class", "1", "--batch", "4"]
    sweep = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=REPO)
    results = out / "results.jsonl"
    try:
        deadline = time.monotonic() + 300
        while True:
            rows = {r["row"] for r in _whole_records(results)}
            if rows == {"vqlcmd", "maskgit"}:
                break
            assert sweep.poll() is None and time.monotonic() < deadline, f"no records of running workers: {rows}"
            time.sleep(0.5)
    finally:
        for pid in [*_children(sweep.pid), sweep.pid]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    records = _whole_records(results)
    made = {(r["row"], r["train_step"], r["kind"]) for r in records}
    assert made >= {("vqlcmd", 2, "curve"), ("maskgit", 2, "curve")}
    keys = [(r["row"], r["train_step"], r["guidance"], r["sample_steps"]) for r in records]
    assert len(keys) == len(set(keys)), "a record written twice"


def test_records_name_the_tokenizer_they_were_made_with(tiny_config, tmp_path):
    """--digits-size prepares (or reuses) a tokenizer whose training is not bit-reproducible across machines
    and thread counts; each record says which one it was by its PSNR and codes used, as prepare_digits
    measured them, and the commit it was made at."""
    from vqlcmd.data.digits import prepare_digits

    cache, out = tmp_path / "cache", tmp_path / "repro"
    res = subprocess.run([sys.executable, *STUDY, "--quick", "--config",
                          str(tiny_config()), "--out", str(out), "--rows", "vqlcmd", "--no-few-steps",
                          "--digits-size", "16", "--tokenizer-steps", "3", "--digits-cache", str(cache),
                          "--model-overrides", '{"codebook_size": 128, "num_classes": 10}'],  # the digits' codebook, classes
                         capture_output=True, text=True, timeout=600, cwd=REPO)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    info = prepare_digits(cache, steps=3, size=16, progress=False, log=lambda *a: None)  # the cached one
    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert records and all(r["image_size"] == 16 for r in records)
    for r in records:
        assert r["tokenizer"] == {"psnr": round(float(info["psnr"]), 2), "codes_used": int(info["codebook_usage"])}
        assert r["commit"]


def test_the_report_header_names_the_seeds_its_tables_average(tmp_path):
    """The tables average every seed on file for the budget; the header named only the call's --seeds, so a
    sweep adding seed 1 to seed 0's records said "seeds [1]" above two-seed means."""
    mod = _module()
    args = _args(mod, ("steps", 8), ("seeds", [1]), ("curve_guidance", [0.0]), ("out", tmp_path))
    (tmp_path / "real_reference_16px.json").write_text(json.dumps(dict(fid=0.1, precision=0.9, recall=0.9,
                                                                         num_samples=899)))
    recs = [dict(_curve_record(seed, 2, 1.0 + seed), setup=args.setup, image_size=16, sample_seconds=1.0)
            for seed in (0, 1)]
    mod.write_report(recs, args, log=None)
    text = (tmp_path / "tables.md").read_text()
    assert "seeds [0, 1]," in text.splitlines()[0]
    assert "| 2 | 2 | 20 ± 0 | 1.50 ± 0.71 |" in text  # both seeds in the curve table below it


def test_a_run_trained_on_after_it_stopped_counts_once_at_its_last_step(tmp_path):
    """MaskGIT's seed 2 of the bf16 study stopped at step 3000 under --patience 3 (a noisy FID) and was then
    trained on to 4000 with --patience 0: the Baselines table counted that seed twice (4 seeds of 3) and the
    few-step table averaged its step-3000 and step-4000 samples."""
    mod = _module()
    args = _args(mod, ("steps", 8), ("out", tmp_path))
    args.image_size = 16
    (tmp_path / "real_reference_16px.json").write_text(json.dumps(dict(fid=0.1, precision=0.9, recall=0.9,
                                                                         num_samples=899)))
    base = dict(row="maskgit", train_steps=8, batch=64, bf16=False, sample_steps=8, sampler="maskgit",
                setup=args.setup, guidance=args.guidance, precision=0.9, recall=0.9, accuracy=1.0, spread_ratio=0.8)
    recs = [dict(base, seed=0, kind="main", train_step=8, fid=1.0),
            dict(base, seed=1, kind="main", train_step=6, fid=9.0),  # stopped at 6 ...
            dict(base, seed=1, kind="few_steps", train_step=6, sample_steps=2, fid=9.0),
            dict(base, seed=1, kind="curve", train_step=6, fid=9.0),
            dict(base, seed=1, kind="main", train_step=8, fid=3.0),  # ... then trained on to 8
            dict(base, seed=1, kind="few_steps", train_step=8, sample_steps=2, fid=5.0)]
    cur = mod._current(recs, args)
    assert sorted((r["seed"], r["kind"], r["train_step"]) for r in cur) == [
        (0, "main", 8), (1, "curve", 6), (1, "few_steps", 8), (1, "main", 8)]  # its curve keeps step 6
    table = mod.write_tables(recs, args, "h")
    assert "| MaskGIT | 2 | maskgit 8 | 2.00 ± 1.41 |" in table
    assert "At training step 8 (" in table and "| MaskGIT fid | 5.00 |" in table
