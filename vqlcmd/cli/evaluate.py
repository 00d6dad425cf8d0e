#!/usr/bin/env python
"""Evaluate a sample folder or .npz: FID, Inception Score and precision/recall (k = 3), or the digits metrics.

    python scripts/evaluate.py SAMPLES --ref REF --inception-weights weights-inception-2015-12-05-6726825d.pth
    python scripts/evaluate.py SAMPLES --digits

SAMPLES: a folder of PNG/JPEG files (read in name order, numbered names by number; labels from the
``manifest.json`` that scripts/sample.py writes) or an ADM-layout ``.npz`` (``arr_0`` uint8 (N, H, W, 3),
optional ``arr_1`` labels). REF: an image folder, an ADM reference batch / sample ``.npz`` (``arr_0``), or
statistics (``.npz`` with ``mu`` and ``sigma``, and ``pool`` features for precision/recall) saved by
``--save-ref``.
Where a reference batch holds both images and ``mu``/``sigma``, its images are re-encoded with this
Inception so that both sides come from one network.

Inception (torch-fidelity's port of the TF FID network) needs a local weights file: ``--inception-weights``
or ``$VQLCMD_INCEPTION_WEIGHTS``. ``--digits`` needs no download: a classifier fitted on the embedded
digits gives class accuracy (conditional samples) and FID / precision / recall in its feature space
against all 1797 real digits (see vqlcmd/metrics/digits.py).
"""
from __future__ import annotations

import os
import sys

import argparse  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

from vqlcmd.cli import choices_list, positive_int  # noqa: E402

IMAGE_EXTS = (".png", ".jpg", ".jpeg")


def _file_order(p: Path):
    # numbered names by number: sample.py's names grow to 7 digits at 10^6, and 1000000.png sorted between
    # 100000.png and 100001.png, pairing images with other images' manifest labels (the name breaks ties)
    numbered = re.fullmatch(r"[0-9]+", p.stem) is not None  # (isdigit takes "²", which int() refuses)
    return (0, int(p.stem), p.name) if numbered else (1, 0, p.name)


def image_files(folder: Path) -> list:
    files = sorted((p for p in folder.iterdir() if p.suffix.lower() in IMAGE_EXTS and not p.name.startswith(".")),
                   key=_file_order)
    if not files:
        raise SystemExit(f"{folder}: no {'/'.join(IMAGE_EXTS)} files")
    return files


def read_image(path: Path, grey: bool = False) -> np.ndarray:
    from PIL import Image

    with Image.open(path) as im:
        return np.asarray(im.convert("L" if grey else "RGB"))


def stack_images(files, grey: bool = False, size=None) -> np.ndarray:
    """The files' pixels as one array; images of another size than ``size`` (default: the first's) are an
    error naming both (np.stack's "all input arrays must have the same shape" named no file)."""
    arrs = [read_image(f, grey) for f in files]
    size = size or arrs[0].shape[:2]
    odd = next((i for i, a in enumerate(arrs) if a.shape[:2] != size), None)
    if odd is not None:
        h, w = arrs[odd].shape[:2]
        raise SystemExit(f"images of different sizes: {files[odd].name} is {w}x{h}, the others {size[1]}x{size[0]}; "
                         "resize them to one size first")
    return np.stack(arrs)


def folder_batches(files, batch_size: int):
    size = None
    for i in range(0, len(files), batch_size):
        batch = stack_images(files[i:i + batch_size], size=size)
        size = batch.shape[1:3]
        yield batch


def load_npz(path: Path):
    """``np.load`` of an .npz, or a one-line error naming the file: numpy calls a file that is not a zip
    "pickled data", and an empty or cut-off one raises EOFError or BadZipFile. Pickled (object) members are
    never loaded: reading one is an error naming the file and the member."""
    import zipfile

    try:
        return _PlainNpz(path, np.load(path, allow_pickle=False))
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:
        raise SystemExit(f"{path}: not a readable .npz ({type(exc).__name__}: {exc})") from None


class _PlainNpz:
    """An ``NpzFile`` whose member reads name the file when a member is a pickle (numpy's error names neither)."""

    def __init__(self, path: Path, npz):
        self.path, self.npz, self.files = path, npz, npz.files

    def __getitem__(self, key):
        try:
            return self.npz[key]
        except ValueError as exc:
            if "allow_pickle" not in str(exc):
                raise
            raise SystemExit(f"{self.path}: {key!r} is an object array, stored as a pickle, which is never loaded "
                             "(it could run code); save numeric arrays (uint8 images, int labels)") from None

    def __contains__(self, key):
        return key in self.npz

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.npz.close()


def load_labels(source: Path, n: int):
    """Class labels of a sample set: ``arr_1`` of an .npz, ``class_labels`` of a folder's manifest.json."""
    if source.suffix == ".npz":
        with load_npz(source) as data:
            return torch.as_tensor(data["arr_1"]) if "arr_1" in data.files else None
    manifest = source / "manifest.json"
    if manifest.is_file():
        labels = json.loads(manifest.read_text()).get("class_labels")
        if labels and labels[0] is not None:
            if len(labels) != n:
                raise SystemExit(f"{manifest} lists {len(labels)} labels but {source} holds {n} images")
            return torch.as_tensor(labels)
    return None


def image_source(path: Path, batch_size: int):
    """(number of images, iterable of uint8 batches) of a folder or an .npz's ``arr_0``."""
    if path.is_dir():
        files = image_files(path)
        return len(files), folder_batches(files, batch_size)
    if path.suffix == ".npz":
        with load_npz(path) as data:
            if "arr_0" not in data.files:
                raise SystemExit(f"{path}: no arr_0 images (keys: {data.files})")
            arr = data["arr_0"]
        return len(arr), (arr[i:i + batch_size] for i in range(0, len(arr), batch_size))
    raise SystemExit(f"{path}: expected an image folder or a .npz file")


def _image_size(path: Path) -> tuple:
    from PIL import Image

    with Image.open(path) as im:
        return im.height, im.width


def needs_resizing(folder: Path, size: tuple) -> bool:
    """Whether a reference folder is a class-folder tree (no images at its top level), or holds images of
    another size than the samples' (headers only): then it is read as vqlcmd-tokenize reads a tree."""
    files = sorted(p for p in folder.iterdir() if p.suffix.lower() in IMAGE_EXTS and not p.name.startswith("."))
    if not files:
        return any(p.is_dir() for p in folder.iterdir())
    return any(_image_size(f) != size for f in files)


def tree_batches(folder: Path, size: tuple, batch_size: int):
    """uint8 NHWC batches of an image tree (class folders, or flat; any sizes and modes) at the samples' size,
    each image resized on its shorter side and centre-cropped as the tokenizer's training images were."""
    from vqlcmd.data import image_batches, list_images

    if size[0] != size[1]:
        raise SystemExit(f"--ref {folder}: its images are resized to the samples' size, which must be square, "
                         f"got {size[1]}x{size[0]}")
    images = list_images(folder)
    if not len(images.files):
        raise SystemExit(f"--ref {folder}: no images")
    for x, _ in image_batches(images, size[0], batch_size, backend="pil", channels=3):
        yield ((x + 1) * 127.5).round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).numpy()


def reference_features(ref: Path, extractor, batch_size: int, sample_size: tuple = None) -> dict:
    if ref.is_dir() and sample_size is not None and needs_resizing(ref, sample_size):
        print(f"--ref {ref}: read as an image tree, each image resized and centre-cropped to the samples' "
              f"{sample_size[1]}x{sample_size[0]}", file=sys.stderr)
        return extractor(tree_batches(ref, sample_size, batch_size))
    if ref.suffix == ".npz":
        with load_npz(ref) as data:
            keys = set(data.files)
            if "arr_0" not in keys:  # statistics, not images
                if "pool" not in keys and not {"mu", "sigma"} <= keys:
                    raise SystemExit(f"{ref}: neither images (arr_0) nor statistics (mu, sigma or pool); "
                                     f"keys: {sorted(keys)}")
                return {k: data[k] for k in ("mu", "sigma", "pool") if k in keys}
    _, batches = image_source(ref, batch_size)
    return extractor(batches)


def _statistics_without_features(ref: Path) -> bool:
    if ref.suffix != ".npz" or not ref.is_file():
        return False
    with load_npz(ref) as data:
        keys = set(data.files)
    return "arr_0" not in keys and "pool" not in keys


def evaluate_inception(args) -> dict:
    from vqlcmd.metrics.inception import InceptionFeatures, as_uint8_nchw, inception_metrics
    from vqlcmd.metrics.stats import feature_statistics

    metrics = tuple(args.metrics)
    if ("fid" in metrics or "pr" in metrics) and not args.ref:
        raise SystemExit("FID and precision/recall need --ref (or use --metrics is)")
    if args.ref and "pr" in metrics and _statistics_without_features(Path(args.ref)):
        # found only after every sample was encoded, which lost the FID and IS computed with them
        raise SystemExit(f"--ref {args.ref} holds mu/sigma only: precision/recall need its pool features "
                         "(use --metrics fid,is, or a reference of images or saved with --save-ref)")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        extractor = InceptionFeatures(args.inception_weights, device=device, batch_size=args.batch_size,
                                      verify=not args.any_inception_weights)
    except (FileNotFoundError, ValueError) as exc:
        raise SystemExit(str(exc))
    _, batches = image_source(Path(args.samples), args.batch_size)
    sizes = []

    def noting_size(batches):  # the samples' (H, W), for a reference tree that needs resizing to it
        for batch in batches:
            if not sizes:
                try:
                    sizes.append(tuple(as_uint8_nchw(batch).shape[-2:]))
                except ValueError:
                    pass  # the extractor names the problem
            yield batch

    fake = extractor(noting_size(batches))
    ref = {}
    if args.ref:
        ref = reference_features(Path(args.ref), extractor, args.batch_size, sizes[0] if sizes else None)
        if args.save_ref and "pool" in ref:
            mu, sigma = feature_statistics(ref["pool"])
            np.savez(args.save_ref, mu=mu, sigma=sigma, pool=ref["pool"])
            print(f"reference statistics -> {args.save_ref}", file=sys.stderr)
        elif args.save_ref:
            print(f"--save-ref: nothing saved, {args.ref} is already statistics without features", file=sys.stderr)
    return inception_metrics(fake, ref, k=args.k, splits=args.splits, metrics=metrics)


def evaluate_digits(args) -> dict:
    from vqlcmd.metrics.digits import evaluate_digit_samples, real_reference

    src = Path(args.samples)
    if src.is_dir():
        images = stack_images(image_files(src), grey=True)
    else:
        from vqlcmd.metrics.inception import as_uint8_nchw

        _, batches = image_source(src, 1 << 30)
        try:  # the layouts and dtype the Inception path takes: an NCHW array lost its width axis here, and a
            # float one in [0, 1] was divided by 255 again, both scored as garbage with exit 0
            images = next(iter(batches), None)
            if images is None or not len(images):
                raise SystemExit(f"{src}: no images")
            images = images[..., None] if images.ndim == 3 else images  # (N, H, W) grey
            images = as_uint8_nchw(images).float().mean(1).numpy()  # RGB-repeated grey: one channel
        except ValueError as exc:
            raise SystemExit(f"{src}: {exc}") from None
    x = torch.as_tensor(np.asarray(images, dtype=np.float32) / 255.0)[:, None]
    labels = load_labels(src, len(x))
    out = evaluate_digit_samples(x, labels)
    out["real_halves"] = real_reference(x.shape[-1], n=len(x))  # the floor at this many samples, not at 899
    return out


# what each number is, and which way is better, for the table
_METRIC_NAMES = {"num_samples": "samples", "fid": "FID (lower)", "is": "Inception Score (higher)",
                 "is_std": "Inception Score std", "precision": "precision (higher)", "recall": "recall (higher)",
                 "accuracy": "class accuracy (higher)", "spread_ratio": "spread ratio (real: 1)"}


def format_table(result: dict) -> str:
    """The scalar results as aligned rows; a nested dict of the same metrics (``real_halves``: the real
    digits' own halves, the floor at this many samples) as a second column."""
    nested = {k: v for k, v in result.items() if isinstance(v, dict)}
    columns = ["value", *(k.replace("_", " ") for k in nested)]
    rows = []
    for key, value in result.items():
        if isinstance(value, (dict, list)):
            continue
        rows.append([_METRIC_NAMES.get(key, key), _cell(value), *(_cell(d.get(key)) for d in nested.values())])
    width = [max(len(r[i]) for r in rows + [["metric", *columns]]) for i in range(len(columns) + 1)]
    line = lambda cells: "  ".join(c.ljust(width[0]) if i == 0 else c.rjust(width[i]) for i, c in enumerate(cells))
    return "\n".join([line(["metric", *columns]), line(["-" * w for w in width]), *map(line, rows)])


def _cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool) or isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return f"{value:.4f}" if abs(value) < 1e4 else f"{value:.4g}"
    return str(value)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("samples", help="sample folder or .npz")
    p.add_argument("--ref", default=None,
                   help="reference: image folder (a class-folder tree, or images of other sizes, are resized and "
                        "centre-cropped to the samples' size), .npz batch, or saved statistics")
    p.add_argument("--digits", action="store_true", help="digits metrics against the embedded real digits")
    p.add_argument("--inception-weights", default=None,
                   help="local weights-inception-2015-12-05-6726825d.pth (default $VQLCMD_INCEPTION_WEIGHTS)")
    p.add_argument("--any-inception-weights", action="store_true",
                   help="take Inception weights other than torch-fidelity's release (whose SHA-256 is checked "
                        "otherwise), e.g. your own conversion; they are still loaded weights-only")
    p.add_argument("--metrics", type=choices_list(("fid", "is", "pr")), default=["fid", "is", "pr"],
                   help="comma-separated subset of fid, is, pr")
    p.add_argument("--k", type=positive_int, default=3, help="neighbourhood size for precision/recall")
    p.add_argument("--splits", type=positive_int, default=10,
                   help="Inception Score splits: consecutive slices, as in ADM's evaluator (give samples in mixed "
                        "class order)")
    p.add_argument("--save-ref", default=None, help="save the reference's mu/sigma/pool features to this .npz")
    p.add_argument("--batch-size", type=positive_int, default=64)
    p.add_argument("--device", default=None)
    p.add_argument("--json", default=None, help="also write the results to this file")
    args = p.parse_args(argv)
    for name, value in (("samples", args.samples), ("--ref", args.ref)):
        if value is not None and not Path(value).exists():
            raise SystemExit(f"{name}: {value} does not exist")

    result = evaluate_digits(args) if args.digits else evaluate_inception(args)
    text = json.dumps(result, indent=2)
    print(format_table(result), file=sys.stderr)  # for people; stdout stays the JSON that tools read
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
