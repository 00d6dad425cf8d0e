"""How paper_steps.jsonl in docs/archive/reproduce64_bf16, _8000 and _dropout were made: a study's final pipelines
sampled unguided (omega = 0) at more sampling steps than the learning curves use. The paper compares its
unconditional models with "200 steps for inference" for every method; the study's curves use 50 (VQ-LCMD) and 8
(MaskGIT). MaskGIT commits at least one of the 64 tokens per step, so 64 is its most. Sampled with
studies/reproduce.py's own evaluate() and the run's seed as the sampling seed, as the study's records; at
--per-class 20 (the study's count) the 50- and 8-step settings repeat records the study already has, figure for figure.
The default, 50 per class, is 2.5x the samples of the study's evaluations: an FID from 200 samples moves by ~0.1
from one evaluation to the next.

    python -m studies.paper_steps docs/archive/reproduce64_bf16   # after the study; settings done are skipped
"""
import argparse
import json
import sys
from pathlib import Path

import torch

from studies.reproduce import _fmt, append_records, evaluate, read_records  # _fmt: the study tables' mean ± std
from vqlcmd.pipeline import VQLCMDPipeline

SETTINGS = {"vqlcmd": [("ancestral", 50), ("ancestral", 200), ("ddim", 50), ("ddim", 200)],
            "maskgit": [("maskgit", 8), ("maskgit", 16), ("maskgit", 64)]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("study", type=Path)
    p.add_argument("--per-class", type=int, default=50)
    p.add_argument("--threads", type=int, default=1)
    cli = p.parse_args(argv)
    torch.set_num_threads(cli.threads)
    study = cli.study
    out = study / "paper_steps.jsonl"
    done = {(r["row"], r["seed"], r["sampler"], r["sample_steps"], r["per_class"]) for r in read_records(out)}
    args = argparse.Namespace(per_class=cli.per_class, eval_batch=None)
    for row, settings in SETTINGS.items():
        for folder in sorted((study / "runs" / row).glob("seed*/pipeline")):
            seed = int(folder.parent.name.split("-")[0].removeprefix("seed"))
            pipe = VQLCMDPipeline.from_pretrained(folder)
            step = json.loads((folder.parent / "train_seconds.json").read_text())["step"]
            for sampler, steps in settings:
                if (row, seed, sampler, steps, cli.per_class) in done:
                    continue
                r = evaluate(pipe, row, steps, sampler, seed, args, 0.0)
                r.update(row=row, seed=seed, train_step=step, sampler=sampler, sample_steps=steps, guidance=0.0,
                         per_class=cli.per_class)
                print(json.dumps(r), flush=True)
                append_records(out, [r])

    records = [r for r in read_records(out) if r["per_class"] == cli.per_class]
    print(f"{cli.per_class} samples per class, unguided, at each run's last training step")
    print("| method | sampler | steps | seeds | FID ↓ | precision | recall | accuracy | spread |")
    print("|---|---|---:|---:|---|---|---|---|---|")
    for row, settings in SETTINGS.items():
        for sampler, steps in settings:
            rs = [r for r in records if (r["row"], r["sampler"], r["sample_steps"]) == (row, sampler, steps)]
            if rs:
                cells = [_fmt([r[k] for r in rs], d) for k, d in
                         (("fid", 2), ("precision", 2), ("recall", 2), ("accuracy", 3), ("spread_ratio", 2))]
                print(f"| {row} | {sampler} | {steps} | {len(rs)} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
