"""Experiment configuration: one JSON file with DeepSpeed's keys plus a ``vqlcmd`` section.

The ``vqlcmd`` section is parsed into dataclasses; an unknown key anywhere in it
is an error naming the key and where it stood, so a typo never silently trains
with a default. The resolved configuration (defaults filled in) is stored with
every checkpoint and exported pipeline.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import typing
import warnings
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Callable, Optional, Union

from ..baselines import CSDMConfig, MaskGITConfig
from ..diffusion import LossConfig
from ..ops import BACKENDS
from ..samplers import FINALS, SAMPLERS, checked_interval

OP_BACKENDS = ("auto", *BACKENDS)
DATA_SOURCES = ("shards", "images")

# the shipped configs: package data (vqlcmd/configs links to the top-level configs/ in a checkout)
CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"


class ConfigError(ValueError):
    pass


def _require(section, rules: tuple[tuple[str, Callable[[Any], bool], str], ...]) -> None:
    """Range checks of a section's fields (their types are checked by ``_build`` before): each rule is
    (field, predicate, what the value must be); None values are skipped."""
    for name, ok, what in rules:
        value = getattr(section, name)
        if value is not None and not ok(value):
            raise ValueError(f"{name} must be {what}, got {value!r}")


@dataclass
class ModelSection:
    preset: str = "digits-1m"
    overrides: dict = field(default_factory=dict)  # any DenoiserConfig field, e.g. {"depth": 6}

    def __post_init__(self):
        # checked here, as every other key is: else a bad one failed only once the model was built (after the
        # digits tokenizer's minutes), in a traceback that named no key
        from ..model import DenoiserConfig

        fields = {f.name: type(f.default) for f in dataclasses.fields(DenoiserConfig)}
        for key, value in self.overrides.items():
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
        from ..model import preset_config

        try:  # the preset with these overrides: the denoiser config's own checks (width vs heads, ...)
            preset_config(self.preset, **self.overrides)
        except KeyError as exc:
            raise ValueError(f"preset: {exc.args[0]}") from None
        except ValueError as exc:
            raise ValueError(f"preset {self.preset!r} with overrides {self.overrides}: {exc}") from None


@dataclass
class DataSection:
    # "digits": the embedded data set, prepared (tokenizer + shards) on first use and cached.
    dataset: Optional[str] = None
    tokenizer_steps: int = 1000  # "digits" only: training steps of the small tokenizer (cached per value)
    shards: Optional[str] = None  # folder of token shards (relative paths: to the working directory)
    tokenizer: Optional[str] = None  # folder of the VQ tokenizer (for decoding sample grids; source "images": encoding)
    # "shards" (pre-tokenized by vqlcmd-tokenize) or "images": the tree is decoded and encoded every epoch
    source: str = "shards"
    images: Optional[str] = None  # "images": the image tree (one folder per class, or flat), as tokenize.py --images
    flip: bool = False  # "images": a random horizontal flip per sample and epoch
    image_backend: str = "auto"  # "images": "dali" (the GPU decoder on CUDA), "pil", "auto" (DALI when installed)
    check_images: str = "header"  # "images": files checked before training ("none", "header", "decode")
    decode_threads: int = 2  # "images": decoding threads per rank

    def __post_init__(self):
        _require(self, (("tokenizer_steps", lambda v: v >= 1, "a positive integer"),
                        ("source", lambda v: v in DATA_SOURCES, f"one of {', '.join(DATA_SOURCES)}"),
                        ("image_backend", lambda v: v in ("auto", "dali", "pil"), "'auto', 'dali' or 'pil'"),
                        ("check_images", lambda v: v in ("none", "header", "decode"), "'none', 'header' or 'decode'"),
                        ("decode_threads", lambda v: v >= 1, "a positive integer")))
        if self.source == "images":
            if self.images is None or self.tokenizer is None:
                raise ValueError("source 'images' needs images (the image tree) and tokenizer (the VQ tokenizer's "
                                 "folder, which encodes them)")
            if self.dataset is not None or self.shards is not None:
                key = "dataset" if self.dataset is not None else "shards"
                raise ValueError(f"source 'images' reads images, not {key}: remove that key (--set data.{key}=null), "
                                 "or set source 'shards'")
        elif self.images is not None or self.flip:  # read by source "images" only: it would be ignored silently
            raise ValueError(f"{'images' if self.images is not None else 'flip'} is read with source 'images' only "
                             "(this run reads token shards; tokenize flipped copies with vqlcmd-tokenize --flip)")


@dataclass
class EmbeddingSection:
    frozen: bool = False  # ablation: fixed embeddings
    l2_normalize: bool = False  # ablation: ℓ2-normalised embeddings


@dataclass
class ScheduleSection:
    shift: float = 0.0
    t_min: float = 1e-4

    def __post_init__(self):
        # (the schedule clamps t to [t_min, 1 - t_min], which is empty from 0.5 on)
        _require(self, (("t_min", lambda v: 0.0 < v < 0.5, "in (0, 0.5)"),))


@dataclass
class EMASection:
    teacher: float = 0.99  # η of the consistency-matching teacher (paper)
    sampling: float = 0.999  # ours: slower EMA used by the exported pipeline

    def __post_init__(self):
        # (1 would be a shadow that never moves; the EMA refuses it, but only once the run has built the model)
        _require(self, tuple((name, lambda v: 0.0 <= v < 1.0, "in [0, 1)") for name in ("teacher", "sampling")))


@dataclass
class OptimizerSection:
    lr: float = 1e-3
    betas: tuple = (0.9, 0.99)
    weight_decay: float = 0.0
    eps: float = 1e-8
    warmup_steps: int = 100
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    # "torch": torch.optim.AdamW (fused on CUDA, foreach on CPU); "apex": apex FusedAdam (optional install)
    impl: str = "torch"

    def __post_init__(self):
        _require(self, (("lr", lambda v: v > 0, "positive"),
                        ("betas", lambda v: len(v) == 2 and all(0.0 <= b < 1.0 for b in v), "two numbers in [0, 1)"),
                        ("weight_decay", lambda v: v >= 0, "non-negative"),
                        ("eps", lambda v: v > 0, "positive"),
                        ("warmup_steps", lambda v: v >= 0, "a non-negative integer"),
                        ("min_lr_ratio", lambda v: 0.0 <= v <= 1.0, "in [0, 1]"),
                        # here, not when the optimizer is built: after the digits tokenizer's minutes
                        ("impl", lambda v: v in ("torch", "apex"), "'torch' or 'apex'")))


@dataclass
class TrainSection:
    steps: int = 1000
    seed: int = 0
    output_dir: str = "runs/digits"
    log_every: int = 20
    sample_every: int = 500
    checkpoint_every: int = 500
    keep_checkpoints: int = 3
    compile: bool = False  # torch.compile the denoiser (with fast: the whole loss, student and teacher)
    # The throughput step (vqlcmd.engine.step): no host reads inside a step (losses checked and logged at
    # log steps, before every checkpoint), both EMAs in one multi-tensor update, the teacher forward on a bf16
    # copy of its fp32 EMA under bf16. Same draws and updates as the default step; see docs/fast_training.md
    fast: bool = False
    backend: str = "auto"  # backend of the fused ops
    resume: bool = True  # continue from output_dir/checkpoints/latest when present

    def __post_init__(self):
        # 0 switches the grids and intermediate checkpoints off (the final checkpoint is always written)
        _require(self, (("steps", lambda v: v >= 1, "a positive integer"),
                        ("seed", lambda v: 0 <= v < 2 ** 31, "an integer in [0, 2**31)"),
                        ("log_every", lambda v: v >= 1, "a positive integer"),
                        ("sample_every", lambda v: v >= 0, "a non-negative integer (0: off)"),
                        ("checkpoint_every", lambda v: v >= 0, "a non-negative integer (0: off)"),
                        ("keep_checkpoints", lambda v: v >= 0, "a non-negative integer (0: keep all)"),
                        ("backend", lambda v: v in OP_BACKENDS, f"one of {', '.join(OP_BACKENDS)}")))


@dataclass
class SampleSection:
    num_steps: int = 50
    guidance_scale: float = 1.0
    sampler: str = "ancestral"
    per_class: int = 10  # images per class in the sample grids (a row each, at most 10 classes: report.grid_classes)
    final: str = "sample"
    # Sampling steps of the grids saved during training (progress previews); None = num_steps. The
    # end-of-run grid and evaluation always use num_steps.
    grid_steps: Optional[int] = None
    # [lo, hi]: guidance only where the sampler's noise level t is in it (vqlcmd.samplers.sample_tokens);
    # None = at every t, as the paper samples
    guidance_interval: Optional[list] = None

    def __post_init__(self):
        if self.guidance_interval is not None:
            self.guidance_interval = list(checked_interval(self.guidance_interval))
        for name in ("num_steps", "grid_steps", "per_class"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        _require(self, (("guidance_scale", lambda v: v >= 0, "non-negative (ω = 0: no guidance)"),
                        ("sampler", lambda v: v in SAMPLERS, f"one of {', '.join(SAMPLERS)}"),
                        ("final", lambda v: v in FINALS, f"one of {', '.join(FINALS)}")))


@dataclass
class VQLCMDConfig:
    # "vqlcmd", or a baseline of the paper in the same engine (vqlcmd/baselines): "maskgit", "csdm_fixed"
    # (CSDM†), "csdm", "csdm_l2". The csdm methods force their loss / embedding / schedule switches.
    method: str = "vqlcmd"
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    loss: LossConfig = field(default_factory=LossConfig)
    embedding: EmbeddingSection = field(default_factory=EmbeddingSection)
    schedule: ScheduleSection = field(default_factory=ScheduleSection)
    ema: EMASection = field(default_factory=EMASection)
    optimizer: OptimizerSection = field(default_factory=OptimizerSection)
    train: TrainSection = field(default_factory=TrainSection)
    sample: SampleSection = field(default_factory=SampleSection)
    maskgit: MaskGITConfig = field(default_factory=MaskGITConfig)  # used by method "maskgit" only
    csdm: CSDMConfig = field(default_factory=CSDMConfig)  # used by method "csdm_fixed" only

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _build(cls, data: Any, where: str):
    if not isinstance(data, dict):
        raise ConfigError(f"{where} must be a JSON object, got {type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    retired = [k for k in data if k in _RETIRED.get(where, ())]
    if retired:  # written into every run's saved config.json by earlier versions: relaunching one must work
        warnings.warn(f"{where}.{retired[0]} is no longer used and is ignored", stacklevel=3)
        data = {k: v for k, v in data.items() if k not in retired}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ConfigError(f"unknown key {where}.{unknown[0]} (known keys of {where}: {', '.join(fields)})")
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for name, value in data.items():
        if dataclasses.is_dataclass(hints[name]):
            kwargs[name] = _build(hints[name], value, f"{where}.{name}")
        else:
            kwargs[name] = _typed(value, hints[name], f"{where}.{name}")
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{where}: {exc}") from exc


# keys that earlier versions had (and wrote into saved configs) and that nothing reads any more
_RETIRED = {"vqlcmd.data": ("num_workers",)}

_TYPE_NAMES = {bool: "true or false (JSON, lower case)", int: "an integer", float: "a finite number", str: "a string",
               dict: "a JSON object", tuple: "a list of numbers"}


def _typed(value: Any, hint: Any, where: str) -> Any:
    """``value`` checked against a field's type (JSON gives ints for floats, lists for tuples: converted).
    The dataclasses alone would take a string for a bool (``--set train.resume=False`` would mean
    true) or a number (failing deep in the run)."""
    if typing.get_origin(hint) is Union:  # Optional[X]
        if value is None:
            return None
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    ok = {bool: lambda v: isinstance(v, bool),
          int: lambda v: isinstance(v, int) and not isinstance(v, bool),
          float: _finite_number,
          str: lambda v: isinstance(v, str),
          dict: lambda v: isinstance(v, dict),
          tuple: lambda v: isinstance(v, (list, tuple)) and all(_finite_number(x) for x in v)}.get(hint)
    if ok is None:  # a field of another type: its dataclass checks it
        return value
    if not ok(value):
        raise ConfigError(f"{where} must be {_TYPE_NAMES[hint]}, got {value!r}")
    return float(value) if hint is float else tuple(value) if hint is tuple else value


def _finite_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def parse_vqlcmd_section(section: dict) -> VQLCMDConfig:
    from ..methods import METHODS, apply_method

    cfg = _build(VQLCMDConfig, section, "vqlcmd")
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


def _section_names() -> list:
    """The vqlcmd section's own keys (model, data, loss, ..., optimizer)."""
    return [f.name for f in fields(VQLCMDConfig)]


def near_deepspeed_key(dotted: str) -> None:
    """A ``--set`` key that is no vqlcmd section's but close to a DeepSpeed key (``gradient_clippin``): a
    ConfigError saying which, as the config file's own check does (not 'unknown key vqlcmd....')."""
    import difflib

    first = dotted.split(".", 1)[0]
    sections = _section_names()
    if first in sections or difflib.get_close_matches(first, sections, n=1, cutoff=0.8):
        return  # a vqlcmd section or a near miss of one ("optimiser"): vqlcmd's own error names its keys
    # not the two DeepSpeed sections the engine refuses (its own optimizer and schedule are vqlcmd's)
    usable = [k for k in _DEEPSPEED_KEYS if k not in ("optimizer", "scheduler")]
    near = difflib.get_close_matches(first, usable, n=1, cutoff=0.8)
    if near:
        raise ConfigError(f"--set {dotted}: {first!r} is not a key; did you mean the DeepSpeed key {near[0]!r}?")


def is_deepspeed_key(dotted: str) -> bool:
    """Whether a ``--set`` key names the DeepSpeed part (``train_batch_size``, ``zero_optimization.stage``,
    ``bf16.enabled``): its first name is a DeepSpeed key and not a vqlcmd section's (``optimizer`` is both,
    and stays the vqlcmd one: the engine builds its own optimizer)."""
    first = dotted.split(".", 1)[0]
    return first in _DEEPSPEED_KEYS and first not in _section_names()


# DeepSpeed keys a run of this engine may set. DeepSpeed ignores keys it does not read, so a misspelt one
# ("gradient_clippin") trained without its setting and said nothing: a near miss of these is an error here.
_DEEPSPEED_KEYS = (
    "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "gradient_clipping",
    "bf16", "fp16", "amp", "zero_optimization", "zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer",
    "optimizer", "scheduler", "steps_per_print", "wall_clock_breakdown", "memory_breakdown", "dump_state",
    "tensorboard", "wandb", "csv_monitor", "comet", "comms_logger", "flops_profiler", "activation_checkpointing",
    "communication_data_type", "seq_parallel_communication_data_type", "prescale_gradients",
    "gradient_predivide_factor", "sparse_gradients", "data_types", "torch_autocast", "compile", "checkpoint",
    "aio", "timers", "dataloader_drop_last", "data_efficiency", "curriculum_learning", "autotuning", "elasticity",
    "compression_training", "pipeline", "eigenvalue", "progressive_layer_drop", "nebula", "hybrid_engine",
    "weight_quantization", "graph_harvesting", "use_data_before_expert_parallelism", "mics_shard_size",
)


def check_deepspeed_section(ds: dict, path, *, warn: bool = True) -> None:
    """Refuses what DeepSpeed would ignore silently or fail on late; ``warn``: also warn of unknown keys (the
    trainer checks again what ``load_config`` checked, for configs built in code, without warning twice)."""
    import difflib

    for key in ds:
        if key in _DEEPSPEED_KEYS:
            continue
        near = difflib.get_close_matches(key, _DEEPSPEED_KEYS, n=1, cutoff=0.8)
        if near:
            raise ConfigError(f"{path}: unknown DeepSpeed key {key!r}; did you mean {near[0]!r}? (DeepSpeed would "
                              "ignore it without a word)")
        if warn:
            warnings.warn(f"{path}: {key!r} is not a DeepSpeed key this engine knows; DeepSpeed ignores keys it "
                          "does not read", stacklevel=2)
    for key in ("optimizer", "scheduler"):
        if key in ds:  # deepspeed.initialize takes the client optimizer and schedule over these, silently
            raise ConfigError(f"{path}: a DeepSpeed {key!r} section is not used: the engine builds AdamW and its "
                              "warm-up + cosine schedule from vqlcmd.optimizer; set the rates there")
    clip = ds.get("gradient_clipping", 0.0)
    if isinstance(clip, bool) or not isinstance(clip, (int, float)) or not clip >= 0:
        raise ConfigError(f"{path}: gradient_clipping must be a number >= 0 (0: off), got {clip!r}")
    for section in ("zero_optimization", "bf16", "fp16"):  # (--set bf16=true reached .get on a bool)
        if section in ds and not isinstance(ds[section], dict):
            raise ConfigError(f"{path}: {section} must be a JSON object (e.g. {{\"enabled\": true}} or "
                              f"{{\"stage\": 2}}), got {ds[section]!r}")
    zero = ds.get("zero_optimization", {})
    offload = [k for k in ("offload_optimizer", "offload_param")
               if isinstance(zero.get(k), dict) and zero[k].get("device", "none") != "none"]
    if offload:
        raise ConfigError(f"{path}: zero_optimization.{offload[0]} is not supported: ZeRO-Offload wants DeepSpeed's "
                          "CPU Adam, and the engine's optimizer is torch's AdamW (or apex's FusedAdam)")
    stage = zero.get("stage", 0)
    if isinstance(stage, bool) or not isinstance(stage, int):
        raise ConfigError(f"{path}: zero_optimization.stage must be the integer 0, 1 or 2, got {stage!r}")
    if stage not in (0, 1, 2):
        raise ConfigError(
            f"{path}: zero_optimization.stage={stage} is not supported: the EMA teacher runs a full forward "
            "every step and needs the whole parameter set on each rank; ZeRO-3 partitions parameters, so "
            "use stage 0, 1 or 2 (which partition optimizer state and gradients only)"
        )
    for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
        value = ds.get(key)
        if value is not None and not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
            raise ConfigError(f"{path}: {key} must be a positive integer, got {value!r}")
    if ds.get("fp16", {}).get("enabled"):
        raise ConfigError(f"{path}: fp16 training is not supported; use bf16 (or fp32)")
    bf16 = ds.get("bf16", {}).get("enabled", False)
    if not (isinstance(bf16, bool) or bf16 == "auto"):  # resolved by vqlcmd.engine.precision
        raise ConfigError(f'{path}: bf16.enabled must be true, false or "auto", got {bf16!r}')
    _check_with_deepspeed_models(ds, path)


# The DeepSpeed sections that DeepSpeed parses with its own pydantic models (module, class): validated up front,
# so that a misspelt key (zero_optimization.stagee) is one line naming it, not a pydantic traceback from
# deepspeed.initialize after the data was prepared.
_DEEPSPEED_MODELS = {
    "zero_optimization": ("deepspeed.runtime.zero.config", "DeepSpeedZeroConfig"),
    "bf16": ("deepspeed.runtime.precision_config", "DeepSpeedBF16Config"),
    "fp16": ("deepspeed.runtime.precision_config", "DeepSpeedFP16Config"),
    "compile": ("deepspeed.compile.config", "CompileConfig"),
    "comms_logger": ("deepspeed.comm.config", "CommsLoggerConfig"),
    "tensorboard": ("deepspeed.monitor.config", "TensorBoardConfig"),
    "wandb": ("deepspeed.monitor.config", "WandbConfig"),
    "csv_monitor": ("deepspeed.monitor.config", "CSVConfig"),
    "comet": ("deepspeed.monitor.config", "CometConfig"),
    "hybrid_engine": ("deepspeed.runtime.config", "HybridEngineConfig"),
}


def _model_keys(model) -> list:
    """A pydantic model's keys, under their names and aliases (``stage3_prefetch_bucket_size``)."""
    return sorted({k for name, f in model.model_fields.items() for k in (name, f.alias) if k})


def _check_with_deepspeed_models(ds: dict, path) -> None:
    import difflib
    import importlib

    for key, (module, name) in _DEEPSPEED_MODELS.items():
        section = ds.get(key)
        if not isinstance(section, dict):
            continue  # (absent, or a type refused above)
        try:
            model = getattr(importlib.import_module(module), name)
            import pydantic
        except (ImportError, AttributeError):  # another DeepSpeed version: deepspeed.initialize checks it
            continue
        if key == "bf16" and section.get("enabled") == "auto":
            section = {**section, "enabled": True}  # resolved by vqlcmd.engine.precision before DeepSpeed sees it
        try:
            model(**section)
        except pydantic.ValidationError as exc:
            err = exc.errors()[0]
            where = ".".join(str(p) for p in (key, *err["loc"]))
            if err["type"] == "extra_forbidden":
                inner = model
                for part in err["loc"][:-1]:  # a nested section's model (offload_optimizer.devicee)
                    hint = inner.model_fields.get(part) if hasattr(inner, "model_fields") else None
                    inner = getattr(hint, "annotation", None)
                    inner = next((a for a in getattr(inner, "__args__", ()) if hasattr(a, "model_fields")), inner)
                known = _model_keys(inner) if hasattr(inner, "model_fields") else []
                near = difflib.get_close_matches(str(err["loc"][-1]), known, n=1, cutoff=0.6)
                raise ConfigError(f"{path}: unknown DeepSpeed key {where}"
                                  + (f"; did you mean {near[0]!r}?" if near else
                                     f" (DeepSpeed's keys there: {', '.join(known)})" if known else "")) from None
            raise ConfigError(f"{path}: DeepSpeed key {where}: {err['msg']} (got {err.get('input')!r})") from None


def resolve_path(p: Optional[str]) -> Optional[Path]:
    """A path from a config or ``--set`` (output_dir, data folders): ``~`` expanded, a relative one taken from
    the working directory, as on a command line; absolute, so that a later change of directory keeps it."""
    if p is None:
        return None
    return Path(os.path.abspath(os.path.expanduser(p)))


repo_path = resolve_path  # the name engine/data.py and trainer.py import
