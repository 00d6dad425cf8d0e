#!/usr/bin/env python
"""Random token shards in a preset's layout, for timing training where the real tokens are absent.

    python benchmarks/synthetic_shards.py OUT_DIR --preset imagenet-246m [--images 4096]

ImageNet layout for ``imagenet-246m`` (as configs/ds_imagenet.json trains it): K = 1024 codes, a 16 × 16
grid, 1000 classes. Uniform ids and labels: the speed of a step does not depend on the tokens, and
nothing trained on them means anything (the tokenizer id says so).
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vqlcmd.data.shards import write_shard  # noqa: E402
from vqlcmd.model import preset_config  # noqa: E402

# the overrides of the shipped configs: the presets' own defaults are the small test sizes
LAYOUTS = {"imagenet-246m": dict(codebook_size=1024, embed_dim=256, seq_len=256),
           "ffhq-56m": dict(codebook_size=1024, embed_dim=256, seq_len=256)}


def write(out: Path, preset: str, images: int, seed: int = 0) -> Path:
    cfg = preset_config(preset, **LAYOUTS.get(preset, {}))
    side = math.isqrt(cfg.seq_len)
    if side * side != cfg.seq_len:
        raise ValueError(f"preset {preset!r}: seq_len {cfg.seq_len} is not a square grid")
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, cfg.codebook_size, (images, cfg.seq_len), dtype=np.uint16)
    C = cfg.num_classes
    labels = rng.integers(0, C, images) if C else np.zeros(images, dtype=np.int64)
    header = {"codebook_size": cfg.codebook_size, "grid": [side, side], "tokenizer_id": f"synthetic-{preset}",
              "num_classes": C, "class_names": [f"class{i}" for i in range(C)]}
    return write_shard(out / "shard_00000.vqtok", tokens, labels, header)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", type=Path)
    p.add_argument("--preset", default="imagenet-246m")
    p.add_argument("--images", type=int, default=4096)
    args = p.parse_args(argv)
    print(write(args.out, args.preset, args.images))
    return 0


if __name__ == "__main__":
    sys.exit(main())
