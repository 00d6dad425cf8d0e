"""scripts/train.py's engine on ``data.source: "images"``: the image tree decoded (DALI), flipped and encoded every
epoch, against the shards vqlcmd-tokenize writes from the same tree; resume; bad input."""
import json
import warnings

import numpy as np
import pytest
import torch
from image_tree import SIZES, write_tree

from vqlcmd.data import TokenShardDataset, list_images
from vqlcmd.data.online import OnlineTokenLoader
from vqlcmd.engine.config import ConfigError
from vqlcmd.engine.config_file import load_config
from vqlcmd.engine.distributed import data_identity
from vqlcmd.engine.trainer import Trainer
from vqlcmd.tokenizer import load_tokenizer, small_vqmodel

KEYS = ("loss", "l0", "l_dm", "l_cm")
CLASSES = ("ant", "bee", "cat", "dog")  # the tiny preset's 4 classes
N = 28  # 3 batches of 8 per epoch (4 images left over: drop_last)


@pytest.fixture(scope="module")
def data(tmp_path_factory, load_script):
    """A 4-class JPEG tree, a 16-code tokenizer fitting the tiny preset (16 px -> 4x4 tokens), and the shards
    vqlcmd-tokenize writes from them: plain, and with --flip."""
    base = tmp_path_factory.mktemp("online_train")
    tree = write_tree(base / "images", classes=CLASSES, sizes=(SIZES * 4)[:N])
    torch.manual_seed(0)
    small_vqmodel(channels=3, image_size=16, block_channels=(8, 8, 8), codebook_size=16, code_dim=4,
                  groups=4).save_pretrained(str(base / "tok"))
    from vqlcmd.cli.tokenize_images import main as tokenize
    for out, extra in (("shards", []), ("shards-flip", ["--flip"])):
        tokenize(["--images", str(tree), "--tokenizer", str(base / "tok"), "--out", str(base / out), "--backend",
                  "dali", "--device", "cpu", "--batch-size", "5", "--no-progress", *extra])
    return base


def _config(path, base, source, steps=3, images=None, **data):
    src = ({"shards": str(base / "shards")} if source == "shards"
           else {"source": "images", "images": str(images or base / "images")})
    cfg = {"train_micro_batch_size_per_gpu": 8, "gradient_clipping": 1.0, "zero_optimization": {"stage": 2},
           "vqlcmd": {"model": {"preset": "tiny"}, "data": {**src, "tokenizer": str(base / "tok"), **data},
                      "optimizer": {"lr": 3e-3, "warmup_steps": 1},
                      "train": {"steps": steps, "output_dir": str(path / "run"), "log_every": 1, "sample_every": 0,
                                "checkpoint_every": 0}}}
    path.mkdir(parents=True, exist_ok=True)
    (path / "cfg.json").write_text(json.dumps(cfg))
    return path / "cfg.json"


def _trainer(cfg_path, log=lambda *a, **k: None):
    ds, cfg = load_config(str(cfg_path))
    return Trainer(ds, cfg, log=log)


def test_a_step_from_images_equals_one_from_the_shards_tokenize_wrote(data, tmp_path):
    """Flips off in both: vqlcmd-tokenize --flip writes the mirrored copies as extra samples (2N per epoch), online
    mode mirrors each sample or not per epoch (N per epoch), so with flips on the two do not train on the same
    batches; the flips themselves are compared exactly in the next test."""
    shards = _trainer(_config(tmp_path / "s", data, "shards", steps=4))
    a = shards.train(progress=False)  # (before the next trainer seeds the global generator: attention dropout)
    images = _trainer(_config(tmp_path / "i", data, "images", steps=4))
    b = images.train(progress=False)
    assert type(images.loader).__name__ == "OnlineTokenLoader" and type(shards.loader).__name__ == "ShardLoader"
    # the same data to a resume: without flips the two sources are one data set
    assert data_identity(images.header) == data_identity(shards.header)
    assert len(a) == len(b) == 4  # into the second epoch
    for x, y in zip(a, b):
        for k in KEYS:
            assert x[k] == y[k], (x["step"], k)
    assert a[0]["loss"] != a[-1]["loss"]


def test_online_flips_are_the_shards_flipped_copies(data):
    """With flips on, each online batch is the shards' plain or flipped copy of its samples, as the loader's coins
    say, in ShardLoader's order: the same decode, mirror and encode as vqlcmd-tokenize --flip."""
    ds = TokenShardDataset(data / "shards-flip")
    assert len(ds) == 2 * N  # flip-* (0..N-1) sorts before shard-* (N..2N-1)
    tok = load_tokenizer(data / "tok")
    loader = OnlineTokenLoader(list_images(data / "images"), tok, 8, seed=4, flip=True, backend="dali")
    for epoch in range(2):
        coins = loader.flip_coins(epoch)
        order = loader._order.epoch_indices(epoch)[:24]
        got = [b for b in loader]
        want, labels = ds.gather(np.where(coins[order], order, order + N))
        assert torch.equal(torch.cat([t for t, _ in got]), want)
        assert torch.equal(torch.cat([y for _, y in got]), labels)
        assert 0 < coins[order].sum() < 24
    assert (loader.flip_coins(0) != loader.flip_coins(1)).any()  # fresh each epoch


def test_online_resume_mid_epoch_gives_the_same_losses(data, tmp_path):
    """Flips on: the coins come from (seed, epoch, sample), so a resume draws the ones the straight run drew."""
    straight = _trainer(_config(tmp_path / "a", data, "images", steps=5, flip=True)).train(progress=False)
    part1 = _trainer(_config(tmp_path / "b", data, "images", steps=5, flip=True)).train(progress=False, until=2)
    resumed = _trainer(_config(tmp_path / "b", data, "images", steps=5, flip=True))
    assert resumed.loader.state_dict()["position"] == 0  # (loaded in train())
    part2 = resumed.train(progress=False)
    assert resumed.loader.epoch == 1 and resumed.loader.state_dict()["position"] == 2  # 2 of epoch 0's 3 at step 2
    assert [h["step"] for h in part1 + part2] == [1, 2, 3, 4, 5]
    for x, y in zip(straight, part1 + part2):
        for k in KEYS:
            assert x[k] == pytest.approx(y[k], rel=1e-6, abs=1e-7), (x["step"], k)


def test_resuming_on_another_image_tree_is_refused(data, tmp_path):
    import shutil

    tree = shutil.copytree(data / "images", tmp_path / "tree")
    _trainer(_config(tmp_path, data, "images", steps=4, images=tree)).train(progress=False, until=2)
    saved = sorted((tmp_path / "run" / "checkpoints").iterdir())
    (tree / "cat" / "im2.jpg").write_bytes((tree / "ant" / "im0.jpg").read_bytes())  # a picture replaced
    with pytest.raises(ConfigError,
                       match=r"step_0000002 was trained on other data \(token shards or image tree\): .*files_sha256"):
        _trainer(_config(tmp_path, data, "images", steps=4, images=tree))
    assert sorted((tmp_path / "run" / "checkpoints").iterdir()) == saved  # nothing touched


def test_a_codebook_size_that_disagrees_is_refused(data, tmp_path):
    cfg = _config(tmp_path / "a", data, "images")
    raw = json.loads(cfg.read_text())
    raw["vqlcmd"]["model"]["overrides"] = {"codebook_size": 32}
    cfg.write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match=r"overrides\.codebook_size=32 but the images under .*images \(encoded by "
                                          r"tokenizer .*tok\) hold codebook_size=16"):
        _trainer(cfg)
    torch.manual_seed(0)
    small_vqmodel(channels=3, image_size=16, block_channels=(8, 8, 8), codebook_size=32, code_dim=4,
                  groups=4).save_pretrained(str(tmp_path / "tok32"))
    cfg = _config(tmp_path / "b", data, "shards", tokenizer=str(tmp_path / "tok32"))
    with pytest.raises(ConfigError, match=r"tok32 has codebook_size 32 but the shards in .*shards hold "
                                          r"codebook_size=16"):
        _trainer(cfg)
    assert not (tmp_path / "b" / "run").exists()


def test_unreadable_images_are_skipped_by_name_counted_and_training_goes_on(data, tmp_path):
    import shutil

    tree = shutil.copytree(data / "images", tmp_path / "tree")
    (tree / "ant" / "zero.jpg").write_bytes(b"")  # found by the listing (header check)
    good = (tree / "ant" / "im0.jpg").read_bytes()
    (tree / "bee" / "cut.jpg").write_bytes(good[:len(good) // 2])  # header fine, pixels cut short: found decoding
    logs = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tr = _trainer(_config(tmp_path, data, "images", steps=7, images=tree), log=logs.append)
        history = tr.train(progress=False)
    said = " ".join(str(w.message) for w in caught)
    assert "zero.jpg (empty file)" in said and "cut.jpg (cannot read: image file is truncated" in said
    assert any("1 unreadable skipped" in m and "zero.jpg" in m for m in logs)
    assert [f.rsplit("/", 1)[-1] for f, _ in tr.loader.skipped] == ["zero.jpg", "cut.jpg"]
    assert len(history) == 7 and all(np.isfinite(h["loss"]) for h in history)


@pytest.mark.parametrize("data_section, match", [
    ({"source": "images", "images": "x"}, r"source 'images' needs images .* and tokenizer"),
    ({"source": "images", "images": "x", "tokenizer": "t", "shards": "s"},
     r"source 'images' reads images, not shards: remove that key \(--set data.shards=null\)"),
    ({"shards": "s", "flip": True}, r"flip is read with source 'images' only"),
    ({"source": "tokens"}, r"source must be one of shards, images, got 'tokens'"),
])
def test_data_section_errors(data_section, match):
    from vqlcmd.engine.config_file import parse_vqlcmd_section

    with pytest.raises(ConfigError, match=r"vqlcmd\.data: " + match):
        parse_vqlcmd_section({"data": data_section})


def test_a_missing_image_tree_is_named(tmp_path, data):
    with pytest.raises(ConfigError, match=r"vqlcmd\.data\.images: image folder .*nowhere does not exist"):
        _trainer(_config(tmp_path, data, "images", images=tmp_path / "nowhere"))


def test_scripts_train_switches_to_images_with_set(data, tmp_path, load_script):
    """The user's path: a shards config switched to the image tree on the command line."""
    cfg = _config(tmp_path, data, "shards", steps=2)
    code = load_script("train").main(["--config", str(cfg), "--no-progress", "--set", "data.source=images",
                                      "--set", f"data.images={data / 'images'}", "--set", "data.shards=null",
                                      "--set", "data.flip=true"])
    assert code == 0
    saved = json.loads((tmp_path / "run" / "checkpoints" / "step_0000002" / "config.json").read_text())
    assert saved["vqlcmd"]["data"]["source"] == "images" and saved["data"]["random_flip"] is True
    assert saved["data"]["files_sha256"] == list_images(data / "images").digest()


@pytest.mark.gpu
def test_online_batches_on_cuda_follow_the_cpu_loader(data):
    """DALI's mixed (GPU) decoder and the encode on the device: same order, labels and flips as on the CPU; the
    tokens may differ a little (nvJPEG and libjpeg-turbo round differently), not wholesale."""
    tok = load_tokenizer(data / "tok")
    il = list_images(data / "images")
    cpu = list(OnlineTokenLoader(il, tok, 8, seed=2, flip=True, backend="dali"))
    gpu = list(OnlineTokenLoader(il, load_tokenizer(data / "tok"), 8, seed=2, flip=True, backend="dali",
                                 device=torch.device("cuda")))
    assert all(t.device.type == "cuda" and y.device.type == "cuda" for t, y in gpu)
    assert torch.equal(torch.cat([y for _, y in cpu]), torch.cat([y for _, y in gpu]).cpu())
    same = (torch.cat([t for t, _ in cpu]) == torch.cat([t for t, _ in gpu]).cpu()).float().mean().item()
    assert same > 0.8, same


@pytest.mark.slow  # two 2-rank launches: 1-3 minutes on 2 cores
def test_two_ranks_from_images_train_the_weights_two_ranks_from_shards_do(data, tmp_path):
    """The rank split through the trainer under the deepspeed launcher (gloo): each rank's online share is its
    ShardLoader share, so both runs export the same weights."""
    import os
    import shutil
    import subprocess
    from pathlib import Path

    from safetensors.torch import load_file

    from vqlcmd.engine.distributed import free_port

    repo = Path(__file__).resolve().parents[2]
    weights = {}
    for source in ("shards", "images"):
        cfg = _config(tmp_path / source, data, source, steps=3)
        raw = json.loads(cfg.read_text())
        raw["train_micro_batch_size_per_gpu"] = 4  # 3 batches of 4 per rank per epoch: 4 images left out
        cfg.write_text(json.dumps(raw))
        proc = subprocess.run([shutil.which("deepspeed"), "--master_port", str(free_port()), "--num_gpus", "2",
                               "scripts/train.py", "--config", str(cfg), "--no-progress"], cwd=repo,
                              capture_output=True, text=True, timeout=900, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        weights[source] = load_file(tmp_path / source / "run" / "pipeline" / "model.safetensors")
    assert weights["shards"].keys() == weights["images"].keys()
    for k, v in weights["shards"].items():
        assert torch.equal(v, weights["images"][k]), k
