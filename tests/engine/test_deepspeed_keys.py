"""The DeepSpeed part of a config is checked against DeepSpeed's own models before anything runs: a misspelt key
is one line naming it (it ended in a 33-line pydantic traceback from deepspeed.initialize, after the data)."""
import importlib.util
from pathlib import Path

import pytest

import vqlcmd.engine.trainer as trainer_module

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("setting, said", [
    ("zero_optimization.stagee=1", "unknown DeepSpeed key zero_optimization.stagee; did you mean 'stage'?"),
    ('zero_optimization.offload_optimizer={"devicee": "none"}',
     "unknown DeepSpeed key zero_optimization.offload_optimizer.devicee; did you mean 'device'?"),
    ("bf16.enabeld=true", "unknown DeepSpeed key bf16.enabeld; did you mean 'enabled'?"),
    ("zero_optimization.reduce_bucket_size=big", "DeepSpeed key zero_optimization.reduce_bucket_size: Input should "
                                                 "be a valid integer"),
])
def test_a_bad_deepspeed_key_is_one_line_from_train_py(monkeypatch, capsys, setting, said):
    def never(*a, **k):
        raise AssertionError("the config was accepted: Trainer reached")

    monkeypatch.setattr(trainer_module, "Trainer", never)
    spec = importlib.util.spec_from_file_location("train_script", REPO / "scripts" / "train.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.main(["--config", "ds_digits.json", "--no-progress", "--set", setting]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("config error: ") and said in err and "\n" not in err, err


def test_the_shipped_deepspeed_sections_pass():
    from vqlcmd.engine.config_file import load_config

    for name in sorted(p.name for p in (REPO / "configs").glob("ds_*.json")):
        load_config(name)
