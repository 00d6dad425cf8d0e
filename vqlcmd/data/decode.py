"""Decoded image batches of an ``ImageList`` through DALI or PIL (``dali.py``, ``pil.py``): the backend
choice, apart from the file list so that the two pipelines and the list import one way."""
from __future__ import annotations

from .images import FLIP_MODES, ImageList


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
