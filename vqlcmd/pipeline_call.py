"""The arguments a diffusers user passes to a pipeline call, on top of a pipeline's own ``__call__``.

``diffusers_style(core)`` wraps a sampler's ``__call__`` (``VQLCMDPipeline``'s, and any subclass's such as
``MaskGITPipeline``'s: ``VQLCMDPipeline.__init_subclass__`` wraps those) so that it also takes:

- ``num_inference_steps``: diffusers' name for ``num_steps`` (both given and different: an error);
- ``class_labels`` as class names (``["3", "seven"]``), mapped through the pipeline's ``class_names``;
- ``output_type="np"``: float32 (N, H, W, C) in [0, 1], as diffusers gives it;
- ``return_dict=True``: an ``ImagePipelineOutput`` (diffusers' own class) with ``.images``. The default stays
  False: this API returned the images themselves before it took diffusers' arguments, and callers rely on it;
- ``progress=None``: on where ``set_progress_bar_config`` was called (and not with ``disable=True``).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

OUTPUT_TYPES = ("pil", "np", "pt", "tokens")

try:
    from diffusers.pipelines.pipeline_utils import ImagePipelineOutput
except ImportError:  # (diffusers is a dependency; the tokenizers need it)
    @dataclass
    class ImagePipelineOutput:
        images: Any


def resolve_steps(num_inference_steps: Optional[int], num_steps: Optional[int]) -> Optional[int]:
    if num_inference_steps is not None and num_steps is not None and num_inference_steps != num_steps:
        raise ValueError(f"num_inference_steps={num_inference_steps} and num_steps={num_steps} disagree: they are two "
                         "names for the number of sampling steps; give one")
    return num_steps if num_steps is not None else num_inference_steps


def class_ids(class_labels, names: Optional[Sequence[str]]):
    """``class_labels`` with every name replaced by its id in ``names``; ids and tensors pass unchanged."""
    if class_labels is None or isinstance(class_labels, torch.Tensor) or hasattr(class_labels, "__array__"):
        return class_labels
    items = [class_labels] if isinstance(class_labels, str) else class_labels
    try:
        items = list(items)
    except TypeError:  # a single id
        return class_labels
    given = [x for x in items if isinstance(x, str)]
    if not given:
        return class_labels
    if not names:
        raise ValueError(f"class_labels: class names given ({given[:3]}), but this pipeline has no class_names; give "
                         "integer class ids")
    index = {name: i for i, name in enumerate(names)}
    unknown = sorted({x for x in given if x not in index})
    if unknown:
        known = ", ".join(repr(n) for n in list(names)[:20]) + (f", ... ({len(names)} in all)" if len(names) > 20 else "")
        raise ValueError(f"class_labels: unknown class name(s) {', '.join(repr(u) for u in unknown[:5])}; this "
                         f"pipeline's classes are {known}")
    return [index[x] if isinstance(x, str) else x for x in items]


def progress_bar_kwargs(pipe) -> dict:
    """The tqdm arguments given to ``set_progress_bar_config`` ({} if never called)."""
    return dict(getattr(pipe, "_progress_bar_config", None) or {})


def _progress_default(pipe) -> bool:
    config = getattr(pipe, "_progress_bar_config", None)
    return config is not None and not config.get("disable", False)


def to_numpy_images(images: torch.Tensor):
    """(N, C, H, W) in [0, 1] -> float32 numpy (N, H, W, C), diffusers' ``output_type="np"``."""
    return images.detach().permute(0, 2, 3, 1).float().cpu().numpy()


def diffusers_style(core):
    """``core`` (a pipeline's ``__call__``) taking diffusers' arguments as well (see the module docstring)."""
    if getattr(core, "_diffusers_style", False):
        return core

    @functools.wraps(core)
    def __call__(self, class_labels=None, *, num_inference_steps: Optional[int] = None,
                 num_steps: Optional[int] = None, output_type: str = "pil", return_dict: bool = False,
                 progress: Optional[bool] = None, **kwargs):
        if output_type not in OUTPUT_TYPES:
            raise ValueError(f"output_type must be one of {', '.join(map(repr, OUTPUT_TYPES))}, got {output_type!r}")
        steps = resolve_steps(num_inference_steps, num_steps)
        labels = class_ids(class_labels, self.class_names)
        progress = _progress_default(self) if progress is None else progress
        out = core(self, labels, num_steps=steps, output_type="pt" if output_type == "np" else output_type,
                   progress=progress, **kwargs)
        if output_type == "np":
            out = to_numpy_images(out)
        return ImagePipelineOutput(images=out) if return_dict else out

    __call__.__doc__ = (core.__doc__ or "") + """
        Also diffusers' arguments: ``num_inference_steps`` (= ``num_steps``), class names as ``class_labels``
        (through ``class_names``), ``output_type="np"`` (float32 NHWC in [0, 1]) and ``return_dict=True`` (an
        ``ImagePipelineOutput`` with ``.images``); see vqlcmd/pipeline_call.py."""
    __call__._diffusers_style = True
    return __call__
