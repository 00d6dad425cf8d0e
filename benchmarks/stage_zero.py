"""DeepSpeed ZeRO stages 0, 1 and 2 against each other on the same VQ-LCMD training step.

One process, one rank: the stage sets up a 1-rank process group (gloo on CPU,
nccl on CUDA) and calls ``deepspeed.initialize`` once per ZeRO stage on a fresh
copy of the step of ``stage_train_step`` (same seed, data, losses, clipping,
teacher EMA). On a CPU with native bf16 (AVX512-BF16 / AMX-BF16, where ``bf16.enabled:
"auto"`` trains in bf16, as the quick start does) ``zero2-bf16`` adds DeepSpeed's bf16 mode
at stage 2, without autocast as the engine runs it: its ratio to ``zero2`` is what the
precision buys. With one rank nothing is partitioned across ranks, so this measures
what each stage's machinery costs on top of the step (gradient bucketing,
flattened fp32 partitions, hooks), not the memory it saves with several ranks;
``zero0`` is the baseline. The optimizer is torch's AdamW handed to DeepSpeed as a
client optimizer, so no DeepSpeed op needs a JIT build. Under a launcher with
several ranks this stage stands aside: run it alone with ``python benchmarks/run.py``.
"""
from __future__ import annotations

import contextlib
import logging
import os

import torch

from benchmarks.harness import Context, Skip, StageSkipped, describe_error, run_case
from benchmarks.stage_train_step import GRAD_CLIP, Training, build_training, step_figures
from vqlcmd.engine.distributed import free_port
from vqlcmd.engine.precision import cpu_has_native_bf16

STAGE = "zero"
BASELINE = "zero0"
ZERO_STAGES = (0, 1, 2)


class _LossModule(torch.nn.Module):
    """The step's loss as a module, so the step goes through ``engine(...)`` as a training script's would."""

    def __init__(self, tr: Training):
        super().__init__()
        self.net = tr.net
        self.tr = [tr]  # a list: not registered as a submodule (the teacher is no parameter of the engine)

    def forward(self, tokens, labels):
        return self.tr[0].losses(self.net)["loss"]


@contextlib.contextmanager
def _one_rank_deepspeed(device: torch.device):
    """Import DeepSpeed quietly and make sure a 1-rank process group exists."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise StageSkipped("launched with several ranks; this stage runs in one process")
    try:
        import deepspeed
        from deepspeed.accelerator import get_accelerator
        from deepspeed.utils import logger as ds_logger
    except Exception as exc:  # noqa: BLE001: deepspeed fails at import in many ways
        raise StageSkipped(f"deepspeed is not importable ({type(exc).__name__}: {exc})") from exc
    if (get_accelerator().device_name() == "cpu") != (device.type == "cpu"):
        raise StageSkipped(f"DeepSpeed's accelerator is {get_accelerator().device_name()!r}, the run's device "
                           f"is {device.type!r}")
    level = ds_logger.level
    ds_logger.setLevel(logging.WARNING)  # initialize() logs its whole config at INFO, per engine
    # A single rank never uses the shared-memory all-reduce, whose JIT build takes minutes on 2 cores.
    shm = get_accelerator().create_op_builder("ShareMemCommBuilder")
    compatible = deepspeed.ops.__compatible_ops__
    saved = compatible.get(shm.NAME) if shm is not None else None
    if shm is not None:
        compatible[shm.NAME] = False
    for key, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(free_port())), ("RANK", "0"),
                       ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
        os.environ.setdefault(key, value)
    try:
        deepspeed.init_distributed(dist_backend="nccl" if device.type == "cuda" else "gloo")
        yield deepspeed
    finally:
        ds_logger.setLevel(level)
        if shm is not None:
            if saved is None:
                compatible.pop(shm.NAME, None)
            else:
                compatible[shm.NAME] = saved


def _cases(ctx: Context) -> list[tuple[str, int, dict]]:
    if ctx.quick:
        return [("tiny", 4, {})]
    if ctx.is_cuda:
        return [("ffhq-56m", 64, {})]
    return [("digits-1m", 64, dict(warmup=1, reps=5))]


def _variants(ctx: Context) -> list[tuple[str, int, bool, bool]]:
    """(backend name, ZeRO stage, DeepSpeed bf16, autocast) of each measured engine."""
    if ctx.is_cuda:
        # autocast as well: the fp32 EMA teacher then takes the bf16 activations of the engine's model
        return [(f"zero{stage}", stage, True, True) for stage in ZERO_STAGES]
    cpu = [(f"zero{stage}", stage, False, False) for stage in ZERO_STAGES]
    return cpu + ([("zero2-bf16", 2, True, False)] if cpu_has_native_bf16() else [])


def run(ctx: Context) -> list:
    out: list = []
    with _one_rank_deepspeed(ctx.device) as deepspeed:
        for preset, B, reps in _cases(ctx):
            for name, stage, bf16, amp in _variants(ctx):
                if not ctx.wants(name, baseline=name == BASELINE):
                    continue
                tr = build_training(preset, B, ctx.device, ops_backend="auto", attention_backend="auto",
                                    amp_dtype=torch.bfloat16 if amp else None)
                module = _LossModule(tr)
                config = {
                    "train_micro_batch_size_per_gpu": B,
                    "gradient_accumulation_steps": 1,
                    "gradient_clipping": GRAD_CLIP,
                    "zero_optimization": {"stage": stage},
                    "bf16": {"enabled": bf16},
                    "zero_allow_untested_optimizer": True,
                    "steps_per_print": 10**9,
                }
                opt = torch.optim.AdamW(module.parameters(), lr=1e-4, weight_decay=0.01)
                try:
                    engine, *_ = deepspeed.initialize(model=module, optimizer=opt, config=config)
                except Exception as exc:  # noqa: BLE001
                    out.append(Skip(STAGE, "", name, f"deepspeed.initialize: {describe_error(exc)}", failed=True))
                    continue

                def step(engine=engine, tr=tr):
                    loss = engine(tr.tokens, tr.labels)
                    engine.backward(loss)
                    engine.step()
                    tr.teacher.update(engine.module.net)

                run_case(ctx, out, stage=STAGE, case="loss+bwd+step+ema", backend=name,
                         shape=f"{preset} B{B} M{tr.tokens.shape[1]}", dtype="bf16" if bf16 else "float32",
                         fn=step, baseline=BASELINE, extra=lambda t, tr=tr: step_figures(ctx, tr, t.median_ms),
                         **reps)
                if hasattr(engine, "destroy"):  # releases the hooks ZeRO registered on the parameters
                    engine.destroy()
                del engine, module, tr, opt
    return out
