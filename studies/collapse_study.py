#!/usr/bin/env python
"""Embedding collapse with and without the consistency-matching loss, same steps, same data.

Trains the denoiser and the embeddings jointly on synthetic class-structured
tokens (or on token shards with --shards) twice, β_CM = 1 and β_CM = 0, and
prints the collapse indicator (mean pairwise distance between embedding rows
relative to their mean norm: ≈1.41 for random rows, → 0 when they collapse)
every --every steps. Writes a PNG plot next to the table when --plot is given.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from vqlcmd.cli import positive_float, positive_int, seed_int
from vqlcmd.diffusion import LossConfig, training_losses
from vqlcmd.ema import EMA
from vqlcmd.embedding import collapse_indicator
from vqlcmd.model import preset_config
from vqlcmd.network import VQLCMDNetwork
from vqlcmd.schedule import ShiftedCosineSchedule


def synthetic_batches(K, M, C, batch, seed):
    g = torch.Generator().manual_seed(seed)
    patterns = torch.randint(0, K, (C, M), generator=g)
    while True:
        y = torch.randint(0, C, (batch,), generator=g)
        x = patterns[y].clone()
        noise = torch.rand(batch, M, generator=g) < 0.15
        yield torch.where(noise, torch.randint(0, K, (batch, M), generator=g), x), y


def shard_batches(folder, batch, seed):
    from vqlcmd.data.loader import ShardLoader
    from vqlcmd.data.shards import TokenShardDataset

    yield from ShardLoader(TokenShardDataset(folder), batch, seed=seed).forever()


def run(beta_cm, args, den_cfg):
    torch.manual_seed(args.seed)
    net = VQLCMDNetwork(den_cfg)
    teacher = EMA(net, 0.99)
    opt = torch.optim.AdamW(net.parameters(), lr=args.lr)
    sched, cfg = ShiftedCosineSchedule(args.shift), LossConfig(beta_cm=beta_cm)
    g = torch.Generator().manual_seed(args.seed)
    batches = (shard_batches(args.shards, args.batch, args.seed) if args.shards else
               synthetic_batches(den_cfg.codebook_size, den_cfg.seq_len, den_cfg.num_classes, args.batch, args.seed))
    K = den_cfg.codebook_size
    curve = [(0, collapse_indicator(net.embedding.table()[:K]))]
    for step in range(1, args.steps + 1):
        x, y = next(batches)
        out = training_losses(net, teacher.module, sched, x, y, cfg, generator=g)
        opt.zero_grad(set_to_none=True)
        out["loss"].backward()
        opt.step()
        teacher.update(net)
        if step % args.every == 0:
            curve.append((step, collapse_indicator(net.embedding.table()[:K])))
    return curve


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="digits-1m")
    p.add_argument("--shards", default=None, help="token shards to train on (default: synthetic tokens)")
    p.add_argument("--steps", type=positive_int, default=400)
    p.add_argument("--every", type=positive_int, default=100)
    p.add_argument("--batch", type=positive_int, default=32)
    p.add_argument("--lr", type=positive_float, default=1e-3)
    p.add_argument("--shift", type=float, default=0.0)
    p.add_argument("--seed", type=seed_int, default=0)
    p.add_argument("--plot", default=None, help="PNG path for the indicator-vs-steps plot")
    args = p.parse_args(argv)
    if args.plot and not Path(args.plot).resolve().parent.is_dir():  # else found after both training runs
        p.error(f"--plot {args.plot}: no folder {Path(args.plot).resolve().parent}")
    den_cfg = preset_config(args.preset, attn_dropout=0.0)
    t0 = time.perf_counter()
    curves = {beta: run(beta, args, den_cfg) for beta in (1.0, 0.0)}
    print(f"collapse indicator, preset {args.preset}, {'shards ' + args.shards if args.shards else 'synthetic tokens'}, "
          f"{args.steps} steps, batch {args.batch}, lr {args.lr} ({time.perf_counter() - t0:.0f} s)")
    print("| step | with L_CM (β_CM=1) | without L_CM (β_CM=0) |\n|---|---|---|")
    for (s, a), (_, b) in zip(curves[1.0], curves[0.0]):
        print(f"| {s} | {a:.4f} | {b:.4f} |")
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        for beta, label in ((1.0, "with L_CM"), (0.0, "without L_CM")):
            plt.plot(*zip(*curves[beta]), marker="o", label=label)
        plt.xlabel("step"), plt.ylabel("collapse indicator"), plt.legend(), plt.grid(alpha=0.3)
        plt.savefig(args.plot, dpi=120, bbox_inches="tight")
        print(f"plot -> {args.plot}")


if __name__ == "__main__":
    main()
