"""``VQLCMDPipeline``: load an exported model folder and sample images (the Python sampling API).

A pipeline folder holds ``model.safetensors`` (denoiser + token embeddings, the
sampling-EMA weights) and ``config.json`` (denoiser config, schedule, tokenizer
reference, class names, sampling defaults, the resolved training config), and ``tokenizer/`` (the VQ
tokenizer's diffusers folder, named relatively in config.json) when the pipeline has one: a copied or
moved folder samples images on its own.
No pickle anywhere: safetensors + JSON only.
"""
from __future__ import annotations

import contextlib
import json
import hashlib
import importlib
import os
from pathlib import Path
from typing import Optional, Sequence, Union

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from . import ops
from .model import DenoiserConfig
from .network import VQLCMDNetwork
from .ops._checks import checked_guidance
from .pipeline_call import diffusers_style, progress_bar_kwargs
from .engine.manifest import MANIFEST, ManifestError, NoManifest, verify_manifest, write_manifest
from .pipeline_folder import CONFIG, TOKENIZER_DIR, WEIGHTS, _load_tokenizer, _user_mode, save_tokenizer  # noqa: F401
from .samplers import Generators, checked_interval, class_label_tensor, sample_tokens
from .schedule import ShiftedCosineSchedule

SAVE_ID = "save_id"  # in config.json and the weights' metadata: one save wrote both
FAST_MODES = ("compile", "cudagraphs")


# Images per decoder call: a 256-px VQGAN decoder peaks at about 160 MiB per image (CPU, float32), so 16 keep
# it near 2.5 GiB; small decoders (the digits one) gain nothing from larger calls.
DECODE_BATCH = 16


# method -> its pipeline class, filled as vqlcmd.methods registers them (from_pretrained loads that package by
# name when needed: its methods import this module, so this one does not import it)
_PIPELINE_CLASSES: dict = {}
register_pipeline_class = _PIPELINE_CLASSES.__setitem__  # (method, class)


# Not a diffusers.DiffusionPipeline: DiffusionPipeline.from_pretrained finds a folder's pipeline class by
# looking its model_index.json name up in the diffusers package itself, so a class from here loads only as a
# custom_pipeline, i.e. by running a Python file from the folder or the Hub, which a folder a user is handed
# must never do. The call takes diffusers' arguments instead (pipeline_call.py).
class VQLCMDPipeline:
    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "__call__" in cls.__dict__:  # a subclass's own sampler (MaskGITPipeline) takes the same arguments
            cls.__call__ = diffusers_style(cls.__dict__["__call__"])

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
        self._sampling_denoiser, self.fast_mode = None, None
        self._progress_bar_config = None

    def set_progress_bar_config(self, **kwargs) -> None:
        """tqdm arguments for the sampling progress bars (over the steps; over the images when there are several
        batches), as in diffusers; calls then show progress unless ``disable=True`` (or ``progress=False``)."""
        self._progress_bar_config = dict(kwargs)

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
        # Both files are written under temporary names and renamed in, so neither is ever half written. The
        # two renames are not one step: both carry the same save id, and a reader that meets the new weights
        # with the old config (the trainer re-exports with every checkpoint) is told, not given a mix.
        config["tokenizer"] = save_tokenizer(self.tokenizer, self.tokenizer_ref, folder)
        save_id = _content_id(state, config)  # the same save twice: the same bytes (sample.py hashes them)
        config[SAVE_ID] = save_id
        (folder / MANIFEST).unlink(missing_ok=True)  # while rewritten: unverified (the save ids still pair files)
        save_file(state, str(folder / (WEIGHTS + ".tmp")), metadata={SAVE_ID: save_id})
        _user_mode(folder / (WEIGHTS + ".tmp"))  # safetensors creates its files 0600
        (folder / (CONFIG + ".tmp")).write_text(json.dumps(config, indent=2, default=str))
        os.replace(folder / (WEIGHTS + ".tmp"), folder / WEIGHTS)
        os.replace(folder / (CONFIG + ".tmp"), folder / CONFIG)
        # last: each file's size and checksum, which from_pretrained verifies; not config.json, which users may
        # edit (tokenizer.path) and whose pairing with the weights the save id checks
        write_manifest(folder, exclude=(CONFIG,))
        return folder

    @classmethod
    def from_pretrained(cls, folder: Union[str, Path], *, device: Union[str, torch.device] = "cpu",
                        dtype: Optional[torch.dtype] = None, load_tokenizer: bool = True,
                        torch_dtype: Optional[torch.dtype] = None) -> "VQLCMDPipeline":
        """``dtype`` (``torch_dtype``, diffusers' name): the weights' floating-point dtype, default float32."""
        if dtype is not None and torch_dtype is not None and dtype != torch_dtype:
            raise ValueError(f"dtype={dtype} and torch_dtype={torch_dtype} disagree: two names for one setting; give one")
        dtype = dtype or torch_dtype or torch.float32
        if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise TypeError(f"dtype must be a floating-point torch.dtype (torch.float32, torch.bfloat16 or "
                            f"torch.float16), got {dtype!r}")
        folder = Path(folder)
        if not folder.is_dir():
            what = "is a file, not a folder" if folder.exists() else "does not exist"
            raise FileNotFoundError(f"pipeline folder {str(folder)!r} {what} (an exported pipeline is a folder "
                                    f"holding {WEIGHTS} and {CONFIG}; scripts/train.py writes one to "
                                    "<train.output_dir>/pipeline)")
        for name in (WEIGHTS, CONFIG):
            if not (folder / name).is_file():
                raise FileNotFoundError(f"{folder}: missing {name}; not an exported VQ-LCMD pipeline folder")
        try:
            config = json.loads((folder / CONFIG).read_text())
            den_cfg = DenoiserConfig(**config["denoiser"])
            l2_normalize = bool((config.get("embedding") or {}).get("l2_normalize", False))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:  # (JSONDecodeError is a ValueError)
            raise ValueError(f"{folder / CONFIG}: not a VQ-LCMD pipeline config ({type(exc).__name__}: {exc})") from exc
        # the folder says which sampler its model was trained for: a MaskGIT model (trained on [mask] ids at
        # t = 0) gives noise through the diffusion samplers, and a diffusion model cannot unmask
        method = config.get("method", "vqlcmd")
        if method not in _PIPELINE_CLASSES:  # the methods register their classes as vqlcmd.methods loads
            importlib.import_module("vqlcmd.methods")
        saved_cls = _PIPELINE_CLASSES.get(method, VQLCMDPipeline)
        if issubclass(saved_cls, cls):
            cls = saved_cls
        else:
            kind = cls.__name__.removesuffix("Pipeline")
            raise ValueError(f"{folder}: a {method} pipeline, not a {kind} one; load it with "
                             f"{saved_cls.__name__}.from_pretrained")
        try:
            verify_manifest(folder)
        except NoManifest:  # exported before manifests, or caught mid-rewrite: the save ids still check the pair
            pass
        except ManifestError as exc:  # names the file
            what = "unreadable weights, truncated or corrupt" if exc.path.name == WEIGHTS else "damaged file"
            raise ValueError(f"{exc.path}: {what} ({exc.reason}); export the pipeline again") from exc
        network = VQLCMDNetwork(den_cfg, l2_normalize=l2_normalize)
        try:
            with safe_open(str(folder / WEIGHTS), framework="pt") as f:  # one open: tensors and id of one file
                weights_id = (f.metadata() or {}).get(SAVE_ID)
                state = {name: f.get_tensor(name) for name in f.keys()}
        except Exception as exc:  # safetensors' errors name neither the file nor what to do
            raise ValueError(f"{folder / WEIGHTS}: unreadable weights, truncated or corrupt ({exc}); export the "
                             "pipeline again (scripts/train.py writes one with every checkpoint)") from exc
        if weights_id and config.get(SAVE_ID) and weights_id != config[SAVE_ID]:  # (folders from before lack ids)
            raise ValueError(f"{folder}: {WEIGHTS} and {CONFIG} come from different saves (save ids {weights_id} and "
                             f"{config[SAVE_ID]}): the folder was being rewritten while it was read; load it again")
        try:
            missing, unexpected = network.load_state_dict(state, strict=False)
        except RuntimeError as exc:  # a tensor of another shape than the config gives (e.g. embed_dim)
            raise ValueError(f"{folder / WEIGHTS}: weights do not fit the config's sizes ({exc})") from exc
        if missing or unexpected:
            raise ValueError(f"{folder / WEIGHTS}: weights do not fit the config (missing {missing[:5]}, "
                             f"unexpected {unexpected[:5]})")
        network = network.to(device=device, dtype=dtype)
        try:
            sched = ShiftedCosineSchedule(**config["schedule"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{folder / CONFIG}: no usable schedule section ({type(exc).__name__}: {exc})") from exc
        tok_ref = config.get("tokenizer") or {}
        tokenizer = None
        if load_tokenizer and tok_ref.get("path"):
            tokenizer = _load_tokenizer(folder, tok_ref, device)
        elif tok_ref.get("path") and not Path(tok_ref["path"]).is_absolute():
            # saved again without its tokenizer object, the reference must still find this folder's
            tok_ref = {**tok_ref, "path": str((folder / tok_ref["path"]).resolve())}
        extra = {k: v for k, v in config.items()
                 if k not in ("denoiser", "embedding", "schedule", "tokenizer", "class_names", "sample", SAVE_ID)}
        return cls(network, sched, tokenizer=tokenizer, tokenizer_ref=tok_ref, class_names=config.get("class_names"),
                   sample_defaults=config.get("sample"), extra_config=extra)

    # ---- fast sampling ------------------------------------------------------------------------------
    def enable_fast_sampling(self, mode: str = "compile", **compile_kwargs) -> "VQLCMDPipeline":
        """Compile the sampling loop's steps (off by default).

        ``mode``: "compile" (``torch.compile``, any device) or "cudagraphs" (``torch.compile`` with
        mode="reduce-overhead": each compiled step replays as CUDA graphs, which removes the per-step
        launch overhead that dominates few-step sampling of small models; CUDA only). The diffusion
        samplers compile a whole step (the guided batched forward, Ψ̂, the update: ``sample_tokens(...,
        compile=True)``); the MaskGIT sampler compiles the denoiser, with ``compile_kwargs``. Shapes are specialised (``dynamic=False``):
        each batch size (guidance doubles it) compiles once, so keep ``batch_size`` fixed across calls.
        """
        if mode not in FAST_MODES:
            raise ValueError(f"fast sampling mode must be one of {FAST_MODES}, got {mode!r}")
        if mode == "cudagraphs" and self.device.type != "cuda":
            raise ValueError(f"mode='cudagraphs' needs the pipeline on a CUDA device, it is on {self.device}")
        kw = {"dynamic": False, **compile_kwargs}
        if mode == "cudagraphs":
            kw.setdefault("mode", "reduce-overhead")
        self._sampling_denoiser = torch.compile(_SamplingDenoiser(self.network.denoiser), **kw)
        # one module for every call: the compiled step's guards then hold from one call to the next
        self._step_denoiser, self._step_mode = _SamplingDenoiser(self.network.denoiser), kw.get("mode")
        self.fast_mode = mode
        return self

    def disable_fast_sampling(self) -> "VQLCMDPipeline":
        self._sampling_denoiser, self.fast_mode = None, None
        return self

    def _step_options(self) -> tuple:
        """(denoiser, the samplers' compile arguments) for a diffusion sampling call."""
        if self.fast_mode is None:
            return self._denoiser(), {}
        return self._step_denoiser, dict(compile=True, compile_mode=self._step_mode)

    def to(self, device: Union[str, torch.device, None] = None,
           dtype: Optional[torch.dtype] = None) -> "VQLCMDPipeline":
        """Moves the model (and the tokenizer, to ``device``) and returns the pipeline, as diffusers' ``to``.
        ``dtype`` (float32, bfloat16, float16) is the weights': 16-bit ones sample under autocast, as with
        ``from_pretrained(dtype=...)``. Fast sampling is switched off: its compiled graphs belong to the old
        device and dtype (call ``enable_fast_sampling`` again)."""
        if isinstance(device, torch.dtype):  # pipe.to(torch.float16), as diffusers takes it
            device, dtype = None, device
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise TypeError(f"dtype must be a floating-point torch.dtype, got {dtype!r}")
        self.network = self.network.to(device=device, dtype=dtype)
        if device is not None and self.tokenizer is not None and hasattr(self.tokenizer, "to"):
            self.tokenizer = self.tokenizer.to(torch.device(device))
        return self.disable_fast_sampling()

    def _denoiser(self):
        if getattr(self, "_sampling_denoiser", None) is not None:
            return self._sampling_denoiser
        return _SamplingDenoiser(self.network.denoiser)

    # ---- sampling ---------------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.network.embedding.weight.device

    def _batch_size(self, batch_size: Optional[int]) -> int:
        """The caller's batch size, checked, or the device's default (shared with MaskGITPipeline)."""
        batch_size = default_batch_size(self.device) if batch_size is None else batch_size
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        return batch_size

    @diffusers_style
    @torch.no_grad()
    def __call__(self, class_labels=None, *, num_images: Optional[int] = None, num_steps: Optional[int] = None,
                 guidance_scale: Optional[float] = None, sampler: Optional[str] = None,
                 generator: Generators = None, batch_size: Optional[int] = None, output_type: str = "pil",
                 final: Optional[str] = None, progress: bool = False, backend: str = "auto",
                 guidance_interval: Optional[Sequence[float]] = None):
        """Sample images. Conditional models take ``class_labels`` (ints); unconditional ones ``num_images``
        (on a conditional model ``num_images`` draws from the null class, without guidance).

        ``generator``: one ``torch.Generator`` (reproducible for the same ``batch_size``) or a list with one
        generator per image (see ``image_generators``): then each image depends only on its own generator,
        not on the batch or rank that draws it. ``batch_size`` bounds the images per denoiser batch
        (guidance doubles the rows; default ``default_batch_size(device)``); each batch is decoded as it
        is drawn, ``DECODE_BATCH`` images per decoder call. ``output_type``: "pil" (list
        of PIL images), "pt" (float tensor in [0, 1], (N, C, H, W)) or "tokens" ((N, h, w) int64, no
        tokenizer needed). Defaults for
        ``num_steps``, ``guidance_scale``, ``sampler``, ``final`` and ``guidance_interval`` ((lo, hi): guide
        only at noise levels lo <= t <= hi; (0, 1) everywhere) come from the exported config.
        ``backend``: of the sampler's fused op (the (guided) softmax-weighted embedding average): "auto",
        "reference" or "triton"; the compiled backend has no such op.
        """
        batch_size = self._batch_size(batch_size)
        if backend != "auto":  # else found only at the first sampling step (why_not also names unknown ones)
            table = self.network.embedding.table()[:self.network.config.codebook_size]
            probe = torch.empty(1, table.shape[0], device=self.device)  # the sampler's logits are float32
            why = ops.why_not("softmax_embedding_average", backend, probe, table)
            if why is not None:
                raise ValueError(f"backend={backend!r} cannot serve the sampler's softmax_embedding_average: {why}")
        d = self.sample_defaults
        num_steps = d.get("num_steps", 50) if num_steps is None else num_steps  # 0 is refused, not the default
        sampler = sampler or d.get("sampler", "ancestral")
        final = final or d.get("final", "sample")
        guidance_interval = checked_interval(d.get("guidance_interval") if guidance_interval is None
                                             else guidance_interval)
        labels, n, guidance_scale, generator = self._request(class_labels, num_images, guidance_scale, generator,
                                                             output_type)
        table = self.network.embedding.table()
        denoiser, compile_kw = self._step_options()
        bar = None
        if progress and n > batch_size:
            from tqdm.auto import tqdm

            bar = tqdm(total=n, **{"desc": f"{sampler} {num_steps} steps", "unit": "img", **progress_bar_kwargs(self)})
        chunks = []
        for start, stop, kw in self._chunks(labels, n, batch_size, generator):
            with self._autocast():  # the sampler only: the tokenizer decodes in its own dtype
                tokens = sample_tokens(denoiser, table, self.schedule, num_steps=num_steps, sampler=sampler,
                                       guidance_scale=guidance_scale, final=final, backend=backend,
                                       guidance_interval=guidance_interval, **compile_kw,
                                       progress=(progress_bar_kwargs(self) or True) if progress and bar is None
                                       else False, **kw)
            chunks.append(self._finish(tokens, output_type))
            if bar is not None:
                bar.update(stop - start)
        if bar is not None:
            bar.close()
        return self._output(chunks, output_type)

    # ---- shared with MaskGITPipeline: the request's checks, its batches, the output ----------------------
    def _request(self, class_labels, num_images, guidance_scale, generator, output_type):
        """(labels (n,) or None, n, ω, generator: one, None or a list of n) from a call's arguments, checked."""
        if output_type not in ("pil", "pt", "tokens"):
            raise ValueError(f"output_type must be 'pil', 'pt' or 'tokens', got {output_type!r}")
        if output_type != "tokens" and self.tokenizer is None:  # found only after sampling every image
            raise ValueError(f"output_type={output_type!r} needs a tokenizer to decode the tokens, and none is loaded "
                             "(from_pretrained(load_tokenizer=True), or output_type='tokens')")
        explicit_guidance = guidance_scale is not None
        guidance_scale = self.sample_defaults.get("guidance_scale", 0.0) if guidance_scale is None else guidance_scale
        guidance_scale = checked_guidance(guidance_scale)  # before the comparisons below ("1" > 0 was a TypeError)
        cfg = self.network.config
        if class_labels is not None:
            labels = class_label_tensor(class_labels, num_images)
            if cfg.num_classes == 0:
                raise ValueError("this pipeline is unconditional: pass num_images, not class_labels")
            if labels.numel() and (labels.min() < 0 or labels.max() >= cfg.num_classes):
                raise ValueError(f"class_labels must be in [0, {cfg.num_classes}), got {labels.tolist()[:8]}")
            n = labels.numel()
        else:
            if num_images is None:
                raise ValueError("give class_labels (conditional model) or num_images")
            if num_images < 0:
                raise ValueError(f"num_images must be >= 0, got {num_images}")
            labels, n = None, num_images
            if guidance_scale > 0:
                if explicit_guidance:
                    raise ValueError("guidance needs class_labels" if cfg.num_classes else
                                     "guidance needs a class-conditional model; this one is unconditional")
                # the exported default (sample.guidance_scale, 1.0 unless set) guides; without labels, or
                # classes, there is nothing to guide to
                guidance_scale = 0.0
        if generator is not None and not isinstance(generator, torch.Generator):
            try:
                generator = list(generator)
            except TypeError:
                raise TypeError(f"generator must be a torch.Generator or one per image, got "
                                f"{type(generator).__name__} (a seed: torch.Generator().manual_seed(seed))") from None
            if not all(isinstance(g, torch.Generator) for g in generator):
                raise TypeError("generator: a list must hold torch.Generators (image_generators(seeds) makes them)")
            if len(generator) != n:
                raise ValueError(f"{len(generator)} generators for {n} images: give one per image")
        return labels, n, guidance_scale, generator

    def _chunks(self, labels, n: int, batch_size: int, generator):
        """(start, stop, the sampler's label / count and generator arguments) for each batch of the n images."""
        for start in range(0, n, batch_size):
            stop = min(n, start + batch_size)
            kw = dict(class_labels=labels[start:stop].to(self.device)) if labels is not None else \
                dict(num_samples=stop - start)
            kw["generator"] = generator[start:stop] if isinstance(generator, list) else generator
            yield start, stop, kw

    def _finish(self, tokens: torch.Tensor, output_type: str):
        """One batch's tokens (b, L) as ``output_type``, decoded as soon as they are sampled: decoding all N
        at the end held every image's decoder activations at once (about 160 MiB per 256-px image)."""
        tokens = tokens.view(-1, *self.grid)
        if output_type == "tokens":
            return tokens
        images = self.decode(tokens)
        return images if output_type == "pt" else to_pil(images)

    def _output(self, chunks: list, output_type: str):
        """The batches' outputs (``_finish``) as one: tokens (N, h, w), images in [0, 1] or PIL images."""
        if output_type == "pil":
            return [image for chunk in chunks for image in chunk]
        if not chunks:  # no images: an empty batch of the type asked for (_request saw a tokenizer if needed)
            chunks = [self._finish(torch.empty(0, *self.grid, dtype=torch.long, device=self.device), output_type)]
        return torch.cat(chunks)

    def _autocast(self):
        dtype = self.network.embedding.weight.dtype
        if dtype not in (torch.bfloat16, torch.float16):  # fp32, or fp64 which autocast refuses with a warning
            return contextlib.nullcontext()
        # weights stored in half precision: matmuls run in that dtype, norms and the sampler's math in fp32
        return torch.autocast(self.device.type, dtype=dtype)

    @property
    def grid(self) -> tuple[int, int]:
        if self.tokenizer is not None:
            return tuple(self.tokenizer.grid)
        g = self.tokenizer_ref.get("grid")
        if g:
            return tuple(g)
        side = int(round(self.network.config.seq_len ** 0.5))
        return (side, side)

    def decode(self, tokens: torch.Tensor, batch_size: Optional[int] = None) -> torch.Tensor:
        """Tokens (N, h, w) -> images in [0, 1] (N, C, H, W) on the CPU, decoded ``batch_size`` (default
        ``DECODE_BATCH``) at a time: a decoder's activations dwarf the images (a 256-px VQGAN's about
        160 MiB per image)."""
        batch_size = DECODE_BATCH if batch_size is None else batch_size
        if self.tokenizer is None:
            raise RuntimeError("no tokenizer loaded: the pipeline was exported without one, or its folder "
                               f"({self.tokenizer_ref.get('path')}) is missing; use output_type='tokens'")
        if not len(tokens):  # the tokenizer's decoder cannot reshape an empty batch
            h, w = self.tokenizer.image_size
            return torch.empty(0, self.tokenizer.channels, h, w)
        pieces = [((self.tokenizer.decode(piece.to(self.tokenizer.device)).float() + 1) / 2).clamp(0, 1).cpu()
                  for piece in tokens.split(batch_size)]
        return torch.cat(pieces)


class _SamplingDenoiser(torch.nn.Module):
    """The denoiser as the sampling loop calls it: z arrives in float32 and is cast to the weights' dtype;
    the unit that ``enable_fast_sampling`` compiles."""

    def __init__(self, denoiser):
        super().__init__()
        self.inner = denoiser
        self.cfg = denoiser.cfg

    def forward(self, z, t, y=None):
        return self.inner(z.to(self.inner.in_proj.weight.dtype), t, y)


def _content_id(state: dict, config: dict) -> str:
    """A digest of the weights and the config: equal saves get equal ids (and files), different ones not."""
    h = hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode())
    for name in sorted(state):
        h.update(name.encode())
        h.update(state[name].numpy())  # (contiguous float32: hashed as it lies in memory)
    return h.hexdigest()[:32]


def default_batch_size(device: torch.device) -> int:
    """Images per denoiser batch when the caller gives none. On a CPU small batches keep each layer's
    activations in cache: 500 guided digits samples took 1.42 s per step at 25 images per batch, 1.72 s
    at 100 and 2.1 s at 500 (2-core CPU); a GPU wants large batches."""
    return 32 if torch.device(device).type == "cpu" else 256


def image_generators(seeds: Sequence[int], device: Union[str, torch.device] = "cpu") -> list:
    """One ``torch.Generator`` per image, seeded with ``seeds[i]`` (per-image seeds for ``__call__``)."""
    return [torch.Generator(device=device).manual_seed(int(s)) for s in seeds]


def to_pil(images: torch.Tensor):
    from PIL import Image

    arr = (images * 255).round().to(torch.uint8).permute(0, 2, 3, 1).numpy()
    return [Image.fromarray(a[..., 0] if a.shape[-1] == 1 else a) for a in arr]
