"""End-of-run report: a guided class-conditional grid and, on digits, the classifier's verdict."""
from __future__ import annotations

import json
import time
from typing import Optional

import torch

from ..samplers import EVERY_T, checked_interval


def on_digits(trainer) -> bool:
    """Whether the run trains on the embedded digits: named in the config, or its shards given by path
    (as ``studies/reproduce.py`` does), recognised by the source their header records."""
    from ..data.digits import DIGITS_SOURCE

    return trainer.cfg.data.dataset == "digits" or trainer.header.get("source") == DIGITS_SOURCE


GRID_ROWS = 10


def grid_classes(num_classes: int, rows: Optional[int] = None) -> torch.Tensor:
    """The classes a sample grid shows, a row each: all of them up to ``rows``, else ``rows`` spread evenly
    over the labels. Every class of ImageNet's 1000 made a preview of 8000 images, sampled and decoded
    at every ``sample_every``."""
    rows = GRID_ROWS if rows is None else rows
    if num_classes <= rows:
        return torch.arange(num_classes)
    return torch.linspace(0, num_classes - 1, rows).round().long()


def final_report(trainer, per_class: int = 50) -> dict:
    """Saves a grid of the config's sampling defaults (``grid_classes``, 10 images each) and, for the
    embedded digits data set (see ``on_digits``), samples ``per_class`` images of every class and prints
    their accuracy, within-class spread and feature-space FID / precision / recall."""
    from torchvision.utils import save_image

    pipe = trainer.pipeline()
    s = pipe.sample_defaults  # what the pipeline samples with (MaskGIT's sampler and steps for its runs)
    C = trainer.net.config.num_classes
    digits = on_digits(trainer)
    # only the digits' samples are scored: elsewhere the grid's images are all there is to sample
    per_class = per_class if digits else min(per_class, 10)
    t0 = time.perf_counter()
    g = torch.Generator(device=trainer.device).manual_seed(2024)
    classes = (torch.arange(C) if digits else grid_classes(C)) if C else None
    labels = classes.repeat_interleave(per_class) if C else None
    images = pipe(labels, output_type="pt", generator=g) if C else pipe(num_images=per_class * 8, output_type="pt",
                                                                         generator=g)
    seconds = time.perf_counter() - t0
    grid = trainer.out_dir / "samples" / "final.png"
    grid.parent.mkdir(parents=True, exist_ok=True)
    if C:
        shown = images.view(len(classes), per_class, *images.shape[1:])[:, :10]
        shown = shown[grid_classes(len(classes))].reshape(-1, *images.shape[1:])  # (digits: all 10 classes)
    else:
        shown = images[:80]
    save_image(shown, str(grid), nrow=min(per_class, 10) if C else 8, padding=1)
    from ..embedding import collapse_indicator

    K = trainer.net.config.codebook_size
    report = {"step": trainer.step, "grid": str(grid),
              "collapse_indicator": collapse_indicator(trainer.net.embedding.table()[:K]), "num_steps": s["num_steps"],
              # what sampled: an unconditional model's draws are unguided whatever the default says
              "guidance_scale": s["guidance_scale"] if C else 0.0, "sampler": s["sampler"],
              "guidance_interval": s.get("guidance_interval"),
              "sampling_seconds": round(seconds, 1)}
    if digits:
        from ..metrics.digits import evaluate_digit_samples

        report.update(evaluate_digit_samples(images, labels))
        # an unconditional model's samples have no labels, so no accuracy (the spread is by predicted class)
        accuracy = f"classifier accuracy {100 * report['accuracy']:.1f}%, " if "accuracy" in report else ""
        interval = checked_interval(report["guidance_interval"])
        where = "" if interval == EVERY_T else " at t in [{:g}, {:g}]".format(*interval)
        print(f"digits: {report['num_samples']} samples ({s['sampler']}, {s['num_steps']} steps, guidance "
              f"{report['guidance_scale']}{where}): {accuracy}within-class spread {report['spread_ratio']:.2f}x the real digits'")
        # the distribution figures went to report.json only, though they are what shows lost variety
        print(f"digits, against the real digits in the classifier's feature space: FID {report['fid']:.3f}, "
              f"precision {report['precision']:.3f}, recall {report['recall']:.3f}")
    print(f"embedding collapse indicator (mean pairwise distance / mean norm; ~1.41 random, 0 collapsed): "
          f"{report['collapse_indicator']:.3f}")
    print(f"sample grid -> {grid}")
    from .checkpoint import atomic_write_text

    atomic_write_text(trainer.out_dir / "report.json", json.dumps(report, indent=2))
    return report
