"""Rank-sharded, deterministically shuffled, exactly resumable batches from a token data set.

The order of epoch ``e`` is a permutation drawn from ``(seed, e)`` alone, so every rank computes the same
permutation without talking to the others. An optimizer step takes the next ``world_size * accumulation``
micro-batches of it, one per *slot*: step ``s`` covers the permutation's samples ``[s G, (s + 1) G)`` (``G``
the global batch), slot ``v`` the ``v``-th of every ``S``-th of them (``S`` slots), and rank ``r``'s
micro-step ``k`` is slot ``r + world_size * k``. So the samples of a step, and which slot has which, depend on
the global batch and the micro-batch only: a run resumed on another number of ranks (accumulating more or
fewer micro-batches for the same global batch) trains on exactly the samples, in exactly the slots, that the
uninterrupted run would have (``engine/streams.py`` gives each slot its own random stream, likewise).

The saved position is the epoch and the samples of it the run has consumed (whole steps), which does not
depend on the number of ranks; nothing repeated, nothing skipped.
"""
from __future__ import annotations

from typing import Iterator

import numpy as np
import torch


class ShardLoader:
    """Iterating yields the rest of the current epoch as ``(tokens (B, M) int64, labels (B,) int64)``,
    then moves to the next epoch. ``forever()`` chains epochs.

    ``accumulation``: the micro-batches this rank takes per optimizer step (gradient accumulation); they
    come in order, micro-step 0 first. ``drop_last=True`` trims each epoch to whole global batches
    (``batch_size * world_size * accumulation``), so all ranks run the same number of steps.
    ``drop_last=False`` (one micro-batch per step only) pads the permutation by wrapping around so that every
    rank still gets the same number of samples (a few repeat, as in PyTorch's DistributedSampler); the last
    batch may be smaller.
    """

    def __init__(self, dataset, batch_size: int, *, rank: int = 0, world_size: int = 1, seed: int = 0,
                 drop_last: bool = True, shuffle: bool = True, device=None, pin_memory: bool = False,
                 accumulation: int = 1):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} out of range for world_size {world_size}")
        if accumulation < 1 or (accumulation > 1 and not drop_last):
            raise ValueError(f"accumulation {accumulation}: must be >= 1, and 1 with drop_last=False")
        self.dataset = dataset
        self.batch_size, self.rank, self.world_size, self.accumulation = batch_size, rank, world_size, accumulation
        self.slots = world_size * accumulation
        self.global_batch = batch_size * self.slots
        self.seed, self.drop_last, self.shuffle = seed, drop_last, shuffle
        self.device, self.pin_memory = device, pin_memory
        self.num_samples = len(dataset)
        if self.num_samples == 0:  # forever() would loop without yielding
            raise ValueError("the data set holds no samples")
        if drop_last and self.num_samples < self.global_batch:
            raise ValueError(f"{self.num_samples} samples cannot fill one batch of {batch_size} on each of "
                             f"{world_size} ranks x {accumulation} accumulation step(s) with drop_last=True")
        self.epoch = 0
        self.position = 0  # micro-batches of the current epoch already yielded on this rank

    def __len__(self) -> int:
        """Micro-batches per epoch on this rank."""
        return self._batches_per_epoch()

    @property
    def batches_per_epoch(self) -> int:
        return self._batches_per_epoch()

    def _batches_per_epoch(self) -> int:
        if self.drop_last:
            return self.num_samples // self.global_batch * self.accumulation
        per_rank = -(-self.num_samples // self.world_size)
        return -(-per_rank // self.batch_size)

    def epoch_indices(self, epoch: int) -> np.ndarray:
        """This rank's sample indices for ``epoch``, in the order it takes them (micro-batch after micro-batch)."""
        n = self.num_samples
        if self.shuffle:
            order = np.random.Generator(np.random.PCG64([self.seed, epoch])).permutation(n)
        else:
            order = np.arange(n)
        if not self.drop_last:
            total = -(-n // self.world_size) * self.world_size
            if total > n:  # wrap-around padding, as often as needed when world_size > n
                order = np.resize(order, total)
            return order[self.rank::self.world_size]
        steps = n // self.global_batch
        # (step, sample within a slot's micro-batch, slot) -> this rank's slots, micro-step by micro-step
        grid = order[:steps * self.global_batch].reshape(steps, self.batch_size, self.slots)
        mine = grid[:, :, self.rank::self.world_size]  # slots r, r + W, r + 2W, ...: micro-steps 0, 1, 2, ...
        return mine.transpose(0, 2, 1).reshape(-1)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        idx = self.epoch_indices(self.epoch)
        nb = self._batches_per_epoch()
        while self.position < nb:
            b = self.position
            batch = idx[b * self.batch_size:(b + 1) * self.batch_size]
            # advance before yielding: a state_dict taken while the consumer holds this batch
            # points at the next one, so a resume does not repeat it
            self.position += 1
            yield self._fetch(batch)
        self.epoch += 1
        self.position = 0

    def forever(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        while True:
            yield from self

    def _fetch(self, indices: np.ndarray):
        if hasattr(self.dataset, "gather"):
            tokens, labels = self.dataset.gather(indices)
        else:
            items = [self.dataset[int(i)] for i in indices]
            tokens = torch.stack([t for t, _ in items]).long()
            labels = torch.stack([torch.as_tensor(l) for _, l in items]).long()
        if self.pin_memory:
            tokens, labels = tokens.pin_memory(), labels.pin_memory()
        if self.device is not None:
            tokens = tokens.to(self.device, non_blocking=True)
            labels = labels.to(self.device, non_blocking=True)
        return tokens, labels

    def _layout(self) -> dict:
        return {"world_size": self.world_size, "batch_size": self.batch_size, "accumulation": self.accumulation}

    def state_dict(self) -> dict:
        """The position as ``samples``: the samples of the epoch consumed by whole steps, on all ranks together
        (the same on every rank, whatever the number of ranks); ``position`` and the layout besides, for a
        resume mid-step on the same layout."""
        steps, micro = divmod(self.position, self.accumulation)
        samples = steps * self.global_batch if self.drop_last else self.position * self.batch_size * self.world_size
        return {"epoch": self.epoch, "samples": samples, "micro_in_step": micro, "global_batch": self.global_batch,
                "position": self.position, "seed": self.seed, "rank": self.rank, "num_samples": self.num_samples,
                "drop_last": self.drop_last, "shuffle": self.shuffle, **self._layout()}

    def load_state_dict(self, state: dict) -> None:
        # the order depends on these; resuming under different values would silently repeat or skip
        for k in ("seed", "num_samples", "drop_last", "shuffle"):
            if k in state and state[k] != getattr(self, k):
                raise ValueError(f"cannot resume loader: saved {k}={state[k]!r} but this loader has "
                                 f"{k}={getattr(self, k)!r}")
        layout = {k: state.get(k, 1 if k == "accumulation" else None) for k in self._layout()}
        if layout == self._layout() or not self.drop_last:  # the same layout (or one slot): the exact position
            if not self.drop_last and layout != self._layout():
                raise ValueError(f"cannot resume loader: saved layout {layout} but this loader has "
                                 f"{self._layout()} (drop_last=False resumes on the same layout only)")
            position = int(state["position"])
        else:
            position = self._position_of(state, layout)
        if not 0 <= position <= self._batches_per_epoch():
            raise ValueError(f"cannot resume loader: position {position} outside the epoch's "
                             f"{self._batches_per_epoch()} batches")
        self.epoch, self.position = int(state["epoch"]), position

    def _position_of(self, state: dict, layout: dict) -> int:
        """This layout's position for another layout's saved state: the samples consumed, in whole steps of a
        global batch both share (a checkpoint from before ``samples`` existed took one micro-batch per step
        on every rank: ``position`` of them)."""
        if "samples" in state:
            samples, saved_global = int(state["samples"]), int(state["global_batch"])
            if state.get("micro_in_step", 0):
                raise ValueError(f"cannot resume loader: saved {state['micro_in_step']} micro-batch(es) into a step "
                                 f"on layout {layout}; mid-step positions resume on the same layout only")
        else:
            samples = int(state["position"]) * layout["batch_size"] * layout["world_size"]
            saved_global = None
        if samples and saved_global not in (None, self.global_batch):
            raise ValueError(f"cannot resume loader mid-epoch: it was saved at a global batch of {saved_global} "
                             f"samples, this loader's is {self.global_batch} ({self.batch_size} x "
                             f"{self.world_size} rank(s) x {self.accumulation}); keep the global batch "
                             "(train_batch_size), or resume at an epoch boundary")
        if samples % self.global_batch:
            raise ValueError(f"cannot resume loader: {samples} samples into the epoch is no whole number of "
                             f"global batches of {self.global_batch}")
        return samples // self.global_batch * self.accumulation
