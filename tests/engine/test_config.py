import json
import subprocess
import sys
from pathlib import Path

import pytest

from vqlcmd.engine.config import ConfigError, load_config, parse_vqlcmd_section, resolve_config_path

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", ["ds_digits.json", "ds_imagenet.json", "ds_ffhq.json"])
def test_shipped_configs_parse(name):
    ds, cfg = load_config(name)
    assert "vqlcmd" not in ds
    assert resolve_config_path(name) == REPO / "configs" / name


def test_imagenet_config_is_the_paper_setup():
    ds, cfg = load_config("ds_imagenet.json")
    from vqlcmd.model import preset_config

    den = preset_config(cfg.model.preset, **cfg.model.overrides)
    assert (den.depth, den.heads, den.width) == (24, 16, 768)
    assert (den.codebook_size, den.embed_dim, den.seq_len, den.num_classes) == (1024, 256, 256, 1000)
    assert ds["train_batch_size"] == 128 and ds["bf16"]["enabled"] and ds["zero_optimization"]["stage"] == 2
    assert (cfg.loss.beta_cm, cfg.loss.beta_dm, cfg.loss.p_drop, cfg.loss.label_drop) == (1.0, 0.005, 0.2, 0.1)
    assert cfg.ema.teacher == 0.99


def test_unknown_keys_are_named():
    with pytest.raises(ConfigError, match=r"unknown key vqlcmd\.loss\.beta_cmm"):
        parse_vqlcmd_section({"loss": {"beta_cmm": 1.0}})
    with pytest.raises(ConfigError, match=r"unknown key vqlcmd\.trian"):
        parse_vqlcmd_section({"trian": {}})


def test_zero3_refused_with_reason(tmp_path):
    p = tmp_path / "z3.json"
    p.write_text(json.dumps({"zero_optimization": {"stage": 3}, "vqlcmd": {}}))
    with pytest.raises(ConfigError, match="EMA teacher"):
        load_config(str(p))


def _run_train(cfg_path, *extra):
    return subprocess.run([sys.executable, str(REPO / "scripts" / "train.py"), "--config", str(cfg_path),
                           "--no-progress", *extra], capture_output=True, text=True, timeout=600)


def test_cli_reports_config_errors(tmp_path, tiny_shards, make_config):
    bad = _run_train(make_config(tmp_path, tmp_path / "missing_shards"))
    assert bad.returncode == 2 and "does not exist" in bad.stderr and "missing_shards" in bad.stderr

    cfg = make_config(tmp_path, tiny_shards)
    unknown = _run_train(cfg, "--set", "loss.bogus=1")
    assert unknown.returncode == 2 and "vqlcmd.loss.bogus" in unknown.stderr

    mismatch = _run_train(cfg, "--set", 'model.overrides={"codebook_size": 32}')
    assert mismatch.returncode == 2 and "codebook_size=32" in mismatch.stderr and "synthetic-test" in mismatch.stderr

    wrong_preset = _run_train(cfg, "--set", "model.preset=digits-1m")
    assert wrong_preset.returncode == 2 and "codebook_size=128" in wrong_preset.stderr


def test_sample_steps_must_be_positive_integers():
    with pytest.raises(ConfigError, match="grid_steps must be a positive integer"):
        parse_vqlcmd_section({"sample": {"grid_steps": 0}})
    with pytest.raises(ConfigError, match="num_steps must be a positive integer"):
        parse_vqlcmd_section({"sample": {"num_steps": "50"}})
    assert parse_vqlcmd_section({"sample": {"grid_steps": 10}}).sample.grid_steps == 10
