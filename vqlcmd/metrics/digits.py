"""Metrics for the embedded digits data set: an independent classifier and within-class variety.

The classifier is an RBF support-vector machine (scikit-learn) fitted on the real
digits only, never on samples, in its input space: images in [0, 1] average-pooled
to 8x8 (the digits' native resolution). Accuracy alone does not separate good
models (a model that draws one perfect digit per class scores 100%), so the
within-class spread of the samples is reported relative to the real digits'.
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np
import torch
import torch.nn.functional as F


def features(images: torch.Tensor) -> np.ndarray:
    """images (N, 1, H, W) in [0, 1] -> (N, 64) classifier inputs."""
    if images.dim() != 4 or images.shape[1] != 1:
        raise ValueError(f"digit images must be (N, 1, H, W), got {tuple(images.shape)}")
    return F.adaptive_avg_pool2d(images.float().cpu(), 8).flatten(1).numpy()


@lru_cache(maxsize=2)
def _real(size: int):
    from ..data.digits import digits_images

    images, labels = digits_images(size)
    return features((images + 1) / 2), labels.numpy()


@lru_cache(maxsize=2)
def digit_classifier(size: int = 32):
    """SVC fitted on all real digits (at ``size`` px, pooled to 8x8)."""
    from sklearn.svm import SVC

    x, y = _real(size)
    return SVC(C=10.0, gamma="scale").fit(x, y)


def real_holdout_accuracy(size: int = 32, seed: int = 0) -> float:
    """Sanity figure: the same classifier recipe fitted on 80% of the real digits, scored on the rest."""
    from sklearn.model_selection import train_test_split
    from sklearn.svm import SVC

    x, y = _real(size)
    xa, xb, ya, yb = train_test_split(x, y, test_size=0.2, random_state=seed, stratify=y)
    return float(SVC(C=10.0, gamma="scale").fit(xa, ya).score(xb, yb))


def within_class_spread(x: np.ndarray, y: np.ndarray) -> float:
    """Mean distance of each image to its class centroid, averaged over the classes present."""
    spreads = [np.linalg.norm(x[y == c] - x[y == c].mean(0), axis=1).mean() for c in np.unique(y)]
    return float(np.mean(spreads))


def evaluate_digit_samples(images: torch.Tensor, labels: torch.Tensor) -> dict:
    """images (N, 1, H, W) in [0, 1] drawn for ``labels``: accuracy of the independent classifier and
    within-class spread relative to the real digits (1.0 = as varied as the data)."""
    size = images.shape[-1]
    x = features(images)
    y = labels.cpu().numpy()
    pred = digit_classifier(size).predict(x)
    real_x, real_y = _real(size)
    return {
        "accuracy": float((pred == y).mean()),
        "spread_ratio": within_class_spread(x, y) / within_class_spread(real_x, real_y),
        "num_samples": int(len(y)),
    }
