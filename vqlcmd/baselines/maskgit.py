"""MaskGIT on the same tokens and the same Transformer backbone (Chang et al. 2022; Besnier & Chen 2023).

The denoiser is reused unchanged: token ids (row K of the embedding table is ``[mask]``) are looked up
in the learned table and fed as ``z``; the time input is held at 0, since MaskGIT does not condition
on the mask ratio. Training is masked-token prediction (Chang et al. §3.2): a ratio γ(r), r ~ U(0, 1),
of the tokens is replaced by ``[mask]`` and cross-entropy is taken on those positions only. Sampling is
the iterative confidence decoder of the PyTorch reimplementation the VQ-LCMD paper compares with
(Besnier & Chen, "A Pytorch Reproduction of Masked Generative Image Transformer", 2023): per step, draw
every masked token from softmax(logits · τ), score it by log p + r_temp · Gumbel · (1 − n/N), and keep
the scheduled number of highest-scoring ones; classifier-free guidance on logits with a weight that
ramps linearly from 0 to ω.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F

from ..diffusion.losses import drop_labels
from ..engine.config import MASK_SCHEDULES, MaskGITConfig  # noqa: F401  (the schema; re-exported)
from ..network import VQLCMDNetwork
from ..pipeline import VQLCMDPipeline
from ..samplers import Generators, multinomial_rows, rand, resolve_labels


def mask_ratio(r: torch.Tensor, schedule: str) -> torch.Tensor:
    """γ(r): fraction of tokens masked at r ∈ [0, 1]; γ(0) = 1 (all masked), γ(1) = 0 (Chang et al. §3.2)."""
    if schedule == "cosine":
        return torch.cos(0.5 * math.pi * r)
    if schedule == "arccos":
        return torch.arccos(r) / (0.5 * math.pi)
    if schedule == "linear":
        return 1.0 - r
    if schedule == "square":
        return 1.0 - r**2
    raise ValueError(f"schedule must be one of {MASK_SCHEDULES}, got {schedule!r}")


def unmask_schedule(num_steps: int, seq_len: int, mode: str = "arccos") -> torch.Tensor:
    """Tokens to unmask at each of ``num_steps`` steps: (N,) int64, each >= 1, summing to ``seq_len``.

    After Besnier & Chen's ``adap_sche``: weights v_n = γ(r_n) (for arccos: arccos(r)/(π/2)), scaled
    to sum to M, rounded, zeros raised to 1, the remainder added to the last step. The grid is
    r_n = linspace(1, 0, N+1)[1:], as in later versions derived from their code; their own uses
    linspace(1, 0, N), whose r_0 = 1 decodes a single token first (N = 8: for M = 256 theirs gives 1, 18,
    26, ... where this gives 15, 21, 26, ...; for M = 64, 1, 5, 6, ... against 4, 5, 7, ...).
    ``docs/archive/reproduce.md``'s MaskGIT rows were made with this grid. ``mode="cosine"`` weights the steps by
    cos(πr/2) in the same way; it is not Chang et al.'s ⌈γ(n/N)·M⌉ rule. Their version can leave the last
    step at ≤ 0 when N is close to M; here the excess is taken from the largest steps instead, so the
    counts always stay >= 1 and sum to M.
    """
    if not 1 <= num_steps <= seq_len:
        raise ValueError(f"num_steps must be in [1, {seq_len}] for {seq_len} tokens, got {num_steps}")
    r = torch.linspace(1.0, 0.0, num_steps + 1, dtype=torch.float64)[1:]
    if mode == "arccos":
        val = torch.arccos(r) / (0.5 * math.pi)
    elif mode == "cosine":
        val = torch.cos(0.5 * math.pi * r)
    elif mode == "linear":
        val = 1.0 - r
    elif mode == "square":
        val = 1.0 - r**2
    else:
        raise ValueError(f"mode must be one of {MASK_SCHEDULES}, got {mode!r}")
    counts = (val / val.sum() * seq_len).round().long().clamp_min(1)
    counts[-1] += seq_len - int(counts.sum())
    while counts[-1] < 1 or counts.sum() > seq_len:
        counts[-1] = max(int(counts[-1]), 1)
        excess = int(counts.sum()) - seq_len
        if excess <= 0:
            break
        counts[int(counts[:-1].argmax())] -= 1
    return counts


def _embed(net: VQLCMDNetwork, ids: torch.Tensor) -> torch.Tensor:
    return F.embedding(ids, net.embedding.table())  # (B, M, D)


def maskgit_losses(net: VQLCMDNetwork, tokens: torch.Tensor, labels: Optional[torch.Tensor], cfg: MaskGITConfig,
                   *, label_drop: float = 0.1, generator: Optional[torch.Generator] = None) -> dict:
    """Masked-token cross-entropy (Chang et al. 2022, eq. 1): ⌈γ(r)·M⌉ tokens, r ~ U(0, 1), chosen uniformly,
    replaced by [mask]; CE on the masked positions only, averaged over them. Labels dropped to the null
    class with ``label_drop`` for classifier-free guidance."""
    B, M = tokens.shape
    K = net.embedding.codebook_size
    device = tokens.device
    tokens = tokens.long()
    r = torch.rand((B,), device=device, generator=generator)
    n_mask = torch.ceil(mask_ratio(r, cfg.train_schedule) * M).long().clamp(1, M)  # (B,)
    scores = torch.rand((B, M), device=device, generator=generator)
    ranks = scores.argsort(dim=1).argsort(dim=1)  # uniform random permutation per row
    mask = ranks < n_mask[:, None]  # (B, M) True = [mask]
    ids = torch.where(mask, torch.full_like(tokens, K), tokens)
    y = drop_labels(labels, net.denoiser.null_class, label_drop, generator)
    logits = net.denoiser(_embed(net, ids), torch.zeros(B, device=device), y).float()  # (B, M, K)
    ce = F.cross_entropy(logits[mask], tokens[mask], label_smoothing=cfg.label_smoothing)
    return {"loss": ce, "ce": ce.detach(), "mask_ratio": mask.float().mean().detach()}


def _gumbel(shape, device, generator: Generators) -> torch.Tensor:
    u = rand(shape, generator, device).clamp(1e-20, 1.0 - 1e-7)
    return -torch.log(-torch.log(u))


@torch.no_grad()
def maskgit_sample(net: VQLCMDNetwork, *, class_labels: Optional[torch.Tensor] = None,
                   num_samples: Optional[int] = None, num_steps: Optional[int] = None, guidance_scale: float = 0.0,
                   cfg: Optional[MaskGITConfig] = None, generator: Optional[torch.Generator] = None,
                   return_trace: bool = False, denoiser=None):
    """Iterative confidence decoding (Chang et al. §3.3, with Besnier & Chen's Gumbel noise and guidance).

    Returns tokens (B, M) int64; with ``return_trace`` also the list of (B, M) bool masks of the
    positions unmasked at each step. ``denoiser`` replaces ``net.denoiser`` in the loop (the pipeline's
    compiled one under fast sampling).
    """
    cfg = cfg or MaskGITConfig()
    den = net.denoiser if denoiser is None else denoiser
    K, M, C = den.cfg.codebook_size, den.cfg.seq_len, den.cfg.num_classes
    device = net.embedding.weight.device
    y, B = resolve_labels(C, class_labels, num_samples, guidance_scale, device)
    guided = guidance_scale > 0
    # At least one token per step: more steps than tokens decode one token per step (M steps), as Besnier &
    # Chen's loop does once every token is decoded.
    num_steps = cfg.num_steps if num_steps is None else num_steps
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    sched = unmask_schedule(min(num_steps, M), M, cfg.sample_schedule)
    N = len(sched)
    ids = torch.full((B, M), K, device=device, dtype=torch.long)
    masked = torch.ones((B, M), device=device, dtype=torch.bool)
    t = torch.zeros(B, device=device)
    trace = []
    for n, k in enumerate(sched.tolist()):
        z = _embed(net, ids)
        if guided:
            logits = den(torch.cat([z, z]), torch.cat([t, t]), torch.cat([y, torch.full_like(y, C)])).float()
            cond, uncond = logits[:B], logits[B:]
            w = guidance_scale * (n / (N - 1) if N > 1 else 1.0) if cfg.guidance_ramp else guidance_scale
            logits = (1 + w) * cond - w * uncond  # guidance on logits (Besnier & Chen)
        else:
            logits = den(z, t, y).float()
        probs = torch.softmax(logits * cfg.softmax_temperature, dim=-1)  # (B, M, K)
        pred = multinomial_rows(probs, generator)  # (B, M)
        conf = torch.log(probs.gather(-1, pred[..., None])[..., 0].clamp_min(1e-30))  # (B, M)
        if cfg.gumbel_temperature > 0:
            conf = conf + cfg.gumbel_temperature * (1.0 - n / N) * _gumbel((B, M), device, generator)
        conf = conf.masked_fill(~masked, -math.inf)  # already decoded tokens stay as they are
        chosen = conf.topk(k, dim=1).indices  # (B, k)
        new = torch.zeros_like(masked).scatter_(1, chosen, True)
        ids = torch.where(new, pred, ids)
        masked &= ~new
        if return_trace:
            trace.append(new)
    return (ids, trace) if return_trace else ids


class MaskGITPipeline(VQLCMDPipeline):
    """A ``VQLCMDPipeline`` whose sampler is MaskGIT's; same folder format, with ``"method": "maskgit"`` and
    the sampler settings in its config.json."""

    def __init__(self, network, schedule, *, maskgit: Optional[MaskGITConfig] = None, **kwargs):
        super().__init__(network, schedule, **kwargs)
        if maskgit is None:
            maskgit = MaskGITConfig(**self.extra_config.get("maskgit", {}))
        self.maskgit = maskgit
        # what scripts/sample.py's manifest and the end-of-run report record as the sampler
        self.sample_defaults = {**self.sample_defaults, "sampler": "maskgit", "num_steps": maskgit.num_steps}
        self.extra_config["method"] = "maskgit"
        self.extra_config["maskgit"] = maskgit.to_dict()

    def save_pretrained(self, folder):
        # the sampler as it is now: settings changed on pipe.maskgit after construction were saved as they were
        self.extra_config["maskgit"] = self.maskgit.to_dict()
        self.sample_defaults = {**self.sample_defaults, "num_steps": self.maskgit.num_steps}
        return super().save_pretrained(folder)

    @torch.no_grad()
    def __call__(self, class_labels=None, *, num_images: Optional[int] = None, num_steps: Optional[int] = None,
                 guidance_scale: Optional[float] = None, generator: Generators = None,
                 batch_size: Optional[int] = None, output_type: str = "pil", progress: bool = False,
                 sampler: Optional[str] = None, final: Optional[str] = None, backend: Optional[str] = None):
        """As ``VQLCMDPipeline.__call__`` (the same checks, per-image generators and outputs); ``num_steps``
        defaults to the MaskGIT config's. The continuous samplers' options (``sampler``, ``final``, ``backend``)
        do not apply: given, they are refused (any other keyword, a typo such as ``num_step``, was ignored)."""
        given = {k: v for k, v in (("sampler", sampler), ("final", final), ("backend", backend))
                 if v is not None and not (k == "sampler" and v == "maskgit")}
        if given:
            raise ValueError(f"{', '.join(given)}: a MaskGIT pipeline samples by iterative unmasking; the diffusion "
                             "samplers' options do not apply")
        batch_size = self._batch_size(batch_size)
        num_steps = self.maskgit.num_steps if num_steps is None else num_steps
        labels, n, guidance_scale, generator = self._request(class_labels, num_images, guidance_scale, generator,
                                                             output_type)
        # through the pipeline's denoiser and autocast, as the diffusion samplers: enable_fast_sampling did nothing
        # here, and half-precision weights ran without autocast
        denoiser = self._denoiser()
        from tqdm.auto import tqdm

        bar = tqdm(total=n, desc=f"maskgit {num_steps} steps", unit="img", disable=not progress)
        chunks = []
        for start, stop, kw in self._chunks(labels, n, batch_size, generator):
            with self._autocast():  # the sampler only: the tokenizer decodes in its own dtype
                tokens = maskgit_sample(self.network, num_steps=num_steps, guidance_scale=guidance_scale,
                                        cfg=self.maskgit, denoiser=denoiser, **kw)
            chunks.append(self._finish(tokens, output_type))
            bar.update(stop - start)
        bar.close()
        return self._output(chunks, output_type)
