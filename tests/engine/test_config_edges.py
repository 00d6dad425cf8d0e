"""Config validation at the boundaries the docs name (0 = off / keep all, [0, 1] closed), the DeepSpeed
settings that must be refused, and relative paths taken from the working directory."""
import json

import pytest

from vqlcmd.engine.config import ConfigError, repo_path
from vqlcmd.engine.config_file import load_config, parse_vqlcmd_section


def test_the_documented_edge_values_are_accepted():
    """min_lr_ratio 'in [0, 1]' (1: no decay), warmup_steps 'a non-negative integer', keep_checkpoints '0: keep
    all', checkpoint_every / sample_every '0: off'."""
    cfg = parse_vqlcmd_section({"optimizer": {"min_lr_ratio": 1, "warmup_steps": 0},
                                "train": {"keep_checkpoints": 0, "checkpoint_every": 0, "sample_every": 0}})
    assert (cfg.optimizer.min_lr_ratio, cfg.optimizer.warmup_steps) == (1.0, 0)
    assert (cfg.train.keep_checkpoints, cfg.train.checkpoint_every, cfg.train.sample_every) == (0, 0, 0)
    assert parse_vqlcmd_section({"optimizer": {"min_lr_ratio": 0}}).optimizer.min_lr_ratio == 0.0


def _load(tmp_path, ds):
    p = tmp_path / "c.json"
    p.write_text(json.dumps({**ds, "vqlcmd": {}}))
    return load_config(str(p))


def test_gradient_clipping_zero_is_off_and_a_bool_is_refused(tmp_path):
    assert _load(tmp_path, {"gradient_clipping": 0})[0]["gradient_clipping"] == 0
    with pytest.raises(ConfigError, match=r"gradient_clipping must be a number >= 0 \(0: off\), got True"):
        _load(tmp_path, {"gradient_clipping": True})


@pytest.mark.parametrize("ds, match", [
    ({"fp16": {"enabled": True}}, r"fp16 training is not supported; use bf16"),
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme"}}},
     r"zero_optimization\.offload_optimizer is not supported"),
])
def test_settings_the_engine_cannot_train_are_refused(tmp_path, ds, match):
    with pytest.raises(ConfigError, match=match):
        _load(tmp_path, ds)
    assert _load(tmp_path, {"fp16": {"enabled": False}})  # switched off: fine


def test_relative_paths_are_the_working_directorys(tmp_path, monkeypatch):
    """config.py: a relative path in a config is taken from the working directory, as on a command line (not
    from the source checkout, which an installed package does not have), and kept absolute."""
    from vqlcmd.engine.config import DataSection
    from vqlcmd.engine.data import resolve_shards

    (tmp_path / "work" / "shards").mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "work")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert repo_path("runs/digits") == tmp_path / "work" / "runs" / "digits"
    assert repo_path("~/runs") == tmp_path / "runs"
    assert repo_path(str(tmp_path / "abs")) == tmp_path / "abs"
    assert resolve_shards(DataSection(shards="shards"), 0) == (tmp_path / "work" / "shards", None)
    with pytest.raises(ConfigError, match="shard folder .*/work/configs does not exist"):
        resolve_shards(DataSection(shards="configs"), 0)  # the checkout's configs/ is not where it looks
    monkeypatch.chdir(tmp_path)
    assert load_config("ds_digits.json")[1].train.output_dir == "runs/digits"  # shipped configs by name
    assert repo_path("runs/digits") == tmp_path / "runs" / "digits"


def test_a_missing_tokenizer_folder_is_named_before_training(tmp_path):
    from vqlcmd.engine.config import DataSection
    from vqlcmd.engine.data import resolve_shards

    with pytest.raises(ConfigError, match=r"vqlcmd\.data\.tokenizer: folder .*no_tok does not exist"):
        resolve_shards(DataSection(shards=str(tmp_path), tokenizer=str(tmp_path / "no_tok")), 0)
    (tmp_path / "tok").mkdir()
    assert resolve_shards(DataSection(shards=str(tmp_path), tokenizer=str(tmp_path / "tok")), 0) == \
        (tmp_path, tmp_path / "tok")
