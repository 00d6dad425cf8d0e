"""Metric math on feature sets: Fréchet distance (FID), Inception Score, precision/recall.

Feature extractors live apart (``inception.py`` for images, ``digits.py`` for the embedded data
set); these functions take plain (N, F) arrays or tensors so that tests can check them on features
they construct. All math is float64.

- FID (Heusel et al. 2017): ‖μ₁ − μ₂‖² + tr(Σ₁ + Σ₂ − 2 (Σ₁Σ₂)^{1/2}).
- Inception Score (Salimans et al. 2016): exp E_x KL(p(y|x) ‖ p(y)), mean and std over splits.
- Precision/recall (Kynkäänniemi et al. 2019, k = 3, as the ADM evaluation suite reports them):
  each set's manifold is the union of balls around its points with radius the distance to the
  k-th nearest neighbour in the same set; precision is the fraction of generated points inside
  the real manifold, recall the fraction of real points inside the generated one.
"""
from __future__ import annotations

from typing import Union

import numpy as np
import torch

ArrayLike = Union[np.ndarray, torch.Tensor]


def _f64(x: ArrayLike) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().double().numpy()
    x = np.asarray(x, dtype=np.float64)
    if x.ndim != 2:
        raise ValueError(f"features must be (N, F), got shape {x.shape}")
    if not np.isfinite(x).all():
        raise ValueError("features contain NaN or inf")
    return x


def feature_statistics(features: ArrayLike) -> tuple[np.ndarray, np.ndarray]:
    """(μ, Σ) of (N, F) features; Σ is the unbiased covariance (N − 1), as the reference FID code uses."""
    x = _f64(features)
    if x.shape[0] < 2:
        raise ValueError(f"need at least 2 feature vectors for a covariance, got {x.shape[0]}")
    return x.mean(0), np.cov(x, rowvar=False).reshape(x.shape[1], x.shape[1])


def _psd_sqrt(a: np.ndarray) -> np.ndarray:
    w, v = np.linalg.eigh((a + a.T) / 2)
    return (v * np.sqrt(np.clip(w, 0, None))) @ v.T


def frechet_distance(mu1, sigma1, mu2, sigma2) -> float:
    """Fréchet distance between N(μ₁, Σ₁) and N(μ₂, Σ₂).

    tr (Σ₁Σ₂)^{1/2} is computed as Σ √λᵢ of the symmetric PSD matrix Σ₁^{1/2} Σ₂ Σ₁^{1/2}, which has
    the same eigenvalues as Σ₁Σ₂: symmetric eigendecompositions only, so no complex round-off
    (scipy's ``sqrtm`` of the non-symmetric product needs the "discard imaginary part" fix-up).
    """
    mu1, mu2 = np.asarray(mu1, np.float64).reshape(-1), np.asarray(mu2, np.float64).reshape(-1)
    s1, s2 = np.atleast_2d(np.asarray(sigma1, np.float64)), np.atleast_2d(np.asarray(sigma2, np.float64))
    if mu1.shape != mu2.shape or s1.shape != s2.shape or s1.shape != (mu1.size, mu1.size):
        raise ValueError(f"statistics do not match: mu {mu1.shape} vs {mu2.shape}, sigma {s1.shape} vs {s2.shape}")
    r1 = _psd_sqrt(s1)
    middle = r1 @ s2 @ r1
    tr_covmean = np.sqrt(np.clip(np.linalg.eigvalsh((middle + middle.T) / 2), 0, None)).sum()
    diff = mu1 - mu2
    return float(max(diff @ diff + np.trace(s1) + np.trace(s2) - 2 * tr_covmean, 0.0))


def fid_from_features(a: ArrayLike, b: ArrayLike) -> float:
    return frechet_distance(*feature_statistics(a), *feature_statistics(b))


def inception_score(logits: ArrayLike, splits: int = 10) -> tuple[float, float]:
    """(mean, std) over ``splits`` of exp E KL(p(y|x) ‖ p(y)); ``logits`` (N, C) are unnormalised
    (torch-fidelity's ``logits_unbiased``: the 1008-way head without its bias, as the TF original).

    The splits are consecutive slices, as in ADM's evaluator (torch-fidelity shuffles first), so the
    samples' order matters: a set sorted by class scores far lower (each split sees few classes).
    scripts/sample.py cycles the classes; give other sets in mixed order."""
    x = _f64(logits)
    n = x.shape[0]
    if not 1 <= splits <= n:
        raise ValueError(f"splits must be in [1, {n}] for {n} samples, got {splits}")
    log_p = x - x.max(1, keepdims=True)
    log_p = log_p - np.log(np.exp(log_p).sum(1, keepdims=True))
    scores = []
    for part in np.array_split(np.arange(n), splits):
        lp = log_p[part]
        log_marginal = np.log(np.exp(lp).mean(0))
        kl = (np.exp(lp) * (lp - log_marginal)).sum(1)
        scores.append(np.exp(kl.mean()))
    return float(np.mean(scores)), float(np.std(scores))


def _kth_nn_radii(x: torch.Tensor, k: int, chunk: int) -> torch.Tensor:
    radii = []
    for i in range(0, x.shape[0], chunk):
        d = torch.cdist(x[i:i + chunk], x)
        # k + 1: each point is its own nearest neighbour at distance 0
        radii.append(d.kthvalue(k + 1, dim=1).values)
    return torch.cat(radii)


def _covered(points: torch.Tensor, centres: torch.Tensor, radii: torch.Tensor, chunk: int) -> torch.Tensor:
    out = []
    for i in range(0, points.shape[0], chunk):
        d = torch.cdist(points[i:i + chunk], centres)
        out.append((d <= radii[None]).any(dim=1))
    return torch.cat(out)


def precision_recall(real: ArrayLike, fake: ArrayLike, k: int = 3, chunk: int = 4096) -> dict:
    """Improved precision and recall (k-NN manifolds, Kynkäänniemi et al. 2019)."""
    r = torch.from_numpy(_f64(real))
    f = torch.from_numpy(_f64(fake))
    if r.shape[1] != f.shape[1]:
        raise ValueError(f"feature widths differ: real {r.shape[1]}, fake {f.shape[1]}")
    if min(len(r), len(f)) <= k:
        raise ValueError(f"need more than k={k} points in each set, got real {len(r)}, fake {len(f)}")
    real_radii = _kth_nn_radii(r, k, chunk)
    fake_radii = _kth_nn_radii(f, k, chunk)
    precision = _covered(f, r, real_radii, chunk).double().mean().item()
    recall = _covered(r, f, fake_radii, chunk).double().mean().item()
    return {"precision": precision, "recall": recall}
