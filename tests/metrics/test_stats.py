"""Metric math against independent computations: scipy's sqrtm for FID, closed forms for IS and for
precision/recall on point clouds whose k-NN balls can be counted by hand."""
import numpy as np
import pytest
import scipy.linalg
import torch

from vqlcmd.metrics.stats import (feature_statistics, fid_from_features, frechet_distance, inception_score,
                                  precision_recall)


def _scipy_fid(mu1, s1, mu2, s2):
    # the formula of the reference implementations (pytorch-fid, ADM evaluator), built on scipy's sqrtm
    covmean = scipy.linalg.sqrtm(s1 @ s2)
    covmean = covmean.real if np.iscomplexobj(covmean) else covmean
    d = mu1 - mu2
    return d @ d + np.trace(s1) + np.trace(s2) - 2 * np.trace(covmean)


def test_fid_of_a_set_against_itself_is_zero():
    x = np.random.default_rng(0).normal(size=(500, 16)) @ np.random.default_rng(1).normal(size=(16, 16))
    assert fid_from_features(x, x) == pytest.approx(0.0, abs=1e-7)


@pytest.mark.parametrize("dim", [1, 7, 32])
def test_fid_between_gaussian_sets_matches_scipy_sqrtm(dim):
    rng = np.random.default_rng(dim)
    a = rng.normal(size=(800, dim)) @ rng.normal(size=(dim, dim))
    b = 0.7 * rng.normal(size=(600, dim)) @ rng.normal(size=(dim, dim)) + rng.normal(size=dim)
    mu1, s1 = feature_statistics(a)
    mu2, s2 = feature_statistics(b)
    assert s1.shape == (dim, dim)
    np.testing.assert_allclose(s1, np.cov(a, rowvar=False).reshape(dim, dim))
    ours = frechet_distance(mu1, s1, mu2, s2)
    assert ours > 0.1
    assert ours == pytest.approx(_scipy_fid(mu1, s1, mu2, s2), rel=1e-6)
    assert fid_from_features(torch.from_numpy(a).float(), b) == pytest.approx(ours, rel=1e-4)


def test_fid_of_known_gaussians_has_the_closed_form():
    # N(0, I) vs N(m, c² I) in d dims: ‖m‖² + d (1 − c)²
    d, c = 5, 3.0
    m = np.arange(d, dtype=float)
    assert frechet_distance(np.zeros(d), np.eye(d), m, c * c * np.eye(d)) == pytest.approx(m @ m + d * (1 - c) ** 2)


def test_fid_handles_rank_deficient_covariances():
    # fewer samples than features: singular Σ, where sqrtm of the product is ill-conditioned
    rng = np.random.default_rng(3)
    a, b = rng.normal(size=(10, 40)), rng.normal(size=(12, 40)) + 0.5
    value = fid_from_features(a, b)
    assert np.isfinite(value) and value > 0
    assert value == pytest.approx(_scipy_fid(*feature_statistics(a), *feature_statistics(b)), rel=1e-3)


def test_fid_rejects_mismatched_statistics():
    with pytest.raises(ValueError, match="do not match"):
        frechet_distance(np.zeros(3), np.eye(3), np.zeros(4), np.eye(4))
    with pytest.raises(ValueError, match="NaN"):
        feature_statistics(np.full((4, 2), np.nan))


def test_inception_score_closed_forms():
    C = 10
    # confident and spread evenly over C classes: IS = C; all uniform: IS = 1
    confident = np.full((200, C), -30.0)
    confident[np.arange(200), np.arange(200) % C] = 30.0
    mean, std = inception_score(confident, splits=4)
    assert mean == pytest.approx(C, rel=1e-6) and std == pytest.approx(0, abs=1e-6)
    assert inception_score(np.zeros((50, C)), splits=1)[0] == pytest.approx(1.0)
    # confident but all the same class: no variety, IS = 1
    assert inception_score(np.tile(confident[:1], (40, 1)), splits=2)[0] == pytest.approx(1.0)


def test_inception_score_matches_an_independent_computation():
    from scipy.special import softmax
    from scipy.stats import entropy

    logits = np.random.default_rng(4).normal(scale=3, size=(300, 20))
    p = softmax(logits, axis=1)
    expected = []
    for part in np.array_split(p, 3):
        py = part.mean(0)
        expected.append(np.exp(np.mean([entropy(row, py) for row in part])))
    mean, std = inception_score(logits, splits=3)
    assert mean == pytest.approx(np.mean(expected), rel=1e-9)
    assert std == pytest.approx(np.std(expected), rel=1e-6)


def _line(lo, hi):
    x = np.arange(lo, hi, dtype=float)
    return np.stack([x, np.zeros_like(x)], 1)


def test_precision_recall_on_a_line_counted_by_hand():
    # real: 0..99 on a line; k = 3 radius is 2 inside, 3 at the ends
    real = _line(0, 100)
    assert precision_recall(real, real) == {"precision": 1.0, "recall": 1.0}
    # fake: 0..49, all inside the real manifold; their balls (radius 2, 3 at 0 and 49) cover reals 0..52
    pr = precision_recall(real, _line(0, 50), k=3)
    assert pr["precision"] == 1.0
    assert pr["recall"] == pytest.approx(53 / 100)


def test_precision_recall_far_and_mixed_clouds():
    rng = np.random.default_rng(5)
    real = rng.normal(size=(300, 8))
    far = rng.normal(size=(200, 8)) + 100.0
    assert precision_recall(real, far) == {"precision": 0.0, "recall": 0.0}
    # half of the fake set is copies of real points (inside), half far away (outside)
    mixed = np.concatenate([real[:100], far[:100]])
    pr = precision_recall(real, mixed)
    assert pr["precision"] == pytest.approx(0.5)
    # a mode-collapsed fake set (all near one real point) is precise but has almost no recall
    collapsed = real[:1] + 1e-3 * rng.normal(size=(50, 8))
    pr = precision_recall(real, collapsed)
    assert pr["precision"] == 1.0 and pr["recall"] < 0.05


def test_precision_recall_matches_brute_force():
    rng = np.random.default_rng(6)
    real, fake = rng.normal(size=(120, 3)), rng.normal(size=(90, 3)) * 1.5 + 0.3

    def brute(a, b, k):
        daa = np.linalg.norm(a[:, None] - a[None], axis=-1)
        radii = np.sort(daa, axis=1)[:, k]
        dba = np.linalg.norm(b[:, None] - a[None], axis=-1)
        return float((dba <= radii[None]).any(1).mean())

    pr = precision_recall(real, fake, k=3, chunk=7)  # odd chunk: the batching must not matter
    assert pr["precision"] == pytest.approx(brute(real, fake, 3))
    assert pr["recall"] == pytest.approx(brute(fake, real, 3))
