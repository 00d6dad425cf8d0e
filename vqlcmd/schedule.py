"""Shifted cosine noise schedule, variance preserving (docs/method.md §3, eq. 3-5).

    λ(t) = log SNR(t) = -2 log tan(π t / 2) + shift
    α_t² = sigmoid(λ),  σ_t² = sigmoid(-λ)   so α_t² + σ_t² = 1

Everything is computed through λ: ``tan`` near π/2 is never evaluated in float32,
and α, σ come from ``logsigmoid`` so neither underflows to 0 inside [t_min, 1 - t_min].
"""
from __future__ import annotations

import math

import torch


class ShiftedCosineSchedule:
    """Shifted cosine schedule (Hoogeboom et al. 2023, as used by VQ-LCMD).

    ``shift`` < 0 moves weight to high noise. ``t`` is clamped to
    ``[t_min, 1 - t_min]`` so λ, α and σ are finite on the whole of [0, 1].
    """

    def __init__(self, shift: float = 0.0, t_min: float = 1e-4):
        if not 0.0 < t_min < 0.5:
            raise ValueError(f"t_min must be in (0, 0.5), got {t_min}")
        self.shift = float(shift)
        self.t_min = float(t_min)

    def __repr__(self) -> str:
        return f"ShiftedCosineSchedule(shift={self.shift}, t_min={self.t_min})"

    def clamp(self, t: torch.Tensor) -> torch.Tensor:
        return t.clamp(self.t_min, 1.0 - self.t_min)

    def log_snr(self, t: torch.Tensor) -> torch.Tensor:
        """λ(t) = -2 log tan(πt/2) + shift, float32, finite on [0, 1]."""
        t = self.clamp(torch.as_tensor(t, dtype=torch.float32))
        # tan(πt/2) = sin(πt/2) / sin(π(1-t)/2): two small-argument sines, so no tan overflow near 1. Near
        # t = 1, 1 - t carries t's own float32 rounding (λ(1 - t_min) is 3e-4 off at t_min = 1e-4, α a
        # relative 2e-4; 3e-2 at t_min = 1e-6), which no float32 t can avoid.
        half_pi = 0.5 * math.pi
        log_tan = torch.log(torch.sin(half_pi * t)) - torch.log(torch.sin(half_pi * (1.0 - t)))
        return -2.0 * log_tan + self.shift

    @staticmethod
    def alpha_sigma_from_log_snr(lam: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        alpha = torch.exp(0.5 * torch.nn.functional.logsigmoid(lam))
        sigma = torch.exp(0.5 * torch.nn.functional.logsigmoid(-lam))
        return alpha, sigma

    def alpha_sigma(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(α_t, σ_t) with α² + σ² = 1."""
        return self.alpha_sigma_from_log_snr(self.log_snr(t))

    def dlog_snr_dt(self, t: torch.Tensor) -> torch.Tensor:
        """dλ/dt = -2π / sin(πt): the VLB weight of L_∞ is -½ dλ/dt · SNR-scaled error (Kingma et al. 2021)."""
        t = self.clamp(torch.as_tensor(t, dtype=torch.float32))
        return -2.0 * math.pi / torch.sin(math.pi * t)

    def posterior(self, t: torch.Tensor, s: torch.Tensor):
        """Coefficients of q(z_s | z_t, x) for s < t (docs/method.md §5, eq. 7-8).

        Returns ``(c_z, c_x, var)`` with mean ``c_z z_t + c_x x`` and variance ``var``:
        ``c_z = α_{t|s} σ_s² / σ_t²``, ``c_x = α_s σ²_{t|s} / σ_t²``, ``var = σ²_{t|s} σ_s² / σ_t²``,
        with ``σ²_{t|s} / σ_t² = -expm1(λ_t - λ_s)`` computed stably.
        """
        lam_t, lam_s = self.log_snr(t), self.log_snr(s)
        alpha_t, sigma_t = self.alpha_sigma_from_log_snr(lam_t)
        alpha_s, sigma_s = self.alpha_sigma_from_log_snr(lam_s)
        ratio = -torch.expm1(lam_t - lam_s)  # σ²_{t|s} / σ_t², in [0, 1]
        c_z = (alpha_t / alpha_s) * (sigma_s**2 / sigma_t**2)
        c_x = alpha_s * ratio
        var = ratio * sigma_s**2
        return c_z, c_x, var
