"""Small JPEG trees for the data tests (smooth pictures with a little noise, odd sizes)."""
import numpy as np
from PIL import Image

SIZES = [(37, 53), (64, 45), (50, 50), (41, 77), (100, 140), (33, 32), (48, 96)]


def picture(h, w, seed):
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:h, 0:w]
    a = np.stack([128 + 100 * np.sin(xx / 5 + seed), 128 + 100 * np.cos(yy / 7), xx * 255 / w], -1)
    return (a + rng.normal(0, 10, a.shape)).clip(0, 255).astype(np.uint8)


def write_tree(root, classes=("ant", "cat"), sizes=SIZES):
    for i, (h, w) in enumerate(sizes):
        cls = root / classes[i % len(classes)]
        cls.mkdir(parents=True, exist_ok=True)
        Image.fromarray(picture(h, w, i)).save(cls / f"im{i}.jpg", quality=92)
    return root


def cut_pixels(src, dst):
    """``dst``: the JPEG ``src`` cut in half -- its header intact, so a header check passes it, its pixels short."""
    data = src.read_bytes()
    dst.write_bytes(data[:len(data) // 2])
    return dst
