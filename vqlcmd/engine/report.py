"""End-of-run report: a guided class-conditional grid and, on digits, the classifier's verdict."""
from __future__ import annotations

import json
import time

import torch


def on_digits(trainer) -> bool:
    """Whether the run trains on the embedded digits: named in the config, or its shards given by path
    (as ``scripts/reproduce.py`` does), recognised by the source their header records."""
    from ..data.digits import DIGITS_SOURCE

    return trainer.cfg.data.dataset == "digits" or trainer.header.get("source") == DIGITS_SOURCE


def final_report(trainer, per_class: int = 50) -> dict:
    """Samples ``per_class`` images per class with the config's sampling defaults, saves the grid and
    (for the embedded digits data set, see ``on_digits``) prints accuracy and within-class spread."""
    from torchvision.utils import save_image

    pipe = trainer.pipeline()
    s = pipe.sample_defaults  # what the pipeline samples with (MaskGIT's sampler and steps for its runs)
    C = trainer.net.config.num_classes
    t0 = time.perf_counter()
    g = torch.Generator(device=trainer.device).manual_seed(2024)
    labels = torch.arange(C).repeat_interleave(per_class) if C else None
    images = pipe(labels, output_type="pt", generator=g) if C else pipe(num_images=per_class * 8, output_type="pt",
                                                                         generator=g)
    seconds = time.perf_counter() - t0
    grid = trainer.out_dir / "samples" / "final.png"
    grid.parent.mkdir(parents=True, exist_ok=True)
    shown = images.view(C, per_class, *images.shape[1:])[:, :10].reshape(-1, *images.shape[1:]) if C else images[:80]
    save_image(shown, str(grid), nrow=10 if C else 8, padding=1)
    from ..embedding import collapse_indicator

    K = trainer.net.config.codebook_size
    report = {"step": trainer.step, "grid": str(grid),
              "collapse_indicator": collapse_indicator(trainer.net.embedding.table()[:K]), "num_steps": s["num_steps"],
              "guidance_scale": s["guidance_scale"], "sampler": s["sampler"], "sampling_seconds": round(seconds, 1)}
    if on_digits(trainer):
        from ..metrics.digits import evaluate_digit_samples

        report.update(evaluate_digit_samples(images, labels))
        # an unconditional model's samples have no labels, so no accuracy (the spread is by predicted class)
        accuracy = f"classifier accuracy {100 * report['accuracy']:.1f}%, " if "accuracy" in report else ""
        print(f"digits: {report['num_samples']} samples ({s['sampler']}, {s['num_steps']} steps, guidance "
              f"{s['guidance_scale']}): {accuracy}within-class spread {report['spread_ratio']:.2f}x the real digits'")
        # the distribution figures went to report.json only, though they are what shows lost variety
        print(f"digits, against the real digits in the classifier's feature space: FID {report['fid']:.3f}, "
              f"precision {report['precision']:.3f}, recall {report['recall']:.3f}")
    print(f"embedding collapse indicator (mean pairwise distance / mean norm; ~1.41 random, 0 collapsed): "
          f"{report['collapse_indicator']:.3f}")
    print(f"sample grid -> {grid}")
    from .checkpoint import atomic_write_text

    atomic_write_text(trainer.out_dir / "report.json", json.dumps(report, indent=2))
    return report
