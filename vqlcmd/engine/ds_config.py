"""The DeepSpeed config a run hands to ``deepspeed.initialize``: batch sizes derived for the world size,
precision resolved, and the keys the fast step sets.

DeepSpeed's keys are the truth for batch sizes; this fills in what it would derive and refuses what it
would get wrong silently (a ``train_batch_size`` that is no multiple of the ranks trained at a rounded-down
batch).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .config import ConfigError
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
