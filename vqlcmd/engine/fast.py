"""The throughput training step (``train.fast``): the default step's work without host reads inside a step.

The default step (``Trainer.train_step``) reads the loss terms back once per micro-step, to stop on a
non-finite loss at once and to agree on a stop signal across ranks; at ZeRO 0 it also reads the gradient
norm. Each read drains the device queue: the host waits for the step to finish before it can queue the
next one. This step keeps the terms, the non-finite flags and the gradient-norm flag on the device and
reads them all in one ``flush`` at log steps, before every checkpoint or sample grid, at the run's last
step, and (one rank) when a signal came. What it gives up, and what it keeps:

- a non-finite loss or gradient is named (step and term) at the next flush, not at its step; the steps
  between ran on, so at ZeRO 0 (whose plain AdamW steps on non-finite gradients, where ZeRO 1/2 skip the
  step) the weights and EMAs in memory may hold NaN by then. No checkpoint, pipeline or grid is written
  from them: every save is preceded by a flush, which raises ``NonFiniteLossError`` first;
- SIGINT / SIGTERM stop the run at the next flush (at most ``train.log_every`` steps later with several
  ranks: they learn of each other's signals in that collective), with the checkpoint as before;
- the id and label range checks' read-backs are skipped (``ops._checks.checked_upstream``): the loader
  opened shards whose ranges were verified; unchecked ids are still never read out of bounds.

The random draws, the losses and the updates are the default step's: same generator streams, same order.
DeepSpeed's own ZeRO 1/2 step still reads its global gradient norm once per step for clipping
(stage_1_and_2.py): that read is DeepSpeed's, not ours. Its other per-step work that a config key turns off,
the fast step turns off where the config leaves the key unset (:func:`deepspeed_settings`):

- ``bf16.check_grad_overflow``: in bf16 DeepSpeed checked every gradient tensor for inf/NaN before each step
  (seven small ops per parameter tensor: ~2100 of the ~7300 kernel-launching ops of an imagenet-246m step,
  and two more reads). Off, DeepSpeed steps on non-finite gradients as ZeRO 0 does, and the fast step flags
  them on the device from DeepSpeed's global norm (inf then) and stops at the next flush, before any save;
  with the key set true DeepSpeed skips such a step as before (benchmarks/host_overhead.py measures both);
- ``timers.throughput``: DeepSpeed's throughput timer synchronised the device at every forward and step
  (two stalls a step) to time steps it never reports here (``steps_per_print`` is off; the trainer logs
  its own images/s).
"""
from __future__ import annotations

import math

import torch

from ..ema import update_emas
from ..ops._checks import checked_upstream
from .distributed import mean_over_ranks


def deepspeed_settings(ds: dict) -> None:
    """The DeepSpeed keys the fast step sets in ``ds`` where the config leaves them unset (module docstring)."""
    if ds.get("bf16", {}).get("enabled"):
        ds["bf16"] = {"check_grad_overflow": False, **ds["bf16"]}
    timers = dict(ds.get("timers") or {})
    timers["throughput"] = {"enabled": False, **(timers.get("throughput") or {})}
    ds["timers"] = timers


def train_step(tr, batches) -> dict:
    """One optimizer step of Trainer ``tr`` (``gas`` micro-steps), returning its loss terms as device tensors
    (unread); they wait in ``tr.pending`` for :func:`flush`."""
    acc = names = None
    tr.step_lr = tr.engine.get_lr()[0]  # host-side: the scheduler's float
    with checked_upstream():
        for micro in range(tr.gas):
            tokens, labels = next(batches)
            tokens, labels = tokens.to(tr.device, non_blocking=True), labels.to(tr.device, non_blocking=True)
            if tr.net.config.num_classes == 0:
                labels = None
            out = tr.engine(tokens, labels, tr.generator)
            names = list(out)
            values = torch.stack([out[k].detach().float().reshape(()) for k in names]) / tr.gas
            acc = values if acc is None else acc + values
            tr.engine.backward(out["loss"])
            if micro == tr.gas - 1 and tr._plain_optimizer():
                # as the default step's check, kept on the device: flagged here, raised at the flush
                grads = [q.grad for q in tr.engine.module.parameters() if q.grad is not None]
                if grads:
                    norm = torch.nn.utils.get_total_norm(grads)
                    tr.own_grad_norm = norm
                    tr.bad_grads = tr.bad_grads | ~torch.isfinite(norm)
            skipped = getattr(tr.engine, "skipped_steps", 0)
            tr.engine.step()
            if micro == tr.gas - 1:
                # a tensor when DeepSpeed stepped (inf if a gradient was not finite and it did not check, see
                # deepspeed_settings); a float after a step it skipped, or None at ZeRO 0 (checked above)
                norm = getattr(tr.engine.optimizer, "_global_grad_norm", None)
                if torch.is_tensor(norm):
                    tr.bad_grads = tr.bad_grads | ~torch.isfinite(norm)
            if getattr(tr.engine, "skipped_steps", 0) > skipped:  # DeepSpeed's host-side counter: no read
                tr.log(f"warning: step {tr.step + 1}: DeepSpeed skipped the optimizer step (non-finite "
                       "gradients); the step still counts, and the rate schedule falls a step behind")
    update_emas([tr.teacher, tr.sampling_ema], tr.net)
    tr.step += 1
    tr.pending.append((tr.step, names, acc))
    return dict(zip(names, acc.unbind()))


def flush(tr) -> list[dict]:
    """The deferred reads, in one collective and one read-back: every pending step's terms averaged over ranks
    (as the default step logs them), their non-finite flags, the gradient flag and the stop flag. Returns the
    steps' rows for the history; raises ``NonFiniteLossError`` naming the first bad step and term."""
    from .trainer import NonFiniteLossError

    pending, tr.pending = tr.pending, []
    device = tr.bad_grads.device
    stop = tr.bad_grads.new_full((1,), float(tr.signal_seen is not None), dtype=torch.float32)
    values = torch.stack([acc for _, _, acc in pending]) if pending else torch.zeros(0, 0, device=device)
    flags = (~torch.isfinite(values)).any(dim=1).float() if pending else values.new_zeros(0)
    host = mean_over_ranks(torch.cat([stop, tr.bad_grads.float().reshape(1), flags, values.reshape(-1)])).tolist()
    tr.stop_agreed = tr.stop_agreed or host[0] > 0
    if host[1]:  # first: the non-finite losses that follow from such a step are its consequence
        first = pending[0][0] if pending else tr.step
        raise NonFiniteLossError(
            f"non-finite gradients at a step in {first}..{tr.step} (with train.fast the optimizer stepped on them: "
            f"ZeRO 0's plain one, or ZeRO 1/2 in bf16 without bf16.check_grad_overflow); stopping without saving ({tr._last_checkpoint_words()})")
    n = len(pending)
    rows = []
    for i, (step, names, _) in enumerate(pending):
        read = dict(zip(names, host[2 + n + i * len(names): 2 + n + (i + 1) * len(names)]))
        if host[2 + i]:
            bad = {k: v for k, v in read.items() if not math.isfinite(v)}
            raise NonFiniteLossError(
                f"non-finite loss at step {step}: term(s) {', '.join(bad) or '(on another rank)'} = {bad}; stopping "
                f"without saving ({tr._last_checkpoint_words()}; train.fast found it at step {tr.step})")
        rows.append({"step": step, **read})
    return rows
