"""Data path throughput: the token-shard loader, tokenization with DALI and with PIL, online mode.

Cases (all on data this stage writes to a temporary folder):
- ``shard loader``: one ``ShardLoader`` batch (random rows of memory-mapped uint16 shards -> int64),
  samples/s. Baseline of ``train batches``.
- ``decode+resize``: one pass of the image pipeline over a JPEG tree, images/s (``pil`` baseline, ``dali``).
- ``tokenize``: the same pass plus the tokenizer's encode, as vqlcmd-tokenize runs it, images/s.
- ``train batches``: one training batch from shards vs from online mode (images -> DALI -> tokenizer
  per batch), samples/s: what online mode costs per step.
The tokenizer is a randomly initialised small VQModel (3 channels; speed does not depend on its weights).
"""
from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import torch

from benchmarks.harness import Context, run_case

STAGE = "data"


def _setting(ctx: Context) -> dict:
    if ctx.quick:
        return dict(samples=512, grid=(8, 8), batch=32, images=8, image_hw=(48, 64), size=16, blocks=(8, 16))
    return dict(samples=50_000, grid=(16, 16), batch=256, images=256, image_hw=(300, 400), size=64,
                blocks=(16, 32, 64))


def _write_shards(folder: Path, s: dict) -> None:
    from vqlcmd.data import write_shard

    rng = np.random.default_rng(0)
    m = s["grid"][0] * s["grid"][1]
    header = dict(codebook_size=1024, grid=list(s["grid"]), tokenizer_id="bench", num_classes=1000,
                  class_names=[str(i) for i in range(1000)])
    for k, part in enumerate(np.array_split(np.arange(s["samples"]), 4)):
        write_shard(folder / f"shard-{k:05d}.vqtok", rng.integers(0, 1024, (len(part), m)),
                    rng.integers(0, 1000, len(part)), header)


def _write_images(folder: Path, s: dict) -> None:
    from PIL import Image

    rng = np.random.default_rng(0)
    h, w = s["image_hw"]
    yy, xx = np.mgrid[0:h, 0:w]
    for i in range(s["images"]):
        cls = folder / f"c{i % 4}"
        cls.mkdir(parents=True, exist_ok=True)
        a = np.stack([128 + 100 * np.sin(xx / (5 + i % 7)), 128 + 100 * np.cos(yy / 7), xx * 255 / w], -1)
        a = (a + rng.normal(0, 8, a.shape)).clip(0, 255).astype(np.uint8)
        Image.fromarray(a).save(cls / f"{i:05d}.jpg", quality=90)


def run(ctx: Context) -> list:
    from vqlcmd.data import OnlineTokenLoader, ShardLoader, TokenShardDataset, image_batches, list_images
    from vqlcmd.data.decode import dali_available
    from vqlcmd.tokenizer import VQModelTokenizer, small_vqmodel

    out: list = []
    s = _setting(ctx)
    B, m = s["batch"], s["grid"][0] * s["grid"][1]
    tmp = tempfile.TemporaryDirectory(prefix="vqlcmd-bench-data-")
    root = Path(tmp.name)
    try:
        (root / "shards").mkdir()
        _write_shards(root / "shards", s)
        ds = TokenShardDataset(root / "shards")
        shard_batches = ShardLoader(ds, B, seed=0, device=ctx.device, pin_memory=ctx.is_cuda).forever()
        reps = ctx.repetitions(warmup=3, reps=20)
        run_case(ctx, out, stage=STAGE, case="shard loader", backend="shards", shape=f"N{len(ds)} B{B} M{m}",
                 dtype="uint16->int64", fn=lambda: next(shard_batches), baseline="shards",
                 extra=lambda t: {"samples/s": B / (t.median_ms / 1e3)}, **reps)

        _write_images(root / "images", s)
        images = list_images(root / "images")
        n = len(images)
        torch.manual_seed(0)
        tok = VQModelTokenizer(small_vqmodel(channels=3, image_size=s["size"], block_channels=s["blocks"],
                                             codebook_size=1024, code_dim=8)).to(ctx.device)
        backends = ["pil"] + (["dali"] if dali_available() else [])
        shape = f"{n} JPEG {s['image_hw'][0]}x{s['image_hw'][1]} -> {s['size']}"
        pass_reps = ctx.repetitions(warmup=1, reps=3)
        for backend in backends:
            if not ctx.wants(backend, baseline=backend == "pil"):
                continue

            def decode(backend=backend):
                for x, _ in image_batches(images, s["size"], 64, backend=backend, device=ctx.device):
                    pass

            def tokenize(backend=backend):
                for x, _ in image_batches(images, s["size"], 64, backend=backend, device=ctx.device):
                    tok.encode(x)

            for case, fn in (("decode+resize", decode), ("tokenize", tokenize)):
                run_case(ctx, out, stage=STAGE, case=case, backend=backend, shape=shape, dtype="uint8->float32",
                         fn=fn, baseline="pil", extra=lambda t: {"images/s": n / (t.median_ms / 1e3)}, **pass_reps)

        online_backend = "dali" if dali_available() else "pil"
        if ctx.wants(f"online-{online_backend}"):
            # eight batches per epoch: with the whole image list as one batch, every next() began an epoch and
            # built a new pipeline, a cost that real online training pays once per epoch
            ob = max(1, min(B, n // 8))
            online = OnlineTokenLoader(images, tok, ob, seed=0, flip=True, backend=online_backend,
                                       device=ctx.device).forever()
            # one shape string for both rows (the batch they deliver), so the speed-up pairs them; the sources
            # differ and go to extra
            batch = f"B{ob} M{tok.num_tokens}"
            run_case(ctx, out, stage=STAGE, case="train batches", backend=f"online-{online_backend}",
                     shape=batch, dtype="int64", fn=lambda: next(online), baseline="shards",
                     extra=lambda t: {"samples/s": ob / (t.median_ms / 1e3), "source": shape}, **reps)
            run_case(ctx, out, stage=STAGE, case="train batches", backend="shards",
                     shape=batch, dtype="int64",
                     fn=(lambda it=ShardLoader(ds, ob, device=ctx.device).forever(): next(it)), baseline="shards",
                     extra=lambda t: {"samples/s": ob / (t.median_ms / 1e3),
                                      "source": f"token shards of {len(ds)} samples"}, **reps)
    finally:
        tmp.cleanup()
    return out
