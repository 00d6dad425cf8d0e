"""``VQLCMDPipeline``: load an exported model folder and sample images (the Python sampling API).

A pipeline folder holds ``model.safetensors`` (denoiser + token embeddings, the
sampling-EMA weights) and ``config.json`` (denoiser config, schedule, tokenizer
reference, class names, sampling defaults, the resolved training config).
No pickle anywhere: safetensors + JSON only.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional, Sequence, Union

import torch
from safetensors.torch import load_file, save_file

from .model import DenoiserConfig
from .network import VQLCMDNetwork
from .samplers import sample_tokens
from .schedule import ShiftedCosineSchedule

WEIGHTS, CONFIG = "model.safetensors", "config.json"


class VQLCMDPipeline:
    def __init__(self, network: VQLCMDNetwork, schedule: ShiftedCosineSchedule, *, tokenizer=None,
                 tokenizer_ref: Optional[dict] = None, class_names: Optional[Sequence[str]] = None,
                 sample_defaults: Optional[dict] = None, extra_config: Optional[dict] = None):
        self.network = network.eval()
        self.schedule = schedule
        self.tokenizer = tokenizer
        self.tokenizer_ref = tokenizer_ref or {}
        self.class_names = list(class_names) if class_names else None
        self.sample_defaults = dict(sample_defaults or {})
        self.extra_config = dict(extra_config or {})

    # ---- persistence --------------------------------------------------------------------------
    def save_pretrained(self, folder: Union[str, Path]) -> Path:
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().float().contiguous().cpu() for k, v in self.network.state_dict().items()}
        config = {
            "denoiser": self.network.config.to_dict(),
            "embedding": {"l2_normalize": self.network.embedding.l2_normalize},
            "schedule": {"shift": self.schedule.shift, "t_min": self.schedule.t_min},
            "tokenizer": self.tokenizer_ref,
            "class_names": self.class_names,
            "sample": self.sample_defaults,
            **self.extra_config,
        }
        # Write both files under temporary names first: a reader never sees half a pipeline.
        save_file(state, str(folder / (WEIGHTS + ".tmp")))
        (folder / (CONFIG + ".tmp")).write_text(json.dumps(config, indent=2, default=str))
        os.replace(folder / (WEIGHTS + ".tmp"), folder / WEIGHTS)
        os.replace(folder / (CONFIG + ".tmp"), folder / CONFIG)
        return folder

    @classmethod
    def from_pretrained(cls, folder: Union[str, Path], *, device: Union[str, torch.device] = "cpu",
                        dtype: torch.dtype = torch.float32, load_tokenizer: bool = True) -> "VQLCMDPipeline":
        folder = Path(folder)
        for name in (WEIGHTS, CONFIG):
            if not (folder / name).is_file():
                raise FileNotFoundError(f"{folder}: missing {name}; not an exported VQ-LCMD pipeline folder")
        config = json.loads((folder / CONFIG).read_text())
        den_cfg = DenoiserConfig(**config["denoiser"])
        network = VQLCMDNetwork(den_cfg, l2_normalize=config.get("embedding", {}).get("l2_normalize", False))
        state = load_file(str(folder / WEIGHTS))
        missing, unexpected = network.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise ValueError(f"{folder / WEIGHTS}: weights do not fit the config (missing {missing[:5]}, "
                             f"unexpected {unexpected[:5]})")
        network = network.to(device=device, dtype=dtype)
        sched = ShiftedCosineSchedule(**config["schedule"])
        tok_ref = config.get("tokenizer") or {}
        tokenizer = None
        if load_tokenizer and tok_ref.get("path"):
            tokenizer = _load_tokenizer(folder, tok_ref, device)
        extra = {k: v for k, v in config.items()
                 if k not in ("denoiser", "embedding", "schedule", "tokenizer", "class_names", "sample")}
        return cls(network, sched, tokenizer=tokenizer, tokenizer_ref=tok_ref, class_names=config.get("class_names"),
                   sample_defaults=config.get("sample"), extra_config=extra)

    # ---- sampling ---------------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.network.embedding.weight.device

    @torch.no_grad()
    def __call__(self, class_labels=None, *, num_images: Optional[int] = None, num_steps: Optional[int] = None,
                 guidance_scale: Optional[float] = None, sampler: Optional[str] = None,
                 generator: Optional[torch.Generator] = None, batch_size: int = 256, output_type: str = "pil",
                 final: Optional[str] = None, progress: bool = False, backend: str = "auto"):
        """Sample images. Conditional models take ``class_labels`` (ints); unconditional ones ``num_images``.

        ``output_type``: "pil" (list of PIL images), "pt" (float tensor in [0, 1], (N, C, H, W)) or
        "tokens" ((N, h, w) int64, no tokenizer needed).
        """
        if output_type not in ("pil", "pt", "tokens"):
            raise ValueError(f"output_type must be 'pil', 'pt' or 'tokens', got {output_type!r}")
        d = self.sample_defaults
        num_steps = num_steps or d.get("num_steps", 50)
        guidance_scale = d.get("guidance_scale", 0.0) if guidance_scale is None else guidance_scale
        sampler = sampler or d.get("sampler", "ancestral")
        final = final or d.get("final", "sample")
        cfg = self.network.config
        if class_labels is not None:
            labels = torch.as_tensor(class_labels, dtype=torch.long).reshape(-1)
            if cfg.num_classes == 0:
                raise ValueError("this pipeline is unconditional: pass num_images, not class_labels")
            if labels.numel() and (labels.min() < 0 or labels.max() >= cfg.num_classes):
                raise ValueError(f"class_labels must be in [0, {cfg.num_classes}), got {labels.tolist()[:8]}")
            n = labels.numel()
        else:
            if num_images is None:
                raise ValueError("give class_labels (conditional model) or num_images")
            labels, n = None, num_images
            if cfg.num_classes > 0 and guidance_scale > 0:
                raise ValueError("guidance needs class_labels")
        table = self.network.embedding.table()
        chunks = []
        for start in range(0, n, batch_size):
            stop = min(n, start + batch_size)
            kw = dict(class_labels=labels[start:stop].to(self.device)) if labels is not None else \
                dict(num_samples=stop - start)
            chunks.append(sample_tokens(self.network.denoiser, table, self.schedule, num_steps=num_steps,
                                        sampler=sampler, guidance_scale=guidance_scale, final=final,
                                        generator=generator, backend=backend, progress=progress, **kw))
        tokens = torch.cat(chunks) if chunks else torch.empty(0, cfg.seq_len, dtype=torch.long)
        grid = self.grid
        tokens = tokens.view(-1, *grid)
        if output_type == "tokens":
            return tokens
        images = self.decode(tokens)
        if output_type == "pt":
            return images
        return to_pil(images)

    @property
    def grid(self) -> tuple[int, int]:
        if self.tokenizer is not None:
            return tuple(self.tokenizer.grid)
        g = self.tokenizer_ref.get("grid")
        if g:
            return tuple(g)
        side = int(round(self.network.config.seq_len ** 0.5))
        return (side, side)

    def decode(self, tokens: torch.Tensor) -> torch.Tensor:
        """Tokens (N, h, w) -> images in [0, 1] (N, C, H, W)."""
        if self.tokenizer is None:
            raise RuntimeError("no tokenizer loaded: the pipeline was exported without one, or its folder "
                               f"({self.tokenizer_ref.get('path')}) is missing; use output_type='tokens'")
        return ((self.tokenizer.decode(tokens.to(self.tokenizer.device)).float() + 1) / 2).clamp(0, 1).cpu()


def to_pil(images: torch.Tensor):
    from PIL import Image

    arr = (images * 255).round().to(torch.uint8).permute(0, 2, 3, 1).numpy()
    return [Image.fromarray(a[..., 0] if a.shape[-1] == 1 else a) for a in arr]


def _load_tokenizer(folder: Path, ref: dict, device):
    from .tokenizer import load_tokenizer

    path = Path(ref["path"])
    if not path.is_absolute():
        path = folder / path
    if not path.exists():
        raise FileNotFoundError(f"tokenizer folder {path} named by {folder / CONFIG} is missing "
                                "(pass load_tokenizer=False and output_type='tokens' to sample tokens only)")
    tok = load_tokenizer(path)
    if ref.get("identifier") and getattr(tok, "identifier", None) not in (None, ref["identifier"]):
        raise ValueError(f"tokenizer at {path} has identifier {tok.identifier}, but the model was trained on "
                         f"tokens of {ref['identifier']}")
    return tok.to(device) if hasattr(tok, "to") else tok
