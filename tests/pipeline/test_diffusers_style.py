"""The diffusers-style call (vqlcmd/pipeline_call.py): num_inference_steps, class names, output_type="np",
return_dict, set_progress_bar_config, torch_dtype; on VQLCMDPipeline and, inherited, on MaskGITPipeline."""
import numpy as np
import pytest
import torch

from vqlcmd import MaskGITPipeline, VQLCMDPipeline
from vqlcmd.baselines import MaskGITConfig


def G(seed=0):
    return torch.Generator().manual_seed(seed)


@pytest.fixture(scope="module")
def folder(tiny_pipeline, tmp_path_factory):
    return tiny_pipeline.save_pretrained(tmp_path_factory.mktemp("pipe") / "pipe")


@pytest.fixture(scope="module")
def pipe(folder):
    return VQLCMDPipeline.from_pretrained(folder)


@pytest.fixture
def steps_seen(monkeypatch):
    """The num_steps each sample_tokens call of the pipeline got."""
    import vqlcmd.pipeline as module

    seen, real = [], module.sample_tokens

    def spy(*args, num_steps, **kw):
        seen.append(num_steps)
        return real(*args, num_steps=num_steps, **kw)

    monkeypatch.setattr(module, "sample_tokens", spy)
    return seen


def test_the_readme_call(pipe, steps_seen):
    class_labels = ["a", "c", "d"]
    images = pipe(class_labels, num_inference_steps=8, output_type="np", return_dict=True, generator=G(1)).images
    assert isinstance(images, np.ndarray) and images.dtype == np.float32 and images.shape == (3, 16, 16, 1)
    assert 0 <= images.min() and images.max() <= 1
    # the same images as the pipeline's own arguments give, laid out NHWC
    ref = pipe([0, 2, 3], num_steps=8, output_type="pt", generator=G(1))
    np.testing.assert_array_equal(images, ref.permute(0, 2, 3, 1).numpy())
    assert steps_seen == [8, 8]  # the call's 8 steps reached the sampler (the exported default is 4)


def test_return_dict_is_diffusers_own_output_and_off_by_default(pipe):
    from diffusers.pipelines.pipeline_utils import ImagePipelineOutput

    out = pipe([0, 1], num_steps=2, return_dict=True, generator=G())
    assert isinstance(out, ImagePipelineOutput) and len(out.images) == 2 and out.images[0].size == (16, 16)
    assert out["images"] is out.images  # a BaseOutput: also indexable by name
    assert isinstance(pipe([0, 1], num_steps=2, generator=G()), list)  # the images themselves, as before


def test_num_inference_steps_and_num_steps(pipe, steps_seen):
    a = pipe([0, 1], num_inference_steps=3, output_type="tokens", generator=G(2))
    b = pipe([0, 1], num_steps=3, output_type="tokens", generator=G(2))
    c = pipe([0, 1], num_steps=3, num_inference_steps=3, output_type="tokens", generator=G(2))
    assert torch.equal(a, b) and torch.equal(a, c) and steps_seen == [3, 3, 3]
    pipe([0], output_type="tokens")
    assert steps_seen[-1] == 4  # neither given: the exported default
    with pytest.raises(ValueError, match="num_inference_steps=3 and num_steps=4 disagree"):
        pipe([0, 1], num_steps=4, num_inference_steps=3, output_type="tokens")


def test_class_names_map_to_ids(pipe):
    named = pipe(["b", 3, "a"], num_steps=2, output_type="tokens", generator=G(5))
    assert torch.equal(named, pipe([1, 3, 0], num_steps=2, output_type="tokens", generator=G(5)))
    assert torch.equal(pipe("c", num_steps=2, output_type="tokens", generator=G(5)),
                       pipe([2], num_steps=2, output_type="tokens", generator=G(5)))
    with pytest.raises(ValueError, match=r"unknown class name\(s\) 'seven', 'z'; this pipeline's classes are 'a', "
                                         r"'b', 'c', 'd'"):
        pipe(["a", "seven", "z"], output_type="tokens")
    nameless = VQLCMDPipeline(pipe.network, pipe.schedule, tokenizer=pipe.tokenizer)
    with pytest.raises(ValueError, match=r"class names given \(\['a'\]\), but this pipeline has no class_names"):
        nameless(["a"], output_type="tokens")


def test_output_types_are_listed(pipe):
    with pytest.raises(ValueError, match="output_type must be one of 'pil', 'np', 'pt', 'tokens', got 'numpy'"):
        pipe([0], output_type="numpy")


def test_set_progress_bar_config_shows_a_bar_over_the_steps(folder, capsys):
    pipe = VQLCMDPipeline.from_pretrained(folder)
    pipe([0], num_steps=3, output_type="tokens")
    assert "sampling" not in capsys.readouterr().err  # off by default, as before
    pipe.set_progress_bar_config(desc="my steps", leave=True, ascii=True)
    pipe([0], num_steps=3, output_type="tokens")
    err = capsys.readouterr().err
    assert "my steps" in err and "3/3" in err
    pipe([0], num_steps=3, output_type="tokens", progress=False)
    assert capsys.readouterr().err == ""
    pipe.set_progress_bar_config(disable=True)
    pipe([0], num_steps=3, output_type="tokens")
    assert capsys.readouterr().err == ""


def test_torch_dtype_and_a_named_error_for_a_non_float_dtype(folder):
    assert VQLCMDPipeline.from_pretrained(folder, torch_dtype=torch.bfloat16).network.embedding.weight.dtype == \
        torch.bfloat16
    assert VQLCMDPipeline.from_pretrained(folder, dtype=torch.float16, torch_dtype=torch.float16).network.embedding \
        .weight.dtype == torch.float16
    with pytest.raises(ValueError, match="dtype=torch.float16 and torch_dtype=torch.bfloat16 disagree"):
        VQLCMDPipeline.from_pretrained(folder, dtype=torch.float16, torch_dtype=torch.bfloat16)
    for bad in (torch.int32, "float16"):
        with pytest.raises(TypeError, match=rf"dtype must be a floating-point torch.dtype .*got {bad!r}"):
            VQLCMDPipeline.from_pretrained(folder, dtype=bad)
    with pytest.raises(TypeError, match="got torch.int32"):
        VQLCMDPipeline.from_pretrained(folder, torch_dtype=torch.int32)


def test_maskgit_inherits_the_diffusers_arguments(tiny_pipeline):
    p = tiny_pipeline
    mg = MaskGITPipeline(p.network, p.schedule, tokenizer=p.tokenizer, tokenizer_ref=p.tokenizer_ref,
                         class_names=p.class_names, maskgit=MaskGITConfig(num_steps=3))
    out = mg(["a", "d"], num_inference_steps=2, output_type="np", return_dict=True, generator=G(7))
    ref = mg([0, 3], num_steps=2, output_type="pt", generator=G(7))
    np.testing.assert_array_equal(out.images, ref.permute(0, 2, 3, 1).numpy())
    with pytest.raises(ValueError, match="disagree"):
        mg([0], num_steps=2, num_inference_steps=3)
    with pytest.raises(ValueError, match="unknown class name"):
        mg(["q"])


def test_diffusion_pipeline_from_pretrained_is_not_offered(folder):
    # (pipeline.py says why: DiffusionPipeline finds a folder's class in the diffusers package, or runs a file)
    assert not (folder / "model_index.json").exists()
