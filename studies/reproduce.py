#!/usr/bin/env python
"""The paper's comparisons at small scale, on the embedded digits data set, in one command.

    python -m studies.reproduce --steps 3000 --seeds 0 1 2      # the real budget (hours on a CPU)
    python -m studies.reproduce --quick                          # every row for a few steps (CI)

Every row is one config of the same engine (``vqlcmd.method`` plus switches; see ROWS), trained at the
same budget (steps x batch) for each seed, then sampled class-conditionally (guidance ω from the config)
and scored with the project's digits metrics: the independent SVC's accuracy, feature-space FID and
k-NN precision/recall (vqlcmd.metrics.digits), the within-class spread, and the embedding collapse
indicator. Writes under --out: ``results.jsonl`` (one line per run and evaluation; finished runs are
reused, so an interrupted or extended run continues), ``tables.md`` (mean ± std over seeds) and
``few_steps.png`` (FID and accuracy vs sampling steps, VQ-LCMD DDIM vs MaskGIT).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sys
import time
from pathlib import Path

import torch

from benchmarks.run import git_commit
from vqlcmd.cli import json_object, non_negative_float, non_negative_int, positive_int, seed_int
from vqlcmd.engine.checkpoint import atomic_write_text
from vqlcmd.engine.config_file import load_config, parse_vqlcmd_section, resolve_config_path

# row name -> (label, vqlcmd-section overrides). VQ-LCMD rows also get --ns-shift (the "NS" of the paper).
ROWS = {
    "vqlcmd": ("VQ-LCMD", {}),
    "maskgit": ("MaskGIT", {"method": "maskgit"}),
    "csdm_fixed": ("CSDM† (frozen VQ codebook)", {"method": "csdm_fixed"}),
    "csdm": ("CSDM (joint, VLB)", {"method": "csdm"}),
    "csdm_l2": ("CSDM w ℓ2-norm", {"method": "csdm_l2"}),
    "no_cm": ("VQ-LCMD w/o L_CM", {"loss.beta_cm": 0.0}),
    "no_ns": ("VQ-LCMD w/o NS (shift 0)", {"schedule.shift": 0.0}),
    "no_rd": ("VQ-LCMD w/o RD", {"loss.drop_strategy": "none"}),
    "drop_linear": ("linear", {"loss.drop_strategy": "linear"}),
    "drop_random": ("rand_drop", {"loss.drop_strategy": "random_ratio"}),
    "drop_0.1": ("rand(0.1)", {"loss.p_drop": 0.1}),
    "drop_0.3": ("rand(0.3)", {"loss.p_drop": 0.3}),
    "drop_0.5": ("rand(0.5)", {"loss.p_drop": 0.5}),
    "beta_0.01_0.01": ("β_CM 0.01, β_DM 0.01", {"loss.beta_cm": 0.01, "loss.beta_dm": 0.01}),
    "beta_0.01_1": ("β_CM 0.01, β_DM 1", {"loss.beta_cm": 0.01, "loss.beta_dm": 1.0}),
    "beta_1_1": ("β_CM 1, β_DM 1", {"loss.beta_cm": 1.0, "loss.beta_dm": 1.0}),
    "beta_1_0.01": ("β_CM 1, β_DM 0.01", {"loss.beta_cm": 1.0, "loss.beta_dm": 0.01}),
    "dim_16": ("D = 16", {"model.overrides.embed_dim": 16}),
    "dim_64": ("D = 64", {"model.overrides.embed_dim": 64}),
    # not swept in the paper (η = 0.99 throughout); its teacher lags ~100 steps of runs far longer than ours
    "eta_0.9": ("η = 0.9", {"ema.teacher": 0.9}),
    "eta_0.999": ("η = 0.999", {"ema.teacher": 0.999}),
}
# (title, paper table or None, rows; "vqlcmd", the reference row of each, is shown under the label given here)
TABLES = [
    ("Baselines", "Table \"unconditional\" (FFHQ / LSUN) and Table \"imagenet\"",
     [("maskgit", None), ("csdm_fixed", None), ("vqlcmd", None)]),
    ("Ablations", "Table \"effect\" (FFHQ)",
     [("csdm", None), ("csdm_l2", None), ("no_cm", None), ("no_ns", None), ("no_rd", None), ("vqlcmd", None)]),
    ("Dropping strategies", "appendix Table \"masking\"",
     [("drop_linear", None), ("drop_random", None), ("drop_0.1", None), ("vqlcmd", "rand(0.2) = VQ-LCMD"),
      ("drop_0.3", None), ("drop_0.5", None)]),
    ("Loss weights", "appendix Table \"weighting\"",
     [("beta_0.01_0.01", None), ("beta_0.01_1", None), ("beta_1_1", None), ("beta_1_0.01", None),
      ("vqlcmd", "β_CM 1, β_DM 0.005 = VQ-LCMD")]),
    ("Embedding dimension", "appendix Table \"dimension\"",
     [("dim_16", None), ("vqlcmd", "D = 32 = VQ-LCMD"), ("dim_64", None)]),
    ("Teacher EMA rate (the paper keeps η = 0.99 throughout)", None,
     [("eta_0.9", None), ("vqlcmd", "η = 0.99 = VQ-LCMD"), ("eta_0.999", None)]),
]
FEW_STEPS = [1, 2, 3, 4, 6, 8, 16, 50]
CURVE_GUIDANCE = [0.0, 1.0]  # ω of the learning curves' evaluations (--curve-guidance)
FEW_STEP_ROWS = ("vqlcmd", "maskgit")
# (row, sampler, label) of the few-step table and plot
FEW_STEP_LINES = [("maskgit", "maskgit", "MaskGIT"), ("vqlcmd", "ddim", "VQ-LCMD (DDIM)"),
                  ("vqlcmd", "ancestral", "VQ-LCMD (ancestral)")]
CURVE_METRICS = [("fid", "FID ↓", 2), ("precision", "Prec. ↑", 2), ("recall", "Rec. ↑", 2), ("accuracy", "Acc. ↑", 3),
                 ("spread_ratio", "spread", 2)]
METRICS = [("fid", "FID ↓", 2), ("precision", "Prec. ↑", 2), ("recall", "Rec. ↑", 2), ("accuracy", "Acc. ↑", 3),
           ("spread_ratio", "spread", 2), ("collapse", "collapse", 3)]


def _set(section: dict, dotted: str, value) -> None:
    *path, last = dotted.split(".")
    for key in path:
        section = section.setdefault(key, {})
    section[last] = value


def read_records(path: Path) -> list[dict]:
    """results.jsonl's records. A last line cut short (a kill or a full disk during the append) is dropped
    with a warning, so the run continues; a bad line before it is an error naming the file and line."""
    if not path.is_file():
        return []
    lines = path.read_text().splitlines()
    records = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as exc:
            if i == len(lines):
                print(f"warning: {path}:{i} is cut short ({exc}); dropped, its run is redone", file=sys.stderr)
                # from the file too: the next append would otherwise continue the cut-short line
                atomic_write_text(path, "".join(line + "\n" for line in lines[:-1]))
            else:
                raise SystemExit(f"{path}:{i}: not a JSON record ({exc})") from None
    return records


def append_records(path: Path, records: list[dict]) -> None:
    """One write of whole lines, flushed to disk: a kill leaves at most one cut-short last line. One
    ``os.write`` on an O_APPEND descriptor (a buffered file splits a long text into several writes), so the
    --jobs workers appending beside each other never interleave their lines."""
    if not records:
        return
    data = "".join(json.dumps(r) + "\n" for r in records).encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        written = os.write(fd, data)
        if written != len(data):  # (a full disk): the rest, as read_records drops a cut-short last line
            raise OSError(f"{path}: only {written} of {len(data)} bytes appended")
        os.fsync(fd)
    finally:
        os.close(fd)


def _budget(args) -> tuple:
    return args.steps, args.batch, args.bf16


def _record_budget(r: dict) -> tuple:
    return r["train_steps"], r["batch"], r.get("bf16", False)  # records before the bf16 field were fp32


def setup_id(args) -> str:
    """A digest of the settings besides the budget that change a run's results. A record is reused, and put
    in a table, only under the setup that made it: a rerun with another shift, model, image size or sample
    count took the old numbers under a header naming the new settings, and mixed two setups in one table.
    Records written before it carry no setup and count as this one's (the committed ones in docs/archive/)."""
    config = json.loads(resolve_config_path(args.config).read_text())
    # as data, not bytes (re-indenting the file is no new setup), without what row_config sets for every run
    for key in ("train_micro_batch_size_per_gpu", "train_batch_size", "bf16"):
        config.pop(key, None)
    train = config.get("vqlcmd", {}).get("train", {})
    for key in ("steps", "seed", "output_dir", "sample_every", "checkpoint_every", "log_every", "keep_checkpoints"):
        train.pop(key, None)
    settings = {"config": config, "ns_shift": args.ns_shift, "per_class": args.per_class,
                "model_overrides": args.model_overrides, "eval_batch": args.eval_batch,
                "digits": [args.digits_size, args.tokenizer_steps] if args.digits_size else None}
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:12]


def _train_step(r: dict) -> int:
    # records before the train_step field were made at the end of their run
    return r.get("train_step", r["train_steps"])


def _record_key(r: dict) -> tuple:
    return (r["row"], r["seed"], *_record_budget(r), r["kind"], r["sample_steps"], r["sampler"],
            _train_step(r), r.get("guidance"))


def _same_setup(r: dict, setup: str) -> bool:
    return r.get("setup", setup) == setup


def row_config(row: str, seed: int, args):
    """(DeepSpeed dict, VQLCMDConfig) of one run: the base config, the row's switches, the budget."""
    ds, base = load_config(args.config)
    section = base.to_dict()
    if args.data is not None:  # a digits variant prepared by main(): explicit shards and tokenizer
        section["data"] = {**section["data"], "dataset": None, "shards": args.data["shards"],
                           "tokenizer": args.data["tokenizer"]}
        section["model"]["overrides"] = {**section["model"]["overrides"], "seq_len": args.data["seq_len"]}
    section["model"]["overrides"] = {**section["model"]["overrides"], **args.model_overrides}
    # Sampling EMA: at most the config's rate, and short enough that the initial weights keep < e^-10 of
    # the average after the budget (0.995 would still hold 22% of the init after 300 steps).
    section["ema"]["sampling"] = min(section["ema"]["sampling"], 1.0 - 10.0 / max(args.steps, 20))
    # warm-up at most a tenth of the budget, so that short budgets still train mostly at the full rate
    section["optimizer"]["warmup_steps"] = min(section["optimizer"]["warmup_steps"], max(1, args.steps // 10))
    method = ROWS[row][1].get("method", "vqlcmd")
    if method == "vqlcmd":
        _set(section, "schedule.shift", args.ns_shift)
    for key, value in ROWS[row][1].items():
        _set(section, key, value)
    precision = "-bf16" if args.bf16 else ""
    # the setup in the name: a run of another setup is not resumed as this one
    run_dir = args.out / "runs" / row / f"seed{seed}-steps{args.steps}-batch{args.batch}{precision}-{args.setup}"
    for key, value in {"train.steps": args.steps, "train.seed": seed, "train.output_dir": str(run_dir.resolve()),
                       "train.sample_every": 0, "train.checkpoint_every": args.checkpoint_every,
                       "train.log_every": max(1, min(50, args.steps)), "train.keep_checkpoints": 1}.items():
        _set(section, key, value)
    ds = dict(ds, train_micro_batch_size_per_gpu=args.batch, bf16={**ds.get("bf16", {}), "enabled": args.bf16})
    ds.pop("train_batch_size", None)
    return ds, parse_vqlcmd_section(section), run_dir


def _sample(pipe, method: str, labels, steps: int, sampler: str, seed: int, batch_size: int, guidance: float):
    g = torch.Generator().manual_seed(10_000 + seed)
    kw = {} if method == "maskgit" else {"sampler": sampler}
    return pipe(labels, num_steps=steps, guidance_scale=guidance, output_type="pt", generator=g,
                batch_size=batch_size, **kw)


def evaluate(pipe, method: str, steps: int, sampler: str, seed: int, args, guidance: float) -> dict:
    from vqlcmd.embedding import collapse_indicator
    from vqlcmd.metrics.digits import evaluate_digit_samples

    C = pipe.network.config.num_classes
    labels = torch.arange(C).repeat_interleave(args.per_class)
    t0 = time.perf_counter()
    images = _sample(pipe, method, labels, steps, sampler, seed, args.eval_batch, guidance)
    out = evaluate_digit_samples(images, labels)
    K = pipe.network.config.codebook_size
    out["image_size"] = int(images.shape[-1])
    out["collapse"] = collapse_indicator(pipe.network.embedding.table()[:K])
    out["sample_seconds"] = round(time.perf_counter() - t0, 1)
    return out


def _method(row: str) -> str:
    return ROWS[row][1].get("method", "vqlcmd")


def main_steps_of(row: str, args) -> int:
    return args.main_steps_maskgit if _method(row) == "maskgit" else args.main_steps


def _main_sampler(row: str) -> str:
    return "maskgit" if _method(row) == "maskgit" else "ancestral"


def eval_steps(args) -> list[int]:
    """The training steps a run is evaluated at: every --eval-every steps and at the end of the budget."""
    if not args.eval_every:
        return [args.steps]
    return [*range(args.eval_every, args.steps, args.eval_every), args.steps]


def curve_evals(row: str, args) -> list[tuple]:
    """(kind, sample steps, sampler, ω) of the learning curve's evaluation at each eval step."""
    if not args.eval_every:
        return []
    return [("curve", main_steps_of(row, args), _main_sampler(row), g) for g in args.curve_guidance]


def final_evals(row: str, args) -> list[tuple]:
    """(kind, sample steps, sampler, ω) at the run's last step (the budget's, or where it converged): the
    main evaluation and the few-step curve (VQ-LCMD with DDIM and ancestral, MaskGIT with its own sampler)."""
    evals = [("main", main_steps_of(row, args), _main_sampler(row), args.guidance)]
    if row in FEW_STEP_ROWS and not args.no_few_steps:
        samplers = ("maskgit",) if _method(row) == "maskgit" else ("ddim", "ancestral")
        evals += [("few_steps", n, s, args.guidance) for s in samplers for n in args.few_steps]
    return evals


def _eval_key(row: str, seed: int, args, e: tuple, step: int) -> tuple:
    kind, steps, sampler, guidance = e
    return (row, seed, *_budget(args), kind, steps, sampler, step, guidance)


def _fid_guidance(args) -> float:
    """The ω whose FID decides convergence: 0 (the paper compares unguided FIDs) when the curves have it."""
    return 0.0 if 0.0 in args.curve_guidance else args.curve_guidance[0]


def converged_at(row: str, seed: int, args, records: list[dict]):
    """The eval step at which the curve's FID (ω = 0, main sampler) had not improved on its best for
    --patience evaluations in a row, or None (no --patience, or still improving, or not evaluated that far)."""
    if not (args.patience and args.eval_every):
        return None
    kind, steps, sampler, g = next(e for e in curve_evals(row, args) if e[3] == _fid_guidance(args))
    fid = {r.get("train_step"): r["fid"] for r in records if _same_setup(r, args.setup)
           and _record_key(r)[:-2] == (row, seed, *_budget(args), kind, steps, sampler) and r.get("guidance") == g}
    best, since = math.inf, 0
    for s in eval_steps(args):
        if s not in fid:
            return None
        best, since = (fid[s], 0) if fid[s] < best else (best, since + 1)
        if since >= args.patience:
            return s
    return None


def has_pending(row: str, seed: int, args, records: list[dict], done: set) -> bool:
    """Whether results.jsonl lacks an evaluation of this row x seed (up to its convergence step, if known)."""
    stop = converged_at(row, seed, args, records) or args.steps
    if any(_eval_key(row, seed, args, e, s) not in done for s in eval_steps(args) if s <= stop
           for e in curve_evals(row, args)):
        return True
    return any(_eval_key(row, seed, args, e, stop) not in done for e in final_evals(row, args))


def _checkpoint_step(run_dir: Path) -> int:
    from vqlcmd.engine import checkpoint as ckpt

    tag = ckpt.latest_tag(run_dir / "checkpoints") if (run_dir / "checkpoints").is_dir() else None
    return int(tag.split("_")[-1]) if tag else 0


def _train_to(step: int, ds: dict, cfg, run_dir: Path, args):
    """Train the run (resuming its latest checkpoint, bit-exactly) up to ``step``, the lr schedule being the
    whole budget's. Returns (trainer, cumulative training seconds at ``step`` or None when unknown, the last
    step's losses). The training seconds, summed over the segments, are those of ``Trainer.train`` alone
    (checkpoint writes included; process start-up, data loading and evaluations not), kept in the run
    folder's train_seconds.json so that a later command goes on counting."""
    from vqlcmd.engine.trainer import Trainer, TrainingInterrupted

    clock = run_dir / "train_seconds.json"
    start = _checkpoint_step(run_dir)
    kept = json.loads(clock.read_text()) if clock.is_file() else {"step": 0, "seconds": 0.0}
    base = kept["seconds"] if kept["step"] == start else None  # a checkpoint saved after the clock's last write
    with open(args.out / "train.log", "a") as f:
        trainer = Trainer(ds, cfg, log=lambda *a, **k: print(*a, file=f, flush=True))
        t0 = time.perf_counter()
        try:
            history = trainer.train(progress=False, until=step)
        except TrainingInterrupted:  # SIGTERM (a timeout): its checkpoint's training time is kept as well
            if base is not None:
                atomic_write_text(clock, json.dumps({"step": trainer.step,
                                                     "seconds": round(base + time.perf_counter() - t0, 3)}))
            raise
    seconds = None if base is None else round(base + time.perf_counter() - t0, 3)
    if seconds is not None:
        atomic_write_text(clock, json.dumps({"step": trainer.step, "seconds": seconds}))
    return trainer, seconds, {k: v for k, v in (history[-1] if history else {}).items() if k != "step"}


def run_segments(row: str, seed: int, args, records: list[dict], done: set, log):
    """Train one row x seed and evaluate it, yielding each eval step's new records as they are made: it trains
    (resuming) only up to the next step whose evaluations results.jsonl lacks, evaluates there, and goes on;
    with --patience it ends where the FID at ω = 0 stopped improving, evaluated there as at the budget's end.
    Each eval step's records are appended to results.jsonl before they are yielded, in whichever process
    runs them (a --jobs worker too): a sweep cut off by a time limit (a lent GPU's) keeps every evaluation
    made, where the workers' used to reach the file only when their whole run finished."""
    mine = [r for r in records if r["row"] == row and r["seed"] == seed and _record_budget(r) == _budget(args)]
    done = set(done)
    ds, cfg, run_dir = row_config(row, seed, args)
    at = None  # (trainer, seconds, losses) of the step trained to last, while it is the one evaluated
    for s in eval_steps(args):
        new = []
        for kinds in ("curve", "final"):
            if kinds == "final":
                stop = converged_at(row, seed, args, mine)
                if s != args.steps and stop != s:
                    continue
            evals = curve_evals(row, args) if kinds == "curve" else final_evals(row, args)
            todo = [e for e in evals if _eval_key(row, seed, args, e, s) not in done]
            if not todo:
                continue
            if at is None or at[0].step != s:
                if _checkpoint_step(run_dir) > s:  # its checkpoint is past this step (another --eval-every)
                    log(f"{row} seed {seed}: step {s} not evaluated, the run's checkpoint is past it")
                    continue
                at = None  # (one engine in memory at a time)
                trainer, seconds, losses = _train_to(s, ds, cfg, run_dir, args)
                at = (trainer, seconds, losses, trainer.pipeline(), {})
            trainer, seconds, losses, pipe, memo = at
            for e in todo:
                kind, steps, sampler, guidance = e
                if (steps, sampler, guidance) not in memo:  # main repeats the curve's ω = 1 evaluation
                    with torch.random.fork_rng():
                        memo[steps, sampler, guidance] = evaluate(pipe, cfg.method, steps, sampler, seed, args,
                                                                  guidance)
                metrics = memo[steps, sampler, guidance]
                rec = {"row": row, "seed": seed, "train_steps": args.steps, "batch": args.batch, "bf16": args.bf16,
                       "setup": args.setup, "kind": kind, "train_step": s, "sample_steps": steps, "sampler": sampler,
                       "method": cfg.method, "guidance": guidance, "train_seconds": seconds,
                       "final_losses": losses, "commit": args.commit,
                       "tokenizer": (args.data or {}).get("tokenizer_quality"), **metrics}
                if kind != "curve":
                    rec["stopped"] = "budget" if s == args.steps else "converged"
                new.append(rec)
                log(f"{row:>14} seed {seed} step {s:>5} {kind:>9} {sampler:>9} {steps:>3} steps ω {guidance:g}: FID "
                    f"{metrics['fid']:.2f} acc {metrics['accuracy']:.3f} P {metrics['precision']:.2f} R "
                    f"{metrics['recall']:.2f} spread {metrics['spread_ratio']:.2f} (train {seconds} s, sample "
                    f"{metrics['sample_seconds']:.0f} s)")
            mine += new[-len(todo):]
            done.update(_record_key(r) for r in new)
        if new:
            append_records(args.out / "results.jsonl", new)
            yield new
        if converged_at(row, seed, args, mine) == s:
            log(f"{row} seed {seed}: FID at ω = {_fid_guidance(args):g} not improved for {args.patience} "
                f"evaluations: converged at step {s}")
            return


def run_one(row: str, seed: int, args, records: list[dict], done: set, log) -> list[dict]:
    """Train (or reuse) one row x seed and evaluate it; returns the new result records."""
    return [r for new in run_segments(row, seed, args, records, done, log) for r in new]


def _exit_with_parent(poll_seconds: float = 2.0) -> None:
    """End this --jobs worker once the sweep that started it is gone. A killed sweep (SIGTERM's default
    action runs no ``finally``, and SIGKILL nothing at all) otherwise left its workers training unwatched:
    their records never written, and a rerun's worker training the same run folder beside them."""
    import threading

    parent = os.getppid()

    def watch():
        while os.getppid() == parent:  # an orphan is adopted by init (or a subreaper): another parent id
            time.sleep(poll_seconds)
        os._exit(1)  # the run's checkpoints are written atomically: a rerun resumes from the last one

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


def _worker(row: str, seed: int, args, records: list[dict], done: set) -> list[dict]:
    _exit_with_parent()
    torch.set_num_threads(args.threads or max(1, (os.cpu_count() or 1) // args.jobs))
    return run_one(row, seed, args, records, done, lambda msg: print(msg, flush=True))


def _run_jobs(jobs, args, records: list[dict], done: set, log, failed: list):
    """Yields each (row, seed) job's new records as it finishes; ``--jobs N`` runs N at once, each in a fresh
    process (a small model leaves a GPU, or a many-core CPU, mostly idle), and ``--time-limit`` starts no
    job after that many seconds, so a bounded session ends with whole runs only. With --eval-every and one
    job, the runs take turns an eval step at a time (each yielding its records), so that every method has
    been evaluated at the same training steps when a time limit stops the session, and the limit then
    starts no new segment."""
    t0 = time.perf_counter()
    late = lambda: args.time_limit is not None and time.perf_counter() - t0 > args.time_limit  # noqa: E731
    if args.jobs <= 1 and args.eval_every:
        turns = [(row, seed, run_segments(row, seed, args, records, done, log)) for row, seed in jobs]
        while turns:
            for job in list(turns):
                row, seed, segments = job
                if late():
                    log(f"time limit: no new segment started ({', '.join(f'{r}/{s}' for r, s, _ in turns)} "
                        "not finished)")
                    return
                try:
                    yield next(segments)
                except StopIteration:
                    turns.remove(job)
                except Exception as exc:  # one run's failure: the others go on (KeyboardInterrupt stops all)
                    log(f"{row} seed {seed} failed: {type(exc).__name__}: {exc}")
                    failed.append((row, seed))
                    turns.remove(job)
        return
    if args.jobs <= 1:
        for row, seed in jobs:
            if late():
                log(f"time limit: {row} seed {seed} and later runs not started")
                return
            try:
                new = run_one(row, seed, args, records, done, log)
            except Exception as exc:  # one run's failure: the sweep goes on (KeyboardInterrupt still stops it)
                log(f"{row} seed {seed} failed: {type(exc).__name__}: {exc}")
                failed.append((row, seed))
                continue
            yield new
        return
    import multiprocessing as mp
    from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait

    # One single-worker pool per run: a fresh spawned process each (a forked CUDA context is unusable; each
    # run starts from a clean state, on Python 3.10 too), and a worker that dies (an out-of-memory kill, a
    # segfault) breaks only its own pool, where a shared pool's BrokenProcessPool lost every run beside it.
    spawn = mp.get_context("spawn")
    queue, running, pools = list(jobs), {}, {}
    try:
        while queue or running:
            while queue and len(running) < args.jobs and not late():
                row, seed = queue.pop(0)
                pool = ProcessPoolExecutor(1, mp_context=spawn)
                fut = pool.submit(_worker, row, seed, args, records, done)
                running[fut], pools[fut] = (row, seed), pool
            if queue and late():
                log(f"time limit: {len(queue)} runs not started ({', '.join(f'{r}/{s}' for r, s in queue)})")
                queue = []
            if not running:
                break
            finished, _ = wait(running, timeout=5, return_when=FIRST_COMPLETED)
            for fut in finished:
                row, seed = running.pop(fut)
                pools.pop(fut).shutdown(wait=False)
                try:
                    new = fut.result()
                except Exception as exc:  # one run's failure: the runs beside it still finish and are recorded
                    log(f"{row} seed {seed} failed: {type(exc).__name__}: {exc}")
                    failed.append((row, seed))
                    continue
                yield new
    finally:
        for pool in pools.values():  # (an interrupt: the runs in progress are not waited for)
            pool.shutdown(wait=False, cancel_futures=True)


def _current(records: list[dict], args) -> list[dict]:
    """The records of this budget and setup, the last one of each key (a repeated seed was counted twice), and
    of a run's final evaluations (main, few steps) only those at its last evaluated step: a run stopped by
    --patience and then trained on (a rerun with more patience, or none) has final evaluations at both steps,
    and the tables counted that seed twice, once at the step where it had stopped."""
    kept = {}
    for r in records:
        if _record_budget(r) == _budget(args) and _same_setup(r, args.setup):
            kept[_record_key(r)] = r
    cur = list(kept.values())
    last = {}
    for r in cur:
        if r["kind"] != "curve":
            last[r["row"], r["seed"]] = max(last.get((r["row"], r["seed"]), 0), _train_step(r))
    return [r for r in cur if r["kind"] == "curve" or _train_step(r) == last[r["row"], r["seed"]]]


def _finite(values) -> list:
    return [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]


def _fmt(values, digits: int) -> str:
    if not values:
        return "–"
    t = torch.tensor(values, dtype=torch.float64)
    if len(values) == 1:
        return f"{t.item():.{digits}f}"
    return f"{t.mean().item():.{digits}f} ± {t.std().item():.{digits}f}"


def write_tables(records: list[dict], args, header: str) -> str:
    from vqlcmd.metrics.digits import real_reference

    records = _current(records, args)
    main = [r for r in records if r["kind"] == "main" and r["sample_steps"] == main_steps_of(r["row"], args)
            and r.get("guidance", args.guidance) == args.guidance]
    lines = [header, ""]
    for title, paper, rows in TABLES:
        present = [(row, label) for row, label in rows if any(r["row"] == row for r in main)]
        if all(row == "vqlcmd" for row, _ in present):  # VQ-LCMD is every table's reference: alone, it says nothing new
            continue
        lines += [f"### {title}" + (f" (cf. paper {paper})" if paper else ""), "",
                  "| row | seeds | sampler | " + " | ".join(h for _, h, _ in METRICS) + " |",
                  "|---|---|---|" + "---|" * len(METRICS)]
        for row, label in present:
            rs = [r for r in main if r["row"] == row]
            sampler = f"{rs[0]['sampler']} {rs[0]['sample_steps']}"
            cells = [_fmt(_finite([r.get(k) for r in rs]), d) for k, _, d in METRICS]
            lines.append(f"| {label or ROWS[row][0]} | {len(rs)} | {sampler} | " + " | ".join(cells) + " |")
        lines.append("")
    few = [r for r in records if r["kind"] == "few_steps"]
    if few:
        steps = sorted({r["sample_steps"] for r in few})
        at = sorted({_train_step(r) for r in few})
        lines += ["### Few sampling steps (cf. paper Table \"maskgit:imagenet\"): FID ↓ / accuracy ↑", "",
                  f"At training step {', '.join(map(str, at))} (the budget's end, or where a run converged).", "",
                  "| method | " + " | ".join(str(s) for s in steps) + " |", "|---|" + "---|" * len(steps)]
        for row, sampler, name in FEW_STEP_LINES:
            for key, digits in (("fid", 2), ("accuracy", 3)):
                cells = [_fmt([r[key] for r in few if (r["row"], r["sampler"]) == (row, sampler)
                               and r["sample_steps"] == s], digits) for s in steps]
                if any(c != "–" for c in cells):
                    lines.append(f"| {name} {key} | " + " | ".join(cells) + " |")
        lines.append("")
    lines += curve_tables(records, args)
    ref_file = args.out / f"real_reference_{args.image_size}px.json"
    if ref_file.is_file():
        ref = json.loads(ref_file.read_text())
    else:  # fitting the metric's feature net takes minutes on a loaded CPU: do it once per size
        ref = real_reference(args.image_size)
        atomic_write_text(ref_file, json.dumps(ref))
    lines += [f"Real-data floor (two halves of the real digits, {ref['num_samples']} each): FID {ref['fid']:.2f}, "
              f"precision {ref['precision']:.2f}, recall {ref['recall']:.2f}.", ""]
    return "\n".join(lines)


def _curves(records: list[dict], args) -> dict:
    """{(row, ω): {eval step: [records over seeds]}} of the learning curves of this budget and setup."""
    out = {}
    for r in _current(records, args):
        if r["kind"] == "curve":
            out.setdefault((r["row"], r["guidance"]), {}).setdefault(r["train_step"], []).append(r)
    return {k: dict(sorted(v.items())) for k, v in sorted(out.items(), key=lambda kv: (list(ROWS).index(kv[0][0]),
                                                                                       kv[0][1]))}


def curve_tables(records: list[dict], args) -> list[str]:
    """Markdown lines: per row and ω, mean ± std over seeds of each metric at every eval step."""
    lines = []
    for (row, g), by_step in _curves(records, args).items():
        first = next(iter(by_step.values()))[0]
        lines += [f"### Learning curve: {ROWS[row][0]}, ω = {g:g} ({first['sampler']} {first['sample_steps']} steps)",
                  "", "| step | seeds | train s | " + " | ".join(h for _, h, _ in CURVE_METRICS) + " |",
                  "|---|---|---|" + "---|" * len(CURVE_METRICS)]
        for step, rs in by_step.items():
            cells = [_fmt(_finite([r.get(k) for r in rs]), d) for k, _, d in CURVE_METRICS]
            secs = _finite([r.get("train_seconds") for r in rs])
            lines.append(f"| {step} | {len(rs)} | {_fmt(secs, 0)} | " + " | ".join(cells) + " |")
        lines.append("")
    return lines


def plot_curves(records: list[dict], args, out: Path) -> bool:
    """curves_steps.png and curves_time.png: each metric (mean ± std over seeds) against training steps and
    against cumulative training wall time, a colour per row, a line style per ω."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves = _curves(records, args)
    if not curves:
        return False
    rows = list(dict.fromkeys(row for row, _ in curves))
    styles = ["-", "--", ":", "-."]
    gs = sorted({g for _, g in curves})
    for name, xlabel in (("curves_steps.png", "training steps"), ("curves_time.png", "training wall time (s)")):
        fig, axes = plt.subplots(1, len(CURVE_METRICS), figsize=(4 * len(CURVE_METRICS), 3.6))
        for (row, g), by_step in curves.items():
            color = f"C{rows.index(row)}"
            for ax, (key, label, _) in zip(axes, CURVE_METRICS):
                xs, mean, std = [], [], []
                for step, rs in by_step.items():
                    v = _finite([r.get(key) for r in rs])
                    secs = _finite([r.get("train_seconds") for r in rs])
                    if not v or (name == "curves_time.png" and not secs):
                        continue
                    t = torch.tensor(v, dtype=torch.float64)
                    xs.append(step if name == "curves_steps.png" else sum(secs) / len(secs))
                    mean.append(t.mean().item()), std.append(t.std().item() if len(v) > 1 else 0.0)
                m, sd = torch.tensor(mean, dtype=torch.float64), torch.tensor(std, dtype=torch.float64)
                ax.plot(xs, mean, styles[gs.index(g) % len(styles)], color=color, marker=".",
                        label=f"{ROWS[row][0]}, ω = {g:g}")
                ax.fill_between(xs, (m - sd).tolist(), (m + sd).tolist(), color=color, alpha=0.15)
        for ax, (key, label, _) in zip(axes, CURVE_METRICS):
            ax.set_xlabel(xlabel), ax.set_ylabel(label), ax.grid(alpha=0.3)
        axes[0].set_yscale("log")
        axes[0].legend(fontsize=7)
        seeds = sorted({r["seed"] for c in curves.values() for rs in c.values() for r in rs})
        fig.suptitle(f"digits, budget {args.steps} steps x batch {args.batch} "
                     f"({'bf16' if args.bf16 else 'fp32'}), seeds {seeds}, mean ± std over seeds")
        fig.tight_layout()
        tmp = out / (name + ".tmp.png")
        fig.savefig(tmp, dpi=110)
        os.replace(tmp, out / name)
        plt.close(fig)
    return True


def plot_few_steps(records: list[dict], args, path: Path) -> bool:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    few = [r for r in _current(records, args) if r["kind"] == "few_steps"]
    if not few:
        return False
    steps = sorted({r["sample_steps"] for r in few})
    xs = list(range(len(steps)))  # categorical x: 1..8 then 50
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for (row, sampler, name), style in zip(FEW_STEP_LINES, ("s--", "o-", "^:")):
        if not any((r["row"], r["sampler"]) == (row, sampler) for r in few):
            continue
        for ax, key in zip(axes, ("fid", "accuracy")):
            mean, std, x_ok = [], [], []
            for x, s in zip(xs, steps):
                v = [r[key] for r in few if (r["row"], r["sampler"]) == (row, sampler) and r["sample_steps"] == s]
                if v:
                    t = torch.tensor(v, dtype=torch.float64)
                    mean.append(t.mean().item()), std.append(t.std().item() if len(v) > 1 else 0.0), x_ok.append(x)
            ax.errorbar(x_ok, mean, yerr=std, fmt=style, capsize=3, label=name)
    for ax, label in zip(axes, ("feature-space FID ↓", "classifier accuracy ↑")):
        ax.set_xticks(xs), ax.set_xticklabels([str(s) for s in steps]), ax.set_xlabel("sampling steps")
        ax.set_ylabel(label), ax.grid(alpha=0.3), ax.legend()
    axes[0].set_yscale("log")
    fig.suptitle(f"digits, {args.steps} training steps x batch {args.batch}, mean ± std over seeds")
    fig.tight_layout()
    tmp = path.with_name(path.name + ".tmp.png")
    fig.savefig(tmp, dpi=120)
    os.replace(tmp, path)
    plt.close(fig)
    return True


def write_report(records: list[dict], args, log) -> None:
    """tables.md, few_steps.png and (with curve records) curves_steps.png / curves_time.png under --out."""
    _, base = load_config(args.config)
    sizes = {r.get("image_size") for r in records if r.get("image_size")}
    args.image_size = sizes.pop() if len(sizes) == 1 else 32
    cur = _current(records, args)  # this budget and setup
    # a run's training time: its last evaluation's (the time is cumulative along the curve)
    train_s = {}
    for r in cur:
        key = (r["row"], r["seed"])
        train_s[key] = max(train_s.get(key, 0.0), r.get("train_seconds") or 0.0)
    # the seeds the tables average: every seed on file for this budget, not only this call's --seeds (a sweep
    # that adds seed 1 to seed 0's records reports both)
    seeds = sorted({r["seed"] for r in cur})
    header = (f"Budget: {args.steps} training steps x batch {args.batch} per run in "
              f"{'bf16' if args.bf16 else 'fp32'}, seeds {seeds}, "
              f"{args.per_class} samples per class per evaluation, guidance ω = {base.sample.guidance_scale}, "
              f"VQ-LCMD shift {args.ns_shift}; base config {args.config}, preset {base.model.preset}"
              f"{' with ' + json.dumps(args.model_overrides) if args.model_overrides else ''}"
              f"{f', digits at {args.digits_size} px (tokenizer {args.tokenizer_steps} steps)' if args.digits_size else ''}. "
              f"Wall time: {sum(r['sample_seconds'] for r in cur) + sum(train_s.values()):.0f} s of training and sampling.")
    text = write_tables(records, args, header)
    atomic_write_text(args.out / "tables.md", text)
    plots = [name for name, made in (("few_steps.png", plot_few_steps(records, args, args.out / "few_steps.png")),
                                     ("curves_steps.png / curves_time.png", plot_curves(records, args, args.out)))
             if made]
    if log is not None:
        log(text)
        log(f"tables -> {args.out / 'tables.md'}" + (f"; plots -> {', '.join(plots)} in {args.out}" if plots else ""))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="ds_digits_paper.json",
                   help="base config (a path or a name in configs/); the default is the digits run with the paper's "
                        "settings (fixed dropping p = 0.2, guidance 1), not the quick start's ds_digits.json")
    p.add_argument("--out", type=Path, default=Path("runs/reproduce"))
    p.add_argument("--rows", nargs="+", default=list(ROWS), choices=list(ROWS), metavar="ROW")
    p.add_argument("--seeds", nargs="+", type=seed_int, default=[0, 1, 2])
    p.add_argument("--steps", type=positive_int, default=3000, help="training steps per run (the budget)")
    p.add_argument("--batch", type=positive_int, default=64, help="micro-batch per step")
    p.add_argument("--checkpoint-every", type=non_negative_int, default=0)
    p.add_argument("--bf16", choices=["config", "false", "true", "auto"], default="config",
                   help="train in bf16 (auto: where the device has native bf16, see vqlcmd/engine/precision.py); "
                        "default: the base config's bf16.enabled (the digits configs: auto). The committed 16-token "
                        "records in docs/archive/ were made with --bf16 false (fp32)")
    p.add_argument("--ns-shift", type=float, default=-1.0,
                   help="schedule shift of the VQ-LCMD rows (the paper's NS; 'w/o NS' uses 0)")
    p.add_argument("--per-class", type=positive_int, default=50, help="samples per class for each evaluation")
    p.add_argument("--main-steps", type=positive_int, default=50, help="sampling steps of the continuous rows' main eval")
    p.add_argument("--main-steps-maskgit", type=positive_int, default=8, help="MaskGIT's sampling steps (paper: 8)")
    p.add_argument("--few-steps", nargs="+", type=positive_int, default=FEW_STEPS)
    p.add_argument("--no-few-steps", action="store_true")
    p.add_argument("--eval-batch", type=positive_int, default=None,
                   help="images per sampling batch (default: the pipeline's, by device)")
    p.add_argument("--threads", type=positive_int, default=None, help="torch.set_num_threads (per run with --jobs)")
    p.add_argument("--jobs", type=positive_int, default=1, help="runs trained at once, each in its own process")
    p.add_argument("--time-limit", type=non_negative_float, default=None,
                   help="seconds after which no new run (with --eval-every and one job: no new segment) starts")
    p.add_argument("--eval-every", type=non_negative_int, default=0,
                   help="learning curves: evaluate each run every N training steps (and at the end) with the main "
                        "sampler at each --curve-guidance ω, training in segments that resume the run's checkpoint "
                        "(0: only at the end)")
    p.add_argument("--curve-guidance", nargs="+", type=non_negative_float, default=CURVE_GUIDANCE,
                   help="guidance scales ω of the learning curves' evaluations")
    p.add_argument("--patience", type=non_negative_int, default=0,
                   help="with --eval-every: stop a run once its FID at ω = 0 has not improved for P evaluations, and "
                        "run the end-of-run evaluations there (0: train the whole budget)")
    p.add_argument("--model-overrides", type=json_object, default={},
                   help='DenoiserConfig fields for every row, e.g. \'{"width": 64, "depth": 2}\'')
    p.add_argument("--digits-size", type=positive_int, default=None,
                   help="prepare the digits tokenizer at this size (px) instead of the config's data section; "
                        "16 gives 4x4 = 16 tokens (the default digits data set is 32 px, 8x8 tokens)")
    p.add_argument("--tokenizer-steps", type=positive_int, default=1000, help="training steps of that tokenizer")
    p.add_argument("--digits-cache", default=None, help="cache folder of that tokenizer (default: the project's)")
    p.add_argument("--report-only", action="store_true",
                   help="write the tables and the plot from results.jsonl without training anything")
    p.add_argument("--quick", action="store_true",
                   help="CI: every row, one seed, 2 training steps, 2 samples per class, few steps 1 2 4")
    args = p.parse_args(argv)
    if args.digits_size is not None and args.digits_size % 4:  # the tokenizer halves the image twice
        p.error(f"--digits-size must be a multiple of 4 (the tokenizer downsamples by 4), got {args.digits_size}")
    # a repeated seed, row or step count ran again and counted as another seed
    args.seeds, args.rows, args.few_steps, args.curve_guidance = (
        list(dict.fromkeys(v)) for v in (args.seeds, args.rows, args.few_steps, args.curve_guidance))
    if args.patience and not args.eval_every:
        p.error("--patience needs --eval-every (convergence is read off the learning curve)")
    if args.quick:
        args.seeds, args.steps, args.per_class, args.batch = args.seeds[:1], 2, 2, 8
        args.main_steps, args.main_steps_maskgit, args.few_steps = 4, 2, [1, 2, 4]
    if args.threads:
        torch.set_num_threads(args.threads)
    from vqlcmd.engine.precision import resolve_bf16

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # the Trainer's choice
    ds, base = load_config(args.config)
    bf16 = ds.get("bf16", {}).get("enabled", False) if args.bf16 == "config" else args.bf16
    args.bf16 = resolve_bf16({"false": False, "true": True, "auto": "auto"}.get(bf16, bf16), device)[0]
    args.guidance = base.sample.guidance_scale
    args.out.mkdir(parents=True, exist_ok=True)
    args.data = None
    if args.digits_size is not None and not args.report_only:
        from vqlcmd.data.digits import prepare_digits

        from vqlcmd.data.shards import TokenShardDataset

        info = prepare_digits(args.digits_cache, steps=args.tokenizer_steps, size=args.digits_size, progress=False)
        grid = TokenShardDataset(info["shards"]).header["grid"]
        args.data = {"shards": info["shards"], "tokenizer": info["tokenizer"], "seq_len": int(grid[0]) * int(grid[1]),
                     # which tokenizer: a rebuilt cache (another machine, thread count) is a slightly different one
                     "tokenizer_quality": {"psnr": round(float(info["psnr"]), 2),
                                           "codes_used": int(info["codebook_usage"])}}
        print(f"digits at {args.digits_size} px: tokenizer {info['tokenizer']} (PSNR {info['psnr']:.1f} dB, "
              f"{info['codebook_usage']}/{info['codebook_size']} codes)")
    args.setup = setup_id(args)
    args.commit = git_commit()  # the tree each record was made from ("-dirty" when it had changes)
    results = args.out / "results.jsonl"
    records = read_records(results)
    done = {_record_key(r) for r in records if _same_setup(r, args.setup)}
    others = sum(not _same_setup(r, args.setup) for r in records)
    if others:
        print(f"{others} record(s) in {results} were made with other settings (setup id): not reused or tabled; "
              f"this setup is {args.setup}", flush=True)

    def log(msg):
        print(msg, flush=True)

    # seed-major: an interrupted run still has every row for the first seeds
    jobs = [] if args.report_only else [(row, seed) for seed in args.seeds for row in args.rows]
    # finished runs get no job (with --jobs, each job is a fresh process that imports torch first)
    pending = [job for job in jobs if has_pending(*job, args, records, done)]
    if len(pending) < len(jobs):
        log(f"{len(jobs) - len(pending)} of {len(jobs)} runs already in {results}: not rerun")
    jobs = pending
    failed = []
    for new in _run_jobs(jobs, args, records, done, log, failed):  # (on file already: run_segments)
        records += new
        done.update(_record_key(r) for r in new)
        if args.eval_every:  # the report as the curves grow: a long run killed at a deadline has it
            write_report(records, args, log=None)
    if failed:  # a failed run's evaluations before it failed are on file too
        records = read_records(results)
    write_report(records, args, log=print)
    if failed:
        print(f"{len(failed)} run(s) failed: {', '.join(f'{r} seed {s}' for r, s in failed)} (see above); the "
              "others' results are in " + str(results), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
