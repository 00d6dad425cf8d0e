#!/usr/bin/env python
"""The digits evaluation table: class accuracy, feature-space FID and precision/recall of a digits
pipeline at several step counts, for the ancestral and DDIM samplers and several guidance scales.

    python -m studies.digits_table --pipeline runs/digits/pipeline --out runs/digits_eval.md

Each cell draws ``--per-class`` images of every class (one generator per image, seeded from
``--seed`` and the image index, so every cell starts from the same noise) and scores them with
vqlcmd.metrics.digits (SVC accuracy; FID, precision, recall with k = 3 in an MLP's feature space
against all 1797 real digits). Cells are appended to a JSON-lines cache as they
finish (``digits_table.jsonl`` beside the pipeline folder), so a stopped run continues where it
stopped; the Markdown is rewritten after every cell.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import shlex
import sys
import time
from pathlib import Path

import torch

from vqlcmd.cli import choices_list, comma_list, non_negative_float, positive_int, seed_int
from vqlcmd.samplers import SAMPLERS


def digest(folder: Path) -> str:
    """The cache key of a pipeline: its weights and its config.json (schedule, sample defaults, tokenizer), but
    not the save id, which hand edits of the config leave as it was."""
    config = {k: v for k, v in json.loads((folder / "config.json").read_text()).items() if k != "save_id"}
    h = hashlib.sha256((folder / "model.safetensors").read_bytes())
    h.update(json.dumps(config, sort_keys=True).encode())
    return h.hexdigest()[:16]


def cell_key(c: dict) -> tuple:
    return (c["weights"], c["sampler"], c["num_steps"], c["guidance_scale"], c["per_class"], c["seed"])


def run_cell(pipe, sampler: str, steps: int, guidance: float, per_class: int, seed: int, batch_size: int) -> dict:
    from vqlcmd.metrics.digits import evaluate_digit_samples
    from vqlcmd.pipeline import image_generators

    C = pipe.network.config.num_classes
    labels = torch.arange(C).repeat(per_class)  # class-interleaved: every batch holds all classes
    gens = image_generators([(seed << 32) | i for i in range(len(labels))])
    t0 = time.perf_counter()
    images = pipe(labels, num_steps=steps, sampler=sampler, guidance_scale=guidance, generator=gens,
                  batch_size=batch_size, output_type="pt")
    seconds = time.perf_counter() - t0
    m = evaluate_digit_samples(images, labels)
    return {**m, "sampling_seconds": round(seconds, 2), "image_size": int(images.shape[-1])}


def markdown(cells: list, info: dict, reference: dict, missing=()) -> str:
    lines = [
        "# Digits: step count, sampler and guidance",
        "",
        f"Model: `{info['pipeline']}` ({info['model']}). "
        f"Each row: {info['per_class']} samples per class ({info['num_samples']} in all), the same per-image "
        f"seeds in every row, final tokens drawn from P(x | z_0) (Algorithm 2). "
        f"Made by `python -m studies.digits_table {info['command']}`.",
        "",
        *([info["note"], ""] if info.get("note") else []),
        "- **accuracy**: an RBF SVC fitted on the real digits classifies the samples; the share that get "
        "the class they were drawn for.",
        "- **FID**, **precision**, **recall** (k = 3): in the 64-unit hidden layer of an MLP classifier "
        "fitted on the real digits, against all 1797 real digits (vqlcmd/metrics/digits.py). Precision is "
        "the share of samples inside the real digits' k-NN manifold (fidelity); recall the share of real "
        "digits inside the samples' manifold (variety).",
        "- **spread**: mean within-class distance to the class centroid (8x8 pixels) relative to the real "
        "digits' (1.0 = as varied as the data).",
        f"- Finite-sample floor: {reference['num_samples']} real digits held out from the other half of the "
        f"data score FID {reference['fid']:.2f}, precision {reference['precision']:.3f}, recall "
        f"{reference['recall']:.3f} against it: a perfect model's FID at {info['num_samples']} samples lies "
        "near this, not at 0.",
        "",
        "| sampler | guidance | steps | accuracy | FID | precision | recall | spread | s / 100 img |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    order = {"ancestral": 0, "ddim": 1}
    for c in sorted(cells, key=lambda c: (order.get(c["sampler"], 9), c["guidance_scale"], c["num_steps"])):
        per100 = 100 * c["sampling_seconds"] / c["num_samples"]
        lines.append(f"| {c['sampler']} | {c['guidance_scale']:g} | {c['num_steps']} | "
                     f"{100 * c['accuracy']:.1f}% | {c['fid']:.2f} | {c['precision']:.3f} | {c['recall']:.3f} | "
                     f"{c['spread_ratio']:.2f} | {per100:.1f} |")
    lines += ["", f"Sampling times: {info['machine']}."]
    if missing:
        lines += ["", "Not run yet (the command continues from its cache): " +
                  ", ".join(f"{s} ω={g:g} {n} steps" for s, n, g in missing) + "."]
    lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pipeline", default="runs/digits/pipeline")
    p.add_argument("--out", default="runs/digits_eval.md")
    p.add_argument("--cache", default=None,
                   help="JSON-lines results cache (default: digits_table.jsonl beside the pipeline folder)")
    p.add_argument("--steps", type=comma_list(positive_int), default=[5, 10, 20, 50])
    p.add_argument("--samplers", type=choices_list(SAMPLERS), default=list(SAMPLERS))
    p.add_argument("--guidance", type=comma_list(non_negative_float), default=[0.0, 1.0, 2.0])
    p.add_argument("--per-class", type=positive_int, default=50)
    p.add_argument("--seed", type=seed_int, default=0)
    p.add_argument("--batch-size", type=positive_int, default=250)
    p.add_argument("--machine", default=None, help="words for the machine the times were measured on")
    p.add_argument("--note", default=None, help="a paragraph printed under the model line (e.g. its status)")
    args = p.parse_args(argv)

    from vqlcmd.metrics.digits import real_reference
    from vqlcmd.pipeline import VQLCMDPipeline

    folder = Path(args.pipeline)
    pipe = VQLCMDPipeline.from_pretrained(folder)
    if pipe.sample_defaults.get("sampler") == "maskgit":  # the table's rows are the diffusion samplers
        raise SystemExit(f"{folder}: a MaskGIT pipeline; the table compares the ancestral and DDIM samplers "
                         "(scripts/evaluate.py --digits scores a MaskGIT model's samples)")
    if not 1 <= pipe.network.config.num_classes <= 10:  # a digit classifier scores it: labels 0-9
        raise SystemExit(f"{folder}: the digits table needs a class-conditional digits pipeline (at most 10 "
                         f"classes, the digits 0-9); this one has {pipe.network.config.num_classes}")
    out = Path(args.out)
    # the cache belongs with the model (runs/ is not committed), not with the Markdown
    cache = Path(args.cache) if args.cache else folder.parent / "digits_table.jsonl"
    weights = digest(folder)
    done = {}
    if cache.is_file():
        for line in cache.read_text().splitlines():
            if line.strip():
                c = json.loads(line)
                done[cell_key(c)] = c
    cfg = json.loads((folder / "config.json").read_text())
    train = (cfg.get("training_config") or {}).get("vqlcmd", cfg.get("training_config") or {})
    preset = (train.get("model") or {}).get("preset", "?")
    n_params = sum(p.numel() for p in pipe.network.denoiser.parameters())
    shown = list(sys.argv[1:] if argv is None else argv)
    if "--note" in shown:  # the note is prose for the page, not part of the command that makes the numbers
        i = shown.index("--note")
        del shown[i:i + 2]
    command = shlex.join(shown)  # pasted into a shell, it runs (a --machine with spaces needs its quotes)
    info = {"pipeline": str(folder), "per_class": args.per_class, "command": command, "note": args.note,
            "num_samples": args.per_class * pipe.network.config.num_classes,
            "model": f"preset {preset}, {n_params / 1e6:.2f}M denoiser parameters, trained {cfg.get('step', '?')} "
                     f"steps, weights {weights}",
            "machine": args.machine or f"{torch.get_num_threads()} CPU threads, batch {args.batch_size}, "
                                       "on a machine shared with other jobs (compare within this table only)"}
    reference = None  # the floor at the pipeline's image size, known after the first cell
    plan = [(sampler, steps, guidance) for sampler in args.samplers for guidance in args.guidance
            for steps in args.steps]
    # cheapest cells first (guidance doubles the batch): a run cut short still covers most of the table
    plan.sort(key=lambda c: (c[1] * (2 if c[2] > 0 else 1), c))
    cells = []
    out.parent.mkdir(parents=True, exist_ok=True)
    for n, (sampler, steps, guidance) in enumerate(plan):
        key = (weights, sampler, steps, guidance, args.per_class, args.seed)
        if key in done:
            cells.append(done[key])
            reference = reference or real_reference(done[key].get("image_size", 32), n=info["num_samples"])
            continue
        r = run_cell(pipe, sampler, steps, guidance, args.per_class, args.seed, args.batch_size)
        c = {"weights": weights, "sampler": sampler, "num_steps": steps, "guidance_scale": guidance,
             "per_class": args.per_class, "seed": args.seed, **r}
        with open(cache, "a") as f:
            f.write(json.dumps(c) + "\n")
        cells.append(c)
        reference = reference or real_reference(c["image_size"], n=info["num_samples"])
        print(f"{sampler} ω={guidance:g} {steps:>2} steps: accuracy {100 * r['accuracy']:.1f}%, "
              f"FID {r['fid']:.2f}, P {r['precision']:.3f}, R {r['recall']:.3f} "
              f"({r['sampling_seconds']:.0f} s)", flush=True)
        out.write_text(markdown(cells, info, reference, missing=plan[n + 1:]))
    out.write_text(markdown(cells, info, reference))
    print(f"table -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
