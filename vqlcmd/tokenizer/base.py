"""The tokenizer contract every backend meets: images in [-1, 1] <-> token grids.

Token shards and checkpoints store ``identifier`` so that tokens made by one
tokenizer are never decoded (or trained on) with another.
"""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch


class Tokenizer(ABC):
    codebook_size: int
    grid: tuple[int, int]  # (h, w) tokens per image
    image_size: tuple[int, int]  # (H, W) pixels the tokenizer was built for
    channels: int
    identifier: str

    @abstractmethod
    def encode(self, images: torch.Tensor) -> torch.Tensor:
        """images (B, C, H, W) float in [-1, 1] -> tokens (B, h, w) int64."""

    @abstractmethod
    def decode(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens (B, h, w) or (B, h*w) integer -> images (B, C, H, W) float in [-1, 1]."""

    @property
    def num_tokens(self) -> int:
        return self.grid[0] * self.grid[1]

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def to(self, device) -> "Tokenizer":
        return self

    def check_images(self, images: torch.Tensor) -> None:
        if not isinstance(images, torch.Tensor) or not images.is_floating_point():
            raise TypeError(f"tokenizer {self.identifier}: images must be a floating-point tensor in [-1, 1], "
                            f"got {getattr(images, 'dtype', type(images).__name__)}")
        if images.dim() != 4 or images.shape[1] != self.channels:
            raise ValueError(f"tokenizer {self.identifier}: images must be (B, {self.channels}, H, W), "
                             f"got {tuple(images.shape)}")

    def check_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """Returns tokens as (B, h, w) int64 after checking shape and id range."""
        if not isinstance(tokens, torch.Tensor) or tokens.is_floating_point() or tokens.is_complex():
            raise TypeError(f"tokenizer {self.identifier}: tokens must be an integer tensor, "
                            f"got {getattr(tokens, 'dtype', type(tokens).__name__)}")
        h, w = self.grid
        if tokens.dim() == 2 and tokens.shape[1] == h * w:
            tokens = tokens.reshape(-1, h, w)
        if tokens.dim() != 3 or tuple(tokens.shape[1:]) != (h, w):
            raise ValueError(f"tokenizer {self.identifier}: tokens must be (B, {h}, {w}) or (B, {h * w}), "
                             f"got {tuple(tokens.shape)}")
        if tokens.numel():
            lo, hi = int(tokens.min()), int(tokens.max())
            if lo < 0 or hi >= self.codebook_size:
                raise ValueError(f"tokenizer {self.identifier}: token ids must lie in [0, {self.codebook_size}), "
                                 f"got min {lo}, max {hi}")
        return tokens.long()
