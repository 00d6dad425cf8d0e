"""The CSDM baselines are switches of the VQ-LCMD loss; CSDM† trains on the frozen VQ codebook."""
import pytest
import torch

from vqlcmd.baselines import CSDM_SWITCHES, codebook_from_tokenizer
from vqlcmd.methods import METHODS, apply_method, build_network
from vqlcmd.engine.config import ConfigError
from vqlcmd.engine.config_file import load_config, parse_vqlcmd_section


def test_methods_set_the_papers_switches():
    vq = parse_vqlcmd_section({})
    assert vq.method == "vqlcmd" and vq.loss.beta_cm == 1.0 and vq.loss.weighting == "lcmd"
    for method in ("csdm", "csdm_l2", "csdm_fixed"):
        cfg = parse_vqlcmd_section({"method": method})
        # CSDM = the VLB of eq. (vlb) without the paper's additions: no L_CM, no RD, no shift
        assert (cfg.loss.beta_cm, cfg.loss.drop_strategy, cfg.loss.weighting, cfg.schedule.shift) == \
            (0.0, "none", "vlb", 0.0)
    assert parse_vqlcmd_section({"method": "csdm"}).embedding.l2_normalize is False
    assert parse_vqlcmd_section({"method": "csdm"}).embedding.frozen is False
    assert parse_vqlcmd_section({"method": "csdm_l2"}).embedding.l2_normalize is True
    assert parse_vqlcmd_section({"method": "csdm_fixed"}).embedding.frozen is True
    # a method forces its switches over the file's values (the resolved config shows what trained)
    forced = parse_vqlcmd_section({"method": "csdm", "loss": {"beta_cm": 1.0}, "schedule": {"shift": -1.0}})
    assert forced.loss.beta_cm == 0.0 and forced.schedule.shift == 0.0
    # vqlcmd and maskgit force nothing
    free = parse_vqlcmd_section({"method": "maskgit", "loss": {"beta_cm": 0.3}})
    assert free.loss.beta_cm == 0.3
    assert set(CSDM_SWITCHES) | {"vqlcmd", "maskgit"} == set(METHODS)


def test_resolved_config_round_trips():
    cfg = parse_vqlcmd_section({"method": "csdm_l2", "maskgit": {"num_steps": 6}})
    again = parse_vqlcmd_section(cfg.to_dict())
    assert again == cfg and apply_method(again) == again


def test_unknown_method_and_keys_are_errors():
    with pytest.raises(ConfigError, match="vqlcmd.method must be one of"):
        parse_vqlcmd_section({"method": "d3pm"})
    with pytest.raises(ConfigError, match=r"unknown key vqlcmd\.maskgit\.steps"):
        parse_vqlcmd_section({"maskgit": {"steps": 3}})


def test_csdm_fixed_network_is_the_codebook(tiny_digits):
    _, tok = tiny_digits
    from vqlcmd.model import preset_config

    cfg = parse_vqlcmd_section({"method": "csdm_fixed", "model": {"preset": "tiny"}})
    net = build_network(cfg, preset_config("tiny"), tok, log=lambda *a: None)
    code = codebook_from_tokenizer(tok, rescale=False)
    assert net.config.embed_dim == code.shape[1] == 4  # D is the codebook's, not the preset's 8
    scaled = net.embedding.weight[:16].detach()
    # one scalar: geometry kept, mean norm D^{1/4}
    ratio = scaled / code
    torch.testing.assert_close(ratio, torch.full_like(ratio, ratio[0, 0].item()), rtol=1e-4, atol=1e-4)
    assert scaled.norm(dim=1).mean().item() == pytest.approx(4 ** 0.25, rel=1e-5)
    assert not net.embedding.weight.requires_grad


@pytest.mark.parametrize("bf16", [False, True])
def test_csdm_fixed_never_updates_the_codebook(tiny_config, tiny_digits, bf16):
    """In bf16 the model holds the codebook rounded to bf16 (and no fp32 copy): the EMAs drifted from the
    fp32 codebook toward it, so the exported table was neither; it is rounded once, before training."""
    from vqlcmd.baselines.csdm import codebook_from_tokenizer
    from vqlcmd.engine.trainer import Trainer

    ds, cfg = load_config(str(tiny_config(steps=4, method="csdm_fixed")))
    tr = Trainer({**ds, "bf16": {"enabled": bf16}}, cfg, log=lambda *a, **k: None)
    code = codebook_from_tokenizer(tiny_digits[1])
    before = tr.net.embedding.weight.detach().float().clone()  # the codebook and the [mask] row
    torch.testing.assert_close(before[:16], code.bfloat16().float() if bf16 else code, rtol=0, atol=0)
    den_before = [p.detach().clone() for p in tr.net.denoiser.parameters()]
    hist = tr.train(progress=False)
    assert len(hist) == 4 and all("l_cm" not in h for h in hist)
    torch.testing.assert_close(tr.net.embedding.weight.detach().float(), before, rtol=0, atol=0)
    for ema in (tr.teacher, tr.sampling_ema):
        torch.testing.assert_close(ema.module.embedding.weight, before, rtol=0, atol=0)
    assert any(not torch.equal(a, b.detach()) for a, b in zip(den_before, tr.net.denoiser.parameters()))


def test_joint_csdm_does_update_the_embeddings(tiny_config):
    from vqlcmd.engine.trainer import Trainer

    ds, cfg = load_config(str(tiny_config(steps=2, method="csdm")))
    tr = Trainer(ds, cfg, log=lambda *a, **k: None)
    before = tr.net.embedding.weight.detach().clone()
    tr.train(progress=False)
    assert not torch.equal(tr.net.embedding.weight.detach(), before)


def test_maskgit_trains_and_exports_its_sampler(tiny_config):
    from vqlcmd.baselines import MaskGITPipeline
    from vqlcmd.engine.trainer import Trainer

    ds, cfg = load_config(str(tiny_config(steps=3, method="maskgit", maskgit={"num_steps": 4})))
    tr = Trainer(ds, cfg, log=lambda *a, **k: None)
    hist = tr.train(progress=False)
    assert set(hist[0]) == {"step", "loss", "ce", "mask_ratio"}
    folder = tr.out_dir / "pipeline"
    pipe = MaskGITPipeline.from_pretrained(folder)
    assert pipe.maskgit.num_steps == 4 and pipe.extra_config["method"] == "maskgit"
    images = pipe([0, 1, 2], output_type="pt", generator=torch.Generator().manual_seed(0))
    assert images.shape == (3, 1, 16, 16) and 0 <= images.min() and images.max() <= 1


def test_a_config_built_in_code_gets_its_methods_switches(tiny_config):
    """The switches were forced only as a file was parsed: replace(cfg, method="csdm") trained the full
    VQ-LCMD loss under the name csdm, and a misspelt method trained VQ-LCMD without a word."""
    import dataclasses

    from vqlcmd.engine.config import ConfigError
    from vqlcmd.engine.trainer import Trainer

    ds, cfg = load_config(str(tiny_config(steps=1)))
    tr = Trainer(ds, dataclasses.replace(cfg, method="csdm"), log=lambda *a, **k: None)
    assert (tr.cfg.loss.beta_cm, tr.cfg.loss.drop_strategy, tr.cfg.loss.weighting) == (0.0, "none", "vlb")
    with pytest.raises(ConfigError, match=r"vqlcmd\.method must be one of .* got 'MaskGIT'"):
        Trainer(ds, dataclasses.replace(cfg, method="MaskGIT"), log=lambda *a, **k: None)


def test_csdm_fixed_resume_with_another_codebook_rescale_is_refused(tiny_config):
    import dataclasses

    from vqlcmd.engine.config import ConfigError
    from vqlcmd.engine.trainer import Trainer

    ds, cfg = load_config(str(tiny_config(steps=1, method="csdm_fixed")))
    Trainer(ds, cfg, log=lambda *a, **k: None).train(progress=False)
    changed = dataclasses.replace(cfg, csdm=dataclasses.replace(cfg.csdm, codebook_rescale=False))
    with pytest.raises(ConfigError, match=r"vqlcmd\.csdm = \{\"codebook_rescale\": true\}"):
        Trainer(ds, changed, log=lambda *a, **k: None)
