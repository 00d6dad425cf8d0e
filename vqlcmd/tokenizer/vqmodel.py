"""Tokenizer backend over a diffusers ``VQModel`` saved in a local folder (no network)."""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch

from .base import Tokenizer

# Config keys that describe where or with what a model was saved, not what it computes.
_VOLATILE_CONFIG_KEYS = ("_name_or_path", "_diffusers_version", "_class_name", "_use_default_values")


def model_identifier(model) -> str:
    """Stable id of a VQModel: hash of its architecture config and every weight, so that two folders
    holding the same model agree and any retrained or edited model differs."""
    h = hashlib.sha256()
    config = {k: v for k, v in dict(model.config).items() if k not in _VOLATILE_CONFIG_KEYS}
    h.update(json.dumps(config, sort_keys=True, default=list).encode())
    for name, tensor in sorted(model.state_dict().items()):
        t = tensor.detach().to("cpu", torch.float32).contiguous()
        h.update(name.encode())
        h.update(str(tuple(t.shape)).encode())
        h.update(t.numpy().tobytes())
    return "vqmodel-" + h.hexdigest()[:16]


class VQModelTokenizer(Tokenizer):
    def __init__(self, model, identifier: str | None = None):
        self.model = model.eval().requires_grad_(False)
        cfg = model.config
        factor = 2 ** (len(cfg.block_out_channels) - 1)
        size = int(cfg.sample_size) if not isinstance(cfg.sample_size, (list, tuple)) else cfg.sample_size[0]
        self.image_size = (size, size)
        self.grid = (size // factor, size // factor)
        self.downsample = factor
        self.channels = int(cfg.in_channels)
        self.codebook_size = int(cfg.num_vq_embeddings)
        self.identifier = identifier or model_identifier(model)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def to(self, device) -> "VQModelTokenizer":
        self.model.to(device)
        return self

    @torch.no_grad()
    def encode(self, images: torch.Tensor) -> torch.Tensor:
        self.check_images(images)
        if tuple(images.shape[2:]) != self.image_size:
            raise ValueError(f"tokenizer {self.identifier}: expects {self.image_size[0]}x{self.image_size[1]} "
                             f"images, got {images.shape[2]}x{images.shape[3]}")
        h = self.model.encode(images.to(self.device, torch.float32)).latents  # (B, D, h, w)
        return nearest_codes(h, self.model.quantize.embedding.weight)

    @torch.no_grad()
    def decode(self, tokens: torch.Tensor) -> torch.Tensor:
        tokens = self.check_tokens(tokens).to(self.device)
        b, h, w = tokens.shape
        if self.model.config.lookup_from_codebook:
            # such a VQModel (aMUSEd's) looks the ids up itself: given code vectors, its decode crashed on the
            # first sample grid, after a whole data set had been tokenized and trained on
            d = self.model.quantize.embedding.weight.shape[1]
            images = self.model.decode(tokens.reshape(-1), force_not_quantize=True, shape=(b, h, w, d)).sample
        else:
            quant = self.model.quantize.embedding(tokens).permute(0, 3, 1, 2)  # (B, D, h, w)
            images = self.model.decode(quant, force_not_quantize=True).sample
        return images.clamp(-1, 1)


def nearest_codes(latents: torch.Tensor, codebook: torch.Tensor) -> torch.Tensor:
    """latents (B, D, h, w), codebook (K, D) -> ids (B, h, w) int64 of the nearest code (squared L2).
    Expanded form instead of cdist: same argmin, and it does not build a (B*h*w, K) sqrt."""
    b, d, h, w = latents.shape
    z = latents.permute(0, 2, 3, 1).reshape(-1, d)
    dist = (z * z).sum(1, keepdim=True) - 2 * z @ codebook.t() + (codebook * codebook).sum(1)[None]
    return dist.argmin(1).reshape(b, h, w)


def load_vqmodel(path: str | os.PathLike):
    from diffusers import VQModel

    folder = Path(path)
    if not folder.is_dir():
        what = "is a file, not a folder" if folder.exists() else "does not exist"
        raise FileNotFoundError(f"tokenizer folder {str(folder)!r} {what} (expected a diffusers VQModel "
                                "folder with config.json and weights; see scripts/train_tokenizer.py or "
                                "vqlcmd.tokenizer.convert_taming_checkpoint)")
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"tokenizer folder {str(folder)!r} has no config.json; it is not a diffusers "
                                "VQModel folder")
    try:
        cls = json.loads((folder / "config.json").read_text()).get("_class_name", "VQModel")
    except json.JSONDecodeError as exc:
        raise ValueError(f"{folder / 'config.json'}: not valid JSON ({exc})") from exc
    if cls != "VQModel":
        raise ValueError(f"tokenizer folder {str(folder)!r} holds a {cls}, not a VQModel")
    # diffusers defaults to its accelerate-based lazy init and, without accelerate (an optional
    # dependency here), warns on every load before falling back; asking only for what is
    # installed loads the same weights without the warning.
    from diffusers.utils import (SAFE_WEIGHTS_INDEX_NAME, SAFETENSORS_WEIGHTS_NAME, WEIGHTS_INDEX_NAME, WEIGHTS_NAME,
                                 is_accelerate_available)

    weights = [SAFETENSORS_WEIGHTS_NAME, WEIGHTS_NAME, SAFE_WEIGHTS_INDEX_NAME, WEIGHTS_INDEX_NAME]  # (or sharded)
    if not any((folder / w).is_file() for w in weights):  # diffusers would name only the .bin, after a warning
        raise FileNotFoundError(f"tokenizer folder {str(folder)!r} has no weights file ({' or '.join(weights[:2])})")
    try:
        model, info = VQModel.from_pretrained(str(folder), local_files_only=True, output_loading_info=True,
                                              low_cpu_mem_usage=is_accelerate_available())
    except OSError as exc:  # diffusers' "Unable to load weights" hides why; its .bin load is weights-only
        refused = _refused_global(exc)
        if refused is None:
            raise
        raise ValueError(f"tokenizer folder {str(folder)!r}: a weights file asks for {refused}, which a weights-only "
                         f"load refuses ({exc}); nothing from it was run. Use a folder this project or diffusers "
                         "wrote") from None
    except RuntimeError as exc:  # torch's size mismatch on loading names neither folder nor file
        said = [line.strip() for line in str(exc).splitlines() if "size mismatch" in line]
        if not said:
            raise
        raise ValueError(f"tokenizer folder {str(folder)!r}: the weights do not fit its config.json ("
                         f"{'; '.join(said[:3])[:400]})") from exc
    # diffusers only warns about these and initialises missing weights at random (unseeded): a tokenizer
    # would then tokenize, and its identifier change, from load to load
    problems = {k: info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs")}
    problems = {k: v for k, v in problems.items() if v}
    if problems:
        raise ValueError(f"tokenizer folder {str(folder)!r}: the weights do not fit its config.json ("
                         + "; ".join(f"{k.replace('_', ' ')}: {list(v)[:5]}" for k, v in problems.items()) + ")")
    return model


def _refused_global(exc: BaseException):
    """The global that torch's weights-only unpickler refused, somewhere in ``exc``'s chain, else None."""
    import re

    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        found = re.search(r"Unsupported global: GLOBAL ([\w.]+)", str(exc))
        if found:
            return found.group(1)
        exc = exc.__cause__ or exc.__context__
    return None


def load_tokenizer(path: str | os.PathLike, device="cpu") -> VQModelTokenizer:
    """The tokenizer saved in a local diffusers VQModel folder."""
    return VQModelTokenizer(load_vqmodel(path)).to(device)
