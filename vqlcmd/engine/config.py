"""The experiment's schema: one JSON file holds DeepSpeed's keys plus a ``vqlcmd`` section, and this module
is the ``vqlcmd`` section, every key of it, as dataclasses with their defaults and range checks.

It imports the standard library only, so the whole schema reads in one place and nothing of the package runs
when it loads. The names a key may take (samplers, backends, loss strategies) are defined here and imported
by the modules that implement them. What needs the package to check (a model preset and its overrides, the
method's name) and reading a file are in ``config_file``; the DeepSpeed keys are checked in ``ds_config``.

An unknown key anywhere in the section is an error naming the key and where it stood, so a typo never
silently trains with a default. The resolved configuration (defaults filled in) is stored with every
checkpoint and exported pipeline.
"""
from __future__ import annotations

import dataclasses
import math
import os
import typing
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Union

# The names a config chooses from, each the one definition its implementing module imports.
BACKENDS = ("reference", "compiled", "triton")  # the fused ops' implementations (vqlcmd.ops)
OP_BACKENDS = ("auto", *BACKENDS)
DATA_SOURCES = ("shards", "images")
DROP_STRATEGIES = ("fixed", "linear", "random_ratio", "none")  # vqlcmd.diffusion.losses
WEIGHTINGS = ("lcmd", "vlb")
MASK_SCHEDULES = ("cosine", "arccos", "linear", "square")  # vqlcmd.baselines.maskgit
SAMPLERS = ("ancestral", "ddim")  # vqlcmd.samplers
FINALS = ("sample", "argmax")  # the last draw: x ~ P(x | z_0; 0), or its argmax
EVERY_T = (0.0, 1.0)  # the guidance interval that guides every call, as the paper samples


class ConfigError(ValueError):
    pass


def _require(section, rules: tuple[tuple[str, Callable[[Any], bool], str], ...]) -> None:
    """Range checks of a section's fields (their types are checked by ``_build`` before): each rule is
    (field, predicate, what the value must be); None values are skipped."""
    for name, ok, what in rules:
        value = getattr(section, name)
        if value is not None and not ok(value):
            raise ValueError(f"{name} must be {what}, got {value!r}")


def checked_interval(interval) -> tuple[float, float]:
    """``guidance_interval`` as (lo, hi) with 0 <= lo <= hi <= 1; None is every noise level, ``EVERY_T``."""
    if interval is None:
        return EVERY_T
    try:
        lo, hi = (float(v) for v in interval)
    except (TypeError, ValueError):
        raise ValueError(f"guidance_interval must be two noise levels [lo, hi] in [0, 1], got {interval!r}") from None
    if not 0.0 <= lo <= hi <= 1.0:
        raise ValueError(f"guidance_interval must satisfy 0 <= lo <= hi <= 1, got [{lo:g}, {hi:g}]")
    return lo, hi


@dataclass
class ModelSection:
    preset: str = "digits-1m"
    # any DenoiserConfig field, e.g. {"depth": 6}; the preset and these are checked against the denoiser's own
    # settings while the file is parsed (config_file.check_model_section: they need vqlcmd.model)
    overrides: dict = field(default_factory=dict)


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


# The VQ-LCMD objective's switches (vqlcmd.diffusion.losses; docs/method.md §7-8)
@dataclass
class LossConfig:
    beta_dm: float = 0.005  # paper default
    beta_cm: float = 1.0  # paper default; 0 = ablation "without L_CM"
    p_drop: float = 0.2  # random dropping probability (paper default)
    # "fixed": each token dropped with p_drop (paper "rand(r)"); "linear": ratio = t (paper "linear");
    # "random_ratio": ratio ~ U(0,1) per image (paper "rand_drop"); "none": ablation "without RD"
    drop_strategy: str = "fixed"
    label_drop: float = 0.1  # labels set to null for classifier-free guidance (paper: 10%)
    # "lcmd": β_DM · L_DM, uniformly weighted (paper §4.2); "vlb": the plain VLB weight -½ SNR'(t) on L_DM
    # (ablation; the paper's L_∞, which has no β: beta_dm does not apply)
    weighting: str = "lcmd"
    # Our choice (paper silent): L0 decodes the clean, undropped z_0 ~ q(z_0 | x) as in the VLB.
    drop_in_l0: bool = False
    # Our choice: L0 is estimated on the first ceil(l0_fraction * B) images of the (shuffled) batch,
    # an unbiased estimate of the same expectation. 1.0 = every image; below 1 the extra z_0 rows,
    # a third of a step's FLOPs at 1.0, shrink with it (L0 is ~1e-3 nats after a few hundred steps).
    l0_fraction: float = 1.0

    def __post_init__(self):
        if self.drop_strategy not in DROP_STRATEGIES:
            raise ValueError(f"drop_strategy must be one of {DROP_STRATEGIES}, got {self.drop_strategy!r}")
        if self.weighting not in WEIGHTINGS:
            raise ValueError(f"weighting must be one of {WEIGHTINGS}, got {self.weighting!r}")
        if not 0.0 < self.l0_fraction <= 1.0:
            raise ValueError(f"l0_fraction must be in (0, 1], got {self.l0_fraction}")
        for name in ("p_drop", "label_drop"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")
        for name in ("beta_dm", "beta_cm"):  # a negative weight trains the model away from its target
            if not 0.0 <= getattr(self, name) < math.inf:
                raise ValueError(f"{name} must be a finite number >= 0, got {getattr(self, name)}")
        if self.weighting == "vlb" and self.beta_dm != LossConfig.beta_dm:
            warnings.warn(f"loss.beta_dm = {self.beta_dm} is not used: the vlb weighting (the paper's L_∞) weights "
                          "L_DM by -½ SNR'(t) alone, without β_DM", UserWarning, stacklevel=3)

    def to_dict(self) -> dict:
        return asdict(self)


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
    # "torch": torch.optim.AdamW (fused, on CUDA and CPU); "apex": apex FusedAdam (optional install)
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


STEP_IMPLS = ("auto", "flat", "deepspeed")


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
    # Who takes the fast step's gradients and update (vqlcmd.engine.flat_step): "flat" (one flat gradient,
    # clipped and stepped on DeepSpeed's own flat buffers, without its per-gradient hooks), "deepspeed" (its
    # engine's backward and step), or "auto": flat where it can drive the run (train.fast, ZeRO 1/2), the log
    # says which and why
    step: str = "auto"
    # train.compile on CUDA: the compiled loss captured in CUDA graphs (torch.compile's "reduce-overhead")
    cuda_graphs: bool = False
    backend: str = "auto"  # backend of the fused ops (one the method's loss ops all have: build.check_op_backend)
    resume: bool = True  # continue from output_dir/checkpoints/latest when present

    def __post_init__(self):
        # 0 switches the grids and intermediate checkpoints off (the final checkpoint is always written)
        _require(self, (("steps", lambda v: v >= 1, "a positive integer"),
                        ("seed", lambda v: 0 <= v < 2 ** 31, "an integer in [0, 2**31)"),
                        ("log_every", lambda v: v >= 1, "a positive integer"),
                        ("sample_every", lambda v: v >= 0, "a non-negative integer (0: off)"),
                        ("checkpoint_every", lambda v: v >= 0, "a non-negative integer (0: off)"),
                        ("keep_checkpoints", lambda v: v >= 0, "a non-negative integer (0: keep all)"),
                        ("backend", lambda v: v in OP_BACKENDS, f"one of {', '.join(OP_BACKENDS)}"),
                        ("step", lambda v: v in STEP_IMPLS, f"one of {', '.join(STEP_IMPLS)}")))
        if self.step == "flat" and not self.fast:
            raise ValueError("train.step 'flat' is the fast step's (set train.fast true, or train.step 'auto')")


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


# The baselines' sections (vqlcmd.baselines)
@dataclass
class MaskGITConfig:
    train_schedule: str = "cosine"  # γ(r) of the training mask ratio (Chang et al.: cosine)
    label_smoothing: float = 0.1  # Besnier & Chen train with 0.1
    sample_schedule: str = "arccos"  # tokens unmasked per step (Besnier & Chen's default)
    num_steps: int = 8  # the paper's ImageNet MaskGIT rows use 8 (its unconditional table: 200 for every model)
    gumbel_temperature: float = 4.5  # r_temp; the noise decays linearly to 0 over the steps
    softmax_temperature: float = 1.0  # logits are multiplied by it before the softmax
    guidance_ramp: bool = True  # ω · n / (N − 1) at step n (Besnier & Chen); False: constant ω

    def __post_init__(self):
        for name in ("train_schedule", "sample_schedule"):
            if getattr(self, name) not in MASK_SCHEDULES:
                raise ValueError(f"{name} must be one of {MASK_SCHEDULES}, got {getattr(self, name)!r}")
        if self.num_steps < 1:
            raise ValueError(f"num_steps must be >= 1, got {self.num_steps}")
        if not 0.0 <= self.label_smoothing < 1.0:
            raise ValueError(f"label_smoothing must be in [0, 1), got {self.label_smoothing}")

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class CSDMConfig:
    # Our choice (paper silent): scale the frozen codebook by one scalar so its mean row norm is D^{1/4},
    # the expected norm of the paper's N(0, D^{-1/2}) init; the schedule then means the same SNR as for
    # the learned embeddings, and the codebook's geometry (all distances up to that factor) is kept.
    codebook_rescale: bool = True

    def to_dict(self) -> dict:
        return asdict(self)


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


def parse_sections(section: Any) -> VQLCMDConfig:
    """The ``vqlcmd`` section as dataclasses: every key known, typed and in range. The checks that need the
    package (the model preset, the method's name) follow in ``config_file.parse_vqlcmd_section``."""
    return _build(VQLCMDConfig, section, "vqlcmd")


def section_names() -> list:
    """The vqlcmd section's own keys (model, data, loss, ..., optimizer)."""
    return [f.name for f in dataclasses.fields(VQLCMDConfig)]


def resolve_path(p: Optional[str]) -> Optional[Path]:
    """A path from a config or ``--set`` (output_dir, data folders): ``~`` expanded, a relative one taken from
    the working directory, as on a command line; absolute, so that a later change of directory keeps it."""
    if p is None:
        return None
    return Path(os.path.abspath(os.path.expanduser(p)))


repo_path = resolve_path  # the name engine/data.py and trainer.py import
