"""Digits metrics on sets whose verdict is known: the real digits, collapsed copies, noise."""
import numpy as np
import pytest
import torch

from vqlcmd.data.digits import digits_images
from vqlcmd.metrics.digits import evaluate_digit_samples, real_reference


@pytest.fixture(scope="module")
def real():
    images, labels = digits_images(32)
    return (images + 1) / 2, labels


def test_real_digits_score_as_the_data(real):
    images, labels = real
    m = evaluate_digit_samples(images, labels)
    assert m["accuracy"] > 0.99
    assert m["spread_ratio"] == pytest.approx(1.0)
    assert m["fid"] == pytest.approx(0.0, abs=1e-6)
    assert m["precision"] == 1.0 and m["recall"] == 1.0


def test_collapsed_samples_are_accurate_and_precise_but_have_no_recall(real):
    images, labels = real
    # one real image per class, repeated: what an over-guided model draws
    first = torch.stack([torch.nonzero(labels == c)[0, 0] for c in range(10)])
    idx = first.repeat_interleave(30)
    m = evaluate_digit_samples(images[idx], labels[idx])
    assert m["accuracy"] >= 0.9  # the SVC misreads one of these ten training digits
    assert m["spread_ratio"] < 0.01
    assert m["precision"] == 1.0
    assert m["recall"] < 0.2
    assert m["fid"] > 1.0


def test_noise_is_far_from_the_digits(real):
    g = torch.Generator().manual_seed(0)
    noise = torch.rand(300, 1, 32, 32, generator=g)
    m = evaluate_digit_samples(noise, torch.arange(300) % 10)
    assert m["accuracy"] < 0.3
    assert m["precision"] < 0.1
    assert m["fid"] > 10 * real_reference()["fid"]


def test_unconditional_samples_and_the_finite_sample_floor(real):
    images, labels = real
    m = evaluate_digit_samples(images[::3], None)
    assert "accuracy" not in m and m["precision"] == 1.0
    ref = real_reference()
    # disjoint halves of the real digits: small but non-zero FID, high precision and recall
    assert 0 < ref["fid"] < m["fid"] + 1.0
    assert ref["precision"] > 0.8 and ref["recall"] > 0.8
    with pytest.raises(ValueError, match="labels"):
        evaluate_digit_samples(images[:5], labels[:4])
    with pytest.raises(ValueError, match=r"digit labels must be in \[0, 9\], got \[40\]"):
        evaluate_digit_samples(images[:2], torch.tensor([3, 40]))
    assert np.isfinite(ref["fid"])


@pytest.mark.parametrize("n", [5, 895])
def test_real_reference_at_sample_counts_a_stratified_split_cannot_take(n):
    # fewer digits than classes on either side of the split: train_test_split(stratify=...) raised
    assert real_reference(16, n=n)["num_samples"] == n
