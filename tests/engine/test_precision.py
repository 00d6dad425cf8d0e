"""bf16.enabled = true / false / "auto": validated with the config, resolved per device by the engine."""
import json

import pytest
import torch

from vqlcmd.engine import precision
from vqlcmd.engine.config import ConfigError
from vqlcmd.engine.config_file import load_config
from vqlcmd.engine.precision import resolve_bf16

CPU = torch.device("cpu")


@pytest.mark.parametrize("value", [True, False])
def test_explicit_setting_is_kept(value):
    assert resolve_bf16(value, CPU) == (value, "set in the config")


@pytest.mark.parametrize("caps, expected", [({"avx512_bf16": True, "amx_bf16": False}, True),
                                            ({"avx512_bf16": False, "amx_bf16": True}, True),
                                            ({"avx512_bf16": False, "amx_bf16": False, "avx512_f": True}, False),
                                            ({}, False)])
def test_auto_on_cpu_follows_native_bf16_instructions(monkeypatch, caps, expected):
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: caps)
    on, why = resolve_bf16("auto", CPU)
    assert on is expected
    assert why.startswith("auto: this CPU " + ("has" if expected else "lacks"))


def test_auto_on_this_cpu_matches_cpuinfo():
    """An independent reading of the same fact: the kernel's CPU flags."""
    try:
        flags = open("/proc/cpuinfo").read().split()
    except OSError:
        pytest.skip("no /proc/cpuinfo")
    assert precision.cpu_has_native_bf16() == ("avx512_bf16" in flags or "amx_bf16" in flags)


@pytest.mark.parametrize("bad", ["yes", 1, None, "Auto"])
def test_other_values_are_refused_with_the_key(tmp_path, bad):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"bf16": {"enabled": bad}, "vqlcmd": {}}))
    with pytest.raises(ConfigError, match=r'bf16\.enabled must be true, false or "auto"'):
        load_config(str(path))


def test_auto_is_accepted_by_the_config():
    ds, _ = load_config("ds_digits.json")
    assert ds["bf16"]["enabled"] == "auto"


@pytest.mark.parametrize("capability, expected", [((7, 0), False), ((7, 5), False), ((8, 0), True), ((9, 0), True)])
def test_auto_on_a_gpu_is_bf16_from_ampere_on_only(monkeypatch, capability, expected):
    # torch counts the emulated bf16 of a V100 or T4 as support by default: "auto" trained them in bf16
    import types

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda d=None: types.SimpleNamespace(major=capability[0], minor=capability[1]))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: capability)
    monkeypatch.setattr(torch.cuda, "_check_bf16_tensor_supported", lambda d: True)  # a bf16 tensor can be made
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "a GPU")
    on, why = resolve_bf16("auto", torch.device("cuda", 0))
    assert on is expected, why
