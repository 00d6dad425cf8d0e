"""Ancestral and DDIM samplers with classifier-free guidance (docs/method.md §10-11; paper Algorithm 2).

Grid 0 = t_0 < … < t_N = 1, z_1 ~ N(0, I); each step predicts Ψ̂ from the
(guided) token distribution and moves z_t -> z_s; the final tokens are drawn from
the guided P(x | z_0; 0). Conditional and unconditional logits come from one
batched forward.
"""
from __future__ import annotations

import operator
from typing import Callable, Optional, Sequence, Union

import torch

from . import ops
# the names and the guidance interval a config chooses: defined with the schema, re-exported here
from .engine.config import EVERY_T, FINALS, SAMPLERS, checked_interval  # noqa: F401
from .model import Denoiser
from .ops._checks import checked_guidance, checked_upstream
from .ops.reference import guided_log_probs
from .schedule import ShiftedCosineSchedule


# One generator for the batch, or one per sample: then a sample's noise does not depend on which batch
# (or rank) draws it, which is what per-image seeds in scripts/sample.py rely on.
Generators = Union[None, torch.Generator, Sequence[torch.Generator]]


def _one(generator: Generators) -> bool:
    """Whether ``generator`` serves the whole batch (one generator, or None); else it must hold one per row."""
    return generator is None or isinstance(generator, torch.Generator)


def _check_rows(generator: Sequence[torch.Generator], rows: int) -> None:
    if len(generator) != rows:
        raise ValueError(f"{len(generator)} generators for a batch of {rows}: give one per sample")


def _draw(fn, shape, generator: Generators, device) -> torch.Tensor:
    """``fn`` (torch.randn, torch.rand) float32 draws of ``shape``; per-sample generators give row ``i``."""
    if _one(generator):
        return fn(shape, device=device, dtype=torch.float32, generator=generator)
    _check_rows(generator, shape[0])
    return torch.stack([fn(shape[1:], device=device, dtype=torch.float32, generator=g) for g in generator])


def randn(shape, generator: Generators, device) -> torch.Tensor:
    """Standard normal float32 draws of ``shape``; a sequence of generators gives row ``i`` from generator ``i``."""
    return _draw(torch.randn, shape, generator, device)


def rand(shape, generator: Generators, device) -> torch.Tensor:
    """Uniform [0, 1) float32 draws of ``shape``; per-sample generators as ``randn``."""
    return _draw(torch.rand, shape, generator, device)


def multinomial_rows(probs: torch.Tensor, generator: Generators) -> torch.Tensor:
    """One draw per (B, M) position from probs (B, M, K) -> (B, M) int64; per-sample generators as ``randn``."""
    B, M, K = probs.shape
    if _one(generator):
        return torch.multinomial(probs.reshape(-1, K), 1, generator=generator).view(B, M)
    _check_rows(generator, B)
    return torch.stack([torch.multinomial(probs[i], 1, generator=g).view(M) for i, g in enumerate(generator)])


def _logits_pair(denoiser: Callable, z, t, y, null_class: int, guided: bool):
    """(cond_logits, uncond_logits or None) from one batched forward."""
    if not guided:
        return denoiser(z, t, y).float(), None
    B = z.shape[0]
    logits = denoiser(torch.cat([z, z]), torch.cat([t, t]), torch.cat([y, torch.full_like(y, null_class)])).float()
    return logits[:B], logits[B:]


def ancestral_step(z_t, psi, schedule: ShiftedCosineSchedule, t, s, generator=None):
    """z_s ~ N(μ̂, σ²(s,t) I), μ̂ = c_z z_t + c_x Ψ̂ (closed-form posterior q(z_s | z_t, x=Ψ̂))."""
    return ancestral_update(z_t, psi, schedule, t, s, randn(z_t.shape, generator, z_t.device))


def ancestral_update(z_t, psi, schedule: ShiftedCosineSchedule, t, s, eps):
    """``ancestral_step`` with its standard normal draw ``eps`` given."""
    c_z, c_x, var = schedule.posterior(t, s)
    return c_z * z_t + c_x * psi + var.sqrt() * eps


def ddim_step(z_t, psi, schedule: ShiftedCosineSchedule, t, s):
    """z_s = α_s Ψ̂ + (σ_s/σ_t)(z_t − α_t Ψ̂)."""
    alpha_t, sigma_t = schedule.alpha_sigma(t)
    alpha_s, sigma_s = schedule.alpha_sigma(s)
    return alpha_s * psi + (sigma_s / sigma_t) * (z_t - alpha_t * psi)


def class_label_tensor(class_labels, num_images: Optional[int]) -> torch.Tensor:
    """``class_labels`` as a flat int64 tensor; a fractional label (which a cast would truncate) or a
    ``num_images`` that disagrees with the labels' count is an error, not silently dropped."""
    try:
        labels = torch.as_tensor(class_labels).reshape(-1)
    except (TypeError, ValueError, RuntimeError) as exc:  # names ("cat"), ragged lists: torch's own words
        raise ValueError(f"class_labels must be integer class ids (a pipeline's class_names lists the name of "
                         f"each), got {str(class_labels)[:80]} ({exc})") from None
    if labels.is_floating_point():
        fractional = labels[labels != labels.round()]
        if fractional.numel():
            raise ValueError(f"class_labels must be integers, got {', '.join(f'{v:g}' for v in fractional.tolist()[:8])}")
    elif labels.dtype == torch.bool or labels.is_complex():
        raise ValueError(f"class_labels must be integers, got dtype {labels.dtype}")
    if num_images is not None and num_images != labels.numel():
        raise ValueError(f"num_images={num_images} but {labels.numel()} class_labels were given (one image per label)")
    return labels.long()


def _count(name: str, value) -> int:
    """An integer argument, as an int: 2.5 steps was a TypeError from inside torch.linspace."""
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an integer, got {value!r}") from None


def resolve_labels(num_classes: int, class_labels, num_samples, guidance_scale: float, device):
    """(labels (B,) or None, B) for a sampler: conditional models take ``class_labels``, unconditional ones
    ``num_samples``; a conditional model without labels samples the null class. Guidance needs labels."""
    checked_guidance(guidance_scale)
    if num_samples is not None:
        num_samples = _count("num_samples", num_samples)
        if num_samples < 0:
            raise ValueError(f"num_samples must be >= 0, got {num_samples}")
    if class_labels is not None:
        if num_classes == 0:
            raise ValueError("class_labels given to an unconditional model")
        y = class_label_tensor(class_labels, None)  # a list, or floats that are integers
        if num_samples is not None and num_samples != y.numel():  # (returned B images, silently)
            raise ValueError(f"num_samples={num_samples} but {y.numel()} class_labels were given (one sample per "
                             "label; give either)")
        # here, since a compiled denoiser does not check (a host sync): num_classes is the null class
        if y.numel() and (y.min() < 0 or y.max() > num_classes):
            raise ValueError(f"class_labels must be in [0, {num_classes}] ({num_classes} = the null class), "
                             f"got {y.tolist()[:8]}")
        y = y.to(device)
        B = y.shape[0]
    else:
        if num_samples is None:
            raise ValueError("give class_labels (conditional) or num_samples (unconditional)")
        B = num_samples
        y = None if num_classes == 0 else torch.full((B,), num_classes, device=device, dtype=torch.long)
    if guidance_scale > 0 and (class_labels is None or num_classes == 0):
        raise ValueError("guidance_scale > 0 needs a class-conditional model and class_labels")
    return y, B


@torch.no_grad()
def sample_tokens(
    denoiser: Denoiser,
    table: torch.Tensor,
    schedule: ShiftedCosineSchedule,
    *,
    num_samples: Optional[int] = None,
    class_labels: Optional[torch.Tensor] = None,
    num_steps: int = 50,
    sampler: str = "ancestral",
    guidance_scale: float = 0.0,
    final: str = "sample",
    generator: Generators = None,
    seq_len: Optional[int] = None,
    backend: str = "auto",
    progress: bool = False,
    guidance_interval: Optional[Sequence[float]] = None,
    compile: bool = False,
    compile_mode: Optional[str] = None,
) -> torch.Tensor:
    """Draw token grids (B, M) int64. ``table`` is the (K+1, D) or (K, D) embedding table.

    Class-conditional models take ``class_labels`` (B,); unconditional ones ``num_samples``.
    ``guidance_scale`` ω ≥ 0 applies classifier-free guidance (needs a conditional model).
    ``final``: draw x ~ P(x | z_0; 0) ("sample", Algorithm 2) or take its argmax.
    ``generator``: one torch.Generator, or a sequence of B (one per sample).
    ``guidance_interval`` (lo, hi): guide only the denoiser calls at noise levels lo <= t <= hi (the final
    draw is the call at t = 0); the others are plain conditional, one forward each. None: every call.
    ``compile``: run each step (and the final call) as one ``torch.compile``d function (fullgraph, static
    shapes; ``compile_mode`` is torch.compile's ``mode``: "reduce-overhead" replays CUDA graphs). The first
    call of each variant (guided or not, sampler, ω, batch) compiles; the random draws stay eager, so a
    seeded run draws the same numbers as without it. The loop reads nothing back to the host either way.
    """
    if final not in FINALS:
        raise ValueError(f"final must be 'sample' or 'argmax', got {final!r}")
    _, log_p = sample_latents(denoiser, table, schedule, num_samples=num_samples, class_labels=class_labels,
                              num_steps=num_steps, sampler=sampler, guidance_scale=guidance_scale,
                              generator=generator, seq_len=seq_len, backend=backend, progress=progress,
                              guidance_interval=guidance_interval, compile=compile, compile_mode=compile_mode)
    if final == "argmax":
        return log_p.argmax(dim=-1)
    return multinomial_rows(log_p.exp(), generator)


@torch.no_grad()
def sample_latents(
    denoiser: Denoiser,
    table: torch.Tensor,
    schedule: ShiftedCosineSchedule,
    *,
    num_samples: Optional[int] = None,
    class_labels: Optional[torch.Tensor] = None,
    num_steps: int = 50,
    sampler: str = "ancestral",
    guidance_scale: float = 0.0,
    generator: Generators = None,
    seq_len: Optional[int] = None,
    backend: str = "auto",
    progress: Union[bool, dict] = False,
    guidance_interval: Optional[Sequence[float]] = None,
    compile: bool = False,
    compile_mode: Optional[str] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the reverse process to t = 0: returns z_0 (B, M, D) and the (guided) log P(x | z_0; 0) (B, M, K).

    ``guidance_interval``: see :func:`sample_tokens`. Guidance at high noise is what costs the samples their
    variety (Kynkäänniemi et al. 2024, "Applying guidance in a limited interval improves sample and
    distribution quality"): the layout is decided there, and a guided posterior there picks the class's
    most typical one."""
    if sampler not in SAMPLERS:
        raise ValueError(f"sampler must be one of {SAMPLERS}, got {sampler!r}")
    num_steps = _count("num_steps", num_steps)
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    cfg = denoiser.cfg
    K, D = cfg.codebook_size, cfg.embed_dim
    M = cfg.seq_len if seq_len is None else _count("seq_len", seq_len)  # (0 meant the default)
    if not 1 <= M <= cfg.seq_len:
        raise ValueError(f"seq_len must be in [1, {cfg.seq_len}], got {M}")
    device = table.device
    y, B = resolve_labels(cfg.num_classes, class_labels, num_samples, guidance_scale, device)
    lo, hi = checked_interval(guidance_interval)

    def guided(n: int) -> bool:  # on the host, from the step index: no device read of the grid
        return guidance_scale > 0 and lo <= n / num_steps <= hi
    codebook = table[:K].float()  # (K, D)
    step, last = sampling_step, final_log_probs
    if compile:
        step, last = compiled_step(compile_mode), compiled_final(compile_mode)

    grid = torch.linspace(0.0, 1.0, num_steps + 1, device=device)
    times = grid[:, None].expand(num_steps + 1, B).unbind(0)  # t_n (B,): views made once, not per step
    z = randn((B, M, D), generator, device)
    steps = range(num_steps, 0, -1)
    if progress:  # True, or tqdm's arguments (a pipeline's set_progress_bar_config)
        from tqdm.auto import tqdm

        steps = tqdm(steps, **{"desc": f"{sampler} sampling", "leave": False,
                               **(progress if isinstance(progress, dict) else {})})
    # the labels were range-checked above: the denoiser need not read them back at every call
    with checked_upstream():
        for n in steps:
            # drawn here, where ancestral_step drew it after the forward: the same stream (the forward draws
            # nothing), and a torch.Generator stays out of the compiled step
            eps = randn((B, M, D), generator, device) if sampler == "ancestral" else None
            z = step(denoiser, z, times[n], times[n - 1], y, eps, codebook, schedule, null_class=cfg.num_classes,
                     guidance_scale=guidance_scale if guided(n) else 0.0, sampler=sampler, backend=backend)
        log_p = last(denoiser, z, times[0], y, null_class=cfg.num_classes,
                     guidance_scale=guidance_scale if guided(0) else 0.0)
    return z, log_p


def sampling_step(denoiser, z, t, s, y, eps, codebook, schedule: ShiftedCosineSchedule, *, null_class: int,
                  guidance_scale: float, sampler: str, backend: str = "auto") -> torch.Tensor:
    """One reverse step z_t -> z_s (t, s: (B,)): the denoiser's logits (guided, ω = ``guidance_scale`` > 0: the
    conditional and null rows in one forward), Ψ̂ from them, then the ancestral update (``eps``: its standard
    normal draw) or the DDIM one. The unit that ``compile=True`` compiles."""
    cond, uncond = _logits_pair(denoiser, z, t, y, null_class, guidance_scale > 0)
    if uncond is not None:
        psi = ops.guided_embedding_average(cond, uncond, codebook, guidance_scale, backend=backend)
    else:
        psi = ops.softmax_embedding_average(cond, codebook, backend=backend)
    psi = psi.float()  # Ψ̂ (B, M, D)
    tb, sb = t[:, None, None], s[:, None, None]
    if sampler == "ancestral":
        return ancestral_update(z, psi, schedule, tb, sb, eps)
    return ddim_step(z, psi, schedule, tb, sb)


def final_log_probs(denoiser, z, t, y, *, null_class: int, guidance_scale: float) -> torch.Tensor:
    """The (guided) log P(x | z_0; 0) (B, M, K) of the last denoiser call."""
    cond, uncond = _logits_pair(denoiser, z, t, y, null_class, guidance_scale > 0)
    return guided_log_probs(cond, uncond, guidance_scale) if uncond is not None else torch.log_softmax(cond, dim=-1)


# One torch.compile wrapper per mode, made once: Dynamo keeps its graphs on the function's code, and each
# variant (guided or not, sampler, ω, batch and model shapes, autocast) is a guard of its own.
_COMPILED: dict = {}


def _compiled(fn, mode: Optional[str]):
    key = (fn.__name__, mode)
    if key not in _COMPILED:
        # fullgraph: a graph break would put the eager dispatch back into every step; dynamic=False: static
        # shapes, which CUDA graphs (mode="reduce-overhead") need
        _COMPILED[key] = torch.compile(fn, fullgraph=True, dynamic=False, mode=mode)
    return _COMPILED[key]


def compiled_step(mode: Optional[str] = None):
    """``sampling_step`` compiled (``torch.compile`` ``mode``: None, or "reduce-overhead" for CUDA graphs)."""
    return _compiled(sampling_step, mode)


def compiled_final(mode: Optional[str] = None):
    """``final_log_probs`` compiled, as ``compiled_step``."""
    return _compiled(final_log_probs, mode)
