"""VQLCMDPipeline's plumbing against references: a call is sample_tokens with the caller's arguments, the
exported config round-trips every field, images are the decoder's [-1, 1] mapped to [0, 1]."""

import pytest
import torch
from safetensors.torch import load_file, save_file

from vqlcmd.model import preset_config
from vqlcmd.network import VQLCMDNetwork
from vqlcmd.pipeline import VQLCMDPipeline, _SamplingDenoiser, to_pil
from vqlcmd.samplers import sample_tokens
from vqlcmd.schedule import ShiftedCosineSchedule

LABELS = [0, 1, 2, 3, 0, 1]


def G(seed=0):
    return torch.Generator().manual_seed(seed)


def test_labels_and_guidance_change_the_samples(tiny_pipeline):
    """The shared fixture is not blind to the condition (its AdaLN maps were zero: labels and guidance changed no
    sample, so no test on it could see them mishandled)."""
    kw = dict(num_steps=3, output_type="tokens", final="argmax", sampler="ddim")
    assert not torch.equal(tiny_pipeline([0] * 6, generator=G(), **kw), tiny_pipeline([3] * 6, generator=G(), **kw))
    assert not torch.equal(tiny_pipeline(LABELS, generator=G(), guidance_scale=0.0, **kw),
                           tiny_pipeline(LABELS, generator=G(), guidance_scale=3.0, **kw))


@pytest.mark.parametrize("sampler, final, omega", [("ancestral", "sample", 0.0), ("ddim", "argmax", 2.0),
                                                   ("ddim", "sample", 1.0)])
def test_a_call_is_sample_tokens_with_the_callers_arguments(tiny_pipeline, sampler, final, omega):
    """The exported defaults (ancestral, sample, guidance 1) must not override what the caller asks for;
    batches (of 4 here) see their own labels."""
    net = tiny_pipeline.network
    per_image = lambda: [torch.Generator().manual_seed(s) for s in range(6)]  # noqa: E731
    labels = [3, 2, 1, 0, 1, 3]  # the second batch's labels differ from the first's
    got = tiny_pipeline(labels, num_steps=3, sampler=sampler, final=final, guidance_scale=omega, batch_size=4,
                        output_type="tokens", generator=per_image())
    want = sample_tokens(_SamplingDenoiser(net.denoiser), net.embedding.table(), tiny_pipeline.schedule,
                         class_labels=torch.tensor(labels), num_steps=3, sampler=sampler, final=final,
                         guidance_scale=omega, generator=per_image())
    assert torch.equal(got, want.view(6, 4, 4))
    got = tiny_pipeline(LABELS, num_steps=3, sampler=sampler, final=final, guidance_scale=omega,
                        output_type="tokens", generator=G(5))
    want = sample_tokens(_SamplingDenoiser(net.denoiser), net.embedding.table(), tiny_pipeline.schedule,
                         class_labels=torch.tensor(LABELS), num_steps=3, sampler=sampler, final=final,
                         guidance_scale=omega, generator=G(5))
    assert torch.equal(got, want.view(6, 4, 4))


def test_omitted_settings_come_from_the_exported_defaults_or_the_documented_ones(tiny_pipeline):
    net = tiny_pipeline.network
    labels = [1, 3]
    ref = lambda **kw: sample_tokens(_SamplingDenoiser(net.denoiser), net.embedding.table(),  # noqa: E731
                                     tiny_pipeline.schedule, class_labels=torch.tensor(labels), generator=G(2), **kw)
    got = tiny_pipeline(labels, output_type="tokens", generator=G(2))  # exported: 4 steps, ancestral, ω = 1
    assert torch.equal(got, ref(num_steps=4, guidance_scale=1.0).view(2, 4, 4))
    bare = VQLCMDPipeline(net, tiny_pipeline.schedule, sample_defaults={"num_steps": 2})  # no ω exported: none
    assert torch.equal(bare(labels, output_type="tokens", generator=G(2)),
                       ref(num_steps=2, guidance_scale=0.0).view(2, 4, 4))


def test_the_exported_config_round_trips_every_field(tmp_path):
    torch.manual_seed(0)
    net = VQLCMDNetwork(preset_config("tiny"), l2_normalize=True)
    sched = ShiftedCosineSchedule(shift=1.5, t_min=0.01)
    defaults = {"num_steps": 7, "guidance_scale": 0.5, "sampler": "ddim", "final": "argmax"}
    pipe = VQLCMDPipeline(net, sched, class_names=list("abcd"), sample_defaults=defaults,
                          tokenizer_ref={"grid": [2, 8]}, extra_config={"method": "vqlcmd", "note": 1})
    loaded = VQLCMDPipeline.from_pretrained(pipe.save_pretrained(tmp_path / "p"))
    assert loaded.network.embedding.l2_normalize
    torch.testing.assert_close(loaded.network.embedding.table(), net.embedding.table(), rtol=0, atol=0)
    assert (loaded.schedule.shift, loaded.schedule.t_min) == (1.5, 0.01)
    assert loaded.sample_defaults == defaults and loaded.class_names == list("abcd")
    assert loaded.extra_config == {"method": "vqlcmd", "note": 1}
    # no tokenizer: tokens come in the exported grid, not the square root of seq_len
    assert loaded.grid == (2, 8) and loaded([1, 2], output_type="tokens", num_steps=2).shape == (2, 2, 8)


def test_weights_missing_a_tensor_are_refused(tiny_pipeline, tmp_path):
    folder = tiny_pipeline.save_pretrained(tmp_path / "p")
    weights = folder / "model.safetensors"
    from safetensors import safe_open

    with safe_open(str(weights), framework="pt") as f:
        meta = f.metadata()
    state = load_file(str(weights))
    state.pop("denoiser.head.bias")
    save_file(state, str(weights), metadata=meta)
    (folder / "manifest.json").unlink()  # a folder made by hand, which no manifest describes
    with pytest.raises(ValueError, match=r"weights do not fit the config \(missing \['denoiser.head.bias'\]"):
        VQLCMDPipeline.from_pretrained(folder, load_tokenizer=False)


def test_a_half_precision_pipeline_saves_float32_weights(tiny_pipeline, tmp_path):
    pipe = VQLCMDPipeline.from_pretrained(tiny_pipeline.save_pretrained(tmp_path / "a"), dtype=torch.bfloat16)
    folder = pipe.save_pretrained(tmp_path / "b")
    state = load_file(str(folder / "model.safetensors"))
    assert {v.dtype for v in state.values()} == {torch.float32}
    for name, v in pipe.network.state_dict().items():
        assert torch.equal(state[name], v.float()), name


def test_images_are_the_decoder_output_mapped_from_minus_1_1_to_0_1(tiny_pipeline):
    tokens = tiny_pipeline(LABELS, num_steps=2, output_type="tokens", generator=G(1))
    with torch.no_grad():
        raw = tiny_pipeline.tokenizer.decode(tokens).float()
    assert raw.min() < 0  # the test is not vacuous: the decoder gives values below 0
    torch.testing.assert_close(tiny_pipeline.decode(tokens), ((raw + 1) / 2).clamp(0, 1))
    assert tiny_pipeline([], output_type="pt").shape == (0, 1, 16, 16)


def test_to_pil_rounds_to_the_nearest_level():
    img = torch.tensor([0.0, 0.999, 0.5 / 255 + 1e-4, 1.0]).view(1, 1, 2, 2)
    import numpy as np

    assert np.asarray(to_pil(img)[0]).tolist() == [[0, 255], [1, 255]]
