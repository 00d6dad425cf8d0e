"""Inception-v3 features for FID, Inception Score and precision/recall, from a local weights file.

The network is torch-fidelity's port of the TensorFlow FID Inception (the graph the reference FID
numbers, and the ADM evaluation suite, use), including its TF-compatible resize to 299x299. Its
weights cannot be downloaded here: give the file ``weights-inception-2015-12-05-6726825d.pth``
(torch-fidelity's release asset) by path or through ``$VQLCMD_INCEPTION_WEIGHTS``.

Features: ``pool`` (N, 2048), the pool_3 layer used for FID and precision/recall, and ``logits``
(N, 1008), the unbiased logits used for the Inception Score. The metric math is ``stats.py``.
"""
from __future__ import annotations

import pickle

import os
from pathlib import Path
from typing import Iterable, Optional, Union

import numpy as np
import torch

WEIGHTS_FILE = "weights-inception-2015-12-05-6726825d.pth"
ENV = "VQLCMD_INCEPTION_WEIGHTS"


def inception_weights_path(path: Optional[Union[str, Path]] = None) -> Path:
    """The weights file to use: ``path``, else ``$VQLCMD_INCEPTION_WEIGHTS``; errors name what is missing."""
    given = path if path is not None else os.environ.get(ENV)
    if not given:
        raise FileNotFoundError(
            f"no Inception weights given: pass --inception-weights PATH (or set ${ENV}) to a local copy of "
            f"torch-fidelity's {WEIGHTS_FILE}; nothing is downloaded at run time")
    p = Path(given).expanduser()
    if not p.is_file():
        raise FileNotFoundError(f"Inception weights file {p} does not exist (expected torch-fidelity's "
                                f"{WEIGHTS_FILE}, the TF FID Inception converted to PyTorch)")
    return p


class InceptionFeatures:
    """Callable: uint8 images (N, 3, H, W) (or (N, 1, H, W), repeated to RGB) -> dict(pool, logits) numpy."""

    def __init__(self, weights: Optional[Union[str, Path]] = None, device: Union[str, torch.device] = "cpu",
                 batch_size: int = 64):
        path = inception_weights_path(weights)
        try:
            from torch_fidelity.feature_extractor_inceptionv3 import FeatureExtractorInceptionV3
        except ImportError as exc:
            raise ImportError("Inception metrics need torch-fidelity: pip install torch-fidelity") from exc
        try:
            self.net = FeatureExtractorInceptionV3("inception-v3-compat", ["2048", "logits_unbiased"],
                                                   feature_extractor_weights_path=str(path), verbose=False)
        except (RuntimeError, ValueError, EOFError, pickle.UnpicklingError) as exc:  # another checkpoint, or not one
            raise ValueError(f"{path} is not torch-fidelity's Inception-v3 ({WEIGHTS_FILE}): {exc}") from exc
        self.device = torch.device(device)
        self.net.to(self.device)
        self.batch_size = batch_size

    @torch.no_grad()
    def __call__(self, images: Union[torch.Tensor, np.ndarray, Iterable]) -> dict:
        pools, logits = [], []
        for batch in _batches(images, self.batch_size):
            pool, logit = self.net(batch.to(self.device))
            pools.append(pool.double().cpu().numpy())
            logits.append(logit.double().cpu().numpy())
        if not pools:
            raise ValueError("no images to compute Inception features of")
        return {"pool": np.concatenate(pools), "logits": np.concatenate(logits)}


def as_uint8_nchw(images: Union[torch.Tensor, np.ndarray]) -> torch.Tensor:
    """uint8 NHWC (the ADM .npz layout) or NCHW, 1 or 3 channels -> uint8 (N, 3, H, W)."""
    x = torch.as_tensor(images)
    if x.dtype != torch.uint8:
        raise ValueError(f"images must be uint8 (0..255), got {x.dtype}")
    if x.dim() != 4:
        raise ValueError(f"images must be 4-D (N, H, W, C) or (N, C, H, W), got {tuple(x.shape)}")
    if x.shape[-1] in (1, 3) and x.shape[1] not in (1, 3):
        x = x.permute(0, 3, 1, 2)
    if x.shape[1] == 1:
        x = x.expand(-1, 3, -1, -1)
    if x.shape[1] != 3:
        raise ValueError(f"images must have 1 or 3 channels, got shape {tuple(x.shape)}")
    return x.contiguous()


def _batches(images, batch_size: int):
    if isinstance(images, (torch.Tensor, np.ndarray)):
        x = as_uint8_nchw(images)
        for i in range(0, x.shape[0], batch_size):
            yield x[i:i + batch_size]
    else:
        for batch in images:
            yield as_uint8_nchw(batch)


def inception_metrics(fake: dict, ref: dict, *, k: int = 3, splits: int = 10, metrics=("fid", "is", "pr")) -> dict:
    """FID / IS / precision-recall of ``fake`` features against ``ref``.

    ``fake``: dict(pool, logits) from ``InceptionFeatures``. ``ref``: dict with ``pool`` features, or
    with ``mu`` and ``sigma`` only (precomputed statistics, e.g. an ADM reference batch's; then no
    precision/recall, which needs the reference's features).
    """
    from .stats import feature_statistics, frechet_distance, inception_score, precision_recall

    out = {"num_samples": int(len(fake["pool"]))}
    if "fid" in metrics:
        mu_r, sigma_r = (ref["mu"], ref["sigma"]) if "mu" in ref else feature_statistics(ref["pool"])
        out["fid"] = frechet_distance(*feature_statistics(fake["pool"]), mu_r, sigma_r)
    if "is" in metrics:
        out["is"], out["is_std"] = inception_score(fake["logits"], splits=min(splits, len(fake["logits"])))
    if "pr" in metrics:
        if "pool" not in ref:
            raise ValueError("precision/recall need the reference's features, not only its mu/sigma statistics "
                             "(give the reference images, or statistics saved with --save-ref)")
        out.update(precision_recall(ref["pool"], fake["pool"], k=k))
    return out
