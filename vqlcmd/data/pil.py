"""PIL fallback image pipeline (used when DALI is not installed, or asked for).

Matches the DALI pipeline's geometry exactly (same resized shape, same crop offsets) and its filter
closely (PIL's antialiased bilinear vs DALI's antialiased linear); tests/data/test_pipelines.py pins
the pixel tolerance between the two.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from .images import ImageList, resized_shape


def load_image(path: str, size: int, channels: int, flip: bool) -> np.ndarray:
    """(size, size, channels) uint8: shorter side resized to ``size``, centre crop, optional mirror."""
    from PIL import Image, ImageOps

    try:
        with Image.open(path) as im:
            im = _eight_bit(ImageOps.exif_transpose(im)).convert("L" if channels == 1 else "RGB")
            h, w = resized_shape(im.height, im.width, size)
            im = im.resize((w, h), Image.BILINEAR)
    except (OSError, Image.DecompressionBombError) as e:  # truncated pixel data and the like: say which file
        raise OSError(f"cannot decode image {path}: {e}") from e
    top, left = crop_offset(h, size), crop_offset(w, size)
    a = np.asarray(im, dtype=np.uint8)[top:top + size, left:left + size]
    if a.ndim == 2:
        a = a[:, :, None]
    return a[:, ::-1] if flip else a


def _eight_bit(im):
    """16-bit greyscale (PNG, TIFF) scaled to 8 bits, as DALI's decoder does: PIL's convert() clips it at
    255, which turned such images almost white. (EXIF orientation is applied above for the same reason:
    DALI's decoder applies it.)"""
    from PIL import Image

    if im.mode not in ("I;16", "I;16B", "I;16L", "I;16N"):  # ("I", 32 bits, says nothing of its range)
        return im
    a = np.asarray(im, dtype=np.float64) * (255.0 / 65535.0)
    return Image.fromarray(np.clip(np.round(a), 0, 255).astype(np.uint8), "L")


def crop_offset(extent: int, size: int) -> int:
    # centre crop offset rounded half up, as DALI's crop_pos 0.5 does
    return int((extent - size) / 2 + 0.5)


def pil_batches(images: ImageList, size: int, batch_size: int, *, flip: str = "none", seed: int = 0,
                channels: int = 3, device=None, num_threads: int = 2):
    rng = np.random.Generator(np.random.PCG64(seed))
    flips = {"none": np.zeros(len(images), bool), "always": np.ones(len(images), bool),
             "random": rng.random(len(images)) < 0.5}[flip]
    with ThreadPoolExecutor(max(1, num_threads)) as pool:  # PIL releases the GIL while decoding
        for i in range(0, len(images), batch_size):
            j = min(i + batch_size, len(images))
            arrs = list(pool.map(lambda k: load_image(images.files[k], size, channels, bool(flips[k])), range(i, j)))
            x = torch.from_numpy(np.stack(arrs)).permute(0, 3, 1, 2).float().div_(127.5).sub_(1.0)
            y = torch.tensor(images.labels[i:j], dtype=torch.int64)
            if device is not None:
                x, y = x.to(device), y.to(device)
            yield x.contiguous(), y
