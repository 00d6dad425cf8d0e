"""One training step (docs/method.md §7): ``gas`` micro-steps of forward and backward through DeepSpeed, its optimizer step, then
both EMAs, with one flush policy for the host reads (``TrainStep``).

The loss terms, the non-finite checks and the stop flag (a SIGINT / SIGTERM on any rank) need a collective
and a read-back from the device, which drains the device queue: the host waits for the step to finish before
it can queue the next one. Where those reads happen is the flush policy:

- **every micro-step** (the default step): the terms are read after each forward, before its backward, so a
  non-finite loss stops the run before anything is stepped; at ZeRO 0 (a plain client optimizer, which steps
  on non-finite gradients where ZeRO 1/2 skip them) the gradient norm is read and checked before the step.
- **deferred** (``train.fast``): the terms, their non-finite flags and a gradient flag stay on the device and
  are read in one ``flush`` at log steps, before every checkpoint or sample grid, at the last step, and (one
  rank) when a signal came. A non-finite loss or gradient is then named (step and term) at the next flush;
  the steps between ran on, so the weights in memory may hold NaN by then, but no checkpoint, pipeline or
  grid is written from them: every save is preceded by a flush, which raises first. The id and label range
  checks' read-backs are skipped (``ops._checks.checked_upstream``): the loader opened shards whose ranges
  were verified; unchecked ids are still never read out of bounds.

The random draws, the losses and the updates are the same under both policies: same generator streams, same
order. DeepSpeed's own ZeRO 1/2 step still reads its global gradient norm once per step for clipping
(stage_1_and_2.py): that read is DeepSpeed's, not ours.
"""
from __future__ import annotations

import contextlib
import math
from typing import Callable, Optional

import torch

from ..ema import update_emas
from ..ops._checks import checked_upstream
from .distributed import mean_over_ranks


class NonFiniteLossError(RuntimeError):
    pass


class TrainStep:
    """The step of one run. ``stop_requested()``: whether this rank got a signal; ``checkpoint_words()``: what
    an error says of the last checkpoint. ``stop_agreed`` turns true at the flush where any rank had one."""

    def __init__(self, engine, emas: list, *, streams, device: torch.device, gas: int,
                 deferred: bool, log: Callable, stop_requested: Callable[[], bool],
                 checkpoint_words: Callable[[], str], flat=None):
        # streams: each micro-step's slot's random streams (engine/streams.py); flat: a FlatStep (deferred only)
        # that takes the gradients and the update from DeepSpeed's engine (engine/flat_step.py)
        self.engine, self.emas, self.streams, self.device, self.gas = engine, emas, streams, device, gas
        self.flat = flat
        if flat is not None:
            flat.flatten_emas(emas)
        self.deferred, self.log = deferred, log
        self.stop_requested, self.checkpoint_words = stop_requested, checkpoint_words
        self.net = engine.module.net
        self.step_lr = 0.0  # the rate of the last step: the scheduler has moved on by the log
        self.own_grad_norm: Optional[torch.Tensor] = None  # ZeRO 0's, which DeepSpeed does not keep
        self.stop_agreed = False
        self.pending: list = []  # deferred: (step, term names, per-step means on the device)
        self.bad_grads = torch.zeros((), dtype=torch.bool, device=device)

    def __call__(self, batches, step: int) -> dict:
        """Optimizer step ``step`` (1-based). Returns its terms: floats averaged over ranks, or (deferred)
        unread device tensors waiting in ``pending`` for :meth:`flush`."""
        terms, acc, names = {}, None, None
        self.step_lr = self.engine.get_lr()[0]  # host-side: the scheduler's float
        if self.flat is not None:
            return self._flat_step(batches, step)
        with checked_upstream() if self.deferred else contextlib.nullcontext():
            for micro in range(self.gas):
                tokens, labels = self._next(batches)
                with self.streams.draws(micro) as generator:
                    out = self.engine(tokens, labels, generator)
                names = list(out)
                if self.deferred:
                    acc = self._accumulate(acc, out)
                else:
                    for k, v in self.read_terms(out, step).items():
                        terms[k] = terms.get(k, 0.0) + v / self.gas
                self.engine.backward(out["loss"])
                if micro == self.gas - 1 and self.plain_optimizer():
                    self._check_own_grad_norm(step)
                skipped = getattr(self.engine, "skipped_steps", 0)
                self.engine.step()
                if micro == self.gas - 1 and self.deferred:
                    # a tensor when DeepSpeed stepped (inf if a gradient was not finite and it did not check,
                    # see ds_config.fast_step_settings); a float after a step it skipped, None at ZeRO 0
                    norm = getattr(self.engine.optimizer, "_global_grad_norm", None)
                    if torch.is_tensor(norm):
                        self.bad_grads = self.bad_grads | ~torch.isfinite(norm)
                if getattr(self.engine, "skipped_steps", 0) > skipped:  # DeepSpeed's host-side counter: no read
                    self.log(f"warning: step {step}: DeepSpeed skipped the optimizer step (non-finite "
                             "gradients); the step still counts, and the rate schedule falls a step behind")
        update_emas(self.emas, self.net)
        if not self.deferred:
            return terms
        return self._park(step, names, acc)

    def _next(self, batches):
        tokens, labels = next(batches)
        tokens = tokens.to(self.device, non_blocking=self.deferred)
        labels = labels.to(self.device, non_blocking=self.deferred)
        return tokens, (None if self.net.config.num_classes == 0 else labels)

    def _flat_step(self, batches, step: int) -> dict:
        """The deferred step through the flat step: the draws of each micro-step taken first (so the loss is one
        graph), DeepSpeed's engine skipped for the gradients and the update."""
        acc, module = None, self.engine.module
        with checked_upstream():
            for micro in range(self.gas):
                tokens, labels = self._next(batches)
                with self.streams.draws(micro) as generator:
                    draws = module.draw(tokens, labels, generator)
                    out = self.flat.micro_step(tokens, labels, {"generator": generator} if draws is None
                                               else {"draws": draws}, micro, self.gas)
                names, acc = list(out), self._accumulate(acc, out)
        self.bad_grads = self.bad_grads | ~torch.isfinite(self.flat.update())
        self.flat.update_emas()
        return self._park(step, names, acc)

    def _accumulate(self, acc, out: dict) -> torch.Tensor:
        """Deferred: the step's terms so far plus this micro-step's (its share, 1/gas), on the device."""
        values = torch.stack([v.detach().float().reshape(()) for v in out.values()]) / self.gas
        return values if acc is None else acc + values

    def _park(self, step: int, names: list, acc: torch.Tensor) -> dict:
        """Deferred: the step's terms wait in ``pending`` for the flush; returned unread."""
        self.pending.append((step, names, acc))
        return dict(zip(names, acc.unbind()))

    def plain_optimizer(self) -> bool:
        """Whether DeepSpeed steps a plain client optimizer (ZeRO 0 in fp32): it keeps no grad norm and checks
        no overflow, so the step computes and checks the norm itself."""
        return not hasattr(self.engine.optimizer, "_global_grad_norm")

    def _check_own_grad_norm(self, step: int) -> None:
        """The reduced gradients' norm before clipping, as DeepSpeed's: a plain client optimizer steps on
        non-finite gradients (clipped inf: NaN) where ZeRO 1/2 skip them, and NaN weights reached the EMAs,
        the checkpoint and the pipeline with a finite loss."""
        grads = [q.grad for q in self.engine.module.parameters() if q.grad is not None]
        if not grads:
            return
        norm = torch.nn.utils.get_total_norm(grads)
        self.own_grad_norm = norm
        if self.deferred:  # flagged here, raised at the flush
            self.bad_grads = self.bad_grads | ~torch.isfinite(norm)
        elif not torch.isfinite(norm):
            raise NonFiniteLossError(f"non-finite gradients at step {step} (norm {norm.item()}, the loss finite); "
                                     f"stopping without stepping or saving ({self.checkpoint_words()})")

    def read_terms(self, out: dict, step: int) -> dict:
        """One micro-step's scalar terms as floats, averaged over ranks (as the gradients are), or
        NonFiniteLossError (on every rank alike) if one is not finite on any rank. The terms, the non-finite
        flag and the stop flag travel in one collective and one read-back (a flag's mean is > 0 if any rank
        set it)."""
        names = list(out)
        values = torch.stack([out[k].detach().float().reshape(()) for k in names])
        stop = values.new_full((1,), float(self.stop_requested()))  # a fill: no host-to-device copy
        host = mean_over_ranks(torch.cat([(~torch.isfinite(values)).any().float().reshape(1), stop, values])).tolist()
        self.stop_agreed = self.stop_agreed or host[1] > 0
        read = dict(zip(names, host[2:]))
        if host[0]:
            self._non_finite(step, read, "")
        return read

    def flush(self) -> list[dict]:
        """Deferred: every pending step's terms averaged over ranks, their non-finite flags, the gradient flag
        and the stop flag, in one collective and one read-back. Returns the steps' rows for the history;
        raises ``NonFiniteLossError`` naming the first bad step and term."""
        pending, self.pending = self.pending, []
        stop = self.bad_grads.new_full((1,), float(self.stop_requested()), dtype=torch.float32)
        if pending:
            values = torch.stack([acc for _, _, acc in pending])
            flags = (~torch.isfinite(values)).any(dim=1).float()
        else:
            values, flags = torch.zeros(0, 0, device=self.bad_grads.device), stop.new_zeros(0)
        host = mean_over_ranks(torch.cat([stop, self.bad_grads.float().reshape(1), flags, values.reshape(-1)]))
        host = host.tolist()
        self.stop_agreed = self.stop_agreed or host[0] > 0
        last = pending[-1][0] if pending else None
        if host[1]:  # first: the non-finite losses that follow from such a step are its consequence
            first = pending[0][0] if pending else last
            raise NonFiniteLossError(
                f"non-finite gradients at a step in {first}..{last} (with train.fast the optimizer stepped on "
                "them: ZeRO 0's plain one, or ZeRO 1/2 in bf16 without bf16.check_grad_overflow); stopping "
                f"without saving ({self.checkpoint_words()})")
        n, rows = len(pending), []
        for i, (step, names, _) in enumerate(pending):
            read = dict(zip(names, host[2 + n + i * len(names): 2 + n + (i + 1) * len(names)]))
            if host[2 + i]:
                self._non_finite(step, read, f"; train.fast found it at step {last}")
            rows.append({"step": step, **read})
        return rows

    def _non_finite(self, step: int, read: dict, found: str):
        bad = {k: v for k, v in read.items() if not math.isfinite(v)}
        raise NonFiniteLossError(f"non-finite loss at step {step}: term(s) {', '.join(bad) or '(on another rank)'} "
                                 f"= {bad}; stopping without saving ({self.checkpoint_words()}{found})")
