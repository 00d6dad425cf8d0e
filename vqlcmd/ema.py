"""Exponential moving averages of a module in float32 (docs/method.md §9, eq. 16).

``θ̄ ← η θ̄ + (1-η) θ`` as one fused multi-tensor ``_foreach_lerp_`` over all
parameters (θ̄ + (1-η)(θ - θ̄)); the shadow stays float32 whatever the dtype of the
trained weights, so a 0.9999 decay does not vanish in bf16 rounding.

The training engine's fast step updates both EMAs in one ``update_emas`` call (a bf16 source
cast once for both) and runs the teacher from a bf16 copy of its
fp32 shadow (``EMA.keep_compute_copy``): the fp32 shadow is the master, as DeepSpeed's fp32
partitions are the student's, and the forward needs no per-call weight casts under autocast.
"""
from __future__ import annotations

import copy
import weakref

import torch
import torch.nn as nn

from . import ops


class EMA:
    def __init__(self, module: nn.Module, decay: float):
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"EMA decay must be in [0, 1), got {decay}")
        self.decay = float(decay)
        # eval(): the shadow runs without dropout. As the CM teacher that is our choice (the paper does not
        # say): its prediction is the student's target, and dropout there would only add noise to it.
        self.module = copy.deepcopy(module).float().eval().requires_grad_(False)
        self.compute = self.module  # what forwards run on: the shadow, or its copy in a lower precision
        self.flat = self.compute_flat = None  # (flatten): the shadow's and the compute copy's flat buffers

    def keep_compute_copy(self, dtype: torch.dtype) -> None:
        """Forwards run on a ``dtype`` copy of the shadow, refreshed by every update and load (the shadow
        stays float32: rounded to bf16 itself, updates below its rounding step would be lost)."""
        if dtype == torch.float32:
            self.compute = self.module
            return
        self.compute = copy.deepcopy(self.module).to(dtype)
        self._refresh_compute()

    @torch.no_grad()
    def flatten(self, layout: list, size: int) -> None:
        """The shadow's parameters named in ``layout`` ((name, offset) pairs), and the compute copy's, become
        views of one buffer each of ``size`` elements at those offsets (same values): laid out as the trained
        weights' flat buffer, one pass over the buffers updates every one of them (``update_emas_flat``).
        Parameters left out must be ones that never change (frozen)."""
        self.flat = _flatten(self.module, layout, size)
        if self.compute is not self.module:
            self.compute_flat = _flatten(self.compute, layout, size)

    @torch.no_grad()
    def _refresh_compute(self) -> None:
        if self.compute is self.module:
            return
        if self.compute_flat is not None:
            self.compute_flat.copy_(self.flat)  # the padding between the views too: zeros both
        else:
            torch._foreach_copy_(_parameters(self.compute), _parameters(self.module))
        self._refresh_compute_buffers()

    @torch.no_grad()
    def _refresh_compute_buffers(self) -> None:
        if self.compute is self.module:
            return
        for name in _buffer_names(self.module):
            self.compute.get_buffer(name).copy_(self.module.get_buffer(name))

    def update(self, source: nn.Module) -> None:
        update_emas([self], source)

    def _copy_buffers(self, source: nn.Module) -> None:
        # persistent buffers only: the non-persistent ones are fixed tables the model rebuilds (the
        # denoiser's positions), and the bf16 source's copies would round the shadow's fp32 ones
        for name in _shared_persistent_buffers(source, self.module):
            self.module.get_buffer(name).copy_(source.get_buffer(name))

    def state_dict(self) -> dict:
        return {"decay": self.decay, "module": self.module.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.decay = float(state["decay"])
        self.module.load_state_dict(state["module"])
        self._refresh_compute()


@torch.no_grad()
def update_emas(emas: list, source: nn.Module) -> None:
    """``EMA.update`` of several EMAs of one source, each one multi-tensor ``_foreach_lerp_``, with a bf16
    source's parameters cast to float32 once for all of them, not once per EMA (same values as updating
    each on its own)."""
    params = _as_float32(_parameters(source))
    for ema in emas:
        shadow = _parameters(ema.module)
        if len(shadow) != len(params):
            raise ValueError("EMA source has a different parameter list than its shadow")
        torch._foreach_lerp_(shadow, params, 1.0 - ema.decay)
        ema._copy_buffers(source)
        ema._refresh_compute()


@torch.no_grad()
def update_emas_flat(emas: list, source_flat: torch.Tensor, source: nn.Module, backend: str = "auto") -> None:
    """``update_emas`` for EMAs flattened (``EMA.flatten``) in the layout of ``source_flat``, the flat buffer the
    source's trained parameters are views of: all of them, and the compute copies of those that keep one, in
    one ``vqlcmd.ops.ema_update_`` (the same values: lerp is elementwise). On a CPU that is one pass over the
    weights, where a cast, a lerp per EMA and a copy were a pass each (3.6 ms of a step at imagenet-246m's
    structure, benchmarks/host_overhead.py). ``backend``: the run's ``train.backend``: ``reference`` runs the
    reference; any other leaves the choice to ``auto`` (the compiled kernel is the CPU's only, and there is no
    Triton one, so a run naming either on a GPU still updates its EMAs)."""
    copies = [(ema.compute_flat, k) for k, ema in enumerate(emas) if ema.compute_flat is not None]
    ops.ema_update_([ema.flat for ema in emas], source_flat, [1.0 - ema.decay for ema in emas],
                    [c for c, _ in copies], [k for _, k in copies],
                    backend="reference" if backend == "reference" else "auto")
    for ema in emas:
        ema._copy_buffers(source)
        if ema.compute_flat is None:
            ema._refresh_compute()
        else:
            ema._refresh_compute_buffers()


def _flatten(module: nn.Module, layout: list, size: int) -> torch.Tensor:
    params = dict(module.named_parameters())
    first = next(iter(params.values()))
    flat = torch.zeros(size, dtype=first.dtype, device=first.device)
    for name, offset in layout:
        p = params[name]
        view = flat[offset:offset + p.numel()].view_as(p)
        view.copy_(p)
        p.data = view
    return flat


def _as_float32(params: list) -> list:
    """The parameters in float32 (those already float32 as they are). Parameters that are views of one
    storage, as DeepSpeed's bf16 weights are of its flat buffer, are cast in one op over the storage and
    viewed back (the values of a cast of each): one kernel on a GPU instead of one per tensor."""
    out = list(params)
    shared: dict = {}
    for i, p in enumerate(params):
        if p.dtype != torch.float32:
            shared.setdefault((p.untyped_storage().data_ptr(), p.dtype, p.device), []).append(i)
    for idx in shared.values():
        first = params[idx[0]]
        storage = first.untyped_storage()
        size = storage.nbytes() // first.element_size()
        if len(idx) == 1 or 2 * sum(params[i].numel() for i in idx) < size:  # a lone tensor, or a sparse span
            for i in idx:
                out[i] = params[i].float()
            continue
        flat = first.new_empty(0).set_(storage, 0, (size,), (1,)).float()
        for i in idx:
            out[i] = flat.as_strided(params[i].shape, params[i].stride(), params[i].storage_offset())
    return out


# Each module's parameter list and buffer names, walked once: walking a 24-block denoiser's ~600 submodules took
# ~15 ms of Python per step for the two EMAs' five walks (benchmarks/host_overhead.py), more than their lerps.
# The lists hold the Parameter objects, which moving or casting a module (.to, DeepSpeed's flat buffers) keeps;
# buffers are looked up by name at each use, since .to() replaces buffer tensors.
_PARAMETERS: "weakref.WeakKeyDictionary[nn.Module, list]" = weakref.WeakKeyDictionary()
_BUFFERS: "weakref.WeakKeyDictionary[nn.Module, list]" = weakref.WeakKeyDictionary()
_SHARED: "weakref.WeakKeyDictionary[nn.Module, dict]" = weakref.WeakKeyDictionary()


def _parameters(module: nn.Module) -> list:
    if module not in _PARAMETERS:
        _PARAMETERS[module] = list(module.parameters())
    return _PARAMETERS[module]


def _buffer_names(module: nn.Module) -> list:
    if module not in _BUFFERS:
        _BUFFERS[module] = [name for name, _ in module.named_buffers()]
    return _BUFFERS[module]


def _shared_persistent_buffers(source: nn.Module, shadow: nn.Module) -> list:
    """The source's persistent buffers that the shadow has too, by name."""
    known = _SHARED.setdefault(source, weakref.WeakKeyDictionary())
    if shadow not in known:
        mine = set(_buffer_names(shadow))
        known[shadow] = [n for n in _buffer_names(source) if n in mine and _is_persistent(source, n)]
    return known[shadow]


def _is_persistent(module: nn.Module, name: str) -> bool:
    owner, _, leaf = name.rpartition(".")
    return leaf not in module.get_submodule(owner)._non_persistent_buffers_set
