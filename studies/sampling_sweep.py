#!/usr/bin/env python
"""Score one trained digits pipeline under every sampling setting it exposes, to choose its defaults.

    python -m studies.sampling_sweep runs/digits/pipeline --out sweep.jsonl --guidance 0 0.5 1 2

For each (sampler, sampling steps, guidance ω, final draw) it draws --per-class samples per class with the
same generator seed and scores them with the project's digits metrics (vqlcmd.metrics.digits: the
independent SVC's accuracy, within-class spread relative to the real digits', feature-space FID and k-NN
precision/recall). One JSON line per setting in --out; settings already there (for this pipeline's training
step, this --per-class and this --seed) are not sampled again, so an interrupted sweep continues. Prints a
Markdown table of every setting in --out, with the quick start's goals (accuracy >= 0.98, spread >= 0.70, recall >= 0.5)
marked. VQ-LCMD pipelines only (MaskGIT's sampler has neither the sampler nor the final-draw choice).
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time
from pathlib import Path

import torch

from vqlcmd.cli import noise_interval, non_negative_float, non_negative_int, positive_int
from vqlcmd.samplers import EVERY_T, checked_interval

GOALS = {"accuracy": 0.98, "spread_ratio": 0.70, "recall": 0.5}  # issue 31 (c): the quick start's targets


def _key(r: dict) -> tuple:
    # the seed is part of a setting: a second sampling seed in the same --out is a new draw, not a repeat
    return (r["train_step"], _seed(r), r["per_class"], r["sampler"], r["sample_steps"], r["guidance"], r["final"],
            _interval(r))


def _guided_t(interval) -> str:
    return "all" if tuple(interval) == EVERY_T else "{:g}-{:g}".format(*interval)


def _seed(r: dict) -> int:
    return r.get("seed", 0)  # the generator seed's default, for a record written without one


def _interval(r: dict) -> tuple[float, float]:
    return checked_interval(r.get("interval"))  # records from before the option guided every t


def table(records: list[dict]) -> str:
    lines = ["| step | seed | sampler | steps | ω | guided t | final | accuracy | spread | recall | precision | FID "
             "| goals |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(records, key=_key):
        met = all(r[k] >= v for k, v in GOALS.items())
        lines.append(f"| {r['train_step']} | {_seed(r)} | {r['sampler']} | {r['sample_steps']} "
                     f"| {r['guidance']:g} | {_guided_t(_interval(r))} | {r['final']} "
                     f"| {r['accuracy']:.3f} | {r['spread_ratio']:.2f} | {r['recall']:.2f} | {r['precision']:.2f} "
                     f"| {r['fid']:.2f} | {'all met' if met else '–'} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("pipeline", type=Path, help="an exported pipeline folder (a run's pipeline/)")
    p.add_argument("--out", type=Path, required=True, help="JSON-lines file of the records (appended)")
    p.add_argument("--samplers", nargs="+", default=["ancestral", "ddim"], choices=["ancestral", "ddim"])
    p.add_argument("--steps", nargs="+", type=positive_int, default=[50])
    p.add_argument("--guidance", nargs="+", type=non_negative_float, default=[0.0, 0.5, 1.0, 2.0])
    p.add_argument("--finals", nargs="+", default=["sample", "argmax"], choices=["sample", "argmax"],
                   help="the last draw: x ~ P(x | z_0), or its argmax")
    p.add_argument("--intervals", nargs="+", type=noise_interval, default=[EVERY_T], metavar="LO,HI",
                   help="noise levels t where guidance applies (sample.guidance_interval), e.g. 0,1 (all) 0.2,0.7")
    p.add_argument("--per-class", type=positive_int, default=20)
    p.add_argument("--seed", type=non_negative_int, default=0, help="generator seed of every setting's samples")
    p.add_argument("--time-limit", type=non_negative_float, default=None, help="seconds after which no setting starts")
    args = p.parse_args(argv)

    from vqlcmd.engine.checkpoint import atomic_write_text
    from vqlcmd.metrics.digits import evaluate_digit_samples

    from vqlcmd.pipeline import VQLCMDPipeline

    pipe = VQLCMDPipeline.from_pretrained(args.pipeline)
    step = json.loads((args.pipeline / "config.json").read_text()).get("step")
    records = [json.loads(line) for line in args.out.read_text().splitlines() if line.strip()] \
        if args.out.is_file() else []
    done = {_key(r) for r in records}
    labels = torch.arange(pipe.network.config.num_classes).repeat_interleave(args.per_class)
    t0 = time.perf_counter()
    for sampler, steps, guidance, final, interval in itertools.product(args.samplers, args.steps, args.guidance,
                                                                       args.finals, args.intervals):
        if guidance == 0 and interval != EVERY_T:  # unguided: the interval changes nothing
            continue
        rec = {"pipeline": str(args.pipeline), "train_step": step, "per_class": args.per_class, "sampler": sampler,
               "sample_steps": steps, "guidance": guidance, "final": final, "seed": args.seed,
               "interval": list(interval)}
        if _key(rec) in done:
            continue
        if args.time_limit is not None and time.perf_counter() - t0 > args.time_limit:
            print("time limit: the remaining settings not sampled", flush=True)
            break
        t1 = time.perf_counter()
        images = pipe(labels, num_steps=steps, guidance_scale=guidance, output_type="pt",
                      generator=torch.Generator().manual_seed(args.seed), sampler=sampler, final=final,
                      guidance_interval=interval)
        rec.update(evaluate_digit_samples(images, labels), sample_seconds=round(time.perf_counter() - t1, 1))
        records.append(rec)
        with open(args.out, "a") as f:  # a line per setting as it finishes: a kill loses one setting at most
            f.write(json.dumps(rec) + "\n")
            f.flush()
            os.fsync(f.fileno())
        print(f"{sampler} {steps} steps ω {guidance:g} guided t {_guided_t(interval)} {rec['final']}: acc "
              f"{rec['accuracy']:.3f} spread {rec['spread_ratio']:.2f} recall {rec['recall']:.2f} FID {rec['fid']:.2f} ({rec['sample_seconds']} s)",
              flush=True)
    text = table(records)
    atomic_write_text(args.out.with_suffix(".md"), text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
