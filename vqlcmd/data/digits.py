"""The embedded data set: scikit-learn's digits (1797 images of 8x8, 10 classes), upscaled."""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
from pathlib import Path

import torch
import torch.nn.functional as F

CLASS_NAMES = [str(i) for i in range(10)]


# Batch of the digits tokenizer's training. PSNR is not the whole story: at 400 steps batch 32 reached
# the PSNR of batch 64 (33.6 vs 33.7 dB, 127 vs 126 of 128 codes, 99.9% of its reconstructions read right
# by the classifier) in 136 s instead of 228 s, but VQ-LCMD trained on its tokens with the quick start's
# recipe scored 79.8% (and 83.0% with the erf GELU) against 94.6-99.4% on the batch-64 tokens.
DIGITS_TOKENIZER_BATCH = 64
# the shards' header "source": how a run recognises the digits when given their shards by path
DIGITS_SOURCE = "sklearn-digits"
_UNTAGGED_BATCH = 64  # the batch of every cache folder named without one (fixed, whatever the default becomes)


def digits_images(size: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """images (1797, 1, size, size) float32 in [-1, 1] and labels (1797,) int64 from scikit-learn's copy
    (shipped inside the package: nothing is downloaded)."""
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.from_numpy(d.images).float()[:, None] / 16.0  # pixel values are 0..16
    # bilinear keeps the strokes smooth; nearest would hand the tokenizer 4x4 blocks to memorise
    x = F.interpolate(x, size=(size, size), mode="bilinear", align_corners=False)
    return (x * 2 - 1).clamp(-1, 1).contiguous(), torch.from_numpy(d.target).long()


def default_cache_dir() -> Path:
    """``$VQLCMD_CACHE``, else ``.cache`` in the working directory, beside the run's outputs (the quick start
    runs from the checkout, where it is git-ignored); absolute, so that a later change of directory keeps it."""
    return Path(os.path.abspath(os.environ.get("VQLCMD_CACHE") or ".cache"))


@contextlib.contextmanager
def _locked(path: Path):
    # several ranks of one launch may prepare at once: one trains, the others wait and reuse
    import fcntl

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def prepare_digits(cache_dir=None, *, steps: int = 1000, seed: int = 0, size: int = 32, shard_size: int = 1024,
                   batch_size: int = DIGITS_TOKENIZER_BATCH, progress: bool = True, log=print) -> dict:
    """The embedded data set, ready to train on: trains the small tokenizer on the digits (or reuses the
    cached one), tokenizes them into shards, and returns ``dict(shards=<folder>, tokenizer=<folder>,
    psnr=..., codebook_usage=..., codebook_size=..., seconds=...)``.

    Cached under ``cache_dir`` (default ``default_cache_dir()``), keyed by ``steps``, ``batch_size``,
    ``seed`` and ``size``, so the quick start trains once.
    """
    from ..tokenizer import load_tokenizer
    from ..tokenizer.small import TrainConfig, small_vqmodel, train_vqmodel

    t0 = time.perf_counter()
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    root = root / "digits"
    # caches made before the batch became a parameter hold batch-64 tokenizers under the short name
    batch_tag = "" if batch_size == _UNTAGGED_BATCH else f"-b{batch_size}"
    tok_dir = root / f"tokenizer-{size}px-{steps}steps{batch_tag}-seed{seed}"
    with _locked(root / ".lock"):
        images, labels = digits_images(size)
        metrics_file = tok_dir / "metrics.json"
        if metrics_file.is_file() and (tok_dir / "config.json").is_file():
            metrics = json.loads(metrics_file.read_text())
            log(f"digits: reusing tokenizer {tok_dir} (PSNR {metrics['psnr']:.2f} dB, "
                f"{metrics['codebook_usage']}/{metrics['codebook_size']} codes)")
        else:
            log(f"digits: training the small tokenizer for {steps} steps -> {tok_dir}")
            torch.manual_seed(seed)
            model = small_vqmodel(channels=1, image_size=size)
            config = TrainConfig(steps=steps, batch_size=batch_size, seed=seed)
            metrics = train_vqmodel(model, images, config, progress=progress, log=log)
            tmp = tok_dir.with_name(f".{tok_dir.name}.tmp-{os.getpid()}")
            shutil.rmtree(tmp, ignore_errors=True)
            model.save_pretrained(str(tmp))
            (tmp / "metrics.json").write_text(json.dumps(metrics, indent=1))
            shutil.rmtree(tok_dir, ignore_errors=True)
            os.replace(tmp, tok_dir)
            log(f"digits: tokenizer PSNR {metrics['psnr']:.2f} dB, {metrics['codebook_usage']}/"
                f"{metrics['codebook_size']} codes used, {metrics['train_seconds']:.0f} s")
        tok = load_tokenizer(tok_dir)
        shard_dir = root / f"shards-{tok.identifier}"
        # (a cache: derived data, replaced whatever it holds)
        write_digits_shards(shard_dir, tok, size=size, shard_size=shard_size, progress=progress, log=lambda m: None,
                            overwrite=True)
    return {"shards": str(shard_dir), "tokenizer": str(tok_dir), "psnr": metrics["psnr"],
            "codebook_usage": metrics["codebook_usage"], "codebook_size": metrics["codebook_size"],
            "tokenizer_id": tok.identifier, "seconds": time.perf_counter() - t0}


def write_digits_shards(out_dir, tokenizer, *, size: int = 32, shard_size: int = 1024, progress: bool = True,
                        log=print, overwrite: bool = False) -> dict:
    """Tokenizes the digits (in scikit-learn's order) into ``out_dir``; keeps finished shards (``overwrite``:
    see ``write_token_shards``)."""
    from .writer import write_token_shards

    images, labels = digits_images(size)
    header = {"num_classes": 10, "class_names": CLASS_NAMES, "image_size": [size, size], "channels": 1,
              "source": DIGITS_SOURCE, "flipped": False}

    def batches(start, stop, bs=256):
        for i in range(start, stop, bs):
            j = min(i + bs, stop)
            yield images[i:j], labels[i:j]

    return write_token_shards(out_dir, tokenizer, len(images), batches, header, shard_size=shard_size,
                              progress=progress, log=log, overwrite=overwrite)
