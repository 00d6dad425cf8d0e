"""Trains the project's small VQ tokenizer (a diffusers VQModel) and saves it as a local folder.

    python scripts/train_tokenizer.py --dataset digits            # the embedded data set's tokenizer (cached;
                                                                  # the quick start's: --steps 400)
    python scripts/train_tokenizer.py --images DIR --size 64 --out tok/ [--channels 3] [--steps 2000]

Prints the reconstruction PSNR (through the token path) and how many codes are in use.
"""
import os
import sys

# OpenMP reads its wait policy once, as torch loads it: set before anything imports torch, so that waiting
# threads sleep instead of spinning against other work on the cores (see vqlcmd/threads.py)
if os.environ.get("VQLCMD_THREADS", "").strip().lower() != "torch":
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import json  # noqa: E402

import torch  # noqa: E402,F401  (OpenMP loads under the policy above, --help included, as in the other commands)

from vqlcmd.cli import add_threads_option, positive_float, positive_int  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--dataset", choices=["digits"])
    src.add_argument("--images", help="image folder (loaded into memory: meant for small trees)")
    p.add_argument("--out", help="output folder (digits: default, the cache used by prepare_digits)")
    p.add_argument("--size", type=positive_int, default=32, help="image side")
    p.add_argument("--channels", type=int, choices=(1, 3), default=None, help="1 or 3 (digits: 1; images: 3)")
    p.add_argument("--steps", type=positive_int, default=1000,
                   help="training steps (default 1000; the quick start's config, ds_digits.json, uses 400)")
    p.add_argument("--batch-size", type=positive_int, default=64)
    p.add_argument("--lr", type=positive_float, default=2e-3)
    p.add_argument("--codebook-size", type=positive_int, default=128)
    p.add_argument("--code-dim", type=positive_int, default=8)
    p.add_argument("--channels-per-block", default="16,32,64", help="comma-separated; len-1 downsamplings by 2")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--check-images", default="header", choices=["none", "header", "decode"],
                   help="--images: skip unreadable files up front: header parse (default) or full decode")
    p.add_argument("--overwrite", action="store_true", help="replace what --out holds")
    p.add_argument("--no-progress", action="store_true")
    add_threads_option(p)
    args = p.parse_args(argv)
    try:
        blocks = tuple(int(c) for c in args.channels_per_block.split(","))
    except ValueError:
        p.error(f"--channels-per-block takes comma-separated integers, got {args.channels_per_block!r}")
    groups = min(8, blocks[0])  # the GroupNorm groups small_vqmodel uses
    if any(c < 1 or c % groups for c in blocks):
        p.error(f"--channels-per-block {args.channels_per_block}: each must be a positive multiple of {groups}")
    if args.size % 2 ** (len(blocks) - 1):
        p.error(f"--size {args.size} must be divisible by {2 ** (len(blocks) - 1)} ({len(blocks) - 1} downsamplings "
                f"by 2, one per block after the first)")
    args.blocks = blocks
    if args.dataset == "digits" and args.channels not in (None, 1):
        p.error(f"--channels {args.channels}: the digits are grayscale (1 channel)")
    if args.dataset == "digits" and args.out is None:
        # prepare_digits builds the digits data set's tokenizer, cached under steps, batch size, seed and size
        # only: passing other settings through would need them in that key too, or the cache would hand a
        # different model back under the digits data set's name
        default_blocks = tuple(int(c) for c in p.get_default("channels_per_block").split(","))
        ignored = [opt for opt, changed in (("--lr", args.lr != p.get_default("lr")),
                                            ("--codebook-size", args.codebook_size != p.get_default("codebook_size")),
                                            ("--code-dim", args.code_dim != p.get_default("code_dim")),
                                            ("--channels-per-block", blocks != default_blocks)) if changed]
        if ignored:
            p.error(f"{', '.join(ignored)}: --dataset digits without --out trains the digits data set's cached "
                    "tokenizer, which takes only --steps, --seed, --size and --batch-size; give --out DIR to train one with "
                    "these settings")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    import torch

    from vqlcmd.threads import configure

    configure(args.threads, log=lambda line: print(line, file=sys.stderr))

    from vqlcmd.data import digits_images, image_batches, list_images, prepare_digits
    from vqlcmd.engine.host_memory import keep_freed_memory
    from vqlcmd.tokenizer import TrainConfig, small_vqmodel, train_vqmodel

    print(keep_freed_memory(), file=sys.stderr)  # the small tokenizer trains on the CPU

    progress = not args.no_progress
    if args.dataset == "digits" and args.out is None:
        info = prepare_digits(steps=args.steps, seed=args.seed, size=args.size, batch_size=args.batch_size,
                              progress=progress)
        print(json.dumps(info, indent=1))
        return info
    if args.out is None:
        raise SystemExit("--images needs --out")
    if os.path.isdir(args.out) and os.listdir(args.out) and not args.overwrite:
        # checked before training: the shards and pipelines made with a tokenizer name it by its folder, and
        # a retrained one has another identifier, so they could no longer be decoded
        raise SystemExit(f"--out {args.out} is not empty (a tokenizer there would be replaced, and the shards and "
                         "models made with it could no longer be decoded); choose another folder, or --overwrite")
    if args.dataset == "digits":
        channels = 1
        images, _ = digits_images(args.size)
    else:
        channels = args.channels or 3
        il = list_images(args.images, check=args.check_images)
        images = torch.cat([x for x, _ in image_batches(il, args.size, 256, channels=channels)])
    blocks = args.blocks
    torch.manual_seed(args.seed)
    model = small_vqmodel(channels=channels, image_size=args.size, block_channels=blocks,
                          codebook_size=args.codebook_size, code_dim=args.code_dim, groups=min(8, blocks[0]))
    cfg = TrainConfig(steps=args.steps, batch_size=args.batch_size, lr=args.lr, seed=args.seed)
    metrics = train_vqmodel(model, images, cfg, progress=progress)
    from vqlcmd.tokenizer import model_identifier

    model.save_pretrained(args.out)
    metrics.update(folder=args.out, tokenizer_id=model_identifier(model), images=len(images))
    with open(f"{args.out}/metrics.json", "w") as f:
        json.dump(metrics, f, indent=1)
    print(json.dumps(metrics, indent=1))
    return metrics


def command() -> int:
    """The ``vqlcmd-train-tokenizer`` entry point: ``main`` returns the metrics, for callers in Python."""
    main()
    return 0


if __name__ == "__main__":
    main()
