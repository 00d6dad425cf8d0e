"""Rank-sharded, deterministically shuffled, exactly resumable batches from a token data set.

The order of epoch ``e`` is a permutation drawn from ``(seed, e)`` alone, so every rank computes
the same permutation without talking to the others and takes every ``world_size``-th sample of
it. The position inside an epoch is a batch counter; saving it with the epoch resumes on the
next unseen batch: nothing repeated, nothing skipped.
"""
from __future__ import annotations

from typing import Iterator

import numpy as np
import torch


class ShardLoader:
    """Iterating yields the rest of the current epoch as ``(tokens (B, M) int64, labels (B,) int64)``,
    then moves to the next epoch. ``forever()`` chains epochs.

    ``drop_last=True`` trims each epoch to whole global batches (``batch_size * world_size``) so all
    ranks run the same number of steps. ``drop_last=False`` pads the permutation by wrapping around
    so that every rank still gets the same number of samples (a few repeat, as in PyTorch's
    DistributedSampler); the last batch may be smaller.
    """

    def __init__(self, dataset, batch_size: int, *, rank: int = 0, world_size: int = 1, seed: int = 0,
                 drop_last: bool = True, shuffle: bool = True, device=None, pin_memory: bool = False):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} out of range for world_size {world_size}")
        self.dataset = dataset
        self.batch_size, self.rank, self.world_size = batch_size, rank, world_size
        self.seed, self.drop_last, self.shuffle = seed, drop_last, shuffle
        self.device, self.pin_memory = device, pin_memory
        self.num_samples = len(dataset)
        if self.num_samples == 0:  # forever() would loop without yielding
            raise ValueError("the data set holds no samples")
        if drop_last and self.num_samples < batch_size * world_size:
            raise ValueError(f"{self.num_samples} samples cannot fill one batch of {batch_size} on each of "
                             f"{world_size} ranks with drop_last=True")
        self.epoch = 0
        self.position = 0  # batches of the current epoch already yielded on this rank

    def __len__(self) -> int:
        """Batches per epoch on this rank."""
        return self._batches_per_epoch()

    @property
    def batches_per_epoch(self) -> int:
        return self._batches_per_epoch()

    def _per_rank(self) -> int:
        if self.drop_last:
            return self.num_samples // (self.batch_size * self.world_size) * self.batch_size
        return -(-self.num_samples // self.world_size)

    def _batches_per_epoch(self) -> int:
        n = self._per_rank()
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def epoch_indices(self, epoch: int) -> np.ndarray:
        """This rank's sample indices for ``epoch``, in order."""
        n = self.num_samples
        if self.shuffle:
            order = np.random.Generator(np.random.PCG64([self.seed, epoch])).permutation(n)
        else:
            order = np.arange(n)
        total = self._per_rank() * self.world_size
        if total > n:  # wrap-around padding (drop_last=False), as often as needed when world_size > n
            order = np.resize(order, total)
        return order[:total][self.rank::self.world_size]

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

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed, "rank": self.rank,
                "world_size": self.world_size, "batch_size": self.batch_size, "num_samples": self.num_samples,
                "drop_last": self.drop_last, "shuffle": self.shuffle}

    def load_state_dict(self, state: dict) -> None:
        # the order depends on these; resuming under different values would silently repeat or skip
        for k in ("seed", "world_size", "batch_size", "num_samples", "drop_last", "shuffle"):
            if k in state and state[k] != getattr(self, k):
                raise ValueError(f"cannot resume loader: saved {k}={state[k]!r} but this loader has "
                                 f"{k}={getattr(self, k)!r}")
        if not 0 <= int(state["position"]) <= self._batches_per_epoch():
            raise ValueError(f"cannot resume loader: position {state['position']} outside the epoch's "
                             f"{self._batches_per_epoch()} batches")
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
