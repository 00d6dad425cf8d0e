"""A resume with other settings: refused when the objective changes, recorded when the rates or the length
do, and output_dir/config.json never describes weights the run did not train."""
import json

import pytest

from vqlcmd.engine.config import ConfigError
from vqlcmd.engine.config_file import load_config, parse_vqlcmd_section
from vqlcmd.engine.trainer import Trainer


def _quiet(*a, **k):
    pass


def _first_run(tmp_path, tiny_shards, make_config, steps=2):
    ds, cfg = load_config(str(make_config(tmp_path, tiny_shards, steps=steps)))
    Trainer(ds, cfg, log=_quiet).train(progress=False)
    return ds, cfg.to_dict()


def _pipeline_config(tmp_path):
    return json.loads((tmp_path / "run" / "pipeline" / "config.json").read_text())


@pytest.mark.parametrize("key, value", [("beta_cm", 0.0), ("p_drop", 0.5), ("drop_strategy", "none")])
def test_a_resume_with_another_loss_is_refused_by_key_and_config_json_kept(tmp_path, tiny_shards, make_config, key,
                                                                           value):
    ds, section = _first_run(tmp_path, tiny_shards, make_config)
    config = (tmp_path / "run" / "config.json").read_text()
    section["loss"][key] = value
    section["train"]["steps"] = 4
    was = json.dumps(json.loads(config)["vqlcmd"]["loss"][key])
    with pytest.raises(ConfigError, match=rf"was trained with vqlcmd\.loss\.{key} = {was} but this run has "
                                          rf"{json.dumps(value)}; resume with the same loss settings, or train in "
                                          r"another train\.output_dir"):
        Trainer(ds, parse_vqlcmd_section(section), log=_quiet).train(progress=False)
    assert (tmp_path / "run" / "config.json").read_text() == config


def test_a_run_with_nothing_to_train_says_so_and_rewrites_nothing(tmp_path, tiny_shards, make_config):
    ds, section = _first_run(tmp_path, tiny_shards, make_config, steps=3)
    config = (tmp_path / "run" / "config.json").read_text()
    section["train"]["steps"] = 2  # the README's second command after the quick start: fewer steps than done
    section["optimizer"]["lr"] = 1e-4
    lines = []
    tr = Trainer(ds, parse_vqlcmd_section(section), log=lines.append)
    assert tr.train(progress=False) == [] and tr.step == 3
    assert any(line.startswith("nothing to train: the checkpoint in") and "is at step 3 and train.steps is 2" in line
               for line in lines), lines
    assert (tmp_path / "run" / "config.json").read_text() == config
    pipe = _pipeline_config(tmp_path)  # exported again: still the run that trained the weights
    assert pipe["step"] == 3 and pipe["training_config"]["vqlcmd"]["train"]["steps"] == 3
    assert pipe["training_config"]["vqlcmd"]["optimizer"]["lr"] == 3e-3 and "resumes" not in pipe


def test_a_resume_with_other_rates_records_what_changed_and_when(tmp_path, tiny_shards, make_config):
    ds, section = _first_run(tmp_path, tiny_shards, make_config)
    section["train"]["steps"] = 3
    section["optimizer"]["lr"] = 1e-3
    lines = []
    Trainer(ds, parse_vqlcmd_section(section), log=lines.append).train(progress=False)
    said = next(line for line in lines if line.startswith("resuming at step 2 with settings other than"))
    assert "vqlcmd.optimizer.lr 0.001 (was 0.003)" in said and "vqlcmd.train.steps 3 (was 2)" in said
    entry = {"step": 2, "changed": {"vqlcmd.optimizer.lr": [3e-3, 1e-3], "vqlcmd.train.steps": [2, 3]}}
    assert _pipeline_config(tmp_path)["resumes"] == [entry]
    saved = json.loads((tmp_path / "run" / "checkpoints" / "step_0000003" / "config.json").read_text())
    assert saved["resumes"] == [entry]
    run = json.loads((tmp_path / "run" / "config.json").read_text())  # what a relaunch goes on with
    assert run["vqlcmd"]["optimizer"]["lr"] == 1e-3 and run["vqlcmd"]["train"]["steps"] == 3
    # the next resume keeps the earlier record and adds its own
    section["train"]["steps"] = 4
    Trainer(ds, parse_vqlcmd_section(section), log=_quiet).train(progress=False)
    assert _pipeline_config(tmp_path)["resumes"] == [entry, {"step": 3, "changed": {"vqlcmd.train.steps": [3, 4]}}]


def test_a_resume_that_fails_to_load_leaves_config_json(tmp_path, tiny_shards, make_config):
    from vqlcmd.engine.checkpoint import CheckpointError

    ds, section = _first_run(tmp_path, tiny_shards, make_config)
    config = (tmp_path / "run" / "config.json").read_text()
    (states,) = (tmp_path / "run" / "checkpoints" / "step_0000002").glob("*model_states.pt")
    states.write_bytes(states.read_bytes()[:100])
    section["train"]["steps"] = 5
    with pytest.raises(CheckpointError):
        Trainer(ds, parse_vqlcmd_section(section), log=_quiet).train(progress=False)
    assert (tmp_path / "run" / "config.json").read_text() == config


def test_the_readme_command_after_the_quick_start_is_refused_by_train_py(tmp_path, tiny_shards, make_config, capsys):
    """`--set train.steps=200 --set loss.beta_cm=0` on the quick start's folder resumed, trained 0 steps, exited 0
    and rewrote config.json to beta_cm=0."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("train_script",
                                                  Path(__file__).resolve().parents[2] / "scripts" / "train.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    cfg = str(make_config(tmp_path, tiny_shards, steps=3))
    assert script.main(["--config", cfg, "--no-progress"]) == 0
    config = (tmp_path / "run" / "config.json").read_text()
    capsys.readouterr()
    assert script.main(["--config", cfg, "--no-progress", "--set", "train.steps=2", "--set", "loss.beta_cm=0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("config error: ") and "was trained with vqlcmd.loss.beta_cm = 1.0 but this run has 0" in err
    assert (tmp_path / "run" / "config.json").read_text() == config
    assert script.main(["--config", cfg, "--no-progress", "--set", "train.steps=2"]) == 0
    assert "nothing to train: the checkpoint in" in capsys.readouterr().out
    assert (tmp_path / "run" / "config.json").read_text() == config


def test_a_checkpoint_from_before_a_loss_key_existed_still_resumes(tmp_path, tiny_shards, make_config):
    ds, section = _first_run(tmp_path, tiny_shards, make_config)
    saved_file = tmp_path / "run" / "checkpoints" / "step_0000002" / "config.json"
    saved = json.loads(saved_file.read_text())
    del saved["vqlcmd"]["loss"]["l0_fraction"]  # as a version without the key wrote it
    saved_file.write_text(json.dumps(saved))
    (saved_file.parent / "manifest.json").unlink()  # (that version wrote no manifest either)
    section["train"]["steps"] = 3
    history = Trainer(ds, parse_vqlcmd_section(section), log=_quiet).train(progress=False)
    assert [h["step"] for h in history] == [3]
    assert _pipeline_config(tmp_path)["resumes"] == [{"step": 2, "changed": {"vqlcmd.train.steps": [2, 3]}}]


def test_maskgit_resumes_with_other_sampling_settings_but_not_another_training_mask(tmp_path, tiny_shards,
                                                                                    make_config):
    ds, cfg = load_config(str(make_config(tmp_path, tiny_shards, steps=2)))
    section = cfg.to_dict()
    section["method"] = "maskgit"
    Trainer(ds, parse_vqlcmd_section(section), log=_quiet).train(progress=False)
    section["train"]["steps"] = 3
    section["maskgit"]["num_steps"] = 4  # the sampler's: no matter to the weights
    Trainer(ds, parse_vqlcmd_section(section), log=_quiet).train(progress=False)
    section["train"]["steps"] = 4
    section["maskgit"]["label_smoothing"] = 0.0
    with pytest.raises(ConfigError, match=r"vqlcmd\.maskgit\.label_smoothing = 0\.1 but this run has 0\.0"):
        Trainer(ds, parse_vqlcmd_section(section), log=_quiet)
