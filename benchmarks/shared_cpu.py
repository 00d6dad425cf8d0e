#!/usr/bin/env python
"""The quick start's training speed on a CPU that another process shares, in one run.

    python benchmarks/shared_cpu.py                  # 40 timed steps per case (+5 warm-up), one core kept busy
    python benchmarks/shared_cpu.py --steps 20 --busy 2

Trains configs/ds_digits.json through scripts/train.py (its model, batch and optimizer; token shards shaped
like the digits', K=128 on 8x8 with 10 classes, so that no tokenizer is trained first; checkpoints and
sample grids off) in four cases: the scripts' thread setting (default: auto + OMP_WAIT_POLICY=PASSIVE) and
torch's own defaults (VQLCMD_THREADS=torch: threads = cores, OpenMP spinning as before), each on idle cores
and with --busy processes spinning on the CPU. Prints training steps/s per case and busy/idle ratios;
``--json`` writes them too. The goal (issue 30): busy >= 0.4x idle with the default setting.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODES = {"default": {}, "torch": {"VQLCMD_THREADS": "torch"}}


def _child(argv: list, warmup: int) -> None:
    """Runs scripts/train.py's main in this process, timing its training steps; prints one JSON line."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("train_script", ROOT / "scripts" / "train.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)  # its top sets the wait policy before it imports torch
    import torch

    from vqlcmd.engine import trainer as trainer_module

    stamps = []
    step = trainer_module.Trainer.train_step

    def timed(self, batches):
        out = step(self, batches)
        stamps.append(time.perf_counter())
        return out

    trainer_module.Trainer.train_step = timed
    rc = script.main(argv)
    timed_steps = len(stamps) - 1 - warmup
    rate = timed_steps / (stamps[-1] - stamps[warmup]) if rc == 0 and timed_steps > 0 else None
    print(json.dumps({"rc": rc, "steps_per_s": rate, "threads": torch.get_num_threads(),
                      "wait_policy": os.environ.get("OMP_WAIT_POLICY")}))


def _shards(folder: Path) -> None:
    import numpy as np

    from vqlcmd.data.shards import write_shard

    rng = np.random.default_rng(0)
    labels = rng.integers(0, 10, 1797)
    tokens = rng.integers(0, 128, (1797, 64))
    header = {"codebook_size": 128, "grid": [8, 8], "tokenizer_id": "shared-cpu-benchmark", "num_classes": 10,
              "class_names": [str(i) for i in range(10)]}
    write_shard(folder / "shard_00000.vqtok", tokens, labels, header)


def _case(tmp: Path, mode: str, busy: int, steps: int, warmup: int) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OMP_WAIT_POLICY", "VQLCMD_THREADS")}
    env.update(MODES[mode])
    out = tmp / f"run_{mode}_{busy}"
    argv = ["--config", "ds_digits.json", "--no-progress", "--set", "data.dataset=null",
            "--set", f"data.shards={tmp / 'shards'}", "--set", f"train.steps={steps + warmup + 1}",
            "--set", f"train.output_dir={out}", "--set", "train.sample_every=0", "--set", "train.checkpoint_every=0",
            "--set", f"train.log_every={steps + warmup + 1}"]
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(busy)]
    try:
        time.sleep(1.0 if busy else 0.0)  # the spinners are running when the run judges the cores
        run = subprocess.run([sys.executable, __file__, "--child", json.dumps(argv), "--warmup", str(warmup)],
                             env=env, capture_output=True, text=True)
    finally:
        for p in spinners:
            p.kill()
            p.wait()
    try:
        result = json.loads(run.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        raise SystemExit(f"case {mode}/{busy} busy failed (exit {run.returncode}):\n{run.stderr[-3000:]}")
    if result["steps_per_s"] is None:
        raise SystemExit(f"case {mode}/{busy} busy trained nothing (exit {result['rc']}):\n{run.stderr[-3000:]}")
    return {"mode": mode, "busy": busy, **result}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=40, help="timed training steps per case")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps first")
    p.add_argument("--busy", type=int, default=1, help="spinning processes in the busy cases")
    p.add_argument("--json", default=None, help="also write the results here")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child is not None:
        _child(json.loads(args.child), args.warmup)
        return 0
    sys.path.insert(0, str(ROOT))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        _shards(tmp / "shards")
        for mode in MODES:
            for busy in (0, args.busy):
                row = _case(tmp, mode, busy, args.steps, args.warmup)
                print(f"  {mode:8s} {'busy' if busy else 'idle':5s}: {row['steps_per_s']:.2f} steps/s "
                      f"({row['threads']} threads, OMP_WAIT_POLICY {row['wait_policy']})", file=sys.stderr)
                rows.append(row)
    by = {(r["mode"], r["busy"]): r["steps_per_s"] for r in rows}
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    print(f"ds_digits.json training steps/s, {cores} cores, {args.busy} spinning process(es) when busy, "
          f"{args.steps} timed steps")
    print(f"{'threads':24s} {'idle':>8s} {'busy':>8s} {'busy/idle':>10s}")
    for mode, label in (("default", "default (auto, passive)"), ("torch", "torch's defaults (old)")):
        idle, busy = by[(mode, 0)], by[(mode, args.busy)]
        print(f"{label:24s} {idle:8.2f} {busy:8.2f} {busy / idle:10.2f}")
    met = by[("default", args.busy)] >= 0.4 * by[("default", 0)]
    print(f"goal: default busy/idle >= 0.40 -> {'met' if met else 'NOT met'}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
