"""The two training data sources on the same images, in tokens/s: token shards vs online encoding.

Cases (on a JPEG tree this stage writes to a temporary folder, and the shards tokenized from it):
- ``epoch`` / ``shards`` (baseline): one epoch of training batches from the ``ShardLoader`` over the
  shards ``write_token_shards`` wrote from the tree (as ``vqlcmd-tokenize``), with ``data.source: "shards"``.
- ``epoch`` / ``online-dali`` (``online-pil`` without DALI): one epoch from the ``OnlineTokenLoader`` over
  the tree itself, ``data.source: "images"``: decode (DALI's ``mixed`` GPU decoder on CUDA), random flip,
  encode with the tokenizer on the device. Both rows share a shape, so the speed-up column pairs them.
- ``tokenize once`` / ``tokenize``: the one-off pass that writes those shards (decode + encode + write),
  the price shards pay once and online mode pays every epoch.
``tokens/s`` = tokens delivered to the training loop (images x M) per second.

The tokenizer is a randomly initialised diffusers VQModel (speed does not depend on its weights): on CPU a
small one (64 px -> 16x16 tokens, M = 256 as ImageNet's VQGAN f16 gives); on CUDA a 5-level f16 one at
256 px, closer to the VQGAN's size (the real encoder also has attention at 16x16 and is slower still).
"""
from __future__ import annotations

import itertools
import tempfile
from pathlib import Path

import torch

from benchmarks.harness import Context, run_case
from benchmarks.stage_data import _write_images

STAGE = "data_sources"


def _setting(ctx: Context) -> dict:
    if ctx.quick:
        return dict(images=16, image_hw=(48, 64), size=16, blocks=(8, 16), batch=4, groups=4)
    if ctx.is_cuda:
        return dict(images=1024, image_hw=(300, 400), size=256, blocks=(128, 128, 256, 256, 512), batch=64,
                    groups=32)
    return dict(images=256, image_hw=(300, 400), size=64, blocks=(16, 32, 64), batch=32, groups=8)


def run(ctx: Context) -> list:
    from vqlcmd.data import OnlineTokenLoader, ShardLoader, TokenShardDataset, image_batches, list_images
    from vqlcmd.data.decode import dali_available
    from vqlcmd.data.writer import write_token_shards
    from vqlcmd.tokenizer import VQModelTokenizer, small_vqmodel

    out: list = []
    s = _setting(ctx)
    tmp = tempfile.TemporaryDirectory(prefix="vqlcmd-bench-sources-")
    root = Path(tmp.name)
    try:
        _write_images(root / "images", s)
        images = list_images(root / "images")
        n, B = len(images), s["batch"]
        torch.manual_seed(0)
        tok = VQModelTokenizer(small_vqmodel(channels=3, image_size=s["size"], block_channels=s["blocks"],
                                             codebook_size=1024, code_dim=8, groups=s["groups"])).to(ctx.device)
        M = tok.num_tokens
        backend = "dali" if dali_available() else "pil"
        header = {"num_classes": images.num_classes, "class_names": images.class_names,
                  "image_size": [s["size"]] * 2, "channels": 3, "files_sha256": images.digest()}
        fresh = itertools.count()

        def tokenize(folder=None):
            folder = folder or root / f"tokenized-{next(fresh)}"  # a new folder: a finished one would be kept
            write_token_shards(folder, tok, n, lambda a, b: image_batches(
                images.subset(a, b), s["size"], B, backend=backend, device=ctx.device), header,
                shard_size=max(1, n // 4), progress=False, log=lambda m: None)
            return folder

        src = f"{n} JPEG {s['image_hw'][0]}x{s['image_hw'][1]} -> {s['size']}px"
        if ctx.wants("tokenize"):
            run_case(ctx, out, stage=STAGE, case="tokenize once", backend="tokenize", shape=f"{src}, M{M}",
                     dtype="uint8->int64", fn=tokenize, extra=lambda t: {"tokens/s": n * M / (t.median_ms / 1e3),
                                                                        "images/s": n / (t.median_ms / 1e3),
                                                                        "decoder": backend},
                     **ctx.repetitions(warmup=1, reps=3))
        ds = TokenShardDataset(tokenize(root / "shards"))
        shards = ShardLoader(ds, B, seed=0, device=ctx.device, pin_memory=ctx.is_cuda)
        online = OnlineTokenLoader(images, tok, B, seed=0, flip=True, backend=backend, device=ctx.device)
        per_epoch = len(shards) * B * M  # the same for both: ShardLoader's order over the same n samples
        shape = f"{src}, B{B} M{M}"

        def epoch(loader):
            return [t for t, _ in loader]  # the rest of the current epoch; the next call takes the next epoch

        for name, loader, base in (("shards", shards, True), (f"online-{backend}", online, False)):
            if ctx.wants(name, baseline=base):
                run_case(ctx, out, stage=STAGE, case="epoch", backend=name, shape=shape, dtype="int64",
                         fn=lambda loader=loader: epoch(loader), baseline="shards",
                         extra=lambda t: {"tokens/s": per_epoch / (t.median_ms / 1e3),
                                          "batches": len(shards)}, **ctx.repetitions(warmup=1, reps=5))
    finally:
        tmp.cleanup()
    return out
