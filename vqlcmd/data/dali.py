"""NVIDIA DALI image pipeline: file reader -> decode -> resize shorter side -> centre crop (+ mirror) -> [-1, 1].

Decodes with the GPU ``mixed`` decoder when a CUDA device is given and available, on the CPU
otherwise (CPU-only pipelines: ``device_id=None``), so the same code runs in CI without a GPU.
"""
from __future__ import annotations

import numpy as np
import torch

from .images import ImageList


def build_pipeline(files: list[str], labels: list[int], size: int, batch_size: int, *, flip: str = "none",
                   seed: int = 0, channels: int = 3, device_id: int | None = None, num_threads: int = 2):
    from nvidia.dali import fn, pipeline_def, types

    gpu = device_id is not None

    @pipeline_def(batch_size=batch_size, num_threads=num_threads, device_id=device_id, seed=seed,
                  prefetch_queue_depth=2)
    def pipe():
        jpegs, labs = fn.readers.file(files=files, labels=labels, random_shuffle=False, pad_last_batch=True,
                                      name="reader")
        imgs = fn.decoders.image(jpegs, device="mixed" if gpu else "cpu",
                                 output_type=types.GRAY if channels == 1 else types.RGB)
        # subpixel_scale=False: scale to the rounded output size, as PIL does, so the two agree on geometry
        imgs = fn.resize(imgs, resize_shorter=size, interp_type=types.INTERP_LINEAR, antialias=True,
                         subpixel_scale=False)
        if flip == "random":
            mirror = fn.random.coin_flip(probability=0.5)
        else:
            mirror = 1 if flip == "always" else 0
        imgs = fn.crop_mirror_normalize(imgs, crop=(size, size), crop_pos_x=0.5, crop_pos_y=0.5, mirror=mirror,
                                        mean=[127.5] * channels, std=[127.5] * channels, dtype=types.FLOAT,
                                        output_layout="CHW")
        return imgs, labs

    p = pipe()
    p.build()
    return p


def _to_torch(out, device) -> torch.Tensor:
    t = out.as_tensor()
    if hasattr(out, "as_cpu") and type(out).__name__.endswith("GPU"):
        from nvidia.dali.plugin.pytorch import feed_ndarray

        dst = torch.empty(t.shape(), dtype=torch.float32, device=device)
        feed_ndarray(t, dst, cuda_stream=torch.cuda.current_stream(device))
        return dst
    return torch.from_numpy(np.array(t))


def _is_file_error(message: str) -> bool:
    m = message.lower()
    return any(k in m for k in ("decode", "corrupt", "truncat", "unsupported image", "no such file", "cannot open",
                                "failed to open", "premature end"))


def dali_batches(images: ImageList, size: int, batch_size: int, *, flip: str = "none", seed: int = 0,
                 channels: int = 3, device=None, num_threads: int = 2):
    """Same contract as ``pil.pil_batches``: batches in list order, the last one possibly smaller."""
    device = torch.device(device) if device is not None else None
    device_id = None
    if device is not None and device.type == "cuda" and torch.cuda.is_available():
        device_id = device.index if device.index is not None else torch.cuda.current_device()
        device = torch.device("cuda", device_id)
    n = len(images)
    if n == 0:
        return
    bs = min(batch_size, n)
    p = build_pipeline(images.files, images.labels, size, bs, flip=flip, seed=seed, channels=channels,
                       device_id=device_id, num_threads=num_threads)
    try:
        done = 0
        while done < n:
            try:
                out_imgs, out_labs = p.run()
            except RuntimeError as e:
                batch = images.files[done:done + bs]
                # DALI's own message names the sample that failed ("Failed to decode sample #i : path"); the hint
                # about checking the files only where it was a file that failed (not, say, device memory)
                hint = ("\n(list_images(check='decode') or vqlcmd-tokenize --check-images decode skips such "
                        "files up front)") if _is_file_error(str(e)) else ""
                raise RuntimeError(f"DALI failed on the batch of {len(batch)} images starting with {batch[0]}: "
                                   f"{e}{hint}") from e
            take = min(bs, n - done)
            x = _to_torch(out_imgs, device)[:take]
            y = torch.from_numpy(np.array(out_labs.as_tensor())).reshape(-1)[:take].long()
            if device is not None:
                x, y = x.to(device), y.to(device)
            done += take
            yield x, y
    finally:
        del p
