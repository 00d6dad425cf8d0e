"""vqlcmd-tokenize (scripts/tokenize_images.py): a JPEG tree -> shards (+ flipped copies), restartable; run as a
real script once."""
import importlib
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from image_tree import write_tree

from vqlcmd.data import TokenShardDataset, image_batches, list_images
from vqlcmd.tokenizer import load_tokenizer, small_vqmodel

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "tokenize_images.py"


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    base = tmp_path_factory.mktemp("tok")
    torch.manual_seed(0)
    small_vqmodel(channels=3, image_size=16, block_channels=(8, 16), codebook_size=16, code_dim=4,
                  groups=4).save_pretrained(str(base / "vq"))
    return write_tree(base / "images"), base / "vq", base


def _script_main():
    return importlib.import_module("vqlcmd.cli.tokenize_images").main


def test_runs_as_a_script_with_flipped_copies(setup):
    images, vq, base = setup
    out = base / "out-script"
    r = subprocess.run([sys.executable, str(SCRIPT), "--images", str(images), "--tokenizer", str(vq), "--out",
                        str(out), "--shard-size", "3", "--flip", "--backend", "dali", "--device", "cpu",
                        "--batch-size", "2"], capture_output=True, text=True, cwd=ROOT,
                       env=dict(os.environ, PYTHONWARNINGS="ignore"))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "images/s" in r.stdout
    names = sorted(p.name for p in out.iterdir())
    assert names == [f"{p}-0000{i}.vqtok" for p in ("flip", "shard") for i in range(3)]
    ds = TokenShardDataset(out)
    assert len(ds) == 14 and ds.header["class_names"] == ["ant", "cat"] and ds.header["flipped"]
    tok = load_tokenizer(vq)
    il = list_images(images)
    x = torch.cat([b for b, _ in image_batches(il, 16, 8, backend="dali")])
    want = torch.cat([tok.encode(x), tok.encode(x.flip(-1))]).reshape(14, -1)
    got, labels = ds.gather(np.arange(14))
    order = [7 + i for i in range(7)] + list(range(7))  # flip-* sorts before shard-*
    assert torch.equal(got, want[order]) and labels.tolist() == (il.labels * 2)


def test_restart_keeps_finished_shards_and_redoes_broken_ones(setup, capsys):
    images, vq, base = setup
    out = base / "out-restart"
    main = _script_main()
    argv = ["--images", str(images), "--tokenizer", str(vq), "--out", str(out), "--shard-size", "3",
            "--backend", "pil", "--device", "cpu", "--no-progress"]
    main(argv)
    first = TokenShardDataset(out).gather(np.arange(7))[0]
    kept = out / "shard-00002.vqtok"
    stamp = kept.stat().st_mtime_ns
    (out / "shard-00001.vqtok").unlink()
    data = (out / "shard-00000.vqtok").read_bytes()
    (out / "shard-00000.vqtok").write_bytes(data[:-5])  # a run killed mid-copy elsewhere
    capsys.readouterr()
    stats = main(argv)
    assert stats["shard"]["written"] == 2 and stats["shard"]["images"] == 6
    assert "keeping 1 finished" in capsys.readouterr().out
    assert kept.stat().st_mtime_ns == stamp
    assert torch.equal(TokenShardDataset(out).gather(np.arange(7))[0], first)


def test_other_tokenizers_shards_are_refused_or_overwritten_on_request(setup, tmp_path):
    """They were silently replaced: a model trained on them could then neither resume nor be decoded."""
    images, vq, base = setup
    torch.manual_seed(1)
    small_vqmodel(channels=3, image_size=16, block_channels=(8, 16), codebook_size=16, code_dim=4,
                  groups=4).save_pretrained(str(tmp_path / "vq2"))
    out = tmp_path / "out"
    main = _script_main()
    argv = ["--images", str(images), "--out", str(out), "--shard-size", "4", "--backend", "pil", "--device", "cpu",
            "--no-progress"]
    main(argv + ["--tokenizer", str(vq)])
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with pytest.raises(SystemExit, match=r"holds 2 shard\(s\) of another data set \(shard-00000\.vqtok: "
                                         r"tokenizer_id \"vqmodel-.*--overwrite"):
        main(argv + ["--tokenizer", str(tmp_path / "vq2")])
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # nothing touched
    stats = main(argv + ["--tokenizer", str(tmp_path / "vq2"), "--overwrite"])
    assert stats["shard"]["written"] == 2
    assert TokenShardDataset(out).header["tokenizer_id"] == load_tokenizer(tmp_path / "vq2").identifier


def test_another_tree_or_shard_size_is_not_mistaken_for_finished_work(setup, tmp_path):
    images, vq, base = setup
    main = _script_main()
    out = tmp_path / "out"
    argv = ["--tokenizer", str(vq), "--out", str(out), "--backend", "pil", "--device", "cpu", "--no-progress"]
    main(argv + ["--images", str(images), "--shard-size", "4"])
    # another tree of as many images: its shards used to be kept as "finished" (the same tokenizer, count
    # and classes), so the folder held the first tree's tokens under the second tree's name
    other = write_tree(tmp_path / "other", sizes=[(40 + i, 50) for i in range(7)])
    with pytest.raises(SystemExit, match=r"of another data set \(shard-00000\.vqtok: files_sha256"):
        main(argv + ["--images", str(other), "--shard-size", "4"])
    stats = main(argv + ["--images", str(other), "--shard-size", "4", "--overwrite"])
    assert stats["shard"]["written"] == 2
    tok = load_tokenizer(vq)
    x = torch.cat([b for b, _ in image_batches(list_images(other), 16, 8, backend="pil")])
    assert torch.equal(TokenShardDataset(out).gather(np.arange(7))[0], tok.encode(x).reshape(7, -1))
    # larger shards leave fewer: the old shard-00001 would be read as extra samples
    with pytest.raises(SystemExit, match=r"holds 1 shard shard\(s\) past this run's 1 \(shard-00001\.vqtok\)"):
        main(argv + ["--images", str(other), "--shard-size", "10"])


def test_a_run_without_flip_does_not_leave_another_trees_flipped_shards_unnoticed(setup, tmp_path):
    images, vq, base = setup
    main = _script_main()
    out = tmp_path / "out"
    argv = ["--tokenizer", str(vq), "--out", str(out), "--backend", "pil", "--device", "cpu", "--no-progress",
            "--shard-size", "4"]
    main(argv + ["--images", str(images), "--flip"])
    other = write_tree(tmp_path / "other", sizes=[(40 + i, 50) for i in range(7)])
    with pytest.raises(SystemExit, match=r"holds 4 shard\(s\) of another data set \(flip-00000\.vqtok: files_sha256"):
        main(argv + ["--images", str(other)])
    main(argv + ["--images", str(other), "--overwrite"])  # the other tree's flipped shards go too
    assert sorted(p.name for p in out.iterdir()) == ["shard-00000.vqtok", "shard-00001.vqtok"]


@pytest.mark.parametrize("bad", [["--shard-size", "0"], ["--batch-size", "-2"], ["--num-threads", "0"]])
def test_sizes_must_be_positive(setup, tmp_path, bad, capsys):
    images, vq, base = setup
    with pytest.raises(SystemExit):
        _script_main()(["--images", str(images), "--tokenizer", str(vq), "--out", str(tmp_path / "o"), *bad])
    assert "must be a positive integer" in capsys.readouterr().err and not (tmp_path / "o").exists()


def test_a_size_the_tokenizer_does_not_take_is_refused_up_front(setup, tmp_path):
    images, vq, base = setup
    with pytest.raises(SystemExit, match=r"--size 32: tokenizer .* takes 16x16 images"):
        _script_main()(["--images", str(images), "--tokenizer", str(vq), "--out", str(tmp_path / "o"), "--size", "32"])


def test_a_moved_tree_and_shards_from_before_the_digest_are_kept(setup, tmp_path, capsys):
    import shutil

    from vqlcmd.data.shards import open_shard, write_shard

    images, vq, base = setup
    main = _script_main()
    out = tmp_path / "out"
    argv = ["--tokenizer", str(vq), "--out", str(out), "--backend", "pil", "--device", "cpu", "--no-progress",
            "--shard-size", "4"]
    main(argv + ["--images", str(images)])
    # the same images under another mount point: the digest uses paths within the tree, so nothing is redone
    moved = shutil.copytree(images, tmp_path / "moved")
    assert main(argv + ["--images", str(moved)])["shard"]["written"] == 0
    # a shard written before the header had files_sha256 keeps the checks it was made under
    s = open_shard(out / "shard-00000.vqtok")
    header = {k: v for k, v in s.header.items() if k != "files_sha256"}
    tokens, labels = np.array(s.tokens), np.array(s.labels)
    del s  # the memory map
    write_shard(out / "shard-00000.vqtok", tokens, labels, header)
    capsys.readouterr()
    assert main(argv + ["--images", str(moved)])["shard"]["written"] == 0
    # another tree: refused, naming what differs; overwritten on request, and the log says what went (the
    # legacy shard-00000 cannot tell, and stays)
    other = write_tree(tmp_path / "other", sizes=[(40 + i, 50) for i in range(7)])
    with pytest.raises(SystemExit, match=r"holds 1 shard\(s\) of another data set \(shard-00001\.vqtok: files_sha256"):
        main(argv + ["--images", str(other)])
    assert main(argv + ["--images", str(other), "--overwrite"])["shard"]["written"] == 1
    printed = capsys.readouterr().out
    assert "deleted 1 shard(s) of another data set (overwrite)" in printed
    assert "keeping 1 finished shard shard(s), making 1" in printed


@pytest.mark.parametrize("backend", ["pil", "dali"])
def test_a_file_whose_pixels_are_cut_short_is_skipped_by_name_and_the_rest_written(setup, tmp_path, backend, capsys):
    """It passes the default header check; the run used to die decoding it (hours of ImageNet lost to one file)."""
    import shutil
    import warnings

    from image_tree import cut_pixels

    if backend == "dali":
        pytest.importorskip("nvidia.dali")
    images, vq, base = setup
    tree = shutil.copytree(images, tmp_path / "tree")
    cut_pixels(tree / "cat" / "im1.jpg", tree / "cat" / "cut.jpg")  # sorts mid-list: later shards' ranges move
    main = _script_main()
    common = ["--tokenizer", str(vq), "--shard-size", "3", "--batch-size", "2", "--backend", backend, "--device",
              "cpu", "--no-progress", "--flip"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        stats = main(["--images", str(tree), "--out", str(tmp_path / "out"), *common])
    # once: the flipped pass knows it
    assert sum("cut.jpg (cannot read: image file is truncated" in str(w.message) for w in caught) == 1
    said = capsys.readouterr().out
    assert said.count("1 skipped at decoding (cat/cut.jpg)") == 2 and "1 image(s) skipped in all" in said
    assert all(stats[p]["skipped_files"] == ["cat/cut.jpg"] and stats[p]["images"] == 7 for p in ("shard", "flip"))
    main(["--images", str(images), "--out", str(tmp_path / "clean"), *common])
    got, clean = TokenShardDataset(tmp_path / "out"), TokenShardDataset(tmp_path / "clean")
    assert len(got) == len(clean) == 14
    assert all(torch.equal(a, b) for a, b in zip(got.gather(np.arange(14)), clean.gather(np.arange(14))))
    again = main(["--images", str(tree), "--out", str(tmp_path / "out"), *common])  # the short shard is finished
    assert all(again[p]["written"] == 0 and again[p]["skipped_files"] == ["cat/cut.jpg"] for p in ("shard", "flip"))


def test_a_tree_of_which_no_image_decodes_is_an_error(setup, tmp_path):
    from image_tree import cut_pixels

    images, vq, _ = setup
    (tmp_path / "tree").mkdir()
    for name in ("a.jpg", "b.jpg"):
        cut_pixels(images / "ant" / "im0.jpg", tmp_path / "tree" / name)
    cut = r"no image of the 2 under .*tree decodes \(e\.g\. .*a\.jpg: cannot read: image file is truncated"
    with pytest.raises(SystemExit, match=cut):
        _script_main()(["--images", str(tmp_path / "tree"), "--tokenizer", str(vq), "--out", str(tmp_path / "out"),
                        "--backend", "pil", "--device", "cpu", "--no-progress"])
