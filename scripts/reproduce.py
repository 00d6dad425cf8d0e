#!/usr/bin/env python
"""The paper's comparisons at small scale, on the embedded digits data set, in one command.

    python scripts/reproduce.py --steps 3000 --seeds 0 1 2      # the real budget (hours on a CPU)
    python scripts/reproduce.py --quick                          # every row for a few steps (CI)

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

# The repository root replaces this script's folder on the path: runs from a source checkout without
# install, and scripts/tokenize.py does not shadow the standard library's tokenize module.
sys.path[0] = str(Path(__file__).resolve().parents[1])

import torch  # noqa: E402

from vqlcmd.cli import json_object, non_negative_float, non_negative_int, positive_int, seed_int  # noqa: E402
from vqlcmd.engine.checkpoint import atomic_write_text  # noqa: E402
from vqlcmd.engine.config import load_config, parse_vqlcmd_section, resolve_config_path  # noqa: E402

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
}
# (title, paper table, rows; "vqlcmd" is shown under the row label given here)
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
]
FEW_STEPS = [1, 2, 3, 4, 5, 6, 7, 8, 50]
FEW_STEP_ROWS = ("vqlcmd", "maskgit")
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
    """One write of whole lines, flushed to disk: a kill leaves at most one cut-short last line."""
    if not records:
        return
    with open(path, "a") as f:
        f.write("".join(json.dumps(r) + "\n" for r in records))
        f.flush()
        os.fsync(f.fileno())


def _budget(args) -> tuple:
    return args.steps, args.batch, args.bf16


def _record_budget(r: dict) -> tuple:
    return r["train_steps"], r["batch"], r.get("bf16", False)  # records before the bf16 field were fp32


def setup_id(args) -> str:
    """A digest of the settings besides the budget that change a run's results. A record is reused, and put
    in a table, only under the setup that made it: a rerun with another shift, model, image size or sample
    count took the old numbers under a header naming the new settings, and mixed two setups in one table.
    Records written before it carry no setup and count as this one's (the committed ones in docs/)."""
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


def _record_key(r: dict) -> tuple:
    return (r["row"], r["seed"], *_record_budget(r), r["kind"], r["sample_steps"], r["sampler"])


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


def _sample(pipe, method: str, labels, steps: int, sampler: str, seed: int, batch_size: int):
    g = torch.Generator().manual_seed(10_000 + seed)
    kw = {} if method == "maskgit" else {"sampler": sampler}
    return pipe(labels, num_steps=steps, output_type="pt", generator=g, batch_size=batch_size, **kw)


def evaluate(pipe, method: str, steps: int, sampler: str, seed: int, args) -> dict:
    from vqlcmd.embedding import collapse_indicator
    from vqlcmd.metrics.digits import evaluate_digit_samples

    C = pipe.network.config.num_classes
    labels = torch.arange(C).repeat_interleave(args.per_class)
    t0 = time.perf_counter()
    images = _sample(pipe, method, labels, steps, sampler, seed, args.eval_batch)
    out = evaluate_digit_samples(images, labels)
    K = pipe.network.config.codebook_size
    out["image_size"] = int(images.shape[-1])
    out["collapse"] = collapse_indicator(pipe.network.embedding.table()[:K])
    out["sample_seconds"] = round(time.perf_counter() - t0, 1)
    return out


def main_steps_of(row: str, args) -> int:
    return args.main_steps_maskgit if ROWS[row][1].get("method", "vqlcmd") == "maskgit" else args.main_steps


def pending_evals(row: str, seed: int, args, done) -> list[tuple]:
    """The (kind, sample steps, sampler) evaluations of one row x seed that results.jsonl lacks."""
    method = ROWS[row][1].get("method", "vqlcmd")
    evals = [("main", main_steps_of(row, args), "maskgit" if method == "maskgit" else "ancestral")]
    if row in FEW_STEP_ROWS and not args.no_few_steps:
        evals += [("few_steps", n, "maskgit" if method == "maskgit" else "ddim") for n in args.few_steps]
    return [e for e in evals if (row, seed, *_budget(args), *e) not in done]


def run_one(row: str, seed: int, args, done: dict, log) -> list[dict]:
    """Train (or reuse) one row x seed and evaluate it; returns the new result records."""
    from vqlcmd.engine.trainer import Trainer

    todo = pending_evals(row, seed, args, done)
    if not todo:
        return []
    ds, cfg, run_dir = row_config(row, seed, args)
    method = cfg.method
    t0 = time.perf_counter()
    with open(args.out / "train.log", "a") as f:
        trainer = Trainer(ds, cfg, log=lambda *a, **k: print(*a, file=f, flush=True))
        history = trainer.train(progress=False)
    train_s = time.perf_counter() - t0
    last = {k: v for k, v in (history[-1] if history else {}).items() if k != "step"}
    pipe = trainer.pipeline()
    records = []
    for kind, steps, sampler in todo:
        metrics = evaluate(pipe, method, steps, sampler, seed, args)
        rec = {"row": row, "seed": seed, "train_steps": args.steps, "batch": args.batch, "bf16": args.bf16,
               "setup": args.setup,
               "kind": kind, "sample_steps": steps, "sampler": sampler, "method": method,
               "guidance": pipe.sample_defaults.get("guidance_scale"), "train_seconds": round(train_s, 1),
               "final_losses": last, **metrics}
        records.append(rec)
        log(f"{row:>14} seed {seed} {kind:>9} {sampler:>9} {steps:>3} steps: FID {metrics['fid']:.2f} acc "
            f"{metrics['accuracy']:.3f} P {metrics['precision']:.2f} R {metrics['recall']:.2f} collapse "
            f"{metrics['collapse']:.3f} (train {train_s:.0f} s, sample {metrics['sample_seconds']:.0f} s)")
    return records


def _worker(row: str, seed: int, args, done: dict) -> list[dict]:
    torch.set_num_threads(args.threads or max(1, (os.cpu_count() or 1) // args.jobs))
    return run_one(row, seed, args, done, lambda msg: print(msg, flush=True))


def _run_jobs(jobs, args, done: dict, log, failed: list):
    """Yields each (row, seed) job's new records as it finishes; ``--jobs N`` runs N at once, each in a fresh
    process (a small model leaves a GPU, or a many-core CPU, mostly idle), and ``--time-limit`` starts no
    job after that many seconds, so a bounded session ends with whole runs only."""
    t0 = time.perf_counter()
    late = lambda: args.time_limit is not None and time.perf_counter() - t0 > args.time_limit  # noqa: E731
    if args.jobs <= 1:
        for row, seed in jobs:
            if late():
                log(f"time limit: {row} seed {seed} and later runs not started")
                return
            try:
                new = run_one(row, seed, args, done, log)
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
                fut = pool.submit(_worker, row, seed, args, done)
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
    """The records of this budget and setup, the last one of each key (a repeated seed was counted twice)."""
    kept = {}
    for r in records:
        if _record_budget(r) == _budget(args) and _same_setup(r, args.setup):
            kept[_record_key(r)] = r
    return list(kept.values())


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
    main = [r for r in records if r["kind"] == "main" and r["sample_steps"] == main_steps_of(r["row"], args)]
    lines = [header, ""]
    for title, paper, rows in TABLES:
        present = [(row, label) for row, label in rows if any(r["row"] == row for r in main)]
        if not present:
            continue
        lines += [f"### {title} (cf. paper {paper})", "",
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
        lines += ["### Few sampling steps (cf. paper Table \"maskgit:imagenet\"): FID ↓ / accuracy ↑", "",
                  "| method | " + " | ".join(str(s) for s in steps) + " |", "|---|" + "---|" * len(steps)]
        for row, name in (("maskgit", "MaskGIT"), ("vqlcmd", "VQ-LCMD (DDIM)")):
            for key, digits in (("fid", 2), ("accuracy", 3)):
                cells = [_fmt([r[key] for r in few if r["row"] == row and r["sample_steps"] == s], digits)
                         for s in steps]
                lines.append(f"| {name} {key} | " + " | ".join(cells) + " |")
        lines.append("")
    ref_file = args.out / f"real_reference_{args.image_size}px.json"
    if ref_file.is_file():
        ref = json.loads(ref_file.read_text())
    else:  # fitting the metric's feature net takes minutes on a loaded CPU: do it once per size
        ref = real_reference(args.image_size)
        atomic_write_text(ref_file, json.dumps(ref))
    lines += [f"Real-data floor (two halves of the real digits, {ref['num_samples']} each): FID {ref['fid']:.2f}, "
              f"precision {ref['precision']:.2f}, recall {ref['recall']:.2f}.", ""]
    return "\n".join(lines)


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
    for row, name, style in (("vqlcmd", "VQ-LCMD (DDIM)", "o-"), ("maskgit", "MaskGIT", "s--")):
        for ax, key in zip(axes, ("fid", "accuracy")):
            mean, std, x_ok = [], [], []
            for x, s in zip(xs, steps):
                v = [r[key] for r in few if r["row"] == row and r["sample_steps"] == s]
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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="ds_digits.json", help="base config (a path or a name in configs/)")
    p.add_argument("--out", type=Path, default=Path("runs/reproduce"))
    p.add_argument("--rows", nargs="+", default=list(ROWS), choices=list(ROWS), metavar="ROW")
    p.add_argument("--seeds", nargs="+", type=seed_int, default=[0, 1, 2])
    p.add_argument("--steps", type=positive_int, default=3000, help="training steps per run (the budget)")
    p.add_argument("--batch", type=positive_int, default=64, help="micro-batch per step")
    p.add_argument("--checkpoint-every", type=non_negative_int, default=0)
    p.add_argument("--bf16", choices=["false", "true", "auto"], default="false",
                   help="train in bf16 (auto: where the device has native bf16, see vqlcmd/engine/precision.py); "
                        "default fp32, as the committed records in docs/ were measured, whatever the base config says")
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
                   help="seconds after which no new run starts")
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
    args.seeds, args.rows, args.few_steps = (list(dict.fromkeys(v)) for v in (args.seeds, args.rows, args.few_steps))
    if args.quick:
        args.seeds, args.steps, args.per_class, args.batch = args.seeds[:1], 2, 2, 8
        args.main_steps, args.main_steps_maskgit, args.few_steps = 4, 2, [1, 2, 4]
    if args.threads:
        torch.set_num_threads(args.threads)
    from vqlcmd.engine.precision import resolve_bf16

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # the Trainer's choice
    args.bf16 = resolve_bf16({"false": False, "true": True, "auto": "auto"}[args.bf16], device)[0]
    args.out.mkdir(parents=True, exist_ok=True)
    args.data = None
    if args.digits_size is not None and not args.report_only:
        from vqlcmd.data.digits import prepare_digits

        from vqlcmd.data.shards import TokenShardDataset

        info = prepare_digits(args.digits_cache, steps=args.tokenizer_steps, size=args.digits_size, progress=False)
        grid = TokenShardDataset(info["shards"]).header["grid"]
        args.data = {"shards": info["shards"], "tokenizer": info["tokenizer"], "seq_len": int(grid[0]) * int(grid[1])}
        print(f"digits at {args.digits_size} px: tokenizer {info['tokenizer']} (PSNR {info['psnr']:.1f} dB, "
              f"{info['codebook_usage']}/{info['codebook_size']} codes)")
    args.setup = setup_id(args)
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
    pending = [job for job in jobs if pending_evals(*job, args, done)]
    if len(pending) < len(jobs):
        log(f"{len(jobs) - len(pending)} of {len(jobs)} runs already in {results}: not rerun")
    jobs = pending
    failed = []
    for new in _run_jobs(jobs, args, done, log, failed):
        append_records(results, new)
        records += new
        done.update(_record_key(r) for r in new)
    ds, base = load_config(args.config)
    sizes = {r.get("image_size") for r in records if r.get("image_size")}
    args.image_size = sizes.pop() if len(sizes) == 1 else 32
    cur = _current(records, args)  # this budget and setup
    header = (f"Budget: {args.steps} training steps x batch {args.batch} per run in "
              f"{'bf16' if args.bf16 else 'fp32'}, seeds {args.seeds}, "
              f"{args.per_class} samples per class per evaluation, guidance ω = {base.sample.guidance_scale}, "
              f"VQ-LCMD shift {args.ns_shift}; base config {args.config}, preset {base.model.preset}"
              f"{' with ' + json.dumps(args.model_overrides) if args.model_overrides else ''}"
              f"{f', digits at {args.digits_size} px (tokenizer {args.tokenizer_steps} steps)' if args.digits_size else ''}. "
              f"Wall time: {sum(r['sample_seconds'] for r in cur) + sum({(r['row'], r['seed']): r['train_seconds'] for r in cur}.values()):.0f} s of training and sampling.")
    text = write_tables(records, args, header)
    atomic_write_text(args.out / "tables.md", text)
    plotted = plot_few_steps(records, args, args.out / "few_steps.png")
    print(text)
    print(f"tables -> {args.out / 'tables.md'}" + (f"; plot -> {args.out / 'few_steps.png'}" if plotted else ""))
    if failed:
        print(f"{len(failed)} run(s) failed: {', '.join(f'{r} seed {s}' for r, s in failed)} (see above); the "
              "others' results are in " + str(results), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
