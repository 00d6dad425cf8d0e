#!/usr/bin/env python
"""Long-format benchmark rows from a training run's log steps (``metrics.jsonl`` and ``config.json``).

    python benchmarks/train_rows.py RUN_DIR --backend fast+compile --out FILE.jsonl

One row per log interval (``case`` "train step", the interval's end step in ``extra``) and a
``summary`` row: the median images/s over the intervals after the first (which holds start-up and any
torch.compile), with the MFU that implies by benchmarks/flops.py's count for the run's model,
micro-batch, ``loss.l0_fraction`` and ``loss.beta_cm``. Rows have benchmarks/run.py's fields, so a
cut-off run still leaves the rows of the intervals it logged.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks import flops  # noqa: E402
from benchmarks.run import ROW_FIELDS, append_rows, device_name, git_commit  # noqa: E402
from vqlcmd.model import Denoiser, preset_config  # noqa: E402


def step_flops(config: dict, micro: int) -> float:
    v = config["vqlcmd"]
    cfg = preset_config(v["model"]["preset"], **v["model"].get("overrides", {}))
    with torch.device("meta"):  # the weights' shapes only
        den = Denoiser(cfg)
    loss = v.get("loss", {})
    return flops.train_step_flops(den, micro, cfg.seq_len, l0_fraction=loss.get("l0_fraction", 1.0),
                                  teacher=loss.get("beta_cm", 1.0) > 0)


def last_error(log) -> str:
    """The last line of a training log that names an error (what a failed or cut-off run died of)."""
    if log is None or not Path(log).is_file():
        return ""
    lines = [ln.strip() for ln in Path(log).read_text(errors="replace").splitlines()
             if "Error" in ln or "error:" in ln or "Killed" in ln]
    return lines[-1][:300] if lines else ""


def rows_for(run_dir: Path, backend: str, log=None) -> list[dict]:
    config = json.loads((run_dir / "config.json").read_text())
    metrics = run_dir / "metrics.jsonl"
    logged = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()] if metrics.is_file() \
        else []
    v = config["vqlcmd"]
    micro = config["train_micro_batch_size_per_gpu"]
    ranks = logged[0]["ranks"] if logged else 1
    f_step = step_flops(config, micro)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    name = device_name(device)
    peak = flops.peak_bf16_flops(name) if device.type == "cuda" else None
    precision = "bf16" if config.get("bf16", {}).get("enabled") else "float32"
    meta = dict(stage="train", backend=backend, shape=f"{v['model']['preset']} B{micro} x{ranks} ranks",
                dtype=precision, baseline="", speedup=None, device=device.type, device_name=name,
                torch=torch.__version__, commit=git_commit(), quick=False,
                timestamp=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), host_threads=torch.get_num_threads())

    def figures(images_per_s: float) -> dict:
        per_rank = images_per_s / ranks  # the trainer's rate counts every rank's images
        out = {"images/s": images_per_s, "TFLOP/step": f_step / 1e12, "TFLOP/s": f_step * per_rank / micro / 1e12}
        if peak:
            out["MFU%"] = 100.0 * f_step * per_rank / micro / peak
        return out

    rows = []
    for r in logged:
        ms = 1e3 * micro * ranks / r["images_per_s"]
        rows.append({**meta, "case": "train step", "status": "ok", "median_ms": ms, "spread_ms": None,
                     "peak_mem_bytes": None, "reps": 1, "reason": "",
                     "extra": {"step": r["step"], "loss": r.get("loss"), **figures(r["images_per_s"])}})
    steady = [r["images_per_s"] for r in logged[1:]]
    if steady:
        ips = statistics.median(steady)
        rows.append({**meta, "case": "summary", "status": "ok", "median_ms": 1e3 * micro * ranks / ips,
                     "spread_ms": None, "peak_mem_bytes": None, "reps": len(steady), "reason": "",
                     "extra": {**figures(ips), "steps": logged[-1]["step"], "log_every": v["train"]["log_every"],
                               "first_interval_images/s": logged[0]["images_per_s"]}})
    else:
        rows.append({**meta, "case": "summary", "status": "failed", "median_ms": None, "spread_ms": None,
                     "peak_mem_bytes": None, "reps": 0, "extra": {},
                     "reason": f"{len(logged)} log step(s) in {metrics}: the run stopped before a second. "
                               + last_error(log)})
    return [{k: row.get(k) for k in ROW_FIELDS} for row in rows]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", type=Path)
    p.add_argument("--backend", required=True, help="what the run trained with, e.g. fast+compile")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--log", type=Path, help="the run's output: a failed run's row names the error it ends in")
    args = p.parse_args(argv)
    if not (args.run_dir / "config.json").is_file():
        print(f"error: {args.run_dir} holds no config.json: the run did not start", file=sys.stderr)
        return 2
    rows = rows_for(args.run_dir, args.backend, args.log)
    append_rows(args.out, rows)
    summary = rows[-1]
    print(f"{args.backend} {summary['shape']}: {summary['status']} {json.dumps(summary['extra'] or summary['reason'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
