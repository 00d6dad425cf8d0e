import json

import numpy as np
import pytest

from vqlcmd.data.shards import write_shard


@pytest.fixture
def tiny_shards(tmp_path):
    """Token shards fitting the 'tiny' preset (K=16, 4x4 tokens, 4 classes), with class structure."""
    return _tiny_shards(tmp_path / "shards")


@pytest.fixture(scope="module")
def tiny_shards_module(tmp_path_factory):
    """``tiny_shards`` once per module: for a reference run that several tests compare with."""
    return _tiny_shards(tmp_path_factory.mktemp("shards") / "shards")


def _tiny_shards(folder):
    rng = np.random.default_rng(0)
    patterns = rng.integers(0, 16, (4, 16))
    labels = rng.integers(0, 4, 96)
    tokens = patterns[labels]
    noise = rng.random(tokens.shape) < 0.1
    tokens = np.where(noise, rng.integers(0, 16, tokens.shape), tokens)
    header = {"codebook_size": 16, "grid": [4, 4], "tokenizer_id": "synthetic-test", "num_classes": 4,
              "class_names": ["a", "b", "c", "d"]}
    write_shard(folder / "shard_00000.vqtok", tokens[:64], labels[:64], header)
    write_shard(folder / "shard_00001.vqtok", tokens[64:], labels[64:], header)
    return folder


def _make_config(tmp_path, shards, **train):
    cfg = {
        "train_micro_batch_size_per_gpu": 8,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": 2},
        "vqlcmd": {
            "model": {"preset": "tiny"},
            "data": {"shards": str(shards)},
            "optimizer": {"lr": 3e-3, "warmup_steps": 2},
            "train": {"steps": 6, "output_dir": str(tmp_path / "run"), "log_every": 2, "sample_every": 0,
                      "checkpoint_every": 0, **train},
        },
    }
    path = tmp_path / "cfg.json"
    tmp_path.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(cfg))
    return path


@pytest.fixture
def make_config():
    """make_config(tmp_path, shards, **train_overrides) -> path of a tiny-preset config file."""
    return _make_config
