"""scripts/evaluate.py: digits mode on real digits, Inception mode with weights the test makes (random,
but in torch-fidelity's file format: conftest.py), and the errors for missing weights."""
import importlib
import json

import numpy as np
import pytest
import torch


@pytest.fixture(scope="module")
def evaluate():
    return importlib.import_module("vqlcmd.cli.evaluate")


def _write_pngs(folder, images):
    from PIL import Image

    folder.mkdir(parents=True)
    for i, a in enumerate(images):
        Image.fromarray(a).save(folder / f"{i:06d}.png")


def test_digits_mode_on_real_digits(evaluate, tmp_path, capsys):
    from vqlcmd.data.digits import digits_images

    images, labels = digits_images(32)
    idx = np.arange(0, 1797, 6)
    arr = ((images[idx, 0] + 1) / 2 * 255).round().to(torch.uint8).numpy()
    _write_pngs(tmp_path / "s", arr)
    (tmp_path / "s" / "manifest.json").write_text(json.dumps({"class_labels": labels[idx].tolist()}))
    assert evaluate.main([str(tmp_path / "s"), "--digits", "--json", str(tmp_path / "r.json")]) == 0
    r = json.loads((tmp_path / "r.json").read_text())
    assert r["num_samples"] == len(idx) and r["accuracy"] > 0.97
    assert r["real_halves"]["num_samples"] == len(idx)  # the floor at this many samples (it was 899 always)
    assert r["precision"] > 0.97 and r["fid"] < 2 * r["real_halves"]["fid"] + 0.5
    # the same set as an ADM-layout npz (grey repeated to RGB, labels in arr_1)
    np.savez(tmp_path / "s.npz", arr_0=np.repeat(arr[..., None], 3, -1), arr_1=labels[idx].numpy())
    evaluate.main([str(tmp_path / "s.npz"), "--digits", "--json", str(tmp_path / "r2.json")])
    r2 = json.loads((tmp_path / "r2.json").read_text())
    assert r2["accuracy"] == pytest.approx(r["accuracy"]) and r2["fid"] == pytest.approx(r["fid"], rel=1e-6)
    # NCHW scores the same; it lost its width axis (accuracy 0.7%), and a float array in [0, 1] was divided
    # by 255 again (10%), both with exit 0
    np.savez(tmp_path / "nchw.npz", arr_0=arr[:, None], arr_1=labels[idx].numpy())
    evaluate.main([str(tmp_path / "nchw.npz"), "--digits", "--json", str(tmp_path / "r3.json")])
    assert json.loads((tmp_path / "r3.json").read_text())["accuracy"] == pytest.approx(r["accuracy"])
    np.savez(tmp_path / "float.npz", arr_0=arr[..., None] / 255.0, arr_1=labels[idx].numpy())
    with pytest.raises(SystemExit, match=r"float\.npz: images must be uint8"):
        evaluate.main([str(tmp_path / "float.npz"), "--digits"])
    np.savez(tmp_path / "grey.npz", arr_0=arr, arr_1=labels[idx].numpy())  # (N, H, W)
    evaluate.main([str(tmp_path / "grey.npz"), "--digits", "--json", str(tmp_path / "r4.json")])
    assert json.loads((tmp_path / "r4.json").read_text())["accuracy"] == pytest.approx(r["accuracy"])


def test_inception_metrics_on_given_features():
    from vqlcmd.metrics.inception import inception_metrics
    from vqlcmd.metrics.stats import feature_statistics, fid_from_features

    rng = np.random.default_rng(1)
    fake = {"pool": rng.normal(size=(60, 5)), "logits": rng.normal(size=(60, 7))}
    ref = {"pool": rng.normal(size=(80, 5)) + 0.3}
    r = inception_metrics(fake, ref, splits=3)
    assert r["fid"] == pytest.approx(fid_from_features(ref["pool"], fake["pool"]))
    assert set(r) == {"num_samples", "fid", "is", "is_std", "precision", "recall"}
    mu, sigma = feature_statistics(ref["pool"])
    assert inception_metrics(fake, {"mu": mu, "sigma": sigma}, metrics=("fid",))["fid"] == pytest.approx(r["fid"])
    with pytest.raises(ValueError, match="precision/recall need the reference's features"):
        inception_metrics(fake, {"mu": mu, "sigma": sigma})


@pytest.mark.slow  # Inception-v3 at 299x299 on CPU: ~4 min on the shared 2-core machine
def test_inception_mode_fid_is_pr(evaluate, inception_weights, tmp_path):
    rng = np.random.default_rng(0)
    samples = rng.integers(0, 256, (8, 24, 24, 3), dtype=np.uint8)
    other = np.clip(samples.astype(int) // 2 + 100, 0, 255).astype(np.uint8)
    np.savez(tmp_path / "samples.npz", arr_0=samples)
    _write_pngs(tmp_path / "same", samples)
    np.savez(tmp_path / "other.npz", arr_0=other)
    w = ["--inception-weights", str(inception_weights), "--any-inception-weights", "--splits", "2", "--batch-size", "8"]
    evaluate.main([str(tmp_path / "samples.npz"), "--ref", str(tmp_path / "same"), *w, "--json",
                   str(tmp_path / "same.json"), "--save-ref", str(tmp_path / "stats.npz")])
    same = json.loads((tmp_path / "same.json").read_text())
    assert same["fid"] == pytest.approx(0.0, abs=1e-3)
    assert same["precision"] == 1.0 and same["recall"] == 1.0
    assert same["is"] >= 1.0 and same["num_samples"] == 8
    evaluate.main([str(tmp_path / "other.npz"), "--ref", str(tmp_path / "stats.npz"), *w, "--json",
                   str(tmp_path / "other.json")])
    other_r = json.loads((tmp_path / "other.json").read_text())
    assert other_r["fid"] > 1e-3
    # statistics saved from the reference give the same FID as its images
    evaluate.main([str(tmp_path / "other.npz"), "--ref", str(tmp_path / "same"), *w, "--json",
                   str(tmp_path / "other2.json"), "--metrics", "fid"])
    assert json.loads((tmp_path / "other2.json").read_text())["fid"] == pytest.approx(other_r["fid"], rel=1e-5)


def test_a_class_folder_tree_of_other_sizes_is_a_reference(evaluate, inception_weights, tmp_path, capsys):
    """The user's own training tree: "no .png files" at its top, "images of different sizes" in a class. It
    is read as vqlcmd-tokenize reads it, at the samples' size (the same pixels where sizes agree)."""
    from PIL import Image

    rng = np.random.default_rng(1)
    samples = rng.integers(0, 256, (8, 24, 24, 3), dtype=np.uint8)
    np.savez(tmp_path / "samples.npz", arr_0=samples)
    for i, a in enumerate(samples):  # two classes, and one image at another size
        folder = tmp_path / "tree" / "ab"[i % 2]
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(a).save(folder / f"{i}.png")
    Image.fromarray(samples[0]).resize((48, 60)).save(tmp_path / "tree" / "a" / "big.png")
    w = ["--inception-weights", str(inception_weights), "--any-inception-weights", "--splits", "2", "--batch-size", "8"]
    evaluate.main([str(tmp_path / "samples.npz"), "--ref", str(tmp_path / "tree"), *w, "--json",
                   str(tmp_path / "r.json"), "--metrics", "fid,pr"])
    assert "read as an image tree, each image resized and centre-cropped to the samples' 24x24" in \
        capsys.readouterr().err
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["num_samples"] == 8 and result["precision"] == 1.0  # every sample is one of the tree's images
    x = torch.as_tensor(np.concatenate(list(evaluate.tree_batches(tmp_path / "tree", (24, 24), 4))))
    assert x.shape == (9, 24, 24, 3)
    exact = [i for i in range(9) if any(torch.equal(x[i], torch.as_tensor(a)) for a in samples)]
    assert len(exact) == 8  # same-size images come through untouched; the big one is resized


def test_missing_weights_name_the_file(evaluate, tmp_path, monkeypatch):
    np.savez(tmp_path / "s.npz", arr_0=np.zeros((2, 8, 8, 3), np.uint8))
    monkeypatch.delenv("VQLCMD_INCEPTION_WEIGHTS", raising=False)
    with pytest.raises(SystemExit, match="weights-inception-2015-12-05-6726825d.pth"):
        evaluate.main([str(tmp_path / "s.npz"), "--metrics", "is"])
    with pytest.raises(SystemExit, match=r"nowhere\.pth does not exist"):
        evaluate.main([str(tmp_path / "s.npz"), "--metrics", "is", "--inception-weights", str(tmp_path / "nowhere.pth")])
    with pytest.raises(SystemExit, match="need --ref"):
        evaluate.main([str(tmp_path / "s.npz"), "--inception-weights", str(tmp_path / "nowhere.pth")])


def test_missing_inputs_are_named(evaluate, tmp_path):
    with pytest.raises(SystemExit, match=r"samples: .*nowhere does not exist"):
        evaluate.main([str(tmp_path / "nowhere"), "--digits"])
    np.savez(tmp_path / "s.npz", arr_0=np.zeros((2, 8, 8, 3), np.uint8))
    with pytest.raises(SystemExit, match=r"--ref: .*gone\.npz does not exist"):
        evaluate.main([str(tmp_path / "s.npz"), "--ref", str(tmp_path / "gone.npz")])



def test_bad_inputs_are_refused_before_any_image_is_encoded(evaluate, tmp_path, capsys):
    from PIL import Image

    np.savez(tmp_path / "s.npz", arr_0=np.zeros((2, 8, 8, 3), np.uint8))
    np.savez(tmp_path / "stats.npz", mu=np.zeros(4), sigma=np.eye(4))
    weights = ["--inception-weights", str(tmp_path / "nowhere.pth")]  # never reached
    # statistics without features: precision/recall failed only after every sample was encoded
    with pytest.raises(SystemExit, match="holds mu/sigma only: precision/recall need its pool features"):
        evaluate.main([str(tmp_path / "s.npz"), "--ref", str(tmp_path / "stats.npz"), *weights])
    (tmp_path / "notzip.npz").write_bytes(b"garbage")
    (tmp_path / "empty.npz").write_bytes(b"")
    (tmp_path / "cut.npz").write_bytes((tmp_path / "s.npz").read_bytes()[:100])
    for bad in ("notzip", "empty", "cut"):  # as the reference, and as the samples
        with pytest.raises(SystemExit, match=f"{bad}.npz: not a readable .npz"):
            evaluate.main([str(tmp_path / "s.npz"), "--ref", str(tmp_path / f"{bad}.npz"), *weights])
        with pytest.raises(SystemExit, match=f"{bad}.npz: not a readable .npz"):
            evaluate.main([str(tmp_path / f"{bad}.npz"), "--digits"])
    for flag, value in (("--k", "0"), ("--splits", "0"), ("--batch-size", "0"), ("--metrics", "fid,kid")):
        with pytest.raises(SystemExit) as exc:  # k = 0 gave precision and recall of 0 with exit code 0
            evaluate.main([str(tmp_path / "s.npz"), flag, value])
        assert exc.value.code == 2 and flag in capsys.readouterr().err
    (tmp_path / "garbage.pth").write_bytes(b"not a checkpoint")
    with pytest.raises(SystemExit, match=r"garbage\.pth: SHA-256 [0-9a-f]{64} is not that of torch-fidelity's"):
        evaluate.main([str(tmp_path / "s.npz"), "--metrics", "is", "--inception-weights", str(tmp_path / "garbage.pth")])
    with pytest.raises(SystemExit, match="garbage.pth is not torch-fidelity's Inception-v3"):
        evaluate.main([str(tmp_path / "s.npz"), "--metrics", "is", "--inception-weights", str(tmp_path / "garbage.pth"),
                       "--any-inception-weights"])
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    Image.new("L", (32, 32)).save(mixed / "a.png")
    Image.new("L", (48, 40)).save(mixed / "b.png")
    with pytest.raises(SystemExit, match="images of different sizes: b.png is 48x40, the others 32x32"):
        evaluate.main([str(mixed), "--digits"])


def test_numbered_images_are_read_in_number_order(evaluate, tmp_path):
    # sample.py's names grow to 7 digits at 10^6: by name, 1000000.png came between 100000 and 100001
    for name in ("100001.png", "1000000.png", "100000.png", "²x.png", "a.png"):
        (tmp_path / name).write_bytes(b"")
    (tmp_path / "².png").write_bytes(b"")  # isdigit but no int: not a number
    names = [p.name for p in evaluate.image_files(tmp_path)]
    assert names[:3] == ["100000.png", "100001.png", "1000000.png"] and set(names[3:]) == {"a.png", "²x.png", "².png"}


def test_a_readable_table_goes_with_the_json(evaluate, tmp_path, capsys):
    from vqlcmd.data.digits import digits_images

    images, labels = digits_images(32)
    arr = ((images[:200, 0] + 1) / 2 * 255).round().to(torch.uint8).numpy()
    np.savez(tmp_path / "s.npz", arr_0=np.repeat(arr[..., None], 3, -1), arr_1=labels[:200].numpy())
    assert evaluate.main([str(tmp_path / "s.npz"), "--digits"]) == 0
    out, err = capsys.readouterr()
    result = json.loads(out)  # stdout is still exactly the JSON
    lines = err.strip().splitlines()[-8:]
    assert lines[0].split() == ["metric", "value", "real", "halves"] and set(lines[1]) == {"-", " "}
    rows = {line.rsplit(None, 2)[0].strip(): line.rsplit(None, 2)[1:] for line in lines[2:]}
    assert rows["samples"] == ["200", "200"]
    assert rows["FID (lower)"] == [f"{result['fid']:.4f}", f"{result['real_halves']['fid']:.4f}"]
    assert rows["class accuracy (higher)"] == [f"{result['accuracy']:.4f}", "-"]
    assert rows["recall (higher)"][0] == f"{result['recall']:.4f}"
