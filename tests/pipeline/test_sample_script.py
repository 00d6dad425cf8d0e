"""scripts/sample.py: per-image seeds (rank-count independence), restarts, the ADM .npz layout."""
import datetime
import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from vqlcmd.engine.distributed import free_port

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def sample_script():
    return importlib.import_module("vqlcmd.cli.sample")


@pytest.fixture(scope="module")
def pipe_dir(tiny_pipeline, tmp_path_factory):
    return tiny_pipeline.save_pretrained(tmp_path_factory.mktemp("sample") / "pipe")


def _args(pipe_dir, out, *extra):
    return ["--pipeline", str(pipe_dir), "--out", str(out), "-n", "7", "--num-steps", "3", "--batch-size", "3",
            "--no-progress", *extra]


def _read(out):
    return {p.name: p.read_bytes() for p in sorted(Path(out).glob("*.png"))}


def _as_rank(monkeypatch, mod, rank, world):
    import torch

    monkeypatch.setattr(mod, "dist_setup", lambda args: (rank, world, torch.device("cpu")))


def test_images_do_not_depend_on_the_number_of_ranks(sample_script, pipe_dir, tmp_path, monkeypatch):
    assert sample_script.main(_args(pipe_dir, tmp_path / "one", "--npz", str(tmp_path / "one.npz"))) == 0
    one = _read(tmp_path / "one")
    assert sorted(one) == [f"{i:06d}.png" for i in range(7)]
    # the same command as ranks 0..2 of 3 (ranks run one after another here; the split is what matters).
    # Rank 0 first, as in a real launch: the others wait at a barrier until it has written the manifest
    for rank in (0, 2, 1):
        _as_rank(monkeypatch, sample_script, rank, 3)
        sample_script.main(_args(pipe_dir, tmp_path / "three"))
    assert _read(tmp_path / "three") == one
    data = np.load(tmp_path / "one.npz")
    assert data["arr_0"].shape == (7, 16, 16, 3) and data["arr_0"].dtype == np.uint8
    assert data["arr_1"].tolist() == [0, 1, 2, 3, 0, 1, 2]  # --labels cycle


def test_a_stopped_run_continues_and_keeps_its_images(sample_script, pipe_dir, tmp_path, capsys):
    out = tmp_path / "run"
    sample_script.main(_args(pipe_dir, out))
    full = _read(out)
    (out / "000002.png").unlink()
    (out / "000006.png").unlink()
    kept = (out / "000000.png").stat().st_mtime_ns
    sample_script.main(_args(pipe_dir, out))
    assert _read(out) == full
    assert (out / "000000.png").stat().st_mtime_ns == kept
    assert "sampled 2 new images (5 kept)" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="other settings"):
        sample_script.main(_args(pipe_dir, out, "--seed", "1"))


def test_guidance_interval_reaches_the_sampler_and_the_manifest(sample_script, pipe_dir, tiny_pipeline, tmp_path):
    """--guidance-interval samples what the pipeline samples with that interval (image i from its own seed), and
    a folder made with another interval is not continued as if it were the same settings."""
    out = tmp_path / "limited"
    assert sample_script.main(_args(pipe_dir, out, "--guidance-scale", "2", "--guidance-interval", "0.5,1")) == 0
    assert json.loads((out / "manifest.json").read_text())["guidance_interval"] == [0.5, 1.0]
    gens = [torch.Generator().manual_seed(sample_script.image_seed(0, i)) for i in range(3)]
    want = tiny_pipeline([0, 1, 2], num_steps=3, guidance_scale=2.0, guidance_interval=(0.5, 1.0), generator=gens,
                         output_type="pt")
    ref = tmp_path / "ref"
    ref.mkdir()
    for i, image in enumerate(want):
        sample_script.save_png(image, ref / f"{i:06d}.png")
    assert _read(ref) == {k: v for k, v in _read(out).items() if k in _read(ref)}
    assert sample_script.main(_args(pipe_dir, tmp_path / "all", "--guidance-scale", "2")) == 0
    assert _read(tmp_path / "all") != _read(out)  # the interval reached the sampler
    with pytest.raises(SystemExit, match="other settings"):
        sample_script.main(_args(pipe_dir, out, "--guidance-scale", "2"))


def test_labels_option(sample_script):
    assert sample_script.class_labels("cycle", 5, 3, 0) == [0, 1, 2, 0, 1]
    assert sample_script.class_labels("1,7", 3, 10, 0) == [1, 7, 1]
    r = sample_script.class_labels("random", 50, 10, 0)
    assert r == sample_script.class_labels("random", 50, 10, 0) and len(set(r)) > 5
    with pytest.raises(SystemExit, match="outside"):
        sample_script.class_labels("12", 3, 10, 0)
    assert sample_script.image_seed(1, 5) != sample_script.image_seed(0, 5)


@pytest.mark.slow  # two real ranks under torchrun (gloo): two interpreters importing torch and diffusers
def test_torchrun_two_ranks_match_one(sample_script, pipe_dir, tmp_path):
    sample_script.main(_args(pipe_dir, tmp_path / "one"))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           str(ROOT / "scripts" / "sample.py"), *_args(pipe_dir, tmp_path / "two")]
    subprocess.run(cmd, check=True, env=env, cwd=ROOT, timeout=600)
    assert _read(tmp_path / "two") == _read(tmp_path / "one")


@pytest.mark.parametrize("bad, message", [
    (("--num-steps", "0"), "--num-steps: must be a positive integer, got 0"),
    (("--batch-size", "0"), "--batch-size: must be a positive integer, got 0"),
    (("-n", "0"), "--num-samples: must be a positive integer, got 0"),
    (("--guidance-scale", "-1"), "--guidance-scale: must be a finite number >= 0, got -1"),
    (("--guidance-scale", "nan"), "--guidance-scale: must be a finite number >= 0, got nan"),
    # a negative seed aliased another's images; 2**32 overflowed the generator after the manifest was written
    (("--seed", "-1"), "--seed: must be in [0, 2**31), got -1"),
    (("--seed", "4294967296"), "--seed: must be in [0, 2**31), got 4294967296"),
    (("--guidance-interval", "0.9,0.1"), "--guidance-interval: guidance_interval must satisfy 0 <= lo <= hi <= 1")])
def test_bad_options_are_refused_before_anything_is_written(sample_script, pipe_dir, tmp_path, bad, message, capsys):
    out = tmp_path / "s"
    with pytest.raises(SystemExit) as exc:
        sample_script.main(_args(pipe_dir, out, *bad))
    assert exc.value.code == 2 and message in capsys.readouterr().err
    assert not out.exists()  # a manifest of the bad settings would refuse the corrected rerun


def test_device_cuda_without_an_index_means_this_process_gpu(sample_script, monkeypatch):
    # torch.cuda.set_device(torch.device("cuda")) raised: --device cuda failed on every GPU machine
    import argparse

    import torch

    for k in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("LOCAL_RANK", "1")
    chosen = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: chosen.append(torch.device(d)))
    _, _, device = sample_script.dist_setup(argparse.Namespace(device="cuda", local_rank=None))
    assert device == torch.device("cuda", 1) and chosen == [device]


def test_images_this_script_did_not_make_are_not_taken_as_samples(sample_script, pipe_dir, tmp_path):
    # with no manifest, PNGs named like samples were kept, listed in a new manifest and scored by evaluate.py
    from PIL import Image

    out = tmp_path / "s"
    out.mkdir()
    Image.new("RGB", (64, 64)).save(out / "000000.png")
    with pytest.raises(SystemExit, match=r"holds 1 image\(s\) named like samples \(000000\.png, \.\.\.\) but no "
                                         r"manifest\.json"):
        sample_script.main(_args(pipe_dir, out))
    assert not (out / "manifest.json").exists()


def test_bad_paths_are_one_line_errors(sample_script, pipe_dir, tmp_path):
    a_file = tmp_path / "f"
    a_file.write_text("x")
    with pytest.raises(SystemExit, match="is a file, not a folder"):
        sample_script.main(_args(pipe_dir, a_file))
    with pytest.raises(SystemExit, match="--pipeline: .*nowhere. does not exist"):
        sample_script.main(_args(tmp_path / "nowhere", tmp_path / "s1"))
    (tmp_path / "s2").mkdir()
    (tmp_path / "s2" / "manifest.json").write_text("{not json")
    with pytest.raises(SystemExit, match="manifest.json is not readable JSON"):
        sample_script.main(_args(pipe_dir, tmp_path / "s2"))
    with pytest.raises(SystemExit) as exc:
        sample_script.main(_args(pipe_dir, tmp_path / "s3", "--npz", str(tmp_path)))
    assert exc.value.code == 2 and not (tmp_path / "s3").exists()


def _two_rank_worker(rank, init_file, call, arg, results):
    """Rank ``rank`` of 2 (gloo) runs ``call(sample.py as a module, rank, arg)``: "passed", or its refusal."""
    mod = importlib.import_module("vqlcmd.cli.sample")
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    try:
        call(mod, rank, arg)
        results[rank] = "passed"
    except SystemExit as exc:
        results[rank] = str(exc)
    finally:
        dist.destroy_process_group()


def _check_manifest(mod, rank, out_dir):
    mod.check_manifest(Path(out_dir), {k: None for k in mod.IMAGE_KEYS}, rank, 2)


def _same_on_every_rank(mod, rank, digests):
    mod.same_on_every_rank(digests[rank], "pipe")


@pytest.mark.parametrize("where, said", [("samples", "is a file, not a folder"),
                                         ("samples/sub", "samples/sub: [Errno 20] Not a directory")])
def test_a_refusal_on_rank_0_stops_every_rank(tmp_path, where, said):
    """Only rank 0 reads --out; the others used to wait at a barrier it never reached, which hangs under
    launchers that do not stop the other processes when one fails (an OSError there too)."""
    (tmp_path / "samples").write_text("not a folder")
    results = mp.Manager().dict()
    mp.spawn(_two_rank_worker, args=(str(tmp_path / "init"), _check_manifest, str(tmp_path / where), results),
             nprocs=2, join=True)
    assert said in results[0]
    assert results[1] == results[0]


def test_an_explicit_guidance_scale_on_an_unconditional_model_is_refused(sample_script, tiny_pipeline, tmp_path,
                                                                         capsys):
    """It was silently set to 0, while the API and --labels on the same pipeline refuse the request."""
    from vqlcmd import VQLCMDNetwork, preset_config
    from vqlcmd.pipeline import VQLCMDPipeline
    from vqlcmd.schedule import ShiftedCosineSchedule

    torch.manual_seed(0)
    pipe = VQLCMDPipeline(VQLCMDNetwork(preset_config("tiny", num_classes=0)), ShiftedCosineSchedule(),
                          tokenizer=tiny_pipeline.tokenizer, tokenizer_ref=tiny_pipeline.tokenizer_ref,
                          sample_defaults={"num_steps": 2, "guidance_scale": 1.0})
    folder = pipe.save_pretrained(tmp_path / "uncond")
    out = tmp_path / "s"
    with pytest.raises(SystemExit, match=r"--guidance-scale 2\.0: .* holds an unconditional model"):
        sample_script.main(_args(folder, out, "--guidance-scale", "2"))
    assert not out.exists()
    sample_script.main(_args(folder, out))  # the exported default (1.0) is dropped, as the API drops it
    assert len(_read(out)) == 7


def test_a_pipeline_rewritten_while_it_loads_is_loaded_again(sample_script, tiny_pipeline, tmp_path, monkeypatch):
    """The trainer re-exports its pipeline with every checkpoint: the manifest named the weights read after
    the load, which need not be the ones sampled. The load is bracketed by two digests and retried."""
    from vqlcmd.pipeline import VQLCMDPipeline

    folder = tiny_pipeline.save_pretrained(tmp_path / "p")
    real = VQLCMDPipeline.from_pretrained.__func__
    loads = []
    bias = tiny_pipeline.network.denoiser.head.bias
    saved = bias.detach().clone()  # (a session fixture: put back exactly)

    def rewritten_during_the_first_load(cls, *a, **k):
        pipe = real(cls, *a, **k)
        loads.append(1)
        if len(loads) == 1:  # another save lands just after this load read the weights
            with torch.no_grad():
                tiny_pipeline.network.denoiser.head.bias.add_(1.0)
            tiny_pipeline.save_pretrained(folder)
        return pipe

    monkeypatch.setattr(VQLCMDPipeline, "from_pretrained", classmethod(rewritten_during_the_first_load))
    try:
        sample_script.main(_args(folder, tmp_path / "s", "-n", "2"))
    finally:
        with torch.no_grad():
            bias.copy_(saved)
    assert len(loads) == 2  # the first load was not trusted
    manifest = json.loads((tmp_path / "s" / "manifest.json").read_text())
    assert manifest["weights_sha256"] == sample_script.weights_digest(folder)


def test_late_failures_are_refused_before_anything_is_written(sample_script, pipe_dir, tmp_path, capsys):
    """--fast cudagraphs on a CPU raised after the manifest was written; an --npz under a file failed after
    every image was sampled."""
    out = tmp_path / "s"
    with pytest.raises(SystemExit, match="--fast cudagraphs: "):
        sample_script.main(_args(pipe_dir, out, "--fast", "cudagraphs"))
    assert not out.exists()
    (tmp_path / "file").write_text("x")
    with pytest.raises(SystemExit) as exc:
        sample_script.main(_args(pipe_dir, out, "--npz", str(tmp_path / "file" / "sub" / "s.npz")))
    assert exc.value.code == 2 and "is a file, not a folder" in capsys.readouterr().err and not out.exists()


def test_the_npz_holds_grey_rgb_and_rgba_pngs_as_rgb(sample_script, tmp_path):
    from PIL import Image

    grey = np.full((4, 4), 7, np.uint8)
    rgb = np.arange(48, dtype=np.uint8).reshape(4, 4, 3)
    rgba = np.concatenate([rgb + 1, np.full((4, 4, 1), 255, np.uint8)], axis=-1)
    for i, a in enumerate((grey, rgb, rgba)):
        Image.fromarray(a).save(tmp_path / sample_script.png_name(i))
    sample_script.write_npz(tmp_path, 3, [0, 1, 2], tmp_path / "o.npz")
    with np.load(tmp_path / "o.npz") as data:
        batch = data["arr_0"]
        assert batch.shape == (3, 4, 4, 3) and batch.dtype == np.uint8 and data["arr_1"].tolist() == [0, 1, 2]
    assert (batch[0] == 7).all() and np.array_equal(batch[1], rgb) and np.array_equal(batch[2], rgb + 1)


@pytest.mark.parametrize("digests, said", [(("a", "a"), "passed"), (("a", "b"), "the ranks loaded different weights")])
def test_every_rank_must_have_loaded_the_same_weights(tmp_path, digests, said):
    """Each rank loads the folder itself: a re-export between two ranks' loads mixed two models silently."""
    results = mp.Manager().dict()
    mp.spawn(_two_rank_worker, args=(str(tmp_path / "init"), _same_on_every_rank, digests, results), nprocs=2,
             join=True)
    assert said in results[0] and results[1] == results[0]


def test_a_larger_n_adds_the_missing_images_and_other_settings_are_refused_by_name(sample_script, pipe_dir,
                                                                                  tmp_path, capsys):
    def args(out, n, *extra):
        return ["--pipeline", str(pipe_dir), "--out", str(out), "-n", str(n), "--num-steps", "2", "--batch-size",
                "32", "--no-progress", *extra]

    out = tmp_path / "grown"
    sample_script.main(args(out, 100))
    first = _read(out)
    kept = (out / "000099.png").stat().st_mtime_ns
    capsys.readouterr()
    sample_script.main(args(out, 120, "--npz", str(tmp_path / "grown.npz")))
    printed = capsys.readouterr()
    assert "sampled 20 new images (100 kept)" in printed.out and "adding images 100..119" in printed.err
    grown = _read(out)
    assert len(grown) == 120 and {k: grown[k] for k in first} == first
    assert (out / "000099.png").stat().st_mtime_ns == kept
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["num_samples"] == 120 and manifest["class_labels"] == [i % 4 for i in range(120)]
    sample_script.main(args(tmp_path / "fresh", 120))  # the same 120 as one run makes
    assert _read(tmp_path / "fresh") == grown
    assert np.load(tmp_path / "grown.npz")["arr_0"].shape == (120, 16, 16, 3)
    with pytest.raises(SystemExit, match=r"other settings \{'num_steps': \(2, 3\)\}"):
        sample_script.main(args(out, 140, "--num-steps", "3"))
    with pytest.raises(SystemExit, match=r"other settings \{'labels': \('cycle', '1'\), 'class_labels\[0\]': \(0, 1\)\}"):
        sample_script.main(args(out, 140, "--labels", "1"))
    assert len(_read(out)) == 120 and json.loads((out / "manifest.json").read_text())["num_samples"] == 120
    sample_script.main(args(out, 50))  # fewer: nothing to make, the manifest still covers all 120
    assert json.loads((out / "manifest.json").read_text())["num_samples"] == 120
