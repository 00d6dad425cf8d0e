"""The embedded digits data set: images, and prepare_digits end to end with a few training steps."""
import numpy as np
import pytest
import torch

from vqlcmd.data import ShardLoader, TokenShardDataset, digits_images, prepare_digits
from vqlcmd.tokenizer import load_tokenizer, psnr


def test_digits_images():
    x, y = digits_images(32)
    assert x.shape == (1797, 1, 32, 32) and x.dtype == torch.float32
    assert x.min() >= -1 and x.max() <= 1 and x.min() == -1
    assert y.shape == (1797,) and y.dtype == torch.int64 and set(y.tolist()) == set(range(10))
    assert digits_images(16)[0].shape == (1797, 1, 16, 16)


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache")
    logs = []
    info = prepare_digits(cache, steps=3, progress=False, log=logs.append)
    return cache, info, logs


def test_prepare_digits_writes_what_the_engine_expects(prepared):
    _, info, _ = prepared
    ds = TokenShardDataset(info["shards"])
    h = ds.header
    assert len(ds) == 1797 and ds.seq_len == 64
    assert h["codebook_size"] == 128 and h["grid"] == [8, 8] and h["num_classes"] == 10
    assert h["class_names"] == [str(i) for i in range(10)] and h["tokenizer_id"] == info["tokenizer_id"]
    tok = load_tokenizer(info["tokenizer"])
    assert tok.identifier == h["tokenizer_id"] and tok.codebook_size == 128 and tok.grid == (8, 8)
    assert 1 <= info["codebook_usage"] <= 128 and np.isfinite(info["psnr"])
    tokens, labels = next(iter(ShardLoader(ds, 16)))
    assert tokens.shape == (16, 64) and labels.max() < 10


def test_round_trip_psnr_matches_the_reported_figure(prepared):
    _, info, _ = prepared
    ds = TokenShardDataset(info["shards"])
    tok = load_tokenizer(info["tokenizer"])
    images, labels = digits_images(32)
    tokens, stored_labels = ds.gather(np.arange(len(ds)))
    assert torch.equal(stored_labels, labels)  # shards keep the data set's order
    assert psnr(tok.decode(tokens), images) == pytest.approx(info["psnr"], abs=1e-3)


def test_prepare_again_reuses_the_cache(prepared):
    cache, info, _ = prepared
    logs = []
    again = prepare_digits(cache, steps=3, progress=False, log=logs.append)
    assert any("reusing tokenizer" in m for m in logs)
    assert again["tokenizer_id"] == info["tokenizer_id"] and again["shards"] == info["shards"]


def test_cache_is_keyed_by_the_tokenizer_batch(prepared):
    """Batch 64 keeps the folder name older caches used; another batch trains (and caches) its own."""
    cache, info, _ = prepared
    assert info["tokenizer"].endswith("tokenizer-32px-3steps-seed0")
    logs = []
    other = prepare_digits(cache, steps=3, batch_size=8, progress=False, log=logs.append)
    assert other["tokenizer"].endswith("tokenizer-32px-3steps-b8-seed0")
    assert not any("reusing tokenizer" in m for m in logs)
    assert other["tokenizer_id"] != info["tokenizer_id"]
