"""MaskGITPipeline: loaded by the folder's method, and the same request checks, generators and outputs as
VQLCMDPipeline (the shared ``_request`` / ``_chunks`` / ``_output``)."""
import json

import pytest
import torch

from vqlcmd import MaskGITPipeline, VQLCMDPipeline
from vqlcmd.baselines import MaskGITConfig
from vqlcmd.pipeline import image_generators

LABELS = [0, 1, 2, 3, 0, 1, 2]


@pytest.fixture
def maskgit(tiny_pipeline):
    p = tiny_pipeline
    return MaskGITPipeline(p.network, p.schedule, tokenizer=p.tokenizer, tokenizer_ref=p.tokenizer_ref,
                           class_names=p.class_names, sample_defaults={"guidance_scale": 1.0},
                           maskgit=MaskGITConfig(num_steps=3))


def test_a_maskgit_folder_loads_as_maskgit(maskgit, tiny_pipeline, tmp_path):
    # VQLCMDPipeline.from_pretrained returned a diffusion pipeline for it: scripts/sample.py then drew noise
    # from a model trained to unmask
    folder = maskgit.save_pretrained(tmp_path / "mg")
    assert json.loads((folder / "config.json").read_text())["method"] == "maskgit"
    loaded = VQLCMDPipeline.from_pretrained(folder)
    assert type(loaded) is MaskGITPipeline and loaded.maskgit.num_steps == 3
    assert loaded.sample_defaults["sampler"] == "maskgit" and loaded.sample_defaults["num_steps"] == 3
    kw = dict(output_type="tokens", generator=torch.Generator().manual_seed(0))
    assert torch.equal(loaded(LABELS, **kw), maskgit(LABELS, output_type="tokens",
                                                     generator=torch.Generator().manual_seed(0)))
    with pytest.raises(ValueError, match="a vqlcmd pipeline, not a MaskGIT one"):
        MaskGITPipeline.from_pretrained(tiny_pipeline.save_pretrained(tmp_path / "lcmd"))


def test_sampler_settings_changed_on_the_pipeline_are_saved(tiny_pipeline, tmp_path):
    # the config.json kept the settings of construction time: the reloaded pipeline sampled differently
    import dataclasses

    p = tiny_pipeline
    pipe = MaskGITPipeline(p.network, p.schedule, tokenizer=p.tokenizer, tokenizer_ref=p.tokenizer_ref,
                           class_names=p.class_names, maskgit=MaskGITConfig(num_steps=3))
    pipe.maskgit = dataclasses.replace(pipe.maskgit, num_steps=5, gumbel_temperature=2.0)
    loaded = VQLCMDPipeline.from_pretrained(pipe.save_pretrained(tmp_path / "mg"))
    assert loaded.maskgit == pipe.maskgit and loaded.sample_defaults["num_steps"] == 5
    kw = dict(output_type="tokens", guidance_scale=0.0)
    assert torch.equal(loaded(LABELS, generator=torch.Generator().manual_seed(0), **kw),
                       pipe(LABELS, generator=torch.Generator().manual_seed(0), **kw))


def test_per_image_generators_do_not_depend_on_batching(maskgit):
    seeds = [3, 4, 5, 6, 7, 8, 9]
    whole = maskgit(LABELS, generator=image_generators(seeds), batch_size=7, output_type="tokens")
    chunked = maskgit(LABELS, generator=image_generators(seeds), batch_size=3, output_type="tokens")
    tail = maskgit(LABELS[4:], generator=image_generators(seeds[4:]), batch_size=2, output_type="tokens")
    assert torch.equal(whole, chunked) and torch.equal(whole[4:], tail)
    assert len({tuple(t.flatten().tolist()) for t in whole}) > 1
    with pytest.raises(ValueError, match="2 generators for 7 images"):
        maskgit(LABELS, generator=image_generators([1, 2]))


def test_the_same_checks_as_the_diffusion_pipeline(maskgit):
    with pytest.raises(ValueError, match=r"class_labels must be in \[0, 4\)"):
        maskgit([4])  # the null class was accepted
    # the exported guidance is dropped for unlabelled draws, as VQLCMDPipeline does (was "guidance needs labels")
    assert maskgit(num_images=2, output_type="tokens").shape == (2, 4, 4)
    with pytest.raises(ValueError, match="guidance needs class_labels"):
        maskgit(num_images=2, guidance_scale=1.0)


@pytest.mark.parametrize("which", ["maskgit", "lcmd"])
def test_zero_images_in_every_output_type(which, maskgit, tiny_pipeline):
    pipe = maskgit if which == "maskgit" else tiny_pipeline
    # "pt" and "pil" failed inside the tokenizer's decoder on an empty batch
    assert pipe(num_images=0, output_type="pt").shape == (0, 1, 16, 16)
    assert pipe(num_images=0, output_type="pil") == []
    assert pipe([], output_type="tokens").shape == (0, 4, 4)


def test_maskgit_samples_through_the_pipelines_denoiser(maskgit, monkeypatch):
    # it called net.denoiser directly: enable_fast_sampling ("compile", "cudagraphs") changed nothing for it
    calls = []

    def fake_compile(module, **kw):  # stands in for torch.compile: counts the calls of what it returns
        def run(*a, **k):
            calls.append(kw)
            return module(*a, **k)
        run.cfg = module.cfg
        return run

    monkeypatch.setattr(torch, "compile", fake_compile)
    eager = maskgit(LABELS, output_type="tokens", generator=torch.Generator().manual_seed(0))
    maskgit.enable_fast_sampling("compile")
    try:
        fast = maskgit(LABELS, output_type="tokens", generator=torch.Generator().manual_seed(0))
    finally:
        maskgit.disable_fast_sampling()
    assert len(calls) == 3 and torch.equal(fast, eager)  # one call per step, guided in one batch


def test_options_that_do_not_apply_are_refused_not_ignored(maskgit):
    # any keyword was swallowed: a typo (num_step=1) ran the default 3 steps, sampler="ddim" ran MaskGIT
    with pytest.raises(TypeError, match="num_step"):
        maskgit(LABELS, num_step=1, output_type="tokens")
    for option in (dict(sampler="ddim"), dict(final="argmax"), dict(backend="triton")):
        with pytest.raises(ValueError, match=f"{next(iter(option))}: a MaskGIT pipeline samples by iterative"):
            maskgit(LABELS, output_type="tokens", **option)
    assert maskgit([0], sampler="maskgit", output_type="tokens", progress=True).shape == (1, 4, 4)


def test_sample_script_writes_a_maskgit_folders_images(maskgit, tmp_path, load_script):
    # sample.py passed the diffusion samplers' sampler and final, which MaskGIT now refuses
    mod = load_script("sample")
    folder = maskgit.save_pretrained(tmp_path / "mg")
    assert mod.main(["--pipeline", str(folder), "--out", str(tmp_path / "s"), "-n", "3", "--no-progress"]) == 0
    assert sorted(p.name for p in (tmp_path / "s").glob("*.png")) == ["000000.png", "000001.png", "000002.png"]


def test_digits_table_refuses_a_maskgit_folder_up_front(maskgit, tmp_path):
    # its rows are the diffusion samplers: MaskGIT ran under their names, then (refusing sampler=) failed at
    # the first cell, after the classifiers had loaded
    from studies import digits_table as mod

    folder = maskgit.save_pretrained(tmp_path / "mg")
    with pytest.raises(SystemExit, match="a MaskGIT pipeline; the table compares the ancestral and DDIM samplers"):
        mod.main(["--pipeline", str(folder), "--out", str(tmp_path / "t.md")])
