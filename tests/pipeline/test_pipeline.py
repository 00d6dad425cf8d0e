"""VQLCMDPipeline: round trip, reproducibility, per-image generators, both samplers at 1/2/50 steps."""
import json
import os
import time

import pytest
import torch

from vqlcmd.pipeline import VQLCMDPipeline, default_batch_size, image_generators
from vqlcmd.schedule import ShiftedCosineSchedule


def G(seed=0):
    return torch.Generator().manual_seed(seed)


LABELS = [0, 1, 2, 3, 0, 1]


@pytest.mark.parametrize("sampler", ["ancestral", "ddim"])
def test_round_trip_gives_the_same_samples(tiny_pipeline, tmp_path, sampler):
    folder = tiny_pipeline.save_pretrained(tmp_path / "pipe")
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "manifest.json", "model.safetensors", "tokenizer"]
    config = json.loads((folder / "config.json").read_text())
    assert config["class_names"] == list("abcd") and config["sample"]["num_steps"] == 4
    loaded = VQLCMDPipeline.from_pretrained(folder)
    assert loaded.tokenizer is not None and loaded.grid == (4, 4)
    for (name, a), b in zip(tiny_pipeline.network.state_dict().items(), loaded.network.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
    kw = dict(num_steps=5, sampler=sampler, guidance_scale=1.5, output_type="pt")
    a = tiny_pipeline(LABELS, generator=G(3), **kw)
    b = loaded(LABELS, generator=G(3), **kw)
    assert a.shape == (6, 1, 16, 16) and 0 <= a.min() and a.max() <= 1
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    # a different generator gives different samples (the test is not vacuous)
    assert not torch.equal(a, loaded(LABELS, generator=G(4), **kw))


@pytest.mark.parametrize("sampler", ["ancestral", "ddim"])
@pytest.mark.parametrize("steps", [1, 2, 50])
@pytest.mark.parametrize("guidance", [0.0, 2.0])
def test_both_samplers_run_for_1_2_50_steps(tiny_pipeline, sampler, steps, guidance):
    tokens = tiny_pipeline(LABELS, num_steps=steps, sampler=sampler, guidance_scale=guidance, output_type="tokens",
                           generator=G())
    assert tokens.shape == (6, 4, 4) and tokens.dtype == torch.long
    assert 0 <= tokens.min() and tokens.max() < 16
    again = tiny_pipeline(LABELS, num_steps=steps, sampler=sampler, guidance_scale=guidance, output_type="tokens",
                          generator=G())
    assert torch.equal(tokens, again)


def test_per_image_generators_do_not_depend_on_batching(tiny_pipeline):
    labels = [0, 1, 2, 3, 0, 1, 2]
    seeds = [11, 12, 13, 14, 15, 16, 17]
    kw = dict(num_steps=6, guidance_scale=1.0, output_type="tokens")
    whole = tiny_pipeline(labels, generator=image_generators(seeds), batch_size=7, **kw)
    chunked = tiny_pipeline(labels, generator=image_generators(seeds), batch_size=3, **kw)
    # images 4..6 alone (another rank's share): the same as within the full run
    tail = tiny_pipeline(labels[4:], generator=image_generators(seeds[4:]), batch_size=2, **kw)
    assert torch.equal(whole, chunked)
    assert torch.equal(whole[4:], tail)
    assert len({tuple(t.flatten().tolist()) for t in whole}) > 1


def test_one_generator_is_reproducible_for_a_batch_size(tiny_pipeline):
    kw = dict(num_steps=3, output_type="tokens", batch_size=4)
    assert torch.equal(tiny_pipeline(LABELS, generator=G(1), **kw), tiny_pipeline(LABELS, generator=G(1), **kw))


def test_default_batch_size_is_small_on_cpu(tiny_pipeline):
    assert default_batch_size(torch.device("cpu")) == 32 and default_batch_size(torch.device("cuda")) == 256
    labels = list(range(4)) * 10  # 40 images: two batches of the CPU default
    kw = dict(num_steps=2, output_type="tokens")
    assert torch.equal(tiny_pipeline(labels, generator=G(3), **kw),
                       tiny_pipeline(labels, generator=G(3), batch_size=32, **kw))
    with pytest.raises(ValueError, match="batch_size"):
        tiny_pipeline(labels, batch_size=0, **kw)


def test_output_types_and_defaults(tiny_pipeline):
    images = tiny_pipeline([2, 3], generator=G())  # defaults from the exported config: 4 steps, guidance 1
    assert len(images) == 2 and images[0].size == (16, 16) and images[0].mode == "L"
    # num_images on a conditional model draws from the null class; the exported guidance default is dropped
    assert tiny_pipeline(num_images=3, output_type="tokens", generator=G()).shape == (3, 4, 4)
    assert tiny_pipeline([], output_type="tokens").shape == (0, 4, 4)


def test_images_are_decoded_batch_by_batch_in_bounded_pieces(tiny_pipeline, monkeypatch):
    """The decoder saw all N images in one call (a 256-px VQGAN: ~160 MiB each); now each sampling batch is
    decoded as it is drawn, at most DECODE_BATCH images at a time, with the same images."""
    from vqlcmd import pipeline as pipeline_module

    labels = [0, 1, 2, 3] * 5
    tokens = tiny_pipeline(labels, output_type="tokens", generator=G(), batch_size=8)
    expected = tiny_pipeline.decode(tokens, batch_size=len(tokens))
    sizes = []
    decode = tiny_pipeline.tokenizer.decode
    monkeypatch.setattr(tiny_pipeline.tokenizer, "decode", lambda t: sizes.append(len(t)) or decode(t))
    images = tiny_pipeline(labels, output_type="pt", generator=G(), batch_size=8)
    assert sizes == [8, 8, 4]
    torch.testing.assert_close(images, expected)
    sizes.clear()
    monkeypatch.setattr(pipeline_module, "DECODE_BATCH", 3)  # read at call time, not bound at import
    tiny_pipeline(labels, output_type="pil", generator=G(), batch_size=8)
    assert sizes == [3, 3, 2] * 2 + [3, 1]


def test_errors_name_the_problem(tiny_pipeline, tmp_path):
    with pytest.raises(ValueError, match=r"class_labels must be in \[0, 4\)"):
        tiny_pipeline([4])
    with pytest.raises(ValueError, match="guidance needs class_labels"):
        tiny_pipeline(num_images=2, guidance_scale=1.0)
    with pytest.raises(ValueError, match="one per image"):
        tiny_pipeline([0, 1], generator=image_generators([1]))
    with pytest.raises(ValueError, match="output_type"):
        tiny_pipeline([0], output_type="numpy")  # ("np" is diffusers' NHWC array: test_diffusers_style.py)
    with pytest.raises(FileNotFoundError, match="missing model.safetensors"):
        VQLCMDPipeline.from_pretrained(tmp_path)
    # 0 steps silently sampled the default 50, and a negative or NaN ω silently meant no guidance
    with pytest.raises(ValueError, match="num_steps must be >= 1, got 0"):
        tiny_pipeline([0], num_steps=0)
    for omega in (-1.0, float("nan")):
        with pytest.raises(ValueError, match="guidance_scale must be a finite number >= 0"):
            tiny_pipeline([0], guidance_scale=omega, num_steps=2)
    with pytest.raises(ValueError, match=r"class_labels must be integers, got 1.7$"):
        tiny_pipeline([1.7], num_steps=2)
    with pytest.raises(ValueError, match="num_images=3 but 2 class_labels were given"):
        tiny_pipeline([0, 1], num_images=3, num_steps=2)
    with pytest.raises(ValueError, match="num_images must be >= 0, got -3"):
        tiny_pipeline(num_images=-3, num_steps=2)
    # a TypeError from a comparison, and 'int' object is not iterable
    with pytest.raises(TypeError, match="guidance_scale must be a real number, got str"):
        tiny_pipeline(num_images=2, guidance_scale="1", num_steps=2)
    with pytest.raises(TypeError, match=r"generator must be a torch\.Generator or one per image, got int"):
        tiny_pipeline([0, 1], generator=0, num_steps=2)
    assert tiny_pipeline([1.0, 2.0], num_images=2, num_steps=2, output_type="tokens").shape == (2, 4, 4)
    folder = tiny_pipeline.save_pretrained(tmp_path / "p")
    config = json.loads((folder / "config.json").read_text())
    config["tokenizer"]["path"] = str(tmp_path / "gone")
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(FileNotFoundError, match="gone"):
        VQLCMDPipeline.from_pretrained(folder)
    tokens_only = VQLCMDPipeline.from_pretrained(folder, load_tokenizer=False)
    assert tokens_only([1], output_type="tokens", num_steps=2).shape == (1, 4, 4)
    # refused before sampling (it sampled every image, then failed to decode them)
    with pytest.raises(ValueError, match="output_type='pt' needs a tokenizer to decode the tokens, and none is loaded"):
        tokens_only([1], output_type="pt", num_steps=10 ** 9)
    # a config whose sizes or schedule do not fit: errors that name the file, not a bare KeyError / size mismatch
    good = json.loads((folder / "config.json").read_text())
    for change, said in ((lambda c: c.pop("schedule"), "no usable schedule section"),
                         (lambda c: c["schedule"].update(warp=2), "no usable schedule section"),
                         (lambda c: c["denoiser"].update(embed_dim=c["denoiser"]["embed_dim"] + 1),
                          "weights do not fit the config's sizes"),
                         # these raised a bare AttributeError / ValueError that named no file
                         (lambda c: c.update(embedding="l2"), r"config\.json: not a VQ-LCMD pipeline config"),
                         (lambda c: c["schedule"].update(shift="abc"), "no usable schedule section"),
                         (lambda c: c["denoiser"].update(attn_dropout=2.0),
                          r"config\.json: not a VQ-LCMD pipeline config \(ValueError: attn_dropout")):
        bad = json.loads(json.dumps(good))
        change(bad)
        (folder / "config.json").write_text(json.dumps(bad))
        with pytest.raises(ValueError, match=said):
            VQLCMDPipeline.from_pretrained(folder, load_tokenizer=False)
    (folder / "config.json").write_text(json.dumps(good))
    weights = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(weights[:len(weights) // 2])
    with pytest.raises(ValueError, match=r"model\.safetensors: unreadable weights, truncated or corrupt"):
        VQLCMDPipeline.from_pretrained(folder, load_tokenizer=False)
    (folder / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"config\.json: not a VQ-LCMD pipeline config \(JSONDecodeError"):
        VQLCMDPipeline.from_pretrained(folder, load_tokenizer=False)
    config["denoiser"]["depthx"] = 2
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"not a VQ-LCMD pipeline config \(TypeError.*depthx"):
        VQLCMDPipeline.from_pretrained(folder, load_tokenizer=False)


def test_bfloat16_weights_sample(tiny_pipeline, tmp_path):
    """bf16 weights run the denoiser under autocast: its logits match the fp32 pipeline's to bf16 precision,
    and deterministic sampling (DDIM, argmax tokens) picks mostly the same tokens."""
    folder = tiny_pipeline.save_pretrained(tmp_path / "p")
    pipe = VQLCMDPipeline.from_pretrained(folder, dtype=torch.bfloat16)
    ref = VQLCMDPipeline.from_pretrained(folder)
    assert pipe.network.embedding.weight.dtype == torch.bfloat16
    cfg = ref.network.config
    z = torch.randn(6, cfg.seq_len, cfg.embed_dim, generator=G(5))
    t, y = torch.rand(6, generator=G(6)), torch.tensor(LABELS)
    with torch.no_grad():
        with pipe._autocast():
            got = pipe._denoiser()(z, t, y).float()
        want = ref._denoiser()(z, t, y)
    print(f"bf16 logits: max error {(got - want).abs().max() / want.abs().max():.4f} of the largest")
    assert (got - want).abs().max() <= 0.03 * want.abs().max()
    kw = dict(num_steps=3, sampler="ddim", guidance_scale=1.0, output_type="tokens", final="argmax")
    tokens = pipe(LABELS, generator=G(), **kw)
    assert tokens.shape == (6, 4, 4)
    assert (tokens == ref(LABELS, generator=G(), **kw)).float().mean() > 0.8


@pytest.mark.slow  # torch.compile of the tiny denoiser took ~2 min on the shared 2-core CPU
def test_compiled_denoiser_samples_like_eager(tiny_pipeline, tmp_path):
    pipe = VQLCMDPipeline.from_pretrained(tiny_pipeline.save_pretrained(tmp_path / "p"))
    kw = dict(num_steps=3, sampler="ddim", guidance_scale=1.0, output_type="tokens", final="argmax")
    eager = pipe(LABELS, generator=G(), **kw)
    with pytest.raises(ValueError, match="CUDA"):
        pipe.enable_fast_sampling("cudagraphs")
    t0 = time.perf_counter()
    pipe.enable_fast_sampling("compile")
    assert pipe.fast_mode == "compile"
    compiled = pipe(LABELS, generator=G(), **kw)
    print(f"torch.compile + 3 steps on CPU: {time.perf_counter() - t0:.1f} s")
    # compiled kernels may round differently, which can flip a near-tie argmax: allow a few tokens
    assert (eager == compiled).float().mean() > 0.9
    pipe.disable_fast_sampling()
    assert torch.equal(pipe(LABELS, generator=G(), **kw), eager)


@pytest.mark.gpu
def test_cuda_graphs_sample_like_eager(tmp_path):
    # tokens only, so no tokenizer: the lent GPU machines' images have no diffusers to build tiny_pipeline's
    from vqlcmd import VQLCMDNetwork, preset_config

    torch.manual_seed(1)
    net = VQLCMDNetwork(preset_config("tiny"))
    with torch.no_grad():  # sharper logits than the init gives, as tiny_pipeline's
        net.denoiser.head.weight.mul_(20)
    folder = VQLCMDPipeline(net, ShiftedCosineSchedule(), class_names=list("abcd"),
                            sample_defaults={"num_steps": 4}).save_pretrained(tmp_path / "p")
    pipe = VQLCMDPipeline.from_pretrained(folder, device="cuda", load_tokenizer=False)
    g = lambda: torch.Generator(device="cuda").manual_seed(0)  # noqa: E731
    kw = dict(num_steps=8, guidance_scale=1.0, output_type="tokens", final="argmax", sampler="ddim")
    eager = pipe(LABELS, generator=g(), **kw)
    pipe.enable_fast_sampling("cudagraphs")
    for _ in range(2):  # the first call records the graphs, the second replays them
        graphed = pipe(LABELS, generator=g(), **kw)
        assert (eager == graphed).float().mean() > 0.9


def test_an_unconditional_model_ignores_the_exported_guidance_default():
    # sample.guidance_scale defaults to 1.0, which an unconditional model's pipeline exported and then refused
    # (its previews and every call without an explicit ω raised)
    from vqlcmd import VQLCMDNetwork, preset_config
    from vqlcmd.schedule import ShiftedCosineSchedule

    torch.manual_seed(0)
    pipe = VQLCMDPipeline(VQLCMDNetwork(preset_config("tiny", num_classes=0)), ShiftedCosineSchedule(),
                          sample_defaults={"num_steps": 2, "guidance_scale": 1.0})
    assert pipe(num_images=3, output_type="tokens", generator=G()).shape == (3, 4, 4)
    with pytest.raises(ValueError, match="guidance needs a class-conditional model; this one is unconditional"):
        pipe(num_images=3, guidance_scale=1.0, output_type="tokens")


def test_weights_and_config_of_different_saves_are_refused(tiny_pipeline, tmp_path):
    """save_pretrained renames the weights in, then the config: a reader between the two renames (the
    trainer re-exports with every checkpoint) met new weights with the old config, loaded silently when the
    sizes matched. Both files carry one save id now."""
    folder = tiny_pipeline.save_pretrained(tmp_path / "p")
    old_config, old_weights = (folder / "config.json").read_text(), (folder / "model.safetensors").read_bytes()
    tiny_pipeline.save_pretrained(folder)  # the same save again: the same bytes (sample.py hashes the weights)
    assert (folder / "model.safetensors").read_bytes() == old_weights
    other = VQLCMDPipeline.from_pretrained(folder, load_tokenizer=False)
    with torch.no_grad():
        next(other.network.parameters()).add_(0.01)  # other weights of the same sizes: nothing else tells them apart
    other.save_pretrained(folder)
    (folder / "config.json").write_text(old_config)  # as a reader between the two renames sees the folder
    with pytest.raises(ValueError, match="come from different saves"):
        VQLCMDPipeline.from_pretrained(folder, load_tokenizer=False)
    other.save_pretrained(folder)
    pipe = VQLCMDPipeline.from_pretrained(folder, load_tokenizer=False)
    assert "save_id" not in pipe.extra_config  # an id per save, not carried over as extra config


def test_float64_weights_sample_without_autocast(tiny_pipeline, tmp_path):
    import warnings

    pipe = VQLCMDPipeline.from_pretrained(tiny_pipeline.save_pretrained(tmp_path / "p"), dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # CPU autocast warned on every call that it does not take fp64
        assert pipe([0, 1], num_steps=2, output_type="tokens").shape == (2, 4, 4)


def test_to_moves_the_model_and_samples_like_from_pretrained_with_that_dtype(tiny_pipeline, tmp_path):
    folder = tiny_pipeline.save_pretrained(tmp_path / "p")
    pipe = VQLCMDPipeline.from_pretrained(folder)
    assert pipe.to("cpu", torch.bfloat16) is pipe and pipe.network.embedding.weight.dtype == torch.bfloat16
    kw = dict(num_steps=2, output_type="tokens", generator=G(3))
    loaded = VQLCMDPipeline.from_pretrained(folder, dtype=torch.bfloat16)
    assert torch.equal(pipe([0, 1], **kw), loaded([0, 1], num_steps=2, output_type="tokens", generator=G(3)))
    with pytest.raises(TypeError, match="floating-point torch.dtype"):
        pipe.to(dtype=torch.int64)
    assert pipe.to(torch.float32).network.embedding.weight.dtype == torch.float32  # a dtype alone, positionally


def test_a_backend_that_cannot_serve_the_sampler_is_refused_up_front(tiny_pipeline):
    # it failed at the first sampling step
    with pytest.raises(ValueError, match="backend='compiled' cannot serve the sampler's softmax_embedding_average"):
        tiny_pipeline([0], num_steps=2, output_type="tokens", backend="compiled")
    if not os.environ.get("TRITON_INTERPRET"):  # installed, but not for CPU tensors
        with pytest.raises(ValueError, match="backend='triton' cannot serve the sampler's"):
            tiny_pipeline([0], num_steps=2, output_type="tokens", backend="triton")


def test_class_names_as_labels_map_to_ids_and_other_labels_get_a_message(tiny_pipeline):
    # torch's own words were "too many dimensions 'str'"; names now map through class_names
    # (test_diffusers_style.py), and what is neither a name nor an id still gets the message
    assert tiny_pipeline.class_names == list("abcd")
    assert torch.equal(tiny_pipeline(["b"], output_type="tokens", num_steps=2, generator=G()),
                       tiny_pipeline([1], output_type="tokens", num_steps=2, generator=G()))
    with pytest.raises(ValueError, match=r"class_labels must be integer class ids \(a pipeline's class_names"):
        tiny_pipeline([[0, 1], [2]], output_type="tokens")


def test_a_missing_tokenizer_folder_says_how_to_go_on(tiny_pipeline, tmp_path):
    folder = tiny_pipeline.save_pretrained(tmp_path / "p")
    config = json.loads((folder / "config.json").read_text())
    config["tokenizer"]["path"] = str(tmp_path / "moved")
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(FileNotFoundError, match=r"moved named by .* is missing: restore it, or point tokenizer\.path"):
        VQLCMDPipeline.from_pretrained(folder)
    assert VQLCMDPipeline.from_pretrained(folder, load_tokenizer=False).tokenizer is None
