"""Pipeline and tokenizer folders run no code from their files: a weights file that is a malicious pickle is
refused by name and its pickled call never runs (safetensors and JSON hold no code; diffusers reads a
tokenizer's .bin weights-only, and the error says why)."""
import shutil

import pytest
import torch

from vqlcmd.pipeline import VQLCMDPipeline
from vqlcmd.tokenizer import load_tokenizer


class _Evil:
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').close()",))


def _poison(path, marker, base=None):
    """``path`` rewritten as a torch pickle of ``base`` (a state dict) plus one call that would touch ``marker``."""
    torch.save({**(base or {}), "extra": _Evil(marker)}, path)


@pytest.fixture
def saved(tiny_pipeline, tmp_path):
    return tiny_pipeline.save_pretrained(tmp_path / "pipe")


def test_a_pickle_in_place_of_the_pipeline_weights_is_refused_by_name(saved, tmp_path):
    marker = tmp_path / "MARKER"
    _poison(saved / "model.safetensors", marker)
    # the folder's manifest refuses the swapped file before anything reads it
    with pytest.raises(ValueError, match=rf"{saved / 'model.safetensors'}: unreadable weights.*the manifest says"):
        VQLCMDPipeline.from_pretrained(saved)
    (saved / "manifest.json").unlink()  # a folder exported before manifests: the loader itself refuses it
    with pytest.raises(ValueError, match=rf"{saved / 'model.safetensors'}: unreadable weights"):
        VQLCMDPipeline.from_pretrained(saved)
    assert not marker.exists()


@pytest.mark.parametrize("weights", ["diffusion_pytorch_model.safetensors", "diffusion_pytorch_model.bin"])
def test_a_pickle_in_a_tokenizer_folder_is_refused_by_name(saved, tmp_path, weights):
    marker = tmp_path / "MARKER"
    tok = saved / "tokenizer"
    state = load_tokenizer(tok).model.state_dict()
    (tok / "diffusion_pytorch_model.safetensors").unlink()
    _poison(tok / weights, marker, state)  # the real weights, and one call beside them
    with pytest.raises((ValueError, OSError)) as err:
        load_tokenizer(tok)
    assert str(tok) in str(err.value) and weights in str(err.value)
    if weights.endswith(".bin"):  # read by torch's weights-only unpickler, which names what it refused
        assert "asks for exec, which a weights-only load refuses" in str(err.value)
        assert "nothing from it was run" in str(err.value)
    with pytest.raises((ValueError, OSError), match=str(tok)):  # the pipeline loads its tokenizer the same way
        VQLCMDPipeline.from_pretrained(saved)
    assert not marker.exists()
    if weights.endswith(".bin"):
        torch.load(tok / weights, weights_only=False)  # the file is live: an unchecked load runs it
        assert marker.exists()


def test_a_plain_bin_tokenizer_still_loads(saved, tmp_path):
    tok = saved / "tokenizer"
    model = load_tokenizer(tok).model
    legacy = tmp_path / "legacy"
    model.save_pretrained(str(legacy), safe_serialization=False)
    assert (legacy / "diffusion_pytorch_model.bin").is_file()
    again = load_tokenizer(legacy).model.state_dict()
    assert all(torch.equal(v, again[k]) for k, v in model.state_dict().items())
    shutil.rmtree(legacy)
