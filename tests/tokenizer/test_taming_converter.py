"""The taming VQGAN -> diffusers VQModel converter, on checkpoints built with the real key names."""
import pytest
import torch
from taming_reference import TamingVQModel, fake_loss_tensors

from vqlcmd.tokenizer import convert_taming_checkpoint, load_tokenizer, taming_to_diffusers_state_dict
from vqlcmd.tokenizer.taming import IMAGENET_F16_1024, vqmodel_from_taming_config

# Same layout as vqgan_imagenet_f16_1024 (attention at the lowest resolution, 1x1 shortcut where
# channels change), shrunk so that it runs in a second.
SMALL = dict(ch=32, ch_mult=[1, 2, 2], num_res_blocks=1, attn_resolutions=[8], z_channels=32, embed_dim=16,
             n_embed=64, resolution=32, in_channels=3, out_ch=3)


def _checkpoint(tmp_path, cfg, seed=0):
    torch.manual_seed(seed)
    ref = TamingVQModel(cfg).eval()
    with torch.no_grad():  # GroupNorm affine params default to 1/0: randomise them so the test sees them
        for name, p in ref.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
        ref.quantize.embedding.weight.normal_()
    state = dict(ref.state_dict(), **fake_loss_tensors())
    path = tmp_path / "last.ckpt"
    torch.save({"state_dict": state, "global_step": 7, "epoch": 1}, path)
    return ref, path, state


def test_converted_model_computes_the_same_tokens_and_images(tmp_path):
    ref, ckpt, state = _checkpoint(tmp_path, SMALL)
    report = convert_taming_checkpoint(ckpt, tmp_path / "vq", SMALL)
    # every tensor accounted for: mapped + deliberately dropped loss.*
    assert report["mapped"] + report["dropped"] == report["total"] == len(state)
    assert report["dropped"] == len(fake_loss_tensors())
    tok = load_tokenizer(tmp_path / "vq")
    assert tok.grid == (8, 8) and tok.codebook_size == 64 and tok.identifier == report["tokenizer_id"]
    x = torch.rand(2, 3, 32, 32) * 2 - 1
    with torch.no_grad():
        ref_ids = ref.encode_ids(x)
        ids = tok.encode(x)
        assert (ids == ref_ids).float().mean() > 0.99  # a near-tie may flip under different op order
        torch.testing.assert_close(tok.decode(ref_ids), ref.decode_ids(ref_ids).clamp(-1, 1), atol=1e-4, rtol=1e-4)


def test_real_vqgan_f16_1024_layout_maps_every_tensor():
    """The paper's tokenizer at full size, on the meta device: every key and shape of a taming
    checkpoint lands on a diffusers parameter of the same shape, and nothing is left over."""
    with torch.device("meta"):
        ref = TamingVQModel(IMAGENET_F16_1024)
        model = vqmodel_from_taming_config(IMAGENET_F16_1024, device="meta")
    state = ref.state_dict()
    mapped, dropped = taming_to_diffusers_state_dict(dict(state, **fake_loss_tensors()), 5)
    expected = model.state_dict()
    assert set(mapped) == set(expected)
    assert all(tuple(mapped[k].shape) == tuple(expected[k].shape) for k in mapped)
    assert len(mapped) == len(state) and len(dropped) == len(fake_loss_tensors())
    assert sum(v.numel() for v in mapped.values()) == sum(v.numel() for v in expected.values())
    assert expected["quantize.embedding.weight"].shape == (1024, 256)


def test_unknown_tensor_is_an_error(tmp_path):
    _, ckpt, state = _checkpoint(tmp_path, SMALL)
    state["encoder.extra.weight"] = torch.zeros(3)
    torch.save({"state_dict": state}, ckpt)
    with pytest.raises(ValueError, match="encoder.extra.weight"):
        convert_taming_checkpoint(ckpt, tmp_path / "vq", SMALL)


def test_config_mismatch_is_an_error(tmp_path):
    _, ckpt, _ = _checkpoint(tmp_path, SMALL)
    with pytest.raises(ValueError, match="does not match config|lacks"):
        convert_taming_checkpoint(ckpt, tmp_path / "vq", dict(SMALL, z_channels=64))


def test_a_misspelt_config_key_is_an_error_not_a_default():
    from vqlcmd.tokenizer.taming import read_taming_config

    with pytest.raises(ValueError, match=r"unknown key\(s\) \['num_res_block'\]"):
        read_taming_config(dict(SMALL, num_res_block=2))
    assert read_taming_config(dict(SMALL, dropout=0.0, double_z=False))["num_res_blocks"] == 1


def test_damaged_or_foreign_files_are_named(tmp_path):
    _, ckpt, state = _checkpoint(tmp_path, SMALL)
    data = ckpt.read_bytes()
    ckpt.write_bytes(data[:len(data) // 2])
    with pytest.raises(ValueError, match=r"is not a readable torch checkpoint \(truncated"):
        convert_taming_checkpoint(ckpt, tmp_path / "vq", SMALL)
    ckpt.write_bytes(b"garbage" * 10)
    with pytest.raises(ValueError, match=r"is not a torch checkpoint \(starts with b'garb'\)"):
        convert_taming_checkpoint(ckpt, tmp_path / "vq", SMALL)
    # an attention projection that is not a 1x1 convolution: a bare reshape error named no tensor
    key = next(k for k in state if k.endswith(".attn_1.q.weight") or k.endswith(".q.weight"))
    state[key] = torch.zeros(*state[key].shape[:2], 3, 3)
    torch.save({"state_dict": state}, ckpt)
    with pytest.raises(ValueError, match=key.replace(".", r"\.") + r": expected a 1x1 convolution"):
        convert_taming_checkpoint(ckpt, tmp_path / "vq", SMALL)


def test_missing_checkpoint(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.ckpt"):
        convert_taming_checkpoint(tmp_path / "nope.ckpt", tmp_path / "vq", SMALL)


@pytest.mark.parametrize("smaller", [dict(num_res_blocks=0), dict(attn_resolutions=[])])
def test_config_smaller_than_the_checkpoint_names_what_is_left_over(tmp_path, smaller):
    _, ckpt, _ = _checkpoint(tmp_path, SMALL)
    with pytest.raises(ValueError, match=r"last\.ckpt has \d+ tensor\(s\) the configured model lacks") as err:
        convert_taming_checkpoint(ckpt, tmp_path / "vq", dict(SMALL, **smaller))
    assert "'num_res_blocks'" in str(err.value) and "'decoder." in str(err.value)  # the config, the first names
