"""Images -> token shards, with a progress bar and images/s; restartable (finished shards are kept).

    python scripts/tokenize_images.py --images DATA/train --tokenizer TOK_FOLDER --out shards/ [--flip]
    python scripts/tokenize_images.py --dataset digits [--out shards/]     # (or: vqlcmd-tokenize ...)

A tree with class sub-folders gives class labels; a flat folder is unconditional (label 0).
``--flip`` also writes a horizontally flipped copy of every image (``flip-*.vqtok``).
A file whose header passes ``--check-images`` but whose pixels fail to decode is skipped by name and counted
(each shard lists its own in its header, ``skipped_files``), and the run goes on.
"""
import os

import argparse  # noqa: E402
import json  # noqa: E402

from vqlcmd.cli import positive_int  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--images", help="image folder (class sub-folders, or flat)")
    src.add_argument("--dataset", choices=["digits"], help="the embedded data set")
    p.add_argument("--tokenizer", help="diffusers VQModel folder (for --dataset digits: default, the cached one)")
    p.add_argument("--out", help="output folder for the shards (for --dataset digits: default, the cache)")
    p.add_argument("--size", type=positive_int, help="image side after resize + centre crop (default: the tokenizer's)")
    p.add_argument("--batch-size", type=positive_int, default=64)
    p.add_argument("--shard-size", type=positive_int, default=10000, help="images per shard")
    p.add_argument("--flip", action="store_true", help="also write horizontally flipped copies")
    p.add_argument("--backend", default="auto", choices=["auto", "dali", "pil"])
    p.add_argument("--device", default="cuda" if _cuda() else "cpu")
    p.add_argument("--check-images", default="header", choices=["none", "header", "decode"],
                   help="skip unreadable files up front: header parse (default) or full decode")
    p.add_argument("--num-threads", type=positive_int, default=4, help="decoding threads")
    p.add_argument("--steps", type=positive_int, default=1000,
                   help="--dataset digits: tokenizer training steps (default 1000; the quick start's config, "
                        "ds_digits.json, uses 400)")
    p.add_argument("--overwrite", action="store_true",
                   help="delete shards in --out that another data set wrote (another tokenizer, tree, size, ...) "
                        "instead of stopping on them")
    p.add_argument("--no-progress", action="store_true")
    return p.parse_args(argv)


def _cuda():
    import torch

    return torch.cuda.is_available()


def main(argv=None) -> dict:
    args = parse_args(argv)
    from vqlcmd.data import list_images, prepare_digits
    from vqlcmd.data.shards import ShardError
    from vqlcmd.data.skipping import UndecodableTree
    from vqlcmd.data.digits import write_digits_shards
    from vqlcmd.tokenizer import load_tokenizer

    progress = not args.no_progress
    if args.dataset == "digits":
        if args.tokenizer is None:
            info = prepare_digits(steps=args.steps, progress=progress)
            if args.out is None:
                print(json.dumps(info, indent=1))
                return info
            args.tokenizer = info["tokenizer"]
        if args.out is None:
            raise SystemExit("--dataset digits with --tokenizer needs --out")
        tok = load_tokenizer(args.tokenizer, device=args.device)
        try:
            stats = write_digits_shards(args.out, tok, size=tok.image_size[0], shard_size=args.shard_size,
                                        progress=progress, overwrite=args.overwrite)
        except ShardError as exc:
            raise SystemExit(str(exc)) from None
        print(json.dumps(stats))
        return stats

    if args.tokenizer is None or args.out is None:
        raise SystemExit("--images needs --tokenizer and --out")
    tok = load_tokenizer(args.tokenizer, device=args.device)
    size = args.size or tok.image_size[0]
    if size != tok.image_size[0]:  # the encoder takes its own size only; say so before listing the tree
        raise SystemExit(f"--size {size}: tokenizer {args.tokenizer} takes {tok.image_size[0]}x{tok.image_size[1]} "
                         "images; leave --size out")
    images = list_images(args.images, check=args.check_images)
    print(f"{len(images)} images, {images.num_classes} classes, {len(images.skipped)} skipped; tokenizer "
          f"{tok.identifier} ({tok.codebook_size} codes, grid {tok.grid[0]}x{tok.grid[1]})")
    try:
        return _write_all(args, tok, images, size, progress)
    except (ShardError, UndecodableTree) as exc:  # another run's shards in the folder; no image decodes
        raise SystemExit(str(exc)) from None


def _write_all(args, tok, images, size, progress) -> dict:
    from vqlcmd.data import TokenShardDataset, write_token_shards
    from vqlcmd.data.skipping import readable_batches

    results = {}
    bad = {}  # file: reason, of those that failed to decode; shared by the passes, so each fails once
    for flip, prefix in [("none", "shard")] + ([("always", "flip")] if args.flip else []):
        # the file list's digest: a restart keeps a shard only if the tree still lists the same images
        header = {"num_classes": images.num_classes, "class_names": images.class_names, "image_size": [size, size],
                  "channels": tok.channels, "source": os.path.abspath(args.images), "flipped": flip == "always",
                  "files_sha256": images.digest()}

        def batches(start, stop, flip=flip):
            return readable_batches(images, start, stop, bad, size, args.batch_size, flip=flip, backend=args.backend,
                                    channels=tok.channels, device=args.device, num_threads=args.num_threads)

        def skipped(start, stop):  # names relative to the tree, as its digest's: the shards survive a move
            return [os.path.relpath(f, images.root) for f in images.files[start:stop] if f in bad]

        stats = write_token_shards(args.out, tok, len(images), batches, header, shard_size=args.shard_size,
                                   prefix=prefix, progress=progress, overwrite=args.overwrite, skipped=skipped)
        left_out = stats["skipped_files"]
        print(f"{prefix}: {stats['written']}/{stats['shards']} shards written, {stats['images']} images, "
              f"{stats['images_per_s']:.1f} images/s, {len(left_out)} skipped at decoding{_first_names(left_out)}")
        results[prefix] = stats
    TokenShardDataset(args.out, verify=False)  # the folder as a whole: no other run's shards beside these
    left_out = sorted({f for stats in results.values() for f in stats["skipped_files"]})
    if images.skipped or left_out:
        print(f"{len(images.skipped) + len(left_out)} image(s) skipped in all: {len(images.skipped)} by the "
              f"--check-images {args.check_images} listing, {len(left_out)} at decoding{_first_names(left_out)}")
    return results


def _first_names(names: list) -> str:
    """ " (a, b, ...)": the first ten of ``names`` for a summary line; nothing for none."""
    return f" ({', '.join(names[:10])}{', ...' if len(names) > 10 else ''})" if names else ""


def command() -> int:
    """The ``vqlcmd-tokenize`` entry point: ``main`` returns its statistics, for callers in Python."""
    main()
    return 0


if __name__ == "__main__":
    main()
