"""Image trees: an ImageFolder-style tree (one sub-folder per class) or a flat folder (unconditional).

Both pipelines (``dali.py``, ``pil.py``) consume the file list made here, so they see the same files
in the same order, and both produce ``(images float32 (B, C, size, size) in [-1, 1], labels (B,))``:
resize the shorter side to ``size``, centre crop ``size x size``, optional horizontal flip.
"""
from __future__ import annotations

import hashlib
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".webp", ".tif", ".tiff")
FLIP_MODES = ("none", "always", "random")


@dataclass
class ImageList:
    root: Path
    files: list[str]
    labels: list[int]
    class_names: list[str]  # [] for a flat folder (unconditional: every label is 0, the null class)
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (file, reason)

    def __len__(self) -> int:
        return len(self.files)

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    def digest(self) -> str:
        """sha256 (16 hex digits) of the listed files' paths under ``root``, labels and byte sizes: equal for an
        unchanged tree, different once an image is added, removed, moved or rewritten with another size."""
        h = hashlib.sha256()
        for f, label in zip(self.files, self.labels):
            h.update(f"{os.path.relpath(f, self.root)}\t{label}\t{os.path.getsize(f)}\n".encode())
        return h.hexdigest()[:16]

    def subset(self, start: int, stop: int) -> "ImageList":
        return ImageList(self.root, self.files[start:stop], self.labels[start:stop], self.class_names)


def list_images(root, *, check: str = "header") -> ImageList:
    """Files of an image tree in a fixed order (sorted classes, sorted names).

    ``check="header"`` parses every file's header (cheap: no pixel decoding) and skips files that are
    not readable images -- empty, garbage, unknown format, cut off inside the header -- with one
    warning naming them. Skipping rather than failing because one bad file in a million-image tree
    should not stop a tokenization run; the warning and ``ImageList.skipped`` make the loss visible.
    A file whose header is fine but whose pixel data is truncated then fails at decoding, with an
    error naming it (both pipelines), unless ``check="decode"`` (decode everything up front, slower)
    skipped it too; vqlcmd-tokenize and the online loader skip it then, by name (``skipping.py``).
    ``check="none"`` trusts the tree.
    """
    if check not in ("none", "header", "decode"):
        raise ValueError(f"check must be 'none', 'header' or 'decode', got {check!r}")
    root = Path(root)
    if not root.is_dir():
        what = "is a file, not a folder" if root.exists() else "does not exist"
        raise FileNotFoundError(f"image folder {str(root)!r} {what}")
    subdirs = sorted(d.name for d in root.iterdir() if d.is_dir() and not d.name.startswith("."))
    if subdirs:
        loose = [p.name for p in root.iterdir() if p.is_file() and p.name.lower().endswith(IMAGE_EXTENSIONS)
                 and not p.name.startswith(".")]
        if loose:  # as class folders they would be left out, silently
            raise ValueError(f"image folder {str(root)!r} holds {len(loose)} image(s) (e.g. {sorted(loose)[0]}) beside "
                             f"its subfolders {subdirs[:5]}: a tree is either flat (unconditional: images only, no "
                             "subfolders) or one subfolder per class with no images at its top")
        class_names = subdirs
        pairs = [(str(p), c) for c, name in enumerate(subdirs) for p in _image_files(root / name)]
    else:
        class_names = []
        pairs = [(str(p), 0) for p in _image_files(root)]
    skipped = []
    if check != "none":
        good = []
        for f, label in pairs:
            reason = unreadable_reason(f, decode=check == "decode")
            if reason is None:
                good.append((f, label))
            else:
                skipped.append((f, reason))
        pairs = good
        if skipped:
            names = "; ".join(f"{f} ({r})" for f, r in skipped[:20])
            more = f" and {len(skipped) - 20} more" if len(skipped) > 20 else ""
            warnings.warn(f"skipping {len(skipped)} unreadable image(s) under {root}: {names}{more}", stacklevel=2)
    if not pairs:
        raise FileNotFoundError(f"image folder {str(root)!r} holds no readable images "
                                f"(extensions {', '.join(IMAGE_EXTENSIONS)})")
    empty = sorted(set(class_names) - {class_names[c] for _, c in pairs}) if class_names else []
    if empty:
        # Kept, so the other classes' label numbers stay those of the folder names' order (ImageNet's class
        # ids, say); but a model would be trained on no image of these and still offer them for sampling.
        warnings.warn(f"{len(empty)} class folder(s) under {root} hold no readable image: {empty[:10]}"
                      f"{' ...' if len(empty) > 10 else ''}; their labels are kept (the other classes keep "
                      "their numbers) but nothing is learned for them", stacklevel=2)
    return ImageList(root, [f for f, _ in pairs], [c for _, c in pairs], class_names, skipped)


def _image_files(folder: Path) -> list[Path]:
    out = []
    for dirpath, dirnames, filenames in os.walk(folder, followlinks=True):  # as torchvision's ImageFolder
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        out += [Path(dirpath) / f for f in sorted(filenames)
                if f.lower().endswith(IMAGE_EXTENSIONS) and not f.startswith(".")]
    return out


def unreadable_reason(path, decode: bool = False) -> str | None:
    from PIL import Image, UnidentifiedImageError

    try:
        if os.path.getsize(path) == 0:
            return "empty file"
        with Image.open(path) as im:
            if im.width < 1 or im.height < 1:
                return "zero-sized image"
            if im.mode == "F" or (im.mode == "I" and not _sixteen_bit(im)):  # PIL: all black (F in [0, 1]) or
                # all white; DALI fails on 32-bit integers
                return (f"{'32-bit float' if im.mode == 'F' else '32-bit integer'} pixels (mode {im.mode}), whose "
                        "range is unknown: convert to 8 or 16 bits")
            if decode:
                im.load()
    except UnidentifiedImageError:
        return "not a recognised image"
    except Image.DecompressionBombError as e:  # not an OSError; DALI may decode it, but PIL cannot here
        return f"over PIL's pixel limit: {e}"
    except OSError as e:
        return f"cannot read: {e}"
    return None


def _sixteen_bit(im) -> bool:
    """Whether a mode-"I" image holds 16-bit samples: Pillow up to 10.x opens 16-bit PNGs as "I" (later ones
    as "I;16"); its tile's raw mode says what the file stores."""
    args = im.tile[0][3] if im.tile else ""
    raw = args if isinstance(args, str) else (args[0] if args and isinstance(args[0], str) else "")
    return raw.startswith("I;16")


def resized_shape(h: int, w: int, size: int) -> tuple[int, int]:
    """(h, w) after resizing the shorter side to ``size`` keeping the aspect ratio, rounding the longer
    side to nearest; both pipelines use this so their crops line up."""
    if h <= w:
        return size, max(size, int(w * size / h + 0.5))
    return max(size, int(h * size / w + 0.5)), size


def image_batches(images: ImageList, size: int, batch_size: int, *, flip: str = "none", seed: int = 0,
                  backend: str = "auto", channels: int = 3, device=None, num_threads: int = 2):
    """Batches ``(images (B, channels, size, size) float32 in [-1, 1], labels (B,) int64)`` in list order.

    ``backend``: "dali", "pil" or "auto" (DALI when installed). ``flip``: "none", "always" (the flipped
    copies of vqlcmd-tokenize --flip) or "random" (a fresh coin per image, drawn from ``seed``).
    """
    if flip not in FLIP_MODES:
        raise ValueError(f"flip must be one of {FLIP_MODES}, got {flip!r}")
    if backend == "auto":
        backend = "dali" if dali_available() else "pil"
    if backend == "dali":
        from .dali import dali_batches
        return dali_batches(images, size, batch_size, flip=flip, seed=seed, channels=channels, device=device,
                            num_threads=num_threads)
    if backend == "pil":
        from .pil import pil_batches
        return pil_batches(images, size, batch_size, flip=flip, seed=seed, channels=channels, device=device,
                           num_threads=num_threads)
    raise ValueError(f"unknown image backend {backend!r} (use 'dali', 'pil' or 'auto')")


def dali_available() -> bool:
    try:
        import nvidia.dali  # noqa: F401
    except ImportError:
        return False
    return True
