"""Online mode: images -> pipeline -> random flip -> frozen tokenizer on the training device -> token batches.

For users who want a fresh random flip every epoch, or have no disk for shards; ``scripts/train.py`` takes
it with ``vqlcmd.data.source: "images"``. Same contract as ``ShardLoader`` (``(tokens (B, M) int64,
labels (B,) int64)``, rank sharding, a deterministic order per (seed, epoch), ``state_dict`` /
``load_state_dict``, ``epoch``), so a training loop can take either.
"""
from __future__ import annotations

import warnings
from typing import Iterator

import numpy as np
import torch

from .decode import image_batches
from .images import ImageList, list_images
from .loader import ShardLoader
from .skipping import PREFETCH as _PREFETCH, record_undecodable, skipping_message, stand_ins

_FLIP_STREAM = 0x666C6970  # ("flip"): the coins' seed sequence, apart from the permutation's PCG64([seed, epoch])


class _Count:
    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n


class OnlineTokenLoader:
    """``flip=True``: each sample's coin is drawn from (seed, epoch, sample index), not from the decoder's
    stream, so it is the same on every rank and in a run resumed mid-epoch as in one that was not (resumes
    are exact, flips included), and fresh each epoch. ``flip_coins(epoch)`` gives them.

    A file that passed ``list_images``' check but fails to decode (pixel data cut short: only the header was
    read) is found by name, warned about, left out of its batch (which is then smaller) and of every later
    epoch; ``skipped`` lists it beside the files the listing skipped. Training goes on: the same file fails
    at the same place on a resume, so the batches stay those of an uninterrupted run.
    """

    def __init__(self, images, tokenizer, batch_size: int, *, rank: int = 0, world_size: int = 1, seed: int = 0,
                 flip: bool = True, size: int | None = None, backend: str = "auto", device=None,
                 drop_last: bool = True, num_threads: int = 2, accumulation: int = 1):
        self.images = images if isinstance(images, ImageList) else list_images(images)
        self.tokenizer = tokenizer.to(device) if device is not None else tokenizer
        self.device = device if device is not None else tokenizer.device
        self.size = size or tokenizer.image_size[0]
        self.flip, self.backend, self.num_threads = flip, backend, num_threads
        # the order (permutation per epoch, rank slice, resume position) is exactly ShardLoader's
        self._order = ShardLoader(_Count(len(self.images)), batch_size, rank=rank, world_size=world_size, seed=seed,
                                  accumulation=accumulation,
                                  drop_last=drop_last)
        self.batch_size, self.rank, self.world_size, self.seed = batch_size, rank, world_size, seed
        self.bad: dict[str, str] = {}  # files that failed to decode: reason
        # a TokenShardDataset's header keys, so that without flips the data identity equals that of the shards
        # vqlcmd-tokenize writes from the same tree ("flipped": holds flipped copies; random flips are not)
        self.header = {"codebook_size": tokenizer.codebook_size, "grid": list(tokenizer.grid),
                       "tokenizer_id": tokenizer.identifier, "num_classes": self.images.num_classes,
                       "class_names": list(self.images.class_names), "num_samples": len(self.images),
                       "seq_len": tokenizer.num_tokens, "flipped": False, "image_size": [self.size, self.size],
                       "channels": tokenizer.channels, "source": str(self.images.root),
                       "files_sha256": self.images.digest()}
        if flip:
            self.header["random_flip"] = True

    @property
    def epoch(self) -> int:
        return self._order.epoch

    @property
    def skipped(self) -> list[tuple[str, str]]:
        """(file, reason) of every file left out: by the listing, and since, at decoding."""
        return list(self.images.skipped) + list(self.bad.items())

    def __len__(self) -> int:
        return len(self._order)

    def flip_coins(self, epoch: int) -> np.ndarray:
        """bool per sample index of the tree's list: whether that sample is mirrored in ``epoch``."""
        n = len(self.images)
        if not self.flip:
            return np.zeros(n, bool)
        return np.random.Generator(np.random.PCG64([self.seed, epoch, _FLIP_STREAM])).random(n) < 0.5

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        order = self._order
        idx = order.epoch_indices(order.epoch)
        coins = torch.from_numpy(self.flip_coins(order.epoch))
        while order.position < len(order):
            # decodes from the current position; returns when a file failed (now in self.bad), to go on from there
            yield from self._decode_from(idx, coins)
        order.epoch += 1
        order.position = 0

    def _decode_from(self, idx: np.ndarray, coins: torch.Tensor):
        order, bs = self._order, self.batch_size
        start, nb = order.position, len(order)
        rows = idx[start * bs: nb * bs]
        files = [self.images.files[i] for i in rows]
        keep = torch.tensor([f not in self.bad for f in files])
        # a known-bad file's place is taken by a readable one, so the decoder's batches stay the loader's
        subset = ImageList(self.images.root, stand_ins(self.images, files, self.bad),
                           [self.images.labels[i] for i in rows], self.images.class_names)
        batches = image_batches(subset, self.size, bs, flip="none", backend=self.backend,
                                channels=self.tokenizer.channels, device=self.device, num_threads=self.num_threads)
        b = 0
        while True:
            try:
                images, labels = next(batches)
            except StopIteration:
                return
            except (RuntimeError, OSError) as exc:  # DALI's error / PIL's, naming a file of this batch or the next
                if not self._find_bad(files[b * bs:(b + 1 + _PREFETCH) * bs]):
                    raise  # no file is at fault (device memory, say): the pipeline's own error
                return
            sel = keep[b * bs: b * bs + len(images)]
            flip = coins[torch.from_numpy(rows[b * bs: b * bs + len(images)])] & sel
            b += 1
            order.position += 1
            if not sel.any():
                continue  # every image of the batch unreadable: the next batch, on every resume alike
            if flip.any():
                f = flip.to(images.device)
                images = torch.where(f[:, None, None, None], images.flip(-1), images)
            if not sel.all():
                s = sel.to(images.device)
                images, labels = images[s], labels[s.to(labels.device)]
            tokens = self.tokenizer.encode(images).reshape(len(images), -1)
            yield tokens, labels.to(tokens.device)

    def _find_bad(self, files: list[str]) -> bool:
        """Decodes ``files`` (PIL) to find those that fail; records and names them. Whether any was found."""
        found = record_undecodable(self.images, files, self.bad)
        if not found:
            return False
        warnings.warn(skipping_message(found) + f" ({len(self.skipped)} skipped in all)", stacklevel=3)
        return True

    def forever(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        while True:
            yield from self

    def state_dict(self) -> dict:
        return self._order.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self._order.load_state_dict(state)
