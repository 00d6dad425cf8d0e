import math

import pytest
import torch

from vqlcmd.engine.config import ScheduleSection
from vqlcmd.schedule import ShiftedCosineSchedule


def test_alpha_sigma_variance_preserving_over_whole_interval():
    sched = ShiftedCosineSchedule(shift=-1.0)
    t = torch.linspace(0, 1, 10001)
    alpha, sigma = sched.alpha_sigma(t)
    assert torch.isfinite(alpha).all() and torch.isfinite(sigma).all()
    assert torch.isfinite(sched.log_snr(t)).all()
    torch.testing.assert_close(alpha**2 + sigma**2, torch.ones_like(t), atol=1e-6, rtol=0)
    assert (alpha > 0).all() and (sigma > 0).all()


@pytest.mark.parametrize("shift", [0.0, -2.0, 1.5])
def test_log_snr_matches_formula_in_float64(shift):
    t = torch.linspace(0.01, 0.99, 99)
    expected = -2 * torch.log(torch.tan(math.pi * t.double() / 2)) + shift
    got = ShiftedCosineSchedule(shift).log_snr(t)
    torch.testing.assert_close(got.double(), expected, atol=2e-5, rtol=1e-5)


def test_shift_moves_log_snr_by_shift():
    t = torch.rand(100)
    diff = ShiftedCosineSchedule(-3.0).log_snr(t) - ShiftedCosineSchedule(0.0).log_snr(t)
    torch.testing.assert_close(diff, torch.full_like(t, -3.0))


def test_alpha_squared_is_sigmoid_of_log_snr_and_monotone():
    sched = ShiftedCosineSchedule(0.5)
    t = torch.linspace(0, 1, 501)
    lam = sched.log_snr(t)
    alpha, _ = sched.alpha_sigma(t)
    torch.testing.assert_close(alpha**2, torch.sigmoid(lam))
    assert (lam[1:] <= lam[:-1]).all()  # SNR decreases with t


def test_derivative_matches_finite_difference():
    sched = ShiftedCosineSchedule(0.0)
    t = torch.linspace(0.05, 0.95, 19, dtype=torch.float64)
    h = 1e-6
    lam = lambda x: -2 * torch.log(torch.tan(math.pi * x / 2))
    fd = (lam(t + h) - lam(t - h)) / (2 * h)
    torch.testing.assert_close(sched.dlog_snr_dt(t.float()).double(), fd, rtol=1e-4, atol=1e-4)


def test_posterior_coefficients_match_closed_form_in_float64():
    sched = ShiftedCosineSchedule(-1.0)
    t = torch.tensor([0.9, 0.5, 0.2])
    s = torch.tensor([0.7, 0.1, 0.0])
    c_z, c_x, var = sched.posterior(t, s)
    lam = lambda x: sched.log_snr(x).double()
    a2 = lambda x: torch.sigmoid(lam(x))
    at, as_ = a2(t).sqrt(), a2(s).sqrt()
    st2, ss2 = 1 - a2(t), 1 - a2(s)
    a_ts = at / as_
    s2_ts = st2 - a_ts**2 * ss2
    torch.testing.assert_close(c_z.double(), a_ts * ss2 / st2, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(c_x.double(), as_ * s2_ts / st2, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(var.double(), s2_ts * ss2 / st2, rtol=1e-4, atol=1e-7)


def test_derivative_is_clamped_like_log_snr():
    """dλ/dt at t = 0 and 1 is the derivative at the clamped t (the vlb weight multiplies it with SNR(t_min)):
    finite, and -2π / sin(π t_min) in float64."""
    sched = ShiftedCosineSchedule(0.0, t_min=1e-4)
    got = sched.dlog_snr_dt(torch.tensor([0.0, 1.0])).double()
    expected = -2 * math.pi / math.sin(math.pi * 1e-4)
    torch.testing.assert_close(got, torch.full((2,), expected, dtype=torch.float64), rtol=1e-4, atol=0)


@pytest.mark.parametrize("t_min", [0.0, 0.5, 0.7, -1e-4])
def test_t_min_outside_the_open_interval_is_refused(t_min):
    with pytest.raises(ValueError, match="t_min"):
        ShiftedCosineSchedule(0.0, t_min=t_min)


def test_defaults_are_the_configs():
    """A schedule built in code means what an unconfigured training run means (config.schedule defaults)."""
    sched, cfg = ShiftedCosineSchedule(), ScheduleSection()
    assert (sched.shift, sched.t_min) == (cfg.shift, cfg.t_min) == (0.0, 1e-4)
