"""Online mode: images -> pipeline -> frozen tokenizer on the training device -> token batches.

For users who want a fresh random flip every epoch, or have no disk for shards. Same contract as
``ShardLoader`` (``(tokens (B, M) int64, labels (B,) int64)``, rank sharding, a deterministic order
per (seed, epoch), ``state_dict`` / ``load_state_dict``, ``epoch``), so a training loop of one's own
can take either. ``scripts/train.py``'s engine reads token shards only: its config has no key for an
image tree.
"""
from __future__ import annotations

from typing import Iterator

import numpy as np
import torch

from .images import ImageList, image_batches, list_images
from .loader import ShardLoader


class _Count:
    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n


class OnlineTokenLoader:
    def __init__(self, images, tokenizer, batch_size: int, *, rank: int = 0, world_size: int = 1, seed: int = 0,
                 flip: bool = True, size: int | None = None, backend: str = "auto", device=None,
                 drop_last: bool = True, num_threads: int = 2):
        self.images = images if isinstance(images, ImageList) else list_images(images)
        self.tokenizer = tokenizer.to(device) if device is not None else tokenizer
        self.device = device if device is not None else tokenizer.device
        self.size = size or tokenizer.image_size[0]
        self.flip, self.backend, self.num_threads = flip, backend, num_threads
        # the order (permutation per epoch, rank slice, resume position) is exactly ShardLoader's
        self._order = ShardLoader(_Count(len(self.images)), batch_size, rank=rank, world_size=world_size, seed=seed,
                                  drop_last=drop_last)
        self.batch_size, self.rank, self.world_size, self.seed = batch_size, rank, world_size, seed
        self.header = {"codebook_size": tokenizer.codebook_size, "grid": list(tokenizer.grid),
                       "tokenizer_id": tokenizer.identifier, "num_classes": self.images.num_classes,
                       "class_names": list(self.images.class_names), "num_samples": len(self.images),
                       "seq_len": tokenizer.num_tokens, "flipped": flip, "image_size": [self.size, self.size],
                       "channels": tokenizer.channels, "source": str(self.images.root)}

    @property
    def epoch(self) -> int:
        return self._order.epoch

    def __len__(self) -> int:
        return len(self._order)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        order = self._order
        nb, bs = len(order), self.batch_size
        idx = order.epoch_indices(order.epoch)[order.position * bs: nb * bs]
        subset = ImageList(self.images.root, [self.images.files[i] for i in idx],
                           [self.images.labels[i] for i in idx], self.images.class_names)
        # flips differ per epoch and rank, and resuming mid-epoch draws the rest afresh (the flip of a
        # sample is augmentation, not part of the exact-resume promise, which covers the samples)
        flip_seed = int(np.random.SeedSequence([self.seed, order.epoch, self.rank, order.position]).generate_state(1)[0])
        batches = image_batches(subset, self.size, bs, flip="random" if self.flip else "none", seed=flip_seed,
                                backend=self.backend, channels=self.tokenizer.channels, device=self.device,
                                num_threads=self.num_threads)
        for images, labels in batches:
            order.position += 1
            tokens = self.tokenizer.encode(images).reshape(len(images), -1)
            yield tokens, labels.to(tokens.device)
        order.epoch += 1
        order.position = 0

    def forever(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        while True:
            yield from self

    def state_dict(self) -> dict:
        return self._order.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self._order.load_state_dict(state)
