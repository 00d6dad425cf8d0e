"""The DeepSpeed part of an experiment file: its keys checked (a near miss of a known key, or a section
DeepSpeed would ignore or fail on late, is refused as the file is read), and the config a run hands to
``deepspeed.initialize``: batch sizes derived for the world size, precision resolved, the keys the fast step
sets.

DeepSpeed's keys are the truth for batch sizes; this fills in what it would derive and refuses what it
would get wrong silently (a ``train_batch_size`` that is no multiple of the ranks trained at a rounded-down
batch).
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Optional

import torch

from .config import ConfigError, section_names
from .precision import resolve_bf16


def zero_stage(ds: dict) -> int:
    """The ZeRO stage of a DeepSpeed config (a run's, or a checkpoint's saved one)."""
    return (ds.get("zero_optimization") or {}).get("stage", 0)


@dataclass
class RunDeepSpeedConfig:
    ds: dict  # what deepspeed.initialize takes
    micro: int  # train_micro_batch_size_per_gpu
    gas: int  # gradient_accumulation_steps
    bf16: bool
    bf16_why: str  # how "auto" (or the config) decided, for the log


def derive_batch(ds_config: dict, world: int, resumed: Optional[tuple] = None) -> tuple[dict, int, int, str]:
    """(config with micro-batch and accumulation set and train_batch_size removed, micro, gas, what a resume on
    another number of ranks chose: "" otherwise). ``resumed``: the checkpoint's (micro, gas, ranks)."""
    if resumed is not None and resumed[2] != world:
        return _derive_for_another_world(ds_config, world, *resumed)
    ds = dict(ds_config)
    micro = ds.get("train_micro_batch_size_per_gpu")
    gas = ds.get("gradient_accumulation_steps", 1)
    total = ds.get("train_batch_size")
    if micro is None:
        if total is None:
            raise ConfigError("set train_micro_batch_size_per_gpu or train_batch_size in the config")
        micro = total // (gas * world)
        if micro < 1:
            raise ConfigError(f"train_batch_size={total} cannot give each of {world} rank(s) "
                              f"a micro-batch over gradient_accumulation_steps={gas}")
        if micro * gas * world != total:
            raise ConfigError(
                f"train_batch_size={total} is not a multiple of {world} rank(s) x gradient_accumulation_steps="
                f"{gas}: set a train_batch_size that is (e.g. {micro * gas * world}), or set "
                "train_micro_batch_size_per_gpu instead")
    elif total is not None and micro * gas * world != total:  # DeepSpeed's own rule; it was dropped unread
        raise ConfigError(
            f"train_batch_size={total} but train_micro_batch_size_per_gpu={micro} x gradient_accumulation_steps="
            f"{gas} x {world} rank(s) = {micro * gas * world}: remove one of the keys or make them agree")
    return _set_batch(ds, micro, gas) + ("",)


def _set_batch(ds: dict, micro: int, gas: int) -> tuple[dict, int, int]:
    ds["train_micro_batch_size_per_gpu"] = micro
    ds["gradient_accumulation_steps"] = gas
    ds.pop("train_batch_size", None)  # derived by DeepSpeed from the two above and the world size
    return ds, micro, gas


def _derive_for_another_world(ds_config: dict, world: int, then_micro: int, then_gas: int,
                              then_world: int) -> tuple[dict, int, int, str]:
    """A resume on another number of ranks keeps the global batch: the config's ``train_batch_size``, or
    without one the checkpoint's (the config's micro-batch x accumulation x ranks was that of the old
    world). The checkpoint's micro-batch is kept where the global batch allows, accumulation adapting: the
    slots (engine/streams.py) and so the draws and the losses are then the uninterrupted run's. Otherwise
    the micro-batch adapts, and the random streams start afresh (the data position is kept either way)."""
    ds = dict(ds_config)
    total = ds.get("train_batch_size") or then_micro * then_gas * then_world
    origin = "train_batch_size" if ds.get("train_batch_size") else "the checkpoint's global batch"
    micro = ds.get("train_micro_batch_size_per_gpu") if ds.get("train_batch_size") is None else None
    was = f"(the checkpoint: {then_world} rank(s) x micro-batch {then_micro} x accumulation {then_gas})"
    for m in ([micro] if micro else [then_micro, *range(min(then_micro, total // world), 0, -1)]):
        if total % (m * world) == 0:
            gas = total // (m * world)
            kept = m == then_micro
            note = (f"resuming on {world} rank(s): global batch {total} ({origin}) as micro-batch {m} x "
                    f"accumulation {gas} {was}; " + (
                        "the same data slots, so the same random draws as the uninterrupted run" if kept else
                        "another micro-batch, so the random streams start afresh (the data position is kept)"))
            return _set_batch(ds, m, gas) + (note,)
    raise ConfigError(f"resuming on {world} rank(s): the global batch {total} ({origin}) is no multiple of "
                      f"{world} x train_micro_batch_size_per_gpu={micro} {was}; resume on a number of ranks that "
                      "divides it, or set train_batch_size (and no micro-batch) to let the micro-batch adapt")


def fast_step_settings(ds: dict) -> None:
    """The DeepSpeed keys the fast step (``train.fast``) sets in ``ds`` where the config leaves them unset:

    - ``bf16.check_grad_overflow``: in bf16 DeepSpeed checked every gradient tensor for inf/NaN before each
      step (seven small ops per parameter tensor: ~2100 of the ~7300 kernel-launching ops of an imagenet-246m
      step, and two more reads). Off, DeepSpeed steps on non-finite gradients as ZeRO 0 does, and the fast
      step flags them on the device from DeepSpeed's global norm (inf then) and stops at the next flush,
      before any save; with the key set true DeepSpeed skips such a step as before;
    - ``timers.throughput``: DeepSpeed's throughput timer synchronised the device at every forward and step
      (two stalls a step) to time steps it never reports here (the trainer logs its own images/s).
    """
    if ds.get("bf16", {}).get("enabled"):
        ds["bf16"] = {"check_grad_overflow": False, **ds["bf16"]}
    timers = dict(ds.get("timers") or {})
    timers["throughput"] = {"enabled": False, **(timers.get("throughput") or {})}
    ds["timers"] = timers


def build_ds_config(ds_config: dict, world: int, device: torch.device, *, fast: bool,
                    resumes_zero0_bf16: bool, log, resumed_batch: Optional[tuple] = None) -> RunDeepSpeedConfig:
    """The run's DeepSpeed config. ``resumes_zero0_bf16``: whether the run resumes a ZeRO 0 bf16 checkpoint
    (refused for new runs; its stage and precision cannot change on resume, so it may go on as it was);
    ``resumed_batch``: the resumed checkpoint's (micro-batch, accumulation, ranks)."""
    ds, micro, gas, chosen = derive_batch(ds_config, world, resumed_batch)
    if chosen:
        log(chosen)
    ds.setdefault("zero_allow_untested_optimizer", True)  # torch AdamW as the client optimizer
    ds.setdefault("steps_per_print", 10**9)  # our own logging
    # DeepSpeed takes a bool: "auto" becomes one here, and the run's config records which
    bf16, why = resolve_bf16(ds.get("bf16", {}).get("enabled", False), device)
    ds["bf16"] = {**ds.get("bf16", {}), "enabled": bf16}
    if fast:
        fast_step_settings(ds)
    if bf16 and zero_stage(ds) == 0:
        if not resumes_zero0_bf16:
            raise ConfigError(
                f"zero_optimization.stage 0 with bf16 ({why}) is not supported: DeepSpeed then wraps the "
                "optimizer in its FP16_UnfusedOptimizer, which takes one AdamW step on zero gradients as it "
                "starts (Adam's bias correction runs a step ahead, weight decay applies once before training; "
                "the loss was 4% higher after 12 steps) and reduces gradients in bf16. Use stage 1 (on one "
                "rank the same training as 0) or 2, or bf16.enabled false")
        log("warning: resuming a ZeRO 0 bf16 run, which is no longer accepted for new runs: DeepSpeed's "
            "FP16_UnfusedOptimizer took one AdamW step on zero gradients as that run started (its "
            "later steps are sound); train new runs at stage 1 or 2")
    return RunDeepSpeedConfig(ds, micro, gas, bf16, why)


def near_deepspeed_key(dotted: str) -> None:
    """A ``--set`` key that is no vqlcmd section's but close to a DeepSpeed key (``gradient_clippin``): a
    ConfigError saying which, as the config file's own check does (not 'unknown key vqlcmd....')."""
    import difflib

    first = dotted.split(".", 1)[0]
    sections = section_names()
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
    return first in _DEEPSPEED_KEYS and first not in section_names()


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
