"""The diffusers VQModel tokenizer backend and the small trainable tokenizer."""
import json

import pytest
import torch

from vqlcmd.tokenizer import TrainConfig, load_tokenizer, small_vqmodel, train_vqmodel
from vqlcmd.tokenizer.small import _reinit_dead_codes


def _tiny(channels=3):
    torch.manual_seed(0)
    return small_vqmodel(channels=channels, image_size=16, block_channels=(8, 16), codebook_size=16, code_dim=4,
                         groups=4)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("vq") / "tok"
    _tiny().save_pretrained(str(path))
    return path


def test_encode_decode_contract(folder):
    tok = load_tokenizer(folder)
    assert tok.grid == (8, 8) and tok.codebook_size == 16 and tok.channels == 3 and tok.image_size == (16, 16)
    x = torch.rand(3, 3, 16, 16) * 2 - 1
    ids = tok.encode(x)
    assert ids.shape == (3, 8, 8) and ids.dtype == torch.int64 and 0 <= ids.min() and ids.max() < 16
    # same ids as diffusers' own quantizer
    ref = tok.model.quantize(tok.model.encode(x).latents)[2][2].reshape(3, 8, 8)
    assert (ids == ref).float().mean() > 0.99
    y = tok.decode(ids)
    assert y.shape == (3, 3, 16, 16) and y.min() >= -1 and y.max() <= 1
    torch.testing.assert_close(tok.decode(ids.reshape(3, 64).int()), y)  # flat and int32 ids accepted


def test_a_vqmodel_that_looks_codes_up_itself_decodes(tmp_path):
    """diffusers' lookup_from_codebook models (aMUSEd's VQ) take ids, not vectors, in decode: it crashed with
    torch's 'Expected tensor for argument #1 indices'. Same images as the plain model with the same weights."""
    from diffusers import VQModel

    plain = _tiny()
    lookup = VQModel.from_config({**plain.config, "lookup_from_codebook": True})
    lookup.load_state_dict(plain.state_dict())
    plain.save_pretrained(str(tmp_path / "plain"))
    lookup.save_pretrained(str(tmp_path / "lookup"))
    ids = torch.randint(0, 16, (2, 8, 8), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(load_tokenizer(tmp_path / "lookup").decode(ids), load_tokenizer(tmp_path / "plain").decode(ids))


def test_identifier_is_stable_and_tracks_weights(folder, tmp_path):
    a, b = load_tokenizer(folder), load_tokenizer(folder)
    assert a.identifier == b.identifier and a.identifier.startswith("vqmodel-")
    m = _tiny()
    with torch.no_grad():
        m.quantize.embedding.weight[0, 0] += 1e-3
    m.save_pretrained(str(tmp_path / "other"))
    assert load_tokenizer(tmp_path / "other").identifier != a.identifier


def test_loading_logs_no_warning(folder):
    """diffusers warns at every load without accelerate (optional here) unless told not to try it;
    the quick start loads the tokenizer several times and printed that warning each time."""
    import logging

    records = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    logger = logging.getLogger("diffusers")
    logger.addHandler(handler)
    try:
        load_tokenizer(folder)
    finally:
        logger.removeHandler(handler)
    assert [r.getMessage() for r in records] == []


def test_missing_and_wrong_folders(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer folder .*nowhere.* does not exist"):
        load_tokenizer(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="empty.* has no config.json"):
        load_tokenizer(tmp_path / "empty")
    (tmp_path / "kl").mkdir()
    (tmp_path / "kl" / "config.json").write_text(json.dumps({"_class_name": "AutoencoderKL"}))
    with pytest.raises(ValueError, match="holds a AutoencoderKL, not a VQModel"):
        load_tokenizer(tmp_path / "kl")
    (tmp_path / "kl" / "config.json").write_text("{broken")
    with pytest.raises(ValueError, match=r"kl/config\.json: not valid JSON"):
        load_tokenizer(tmp_path / "kl")
    (tmp_path / "a_file").write_text("")
    with pytest.raises(FileNotFoundError, match="a_file' is a file, not a folder"):
        load_tokenizer(tmp_path / "a_file")


def test_a_folder_without_weights_or_with_weights_of_another_size(folder, tmp_path):
    """diffusers named only the .bin it looked for last, after a warning; a size mismatch was torch's RuntimeError,
    naming neither folder nor file."""
    import shutil

    from safetensors.torch import load_file, save_file

    bad = tmp_path / "bad"
    shutil.copytree(folder, bad)
    weights = bad / "diffusion_pytorch_model.safetensors"
    state = load_file(str(weights))
    weights.unlink()
    with pytest.raises(FileNotFoundError, match=r"bad' has no weights file \(diffusion_pytorch_model\.safetensors "
                                                r"or diffusion_pytorch_model\.bin\)"):
        load_tokenizer(bad)
    state["quantize.embedding.weight"] = torch.zeros(3, 2)
    save_file(state, str(weights))
    with pytest.raises(ValueError, match=r"bad': the weights do not fit its config\.json \(.*quantize\.embedding"):
        load_tokenizer(bad)


@pytest.mark.parametrize("change, problem", [("drop", r"missing keys: \['quantize\.embedding\.weight'\]"),
                                             ("add", r"unexpected keys: \['extra\.weight'\]")])
def test_weights_that_do_not_fit_the_config_are_refused(folder, tmp_path, change, problem):
    """diffusers only warned, and initialised a missing codebook at random (unseeded), so such a folder
    tokenized without error and its identifier changed from load to load."""
    import shutil

    from safetensors.torch import load_file, save_file

    bad = tmp_path / "bad"
    shutil.copytree(folder, bad)
    weights = bad / "diffusion_pytorch_model.safetensors"
    state = load_file(str(weights))
    if change == "drop":
        del state["quantize.embedding.weight"]
    else:
        state["extra.weight"] = torch.zeros(2)
    save_file(state, str(weights))
    with pytest.raises(ValueError, match=r"bad': the weights do not fit its config\.json \(" + problem):
        load_tokenizer(bad)


def test_bad_inputs(folder):
    tok = load_tokenizer(folder)
    with pytest.raises(TypeError, match="floating-point"):
        tok.encode(torch.zeros(1, 3, 16, 16, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"\(B, 3, H, W\)"):
        tok.encode(torch.zeros(1, 1, 16, 16))
    with pytest.raises(ValueError, match="expects 16x16"):
        tok.encode(torch.zeros(1, 3, 32, 32))
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, 16\).*max 16"):
        tok.decode(torch.full((1, 8, 8), 16))
    with pytest.raises(TypeError, match="integer"):
        tok.decode(torch.zeros(1, 8, 8))
    with pytest.raises(ValueError, match=r"\(B, 8, 8\) or \(B, 64\)"):
        tok.decode(torch.zeros(1, 7, 8, dtype=torch.long))


def test_a_few_training_steps_run_and_revive_dead_codes():
    m = _tiny(channels=1)
    x = torch.rand(32, 1, 16, 16) * 2 - 1
    metrics = train_vqmodel(m, x, TrainConfig(steps=4, batch_size=8, reinit_every=2), progress=False)
    assert set(metrics) >= {"psnr", "codebook_usage", "codebook_size", "train_seconds"}
    assert metrics["codebook_size"] == 16 and 1 <= metrics["codebook_usage"] <= 16


@pytest.mark.parametrize("training", [True, False])
def test_evaluate_leaves_the_model_as_it_found_it(training):
    # evaluate wrapped the caller's model in a tokenizer that froze it: training after it then failed
    from vqlcmd.tokenizer import evaluate

    m = _tiny(channels=1).train(training)
    m.decoder.requires_grad_(False)  # a part the caller froze stays frozen, the rest stays trainable
    m.encoder.eval()  # and mixed modes stay mixed
    modes = {name: mod.training for name, mod in m.named_modules()}
    grads = {name: p.requires_grad for name, p in m.named_parameters()}
    x = torch.rand(8, 1, 16, 16) * 2 - 1
    assert evaluate(m, x)["codebook_size"] == 16
    assert {name: mod.training for name, mod in m.named_modules()} == modes
    assert {name: p.requires_grad for name, p in m.named_parameters()} == grads
    train_vqmodel(m, x, TrainConfig(steps=2, batch_size=4), progress=False)  # what failed after it


def test_dead_code_reinit_moves_only_dead_codes():
    codebook = torch.zeros(4, 2)
    hits = torch.tensor([3.0, 0.0, 1.0, 0.0])
    latents = torch.randn(2, 2, 3, 3) + 5
    n = _reinit_dead_codes(codebook, hits, latents, torch.Generator().manual_seed(0))
    assert n == 2 and (codebook[[0, 2]] == 0).all() and (codebook[[1, 3]].abs() > 1).all()
