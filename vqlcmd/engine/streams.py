"""The random streams of a run's data-parallel *slots* (one micro-batch of each optimizer step: rank ``r``'s
micro-step ``k`` is slot ``r + world * k``, as the loader's position is, ``data/loader.py``).

Each slot has its own generator of the loss's draws (t, s, ε, masks; seeded ``train.seed * 1000 + slot``)
and its own state of torch's global generator (attention dropout's; seeded from ``(train.seed, slot)``).
With one micro-step per rank the slot is the rank and the streams are simply live (nothing is swapped);
with several, the step swaps the slot's states in around each micro-step (``draws``).

Why per slot, not per rank: a run resumed on another number of ranks, keeping the global batch and the
micro-batch, has the same slots (2 ranks x 1 micro-step = 1 rank x 2 = slots 0 and 1); each slot's
micro-batch and draws are then the uninterrupted run's, and so are the losses, up to the order in which the
gradients are summed. Where the slots cannot be kept (another micro-batch, another global batch), the
resume starts every slot's streams afresh from ``(train.seed, slot, step)``: new draws, not the first
steps' again.
"""
from __future__ import annotations

import contextlib
from typing import Optional

import numpy as np
import torch


def _global_seed(*key: int) -> int:
    return int(np.random.SeedSequence(list(key)).generate_state(1)[0])


class SlotStreams:
    def __init__(self, seed: int, rank: int, world: int, gas: int, device: torch.device):
        self.seed, self.device = seed, device
        self.slots = [rank + world * k for k in range(gas)]
        self.generator = torch.Generator(device=device)
        self._saved: Optional[list] = None  # per slot (several micro-steps): its states between its micro-steps
        self.reset()

    def reset(self, step: Optional[int] = None) -> None:
        """Every slot's streams from its seed (``step``: afresh for a resume that could not keep the slots)."""
        states = []
        for v in self.slots:
            key = (self.seed, v) if step is None else (self.seed, v, step)
            torch.manual_seed(_global_seed(*key))  # (every device's global generator)
            gen = self.seed * 1000 + v if step is None else _global_seed(*key, 0x67656E)
            self.generator.manual_seed(gen)
            states.append(self._live())
        self._install(states)

    def _live(self) -> dict:
        return {"generator": self.generator.get_state(), "torch_rng": torch.get_rng_state(),
                "cuda_rng": torch.cuda.get_rng_state() if self.device.type == "cuda" else None}

    def _set_live(self, state: dict) -> None:
        self.generator.set_state(state["generator"])
        torch.set_rng_state(state["torch_rng"])
        if state.get("cuda_rng") is not None and self.device.type == "cuda":
            torch.cuda.set_rng_state(state["cuda_rng"])

    def _install(self, states: list) -> None:
        if len(self.slots) == 1:
            self._set_live(states[0])
            self._saved = None
        else:
            self._saved = states
            self._set_live(states[0])

    @contextlib.contextmanager
    def draws(self, micro: int):
        """Micro-step ``micro``'s generator, with its slot's states live while inside."""
        if self._saved is None:
            yield self.generator
            return
        self._set_live(self._saved[micro])
        try:
            yield self.generator
        finally:
            self._saved[micro] = self._live()

    def state_dict(self) -> dict:
        """{slot: its states}: what a checkpoint's rank file keeps."""
        states = [self._live()] if self._saved is None else self._saved
        return dict(zip(self.slots, states))

    def rank_state(self) -> dict:
        """What this rank's checkpoint file keeps of the streams: every slot's, and (as files from before
        slots have them) its first slot's at the top level."""
        by_slot = self.state_dict()
        return {"slots": by_slot, **by_slot[self.slots[0]]}

    def load_state_dict(self, by_slot: dict) -> None:
        """The saved states of the slots ``by_slot`` names; the others keep theirs."""
        current = self.state_dict()
        self._install([by_slot.get(v, current[v]) for v in self.slots])
