"""Reading an experiment file: found by path or shipped name, its ``vqlcmd`` section parsed into the
dataclasses of ``config`` and checked against what the package has (the model presets, the registered
methods), its DeepSpeed part checked by ``ds_config``. Every error is a ``ConfigError`` raised here, before
any data work.
"""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Callable, Optional

from ..methods import METHODS, apply_method
from ..model import DenoiserConfig, preset_config
from .config import ConfigError, ModelSection, VQLCMDConfig, _finite_number, parse_sections
from .ds_config import check_deepspeed_section

# the shipped configs: package data (vqlcmd/configs links to the top-level configs/ in a checkout)
CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"


def check_model_section(model: ModelSection) -> None:
    """The preset exists and each override is a denoiser setting of its type that the preset accepts: else a
    bad one failed only once the model was built (after the digits tokenizer's minutes), naming no key."""
    try:
        _check_model(model)
    except ValueError as exc:
        raise ConfigError(f"vqlcmd.model: {exc}") from exc


def _check_model(model: ModelSection) -> None:
    fields = {f.name: type(f.default) for f in dataclasses.fields(DenoiserConfig)}
    for key, value in model.overrides.items():
        kind = fields.get(key)
        if kind is None:
            raise ValueError(f"overrides.{key} is not a denoiser setting (known: {', '.join(fields)})")
        least = 0 if key == "num_classes" else 1
        ok = {int: isinstance(value, int) and not isinstance(value, bool) and value >= least,
              float: _finite_number(value) and value >= 0,
              bool: isinstance(value, bool), str: isinstance(value, str)}[kind]
        if not ok:
            what = {int: f"an integer >= {least}", float: "a finite number >= 0"}.get(kind, f"a {kind.__name__}")
            raise ValueError(f"overrides.{key} must be {what}, got {value!r}")
    try:  # the preset with these overrides: the denoiser config's own checks (width vs heads, ...)
        preset_config(model.preset, **model.overrides)
    except KeyError as exc:
        raise ValueError(f"preset: {exc.args[0]}") from None
    except ValueError as exc:
        raise ValueError(f"preset {model.preset!r} with overrides {model.overrides}: {exc}") from None


def parse_vqlcmd_section(section: dict) -> VQLCMDConfig:
    """The ``vqlcmd`` section, checked, with its method's switches forced."""
    cfg = parse_sections(section)
    check_model_section(cfg.model)
    if cfg.method not in METHODS:
        raise ConfigError(f"vqlcmd.method must be one of {', '.join(METHODS)}, got {cfg.method!r}")
    return apply_method(cfg)


def resolve_config_path(name: str) -> Path:
    """``--config NAME``: a path (relative to the working directory), or the name of a shipped config."""
    path = Path(os.path.expanduser(name))
    if path.is_file():
        return path
    candidate = (CONFIG_DIR / name).resolve()
    if candidate.is_file():
        return candidate
    shipped = ", ".join(sorted(p.name for p in CONFIG_DIR.glob("*.json")))
    raise ConfigError(f"config {name!r} not found (looked at {path.resolve()} and {candidate}; the shipped "
                      f"configs: {shipped})")


def load_config(name: str, edit: Optional[Callable[[dict], None]] = None,
                edit_deepspeed: Optional[Callable[[dict], None]] = None) -> tuple[dict, VQLCMDConfig]:
    """Returns (the DeepSpeed part of the file, the parsed vqlcmd section). ``edit`` changes the file's
    vqlcmd section in place before it is parsed (``--set``): parsing forces a method's switches, so an edit
    after it could change the method and keep the old one's switches. ``edit_deepspeed`` changes the
    DeepSpeed part before it is checked."""
    path = resolve_config_path(name)
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}: not valid JSON ({exc})") from exc
    if "vqlcmd" not in raw:
        raise ConfigError(f"{path}: missing the 'vqlcmd' section")
    section = raw.pop("vqlcmd")
    if edit is not None:
        if not isinstance(section, dict):
            raise ConfigError(f"vqlcmd must be a JSON object, got {type(section).__name__}")
        edit(section)
    cfg = parse_vqlcmd_section(section)
    if edit_deepspeed is not None:
        edit_deepspeed(raw)
    check_deepspeed_section(raw, path)
    return raw, cfg
