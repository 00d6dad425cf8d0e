import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from vqlcmd.engine.config import ConfigError
from vqlcmd.engine.config_file import load_config, parse_vqlcmd_section, resolve_config_path

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
    assert ds["train_batch_size"] == 128 and ds["bf16"]["enabled"] == "auto" and ds["zero_optimization"]["stage"] == 2
    assert (cfg.loss.beta_cm, cfg.loss.beta_dm, cfg.loss.p_drop, cfg.loss.label_drop) == (1.0, 0.005, 0.2, 0.1)
    assert cfg.ema.teacher == 0.99


@pytest.mark.parametrize("name", ["ds_imagenet.json", "ds_ffhq.json"])
def test_full_scale_configs_train_with_the_shifted_schedule(name):
    """The paper's "NS" is a leftward (negative) shift; shift 0 is its "w/o NS" ablation (FFHQ FID 11.19 vs 7.25)."""
    assert load_config(name)[1].schedule.shift < 0


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


@pytest.mark.parametrize("ds, match", [
    ({"gradient_clippin": 1.0}, r"unknown DeepSpeed key 'gradient_clippin'; did you mean 'gradient_clipping'\?"),
    ({"zero_optimisation": {"stage": 2}}, r"did you mean 'zero_optimization'\?"),
    ({"optimizer": {"type": "Adam", "params": {"lr": 0.5}}}, r"DeepSpeed 'optimizer' section is not used: .*"
                                                             r"vqlcmd\.optimizer"),
    ({"scheduler": {"type": "WarmupLR"}}, r"DeepSpeed 'scheduler' section is not used"),
    ({"gradient_clipping": "1.0"}, r"gradient_clipping must be a number >= 0 \(0: off\), got '1\.0'"),
    ({"gradient_clipping": -1}, r"gradient_clipping must be a number >= 0"),
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}},
     r"zero_optimization\.offload_optimizer is not supported"),
    ({"zero_optimization": {"stage": "2"}}, r"zero_optimization\.stage must be the integer 0, 1 or 2, got '2'"),
    # what --set bf16=true or --set zero_optimization=null gives: an AttributeError traceback before
    ({"bf16": True}, r"bf16 must be a JSON object .* got True"),
    ({"zero_optimization": None}, r"zero_optimization must be a JSON object .* got None"),
])
def test_deepspeed_keys_that_would_be_ignored_or_fail_late_are_refused(tmp_path, ds, match):
    """Each ran before: a typo or an optimizer section without effect, a string clip failing at step 1, offload
    failing inside DeepSpeed with a traceback."""
    p = tmp_path / "c.json"
    p.write_text(json.dumps({**ds, "vqlcmd": {}}))
    with pytest.raises(ConfigError, match=match):
        load_config(str(p))


def test_an_unknown_deepspeed_key_far_from_any_known_one_is_a_warning(tmp_path):
    p = tmp_path / "c.json"
    p.write_text(json.dumps({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "none"}},
                             "my_own_note": "x", "vqlcmd": {}}))
    with pytest.warns(UserWarning, match="'my_own_note' is not a DeepSpeed key this engine knows"):
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
        parse_vqlcmd_section({"sample": {"num_steps": 0}})
    with pytest.raises(ConfigError, match="num_steps must be an integer"):
        parse_vqlcmd_section({"sample": {"num_steps": "50"}})
    assert parse_vqlcmd_section({"sample": {"grid_steps": 10}}).sample.grid_steps == 10
    assert parse_vqlcmd_section({"sample": {"guidance_interval": [0, 0.75]}}).sample.guidance_interval == [0.0, 0.75]


@pytest.mark.parametrize("section, message", [
    # a string for a bool was true to the dataclass: --set train.resume=False kept resuming
    ({"train": {"resume": "False"}}, r"vqlcmd\.train\.resume must be true or false \(JSON, lower case\), got 'False'"),
    ({"embedding": {"frozen": "false"}}, r"vqlcmd\.embedding\.frozen must be true or false"),
    ({"train": {"steps": "abc"}}, r"vqlcmd\.train\.steps must be an integer, got 'abc'"),
    ({"train": {"steps": 20.5}}, r"vqlcmd\.train\.steps must be an integer, got 20\.5"),
    ({"train": {"seed": True}}, r"vqlcmd\.train\.seed must be an integer, got True"),
    ({"schedule": {"shift": "abc"}}, r"vqlcmd\.schedule\.shift must be a finite number"),
    ({"loss": {"beta_cm": float("nan")}}, r"vqlcmd\.loss\.beta_cm must be a finite number, got nan"),
    ({"train": {"output_dir": 123}}, r"vqlcmd\.train\.output_dir must be a string, got 123"),
    ({"data": {"shards": 5}}, r"vqlcmd\.data\.shards must be a string, got 5"),
    ({"optimizer": {"betas": 0.9}}, r"vqlcmd\.optimizer\.betas must be a list of numbers, got 0\.9"),
    ({"model": {"overrides": [1]}}, r"vqlcmd\.model\.overrides must be a JSON object"),
])
def test_values_have_their_fields_types(section, message):
    with pytest.raises(ConfigError, match=message):
        parse_vqlcmd_section(section)


@pytest.mark.parametrize("section, message", [
    ({"train": {"steps": -5}}, r"vqlcmd\.train: steps must be a positive integer, got -5"),
    ({"train": {"log_every": 0}}, r"log_every must be a positive integer"),
    ({"train": {"checkpoint_every": -1}}, r"checkpoint_every must be a non-negative integer \(0: off\)"),
    ({"train": {"keep_checkpoints": -1}}, r"keep_checkpoints must be a non-negative integer \(0: keep all\)"),
    ({"optimizer": {"lr": -1}}, r"vqlcmd\.optimizer: lr must be positive, got -1\.0"),
    ({"optimizer": {"betas": [0.9, 1.0]}}, r"betas must be two numbers in \[0, 1\)"),
    ({"optimizer": {"betas": [0.9]}}, r"betas must be two numbers in \[0, 1\)"),
    ({"optimizer": {"min_lr_ratio": 2}}, r"min_lr_ratio must be in \[0, 1\]"),
    ({"ema": {"teacher": 2}}, r"vqlcmd\.ema: teacher must be in \[0, 1\), got 2\.0"),
    ({"ema": {"sampling": 1}}, r"vqlcmd\.ema: sampling must be in \[0, 1\), got 1\.0"),
    ({"schedule": {"t_min": 0}}, r"t_min must be in \(0, 0\.5\)"),
    ({"sample": {"guidance_scale": -1}}, r"guidance_scale must be non-negative"),
    ({"data": {"tokenizer_steps": 0}}, r"tokenizer_steps must be a positive integer"),
])
def test_values_out_of_range_are_named(section, message):
    with pytest.raises(ConfigError, match=message):
        parse_vqlcmd_section(section)


def test_json_numbers_and_lists_are_converted():
    cfg = parse_vqlcmd_section({"schedule": {"shift": 1}, "optimizer": {"betas": [0.5, 0.9]},
                                "data": {"shards": None}, "sample": {"grid_steps": None}})
    assert cfg.schedule.shift == 1.0 and isinstance(cfg.schedule.shift, float)
    assert cfg.optimizer.betas == (0.5, 0.9)
    assert cfg.data.shards is None and cfg.sample.grid_steps is None


def test_cli_set_needs_a_typed_key_value(tmp_path, tiny_shards, make_config):
    cfg = make_config(tmp_path, tiny_shards)
    python_bool = _run_train(cfg, "--set", "train.resume=False")
    assert python_bool.returncode == 2 and "vqlcmd.train.resume must be true or false" in python_bool.stderr
    no_value = _run_train(cfg, "--set", "train.steps")
    assert no_value.returncode == 2 and "--set takes KEY=VALUE (a JSON value), got 'train.steps'" in no_value.stderr
    not_a_section = _run_train(cfg, "--set", "train.steps.x=1")
    assert not_a_section.returncode == 2 and "train.steps is not a section" in not_a_section.stderr


def test_cli_names_a_damaged_checkpoint(tmp_path, tiny_shards, make_config):
    cfg = make_config(tmp_path, tiny_shards, steps=2)
    assert _run_train(cfg).returncode == 0
    (states,) = (tmp_path / "run" / "checkpoints" / "step_0000002").glob("*model_states.pt")
    states.write_bytes(b"")
    damaged = _run_train(cfg, "--set", "train.steps=3")
    assert damaged.returncode == 2, damaged.stderr[-2000:]
    # (issue 45: the one checkpoint fails its manifest, is set aside, and no other verifies)
    assert "checkpoint error: no checkpoint in" in damaged.stderr and states.name in damaged.stderr
    fresh = _run_train(cfg, "--set", "train.resume=false")
    assert fresh.returncode == 2 and "config error: train.resume is false but" in fresh.stderr


@pytest.mark.parametrize("key, value", [("train_micro_batch_size_per_gpu", 0), ("gradient_accumulation_steps", 0),
                                        ("train_batch_size", "64"), ("train_micro_batch_size_per_gpu", True)])
def test_batch_keys_must_be_positive_integers(tmp_path, key, value):
    p = tmp_path / "c.json"
    p.write_text(json.dumps({key: value, "vqlcmd": {}}))
    with pytest.raises(ConfigError, match=f"{key} must be a positive integer, got {value!r}"):
        load_config(str(p))


def test_cli_names_a_corrupt_shard(tmp_path, tiny_shards, make_config):
    shard = tiny_shards / "shard_00001.vqtok"
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0xFF  # one flipped byte in the tokens
    shard.write_bytes(bytes(data))
    proc = _run_train(make_config(tmp_path, tiny_shards, steps=1))
    assert proc.returncode == 2 and "data error: token shard" in proc.stderr and "checksum mismatch" in proc.stderr


def test_a_retired_key_of_an_older_saved_config_is_ignored_with_a_warning():
    # every run's config.json from before data.num_workers was removed holds it; relaunching one must work
    with pytest.warns(UserWarning, match=r"vqlcmd\.data\.num_workers is no longer used and is ignored"):
        cfg = parse_vqlcmd_section({"data": {"num_workers": 2, "dataset": "digits"}})
    assert cfg.data.dataset == "digits"
    with pytest.raises(ConfigError, match=r"unknown key vqlcmd\.train\.num_workers"):
        parse_vqlcmd_section({"train": {"num_workers": 2}})



def test_a_trainer_built_from_a_config_made_in_code_checks_the_deepspeed_keys_too(tmp_path, tiny_shards, make_config):
    from vqlcmd.engine.trainer import Trainer

    ds, cfg = load_config(str(make_config(tmp_path, tiny_shards)))
    with pytest.raises(ConfigError, match=r"the DeepSpeed config: zero_optimization\.stage=3 is not supported"):
        Trainer({**ds, "zero_optimization": {"stage": 3}}, cfg, log=lambda *a, **k: None)


@pytest.mark.parametrize("overrides, match", [
    ({"embed_dim": "16x"}, r"vqlcmd\.model: overrides\.embed_dim must be an integer >= 1, got '16x'"),
    ({"embed_dim": -4}, r"overrides\.embed_dim must be an integer >= 1, got -4"),
    ({"nosuch": 3}, r"overrides\.nosuch is not a denoiser setting \(known: codebook_size, "),
    ({"attn_dropout": "0.1"}, r"overrides\.attn_dropout must be a finite number >= 0"),
    # values of the right type that the denoiser cannot run: they failed in the first training step
    ({"width": 130, "heads": 4}, r"vqlcmd\.model: preset 'tiny' with overrides .*width 130 must be divisible by heads 4"),
    ({"attention_backend": "flash"}, r"attention_backend must be one of"),
])
def test_model_overrides_are_checked_with_the_other_keys(overrides, match):
    """They failed only once the model was built (after the digits tokenizer's minutes), in a traceback."""
    with pytest.raises(ConfigError, match=match):
        parse_vqlcmd_section({"model": {"preset": "tiny", "overrides": overrides}})
    ok = parse_vqlcmd_section({"model": {"preset": "tiny", "overrides": {"depth": 1, "mlp_ratio": 2, "num_classes": 0}}})
    assert ok.model.overrides == {"depth": 1, "mlp_ratio": 2, "num_classes": 0}


def test_unknown_preset_is_a_config_error():
    with pytest.raises(ConfigError, match=r"vqlcmd\.model: preset: unknown denoiser preset 'nope'"):
        parse_vqlcmd_section({"model": {"preset": "nope"}})


def test_set_applies_before_the_methods_switches(tmp_path, monkeypatch):
    """--set edited the parsed config, after the file's method had forced its switches: --set method=vqlcmd on
    a csdm config trained a run called vqlcmd with CSDM's loss (no L_CM, VLB weighting, no dropping)."""
    import importlib.util

    import vqlcmd.engine.trainer as trainer_module

    p = tmp_path / "csdm.json"
    p.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "vqlcmd": {"method": "csdm"}}))
    seen = {}

    class Stop(Exception):
        pass

    def capture(ds, cfg, **kw):
        seen["cfg"] = cfg
        raise Stop

    monkeypatch.setattr(trainer_module, "Trainer", capture)
    spec = importlib.util.spec_from_file_location("train_script", REPO / "scripts" / "train.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    with pytest.raises(Stop):
        script.main(["--config", str(p), "--set", "method=vqlcmd"])
    cfg = seen["cfg"]
    assert cfg.method == "vqlcmd" and cfg.loss == parse_vqlcmd_section({}).loss  # the defaults, not CSDM's
    with pytest.raises(Stop):
        script.main(["--config", str(p)])
    assert seen["cfg"].loss.beta_cm == 0 and seen["cfg"].loss != parse_vqlcmd_section({}).loss


@pytest.mark.parametrize("section, match", [
    ({"sample": {"sampler": "ddim2"}}, r"vqlcmd\.sample: sampler must be one of ancestral, ddim, got 'ddim2'"),
    ({"sample": {"final": "max"}}, r"vqlcmd\.sample: final must be one of sample, argmax"),
    ({"sample": {"guidance_interval": [0.8, 0.2]}},
     r"vqlcmd\.sample: guidance_interval must satisfy 0 <= lo <= hi <= 1, got \[0\.8, 0\.2\]"),
    ({"sample": {"guidance_interval": 0.5}}, r"vqlcmd\.sample: guidance_interval must be two noise levels"),
    ({"train": {"backend": "foo"}}, r"vqlcmd\.train: backend must be one of auto, reference, compiled, triton"),
    ({"schedule": {"t_min": 0.6}}, r"vqlcmd\.schedule: t_min must be in \(0, 0\.5\)"),
    ({"loss": {"beta_cm": -1}}, r"vqlcmd\.loss: beta_cm must be a finite number >= 0"),
    ({"train": {"seed": -1}}, r"vqlcmd\.train: seed must be an integer in \[0, 2\*\*31\)"),
])
def test_values_that_failed_late_are_config_errors(section, match):
    """Each passed the config and failed at the first preview grid (before the first checkpoint), at the
    first step, once the model was built, or (negative weights) trained without complaint."""
    with pytest.raises(ConfigError, match=match):
        parse_vqlcmd_section(section)


def test_cli_set_reaches_the_deepspeed_part(tmp_path, tiny_shards, make_config):
    """`--set train_batch_size=16` was 'unknown key vqlcmd.train_batch_size': the only way to shrink a
    shipped config's batch for a small data set was to copy the file."""
    from vqlcmd.engine.ds_config import is_deepspeed_key

    assert [is_deepspeed_key(k) for k in ("train_batch_size", "zero_optimization.stage", "bf16.enabled",
                                           "optimizer.lr", "train.steps", "gradient_clippin")] == \
        [True, True, True, False, False, False]  # optimizer: the vqlcmd section's; a typo: vqlcmd's error
    stage3 = _run_train(make_config(tmp_path, tiny_shards), "--set", "zero_optimization.stage=3")
    assert stage3.returncode == 2 and "zero_optimization.stage=3 is not supported" in stage3.stderr
    p = tmp_path / "c.json"
    p.write_text(json.dumps({"train_batch_size": 128, "vqlcmd": {}}))
    ds, _ = load_config(str(p), edit_deepspeed=lambda raw: raw.update(train_batch_size=16))
    assert ds["train_batch_size"] == 16


def test_a_run_too_short_for_its_warm_up_or_ema_is_warned_about():
    from vqlcmd.engine.trainer import run_length_warnings

    short = parse_vqlcmd_section({"train": {"steps": 20}, "optimizer": {"warmup_steps": 5000},
                                  "ema": {"sampling": 0.9999, "teacher": 0.99}})
    found = run_length_warnings(short)
    assert len(found) == 2
    assert "optimizer.warmup_steps 5000 >= train.steps 20" in found[0]
    assert "ema.sampling 0.9999 keeps 100% of the initial weights after train.steps 20" in found[1]
    assert run_length_warnings(load_config("ds_digits.json")[1]) == []  # the quick start's own: nothing to say


def test_set_names_a_misspelt_deepspeed_key_and_a_bad_optimizer_impl(tmp_path, tiny_shards, make_config):
    typo = _run_train(make_config(tmp_path, tiny_shards), "--set", "gradient_clippin=1")
    assert typo.returncode == 2 and "did you mean the DeepSpeed key 'gradient_clipping'" in typo.stderr
    from vqlcmd.engine.ds_config import near_deepspeed_key

    for near_a_section in ("optimiser.lr", "schedul.shift"):  # vqlcmd's error names those sections' keys
        near_deepspeed_key(near_a_section)
    # optimizer.impl was checked only when the optimizer was built (after the digits tokenizer's minutes)
    with pytest.raises(ConfigError, match=r"impl must be 'torch' or 'apex', got 'foo'"):
        parse_vqlcmd_section({"optimizer": {"impl": "foo"}})


def test_cli_refuses_a_second_run_into_a_held_folder_by_name(tmp_path, tiny_shards, make_config):
    """Two launches into one train.output_dir wrote the same checkpoints (issue 47): the second is refused,
    naming the folder and the live holder, and exits 2 without touching the first's files."""
    import json as _json
    import os
    import signal

    cfg = make_config(tmp_path, tiny_shards, steps=1000, log_every=1)
    first = subprocess.Popen([sys.executable, str(REPO / "scripts" / "train.py"), "--config", str(cfg),
                              "--no-progress"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        metrics = tmp_path / "run" / "metrics.jsonl"
        for _ in range(600):  # until the first run is training (it holds the lock from before its first step)
            if metrics.is_file() and metrics.read_text().strip():
                break
            assert first.poll() is None, first.stdout.read()
            time.sleep(0.2)
        second = _run_train(cfg)
        assert second.returncode == 2, second.stderr[-2000:]
        assert f"is in use by another run (host" in second.stderr and f"PID {first.pid}" in second.stderr
        holder = _json.loads((tmp_path / "run" / ".run.lock").read_text())
        assert holder["pid"] == first.pid
    finally:
        os.kill(first.pid, signal.SIGTERM)  # stops at the next step with a checkpoint
        first.wait(timeout=300)
    assert (tmp_path / "run" / "checkpoints" / "latest").is_file()
