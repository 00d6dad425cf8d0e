#!/usr/bin/env python
"""Sample N images from an exported pipeline folder as PNG files (and optionally one ADM-layout .npz).

    python scripts/sample.py --pipeline runs/digits/pipeline --out samples/digits -n 1000
    torchrun --nproc_per_node 8 scripts/sample.py --pipeline P --out OUT -n 50000 --npz OUT.npz
    deepspeed --num_gpus 8 scripts/sample.py --pipeline P --out OUT -n 50000

Image ``i`` is drawn with its own generator seeded from (``--seed``, i) and, for a conditional model,
class ``i mod C`` (``--labels cycle``, balanced), a seeded random class (``--labels random``) or the
classes given; rank r of W draws the images with i mod W = r. So the images do not depend on the
number of ranks, and a run that stops part-way is continued by running the same command again:
existing PNGs are kept, and ``OUT/manifest.json`` refuses a continuation with other settings. A larger ``-n``
with the same settings adds the missing images (image i is the same whatever N is).

``--npz`` writes ``arr_0`` (N, H, W, 3) uint8 (grey images repeated to RGB) and, for conditional
models, ``arr_1`` (N,) labels: the layout that the ADM evaluation suite and scripts/evaluate.py read.
"""
from __future__ import annotations

import os
import sys

# OpenMP reads its wait policy once, as torch loads it: set before anything imports torch, so that waiting
# threads sleep instead of spinning against other work on the cores (see vqlcmd/threads.py)
if os.environ.get("VQLCMD_THREADS", "").strip().lower() != "torch":
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Optional  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

from vqlcmd.cli import add_threads_option, noise_interval, non_negative_float, positive_int  # noqa: E402

MANIFEST = "manifest.json"
# settings that change the images: a continuation must match them (the count may grow: class_labels, which
# depend on it, must then agree on the images both runs have)
IMAGE_KEYS = ("weights_sha256", "seed", "labels", "num_steps", "guidance_scale", "sampler", "final",
              "dtype", "guidance_interval")  # (the last only where it is not every t: absent from older manifests)


def weights_digest(folder: Path) -> str:
    import hashlib

    h = hashlib.sha256()
    with open(folder / "model.safetensors", "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()[:16]


def load_pipeline(args, device, attempts: int = 3):
    """The pipeline and the digest of the weights it holds. The trainer re-exports its pipeline with every
    checkpoint, so the folder may change while it is read: the digest taken before and after the load must
    agree, or the manifest named weights that were never sampled."""
    from vqlcmd.pipeline import VQLCMDPipeline

    folder = Path(args.pipeline)
    for _ in range(attempts):
        try:
            try:
                before = weights_digest(folder)
            except OSError:
                before = None  # from_pretrained names what is missing, and how to make it
            pipe = VQLCMDPipeline.from_pretrained(folder, device=device, dtype=getattr(torch, args.dtype))
            after = weights_digest(folder)
        except (FileNotFoundError, ValueError) as exc:  # a missing folder or file, a config or weights that do not fit
            raise SystemExit(f"--pipeline: {exc}") from None
        if before == after:
            return pipe, after
    raise SystemExit(f"--pipeline: {folder} changed while it was loaded, {attempts} times (a training run "
                     "re-exporting it?); sample a copy of the folder")


def same_on_every_rank(digest: str, folder) -> None:
    """Each rank loads the folder itself: a re-export between two ranks' loads gave a mix of two models."""
    if not _dist_active():
        return
    import torch.distributed as dist

    digests = [None] * dist.get_world_size()
    dist.all_gather_object(digests, digest)
    if len(set(digests)) > 1:
        raise SystemExit(f"--pipeline: the ranks loaded different weights from {folder} ({sorted(set(digests))}): it "
                         "changed while they read it; sample a copy of the folder")


def image_seed(seed: int, index: int) -> int:
    """Per-image seed: the run seed in the high bits, the image index in the low 32."""
    return (int(seed) << 32) | int(index)


def class_labels(spec: str, n: int, num_classes: int, seed: int) -> list:
    if num_classes == 0:
        if spec != "cycle":
            raise SystemExit(f"--labels {spec}: the pipeline is unconditional")
        return [None] * n
    if spec == "cycle":
        return [i % num_classes for i in range(n)]
    if spec == "random":
        g = torch.Generator().manual_seed(seed)
        return torch.randint(0, num_classes, (n,), generator=g).tolist()
    try:
        chosen = [int(c) for c in spec.split(",")]
    except ValueError:
        raise SystemExit(f"--labels must be 'cycle', 'random' or comma-separated class ids, got {spec!r}")
    bad = [c for c in chosen if not 0 <= c < num_classes]
    if bad:
        raise SystemExit(f"--labels: classes {bad} are outside [0, {num_classes})")
    return [chosen[i % len(chosen)] for i in range(n)]


def png_name(i: int) -> str:
    return f"{i:06d}.png"


def save_png(image_chw: torch.Tensor, path: Path) -> None:
    from PIL import Image

    arr = (image_chw.clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 0).cpu().numpy()
    img = Image.fromarray(arr[..., 0] if arr.shape[-1] == 1 else arr)
    tmp = path.with_name(f".{path.name}.tmp")
    img.save(tmp, format="PNG")
    os.replace(tmp, path)  # a killed run never leaves a half-written PNG under the final name


def write_npz(out: Path, n: int, labels: list, npz: Path) -> None:
    from PIL import Image

    batch = None  # one (N, H, W, 3) array filled in place: a list, np.stack and a cast held three copies
    for i in range(n):
        with Image.open(out / png_name(i)) as im:
            a = np.asarray(im)
        if batch is None:
            batch = np.empty((n, a.shape[0], a.shape[1], 3), dtype=np.uint8)
        batch[i] = a[..., None] if a.ndim == 2 else a[..., :3]  # grey broadcasts to the three channels
    data = {"arr_0": batch}
    if labels and labels[0] is not None:
        data["arr_1"] = np.asarray(labels, dtype=np.int64)
    npz.parent.mkdir(parents=True, exist_ok=True)
    tmp = npz.with_name(npz.name + ".tmp.npz")
    np.savez(tmp, **data)
    os.replace(tmp, npz)


def dist_setup(args):
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    local = int(os.environ.get("LOCAL_RANK", args.local_rank if args.local_rank is not None else 0))
    if args.device:
        device = torch.device(args.device)
        if device.type == "cuda" and device.index is None:  # "--device cuda": this process's GPU
            device = torch.device("cuda", local)
    elif torch.cuda.is_available():
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world > 1:
        import torch.distributed as dist

        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return rank, world, device


def _dist_active() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def seed_value(text: str) -> int:
    """A seed the per-image seeds (seed << 32 | index) keep apart: a negative one aliased another, and one of
    2**31 or more overflowed the generator's int64 after the manifest was written."""
    value = int(text)
    if not 0 <= value < 2 ** 31:
        raise argparse.ArgumentTypeError(f"must be in [0, 2**31), got {value}")
    return value


def check_manifest(out: Path, settings: dict, rank: int, world: int) -> None:
    """Rank 0 checks --out and writes the manifest; every rank then exits with its refusal, if any, rather
    than waiting at a barrier that rank 0 never reaches (launchers that do not stop the others would hang)."""
    try:
        error = _manifest_error(out, settings) if rank == 0 else None
    except OSError as exc:  # an unwritable --out: said by every rank too, not left at the broadcast
        error = f"--out {out}: {exc}"
    if _dist_active():
        import torch.distributed as dist

        box = [error]
        dist.broadcast_object_list(box, src=0)
        error = box[0]
    if error is not None:
        raise SystemExit(error)


def _manifest_error(out: Path, settings: dict) -> Optional[str]:
    path = out / MANIFEST
    if out.exists() and not out.is_dir():
        return f"--out {out} is a file, not a folder"
    out.mkdir(parents=True, exist_ok=True)
    if path.is_file():
        try:
            old = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            return f"{path} is not readable JSON ({exc}): delete it, with the images beside it, or use another --out"
        diff = {k: (old.get(k), settings.get(k)) for k in IMAGE_KEYS if old.get(k) != settings.get(k)}
        old_labels, new_labels = old.get("class_labels"), settings.get("class_labels")
        if old_labels is not None and new_labels is not None:
            both = min(len(old_labels), len(new_labels))
            first = next((i for i in range(both) if old_labels[i] != new_labels[i]), None)
            if first is not None:  # (--labels random draws another sequence for another count)
                diff[f"class_labels[{first}]"] = (old_labels[first], new_labels[first])
        if diff:
            return (f"{out} holds samples made with other settings {diff} (old, new); "
                    "use another --out or delete the folder")
        if settings["num_samples"] > old.get("num_samples", 0):  # more of the same: the manifest covers them all
            print(f"{out}: adding images {old.get('num_samples', 0)}..{settings['num_samples'] - 1} to the "
                  f"{old.get('num_samples', 0)} made with these settings", file=sys.stderr)
            _write_manifest(path, settings)
        return None
    # no manifest: images there were not made by this script, and would have been kept as samples
    foreign = sorted(f.name for f in out.glob("[0-9]" * 6 + "*.png") if f.stem.isdigit())  # (7 digits from 10^6)
    if foreign:
        return (f"{out} holds {len(foreign)} image(s) named like samples ({foreign[0]}, ...) but no {MANIFEST}: "
                "not samples of this script; use another --out or empty it")
    _write_manifest(path, settings)
    return None


def _write_manifest(path: Path, settings: dict) -> None:
    tmp = path.with_name(MANIFEST + ".tmp")
    tmp.write_text(json.dumps(settings, indent=1))
    os.replace(tmp, path)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pipeline", required=True, help="exported pipeline folder (model.safetensors + config.json)")
    p.add_argument("--out", required=True, help="folder for the PNGs (and manifest.json)")
    p.add_argument("-n", "--num-samples", type=positive_int, required=True)
    p.add_argument("--seed", type=seed_value, default=0, help="0 <= seed < 2**31 (image i draws from seed << 32 | i)")
    p.add_argument("--labels", default="cycle", help="'cycle' (i mod C), 'random', or class ids '3' / '1,7'")
    p.add_argument("--num-steps", type=positive_int, default=None, help="default: the pipeline's exported setting")
    p.add_argument("--guidance-scale", type=non_negative_float, default=None, help="ω (0: no guidance)")
    p.add_argument("--sampler", choices=("ancestral", "ddim"), default=None)
    p.add_argument("--final", choices=("sample", "argmax"), default=None)
    p.add_argument("--guidance-interval", type=noise_interval, default=None, metavar="LO,HI",
                   help="guide only at noise levels LO <= t <= HI (0,1: everywhere); default: the pipeline's")
    p.add_argument("--batch-size", type=positive_int, default=64, help="images per denoiser batch on each rank")
    p.add_argument("--npz", default=None, help="also write all N images as one ADM-layout .npz (rank 0)")
    p.add_argument("--device", default=None, help="default: cuda:LOCAL_RANK when CUDA is available, else cpu")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    p.add_argument("--fast", choices=("compile", "cudagraphs"), default=None,
                   help="compile the denoiser for the sampling loop (see VQLCMDPipeline.enable_fast_sampling)")
    p.add_argument("--no-progress", action="store_true")
    add_threads_option(p)
    p.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)  # set by deepspeed
    # the value types refuse bad numbers before anything is written: a manifest of bad settings would
    # refuse the corrected rerun as "other settings"
    args = p.parse_args(argv)
    if args.npz and Path(args.npz).is_dir():  # found only after sampling, leaving a .tmp.npz behind
        p.error(f"--npz {args.npz} is a folder; give the .npz file's path")
    parent = next((q for q in Path(args.npz).parents if q.exists()), None) if args.npz else None
    if parent is not None and not parent.is_dir():  # the same, after every image was sampled
        p.error(f"--npz {args.npz}: {parent} is a file, not a folder")

    from vqlcmd.threads import configure

    configure(args.threads, log=lambda line: print(line, file=sys.stderr) if os.environ.get("RANK", "0") == "0"
              else None)
    rank, world, device = dist_setup(args)
    if device.type == "cpu":  # each denoiser batch's activations would page-fault in afresh
        from vqlcmd.engine.host_memory import keep_freed_memory

        msg = keep_freed_memory()
        if rank == 0:
            print(msg, file=sys.stderr)
    pipe, digest = load_pipeline(args, device)
    same_on_every_rank(digest, args.pipeline)
    if pipe.tokenizer is None:  # found by the first batch otherwise, after the manifest was written
        raise SystemExit(f"{args.pipeline} names no tokenizer to decode its tokens into images")
    d = pipe.sample_defaults
    if d.get("sampler") == "maskgit" and (args.sampler or args.final or args.guidance_interval is not None):
        # a MaskGIT pipeline has its own sampler
        raise SystemExit(f"{args.pipeline} holds a MaskGIT model: --sampler, --final and --guidance-interval "
                         "do not apply")
    C = pipe.network.config.num_classes
    settings = {
        "pipeline": str(Path(args.pipeline).resolve()), "weights_sha256": digest,
        "num_samples": args.num_samples, "seed": args.seed, "dtype": args.dtype,
        "labels": args.labels, "num_steps": d.get("num_steps", 50) if args.num_steps is None else args.num_steps,
        "guidance_scale": d.get("guidance_scale", 0.0) if args.guidance_scale is None else args.guidance_scale,
        "sampler": args.sampler or d.get("sampler", "ancestral"), "final": args.final or d.get("final", "sample"),
    }
    if d.get("sampler") != "maskgit":
        from vqlcmd.samplers import EVERY_T, checked_interval

        interval = checked_interval(d.get("guidance_interval") if args.guidance_interval is None
                                    else args.guidance_interval)
        if interval != EVERY_T:  # (absent otherwise: a folder sampled before the option still continues)
            settings["guidance_interval"] = list(interval)
    if C == 0:
        if args.guidance_scale:  # the pipeline refuses it too; only the exported default is dropped
            raise SystemExit(f"--guidance-scale {args.guidance_scale}: {args.pipeline} holds an unconditional model, "
                             "which has nothing to guide toward")
        settings["guidance_scale"] = 0.0
    labels = class_labels(args.labels, args.num_samples, C, args.seed)
    if args.fast:  # before anything is written: cudagraphs on a CPU raised after the manifest was
        try:
            pipe.enable_fast_sampling(args.fast)
        except ValueError as exc:
            raise SystemExit(f"--fast {args.fast}: {exc}") from None
    out = Path(args.out)
    check_manifest(out, {**settings, "class_labels": labels if C else None}, rank, world)
    out.mkdir(parents=True, exist_ok=True)  # ranks may not share rank 0's file system view of a fresh folder

    n_made, wall = sample_missing(pipe, out, settings, labels, device=device, rank=rank, world=world,
                                  batch_size=args.batch_size, progress=not args.no_progress)
    if _dist_active():
        import torch.distributed as dist

        dist.destroy_process_group()
    if rank == 0:
        rate = n_made / wall if wall > 0 else float("nan")
        print(f"sampled {n_made} new images ({args.num_samples - n_made} kept) on {world} rank(s) in "
              f"{wall:.1f} s: {rate:.2f} images/s ({settings['sampler']}, {settings['num_steps']} steps, "
              f"guidance {settings['guidance_scale']}) -> {out}")
        if args.npz:
            write_npz(out, args.num_samples, labels, Path(args.npz))
            print(f"npz -> {args.npz}")
    return 0


def sample_missing(pipe, out: Path, settings: dict, labels: list, *, device, rank: int = 0, world: int = 1,
                   batch_size: int = 64, progress: bool = True) -> tuple[int, float]:
    """Rank ``rank`` of ``world`` draws the images ``i`` of ``settings["num_samples"]`` with i mod world = rank
    that ``out`` lacks, image i from its own seed (``image_seed``) and of class ``labels[i]`` (None:
    unconditional). ``settings`` as in ``OUT/manifest.json``: ``check_manifest`` first, so that a folder of
    other settings is refused rather than mixed. With a process group, every rank returns once all images
    are written. Returns (images drawn on all ranks, seconds of the slowest rank)."""
    from vqlcmd.pipeline import image_generators
    from vqlcmd.samplers import EVERY_T

    device = torch.device(device)
    C = pipe.network.config.num_classes
    mine = [i for i in range(rank, settings["num_samples"], world) if not (out / png_name(i)).is_file()]
    kept = len(range(rank, settings["num_samples"], world)) - len(mine)
    bar = None
    if rank == 0 and progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(mine), desc=f"rank 0/{world} sampling", unit="img")
    if rank == 0 and kept:
        print(f"continuing: rank 0 keeps {kept} existing images", file=sys.stderr)
    t0 = time.perf_counter()
    for start in range(0, len(mine), batch_size):
        idx = mine[start:start + batch_size]
        gens = image_generators([image_seed(settings["seed"], i) for i in idx], device=device)
        kw = dict(class_labels=[labels[i] for i in idx]) if C else dict(num_images=len(idx))
        if settings["sampler"] != "maskgit":  # MaskGIT's own sampler takes neither
            kw.update(sampler=settings["sampler"], final=settings["final"],
                      guidance_interval=settings.get("guidance_interval", EVERY_T))
        images = pipe(**kw, num_steps=settings["num_steps"], guidance_scale=settings["guidance_scale"],
                      generator=gens, batch_size=batch_size, output_type="pt")
        for i, img in zip(idx, images):
            save_png(img, out / png_name(i))
        if bar is not None:
            bar.update(len(idx))
            bar.set_postfix(img_per_s=f"{(start + len(idx)) / (time.perf_counter() - t0):.2f}")
    seconds = time.perf_counter() - t0
    if bar is not None:
        bar.close()
    n_made, wall = len(mine), seconds
    if _dist_active():
        import torch.distributed as dist

        on = device if device.type == "cuda" else "cpu"
        count, slowest = torch.tensor([n_made], device=on), torch.tensor([seconds], device=on)
        dist.all_reduce(count, op=dist.ReduceOp.SUM)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)  # the run took as long as its slowest rank
        n_made, wall = int(count.item()), float(slowest.item())
        # every image is written once all have passed; then no rank waits on rank 0's .npz, which can take
        # longer than NCCL's timeout for large sets (and the run then ended without it, again at every rerun)
        dist.barrier()
    return n_made, wall


if __name__ == "__main__":
    sys.exit(main())
