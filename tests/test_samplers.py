import math

import pytest
import torch

from vqlcmd.model import DenoiserConfig, build_denoiser
from vqlcmd.samplers import ancestral_step, class_label_tensor, ddim_step, sample_latents, sample_tokens
from vqlcmd.schedule import ShiftedCosineSchedule


def _alpha_sigma_f64(t: float, shift: float):
    lam = -2 * math.log(math.tan(math.pi * t / 2)) + shift
    a2 = 1 / (1 + math.exp(-lam))
    return math.sqrt(a2), math.sqrt(1 - a2)


def test_ancestral_step_matches_gaussian_posterior_for_true_embedding(gen):
    """With Ψ̂ = E[x], z_s ~ q(z_s | z_t, x), derived here by conditioning the joint Gaussian of (z_s, z_t)."""
    shift = -1.0
    sched = ShiftedCosineSchedule(shift)
    t, s = 0.7, 0.4
    a_t, s_t = _alpha_sigma_f64(t, shift)
    a_s, s_s = _alpha_sigma_f64(s, shift)
    a_ts = a_t / a_s  # z_t = a_ts z_s + noise, Cov(z_s, z_t) = a_ts σ_s²
    e = torch.randn(1, 1, 4, generator=gen)
    z_t = a_t * e + s_t * torch.randn(1, 1, 4, generator=gen)
    mean = a_s * e + (a_ts * s_s**2 / s_t**2) * (z_t - a_t * e)
    var = s_s**2 - (a_ts * s_s**2) ** 2 / s_t**2

    n = 200_000
    tt, ss = torch.full((n, 1, 1), t), torch.full((n, 1, 1), s)
    draws = ancestral_step(z_t.expand(n, 1, 4), e.expand(n, 1, 4), sched, tt, ss, generator=gen)
    torch.testing.assert_close(draws.mean(0), mean[0], atol=4 * math.sqrt(var / n), rtol=0)
    torch.testing.assert_close(draws.var(0), torch.full((1, 4), var), atol=0, rtol=0.02)


class PerfectDenoiser(torch.nn.Module):
    """Logits peaked on known tokens x whatever the input: a perfect predictor."""

    def __init__(self, tokens, K, D, num_classes=0):
        super().__init__()
        self.cfg = DenoiserConfig(codebook_size=K, embed_dim=D, seq_len=tokens.shape[1], num_classes=num_classes)
        self.register_buffer("logits", 30.0 * torch.nn.functional.one_hot(tokens, K).float())

    def forward(self, z, t, y=None):
        return self.logits.repeat(z.shape[0] // self.logits.shape[0], 1, 1)  # B or 2B rows (guided)


@pytest.mark.parametrize("steps", [1, 2, 50])
def test_ddim_with_perfect_predictor_lands_on_embedding(steps, gen):
    K, D = 12, 6
    x = torch.randint(0, K, (3, 10), generator=gen)
    table = torch.randn(K + 1, D, generator=gen)
    sched = ShiftedCosineSchedule(0.0)
    z0, log_p = sample_latents(PerfectDenoiser(x, K, D), table, sched, num_samples=3, num_steps=steps,
                               sampler="ddim", generator=gen)
    alpha0, _ = sched.alpha_sigma(torch.tensor(0.0))
    torch.testing.assert_close(z0, alpha0 * table[x], atol=2e-3, rtol=0)
    assert (log_p.argmax(-1) == x).all()


@pytest.mark.parametrize("sampler", ["ancestral", "ddim"])
@pytest.mark.parametrize("steps", [1, 2, 50])
def test_both_samplers_run_and_are_reproducible(sampler, steps):
    model = build_denoiser("tiny").eval()
    table = torch.randn(17, 8)
    y = torch.tensor([0, 1, 2])
    kw = dict(class_labels=y, num_steps=steps, sampler=sampler, guidance_scale=1.0)
    a = sample_tokens(model, table, ShiftedCosineSchedule(), generator=torch.Generator().manual_seed(1), **kw)
    b = sample_tokens(model, table, ShiftedCosineSchedule(), generator=torch.Generator().manual_seed(1), **kw)
    assert a.shape == (3, 16) and a.dtype == torch.int64 and (a >= 0).all() and (a < 16).all()
    assert torch.equal(a, b)


class ClassBlind(torch.nn.Module):
    """A conditional model that ignores y: guidance must then change nothing."""

    def __init__(self):
        super().__init__()
        self.inner = build_denoiser("tiny", num_classes=0).eval()
        self.cfg = DenoiserConfig(**{**self.inner.cfg.to_dict(), "num_classes": 4})

    def forward(self, z, t, y=None):
        return self.inner(z, t)


def test_guidance_is_identity_when_condition_is_ignored():
    model, table, y = ClassBlind(), torch.randn(17, 8), torch.tensor([0, 3])
    run = lambda w: sample_latents(model, table, ShiftedCosineSchedule(), class_labels=y, num_steps=4,
                                   guidance_scale=w, generator=torch.Generator().manual_seed(0))
    z_a, lp_a = run(0.0)
    z_b, lp_b = run(2.0)
    torch.testing.assert_close(z_a, z_b, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lp_a, lp_b, atol=1e-4, rtol=1e-4)


def test_argmax_final_and_errors():
    model, table = build_denoiser("tiny").eval(), torch.randn(17, 8)
    y = torch.tensor([1])
    out = sample_tokens(model, table, ShiftedCosineSchedule(), class_labels=y, num_steps=2, final="argmax")
    assert out.shape == (1, 16)
    with pytest.raises(ValueError, match="sampler"):
        sample_tokens(model, table, ShiftedCosineSchedule(), class_labels=y, sampler="euler")
    with pytest.raises(ValueError, match="guidance"):
        sample_tokens(build_denoiser("tiny", num_classes=0), table, ShiftedCosineSchedule(), num_samples=1,
                      guidance_scale=1.0)


def test_ddim_step_fixed_point():
    """If z_t lies on the trajectory of Ψ̂ with noise ε, the DDIM step keeps the same ε."""
    sched = ShiftedCosineSchedule(0.0)
    psi, eps = torch.randn(2, 3, 4), torch.randn(2, 3, 4)
    t, s = torch.full((2, 1, 1), 0.8), torch.full((2, 1, 1), 0.3)
    (a_t, s_t), (a_s, s_s) = sched.alpha_sigma(t), sched.alpha_sigma(s)
    z_s = ddim_step(a_t * psi + s_t * eps, psi, sched, t, s)
    torch.testing.assert_close(z_s, a_s * psi + s_s * eps, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("sampler,interval", [("ancestral", None), ("ddim", None), ("ancestral", (0.3, 0.7)),
                                              ("ddim", (0.0, 0.5))])
def test_guided_sampling_loop_matches_a_transcription_of_algorithm_2(sampler, interval):
    """The whole loop with a model that depends on t and y, ω > 0: z_1 ~ N(0, I); for t_n = n/N down to t_1,
    Ψ̂ from the renormalised P(·|y)^{1+ω} / P(·|∅)^ω, then the posterior (or DDIM) step to t_{n-1}; the
    final log P at t = 0, guided too. Written in float64 from the paper's formulas, not the schedule's.
    With a guidance interval [lo, hi], the calls at t outside it use ω = 0 (t = 0.6, 0.4 guided of
    1, 0.8, 0.6, 0.4, 0.2, 0 for (0.3, 0.7); 0.4, 0.2 and the final draw for (0, 0.5))."""
    torch.manual_seed(0)
    model = build_denoiser("tiny").eval()
    with torch.no_grad():  # AdaLN starts at zero: perturb so that t and y reach the logits
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    K, D, M, C = 16, 8, 16, 4
    table = torch.randn(K + 1, D)
    shift, N, w = -1.0, 5, 1.5
    y = torch.tensor([0, 3])

    def logits(z, t, labels):
        return model(z, torch.full((2,), float(t)), labels).double()

    z_probe = torch.randn(2, M, D)
    assert not torch.allclose(logits(z_probe, 0.3, y), logits(z_probe, 0.7, y))
    assert not torch.allclose(logits(z_probe, 0.3, y), logits(z_probe, 0.3, torch.full((2,), C)))

    lo, hi = interval or (0.0, 1.0)

    def guided_log_p(z, t):
        w_t = w if lo <= t <= hi else 0.0
        with torch.no_grad():
            lc = torch.log_softmax(logits(z.float(), t, y), -1)
            lu = torch.log_softmax(logits(z.float(), t, torch.full((2,), C)), -1)
        return torch.log_softmax((1 + w_t) * lc - w_t * lu, -1)

    def alpha_sigma(t):
        t = min(max(t, 1e-4), 1 - 1e-4)
        a2 = 1 / (1 + math.exp(2 * math.log(math.tan(math.pi * t / 2)) - shift))
        return math.sqrt(a2), math.sqrt(1 - a2)

    z0, log_p = sample_latents(model, table, ShiftedCosineSchedule(shift), class_labels=y, num_steps=N,
                               sampler=sampler, guidance_scale=w, generator=torch.Generator().manual_seed(11),
                               backend="reference", guidance_interval=interval)
    g = torch.Generator().manual_seed(11)
    z = torch.randn(2, M, D, generator=g).double()
    for n in range(N, 0, -1):
        t, s = n / N, (n - 1) / N
        psi = guided_log_p(z, t).exp() @ table[:K].double()
        (a_t, s_t), (a_s, s_s) = alpha_sigma(t), alpha_sigma(s)
        if sampler == "ddim":
            z = a_s * psi + (s_s / s_t) * (z - a_t * psi)
        else:
            a_ts = a_t / a_s
            var_ts = s_t**2 - a_ts**2 * s_s**2
            mean = a_ts * s_s**2 / s_t**2 * z + a_s * var_ts / s_t**2 * psi
            z = mean + math.sqrt(var_ts * s_s**2 / s_t**2) * torch.randn(2, M, D, generator=g).double()
    torch.testing.assert_close(z0.double(), z, rtol=1e-4, atol=1e-4)  # float32 in the sampler
    torch.testing.assert_close(log_p.double(), guided_log_p(z, 0.0), rtol=1e-4, atol=1e-4)


def test_sampler_arguments_are_checked_as_the_pipeline_checks_them():
    """The exported samplers took a list of labels as an AttributeError, a 1.7 label as class 1, seq_len=0
    as the default length and 2.5 steps as a TypeError from inside torch.linspace."""
    from vqlcmd.model import build_denoiser
    from vqlcmd.samplers import sample_tokens

    den = build_denoiser("tiny").eval()
    table, sched = torch.randn(17, 8), ShiftedCosineSchedule()
    tokens = sample_tokens(den, table, sched, class_labels=[0, 3], num_steps=2, generator=torch.Generator().manual_seed(0))
    assert tokens.shape == (2, 16)
    with pytest.raises(ValueError, match="class_labels must be integers, got 1.7"):
        sample_tokens(den, table, sched, class_labels=torch.tensor([1.7]), num_steps=2)
    with pytest.raises(ValueError, match=r"seq_len must be in \[1, 16\], got 0"):
        sample_tokens(den, table, sched, class_labels=[0], num_steps=2, seq_len=0)
    with pytest.raises(TypeError, match="num_steps must be an integer, got 2.5"):
        sample_tokens(den, table, sched, class_labels=[0], num_steps=2.5)
    with pytest.raises(TypeError, match="num_samples must be an integer, got 2.5"):
        sample_tokens(den, table, sched, num_samples=2.5, num_steps=1)
    # both given and disagreeing: it returned one image per label, silently
    with pytest.raises(ValueError, match="num_samples=5 but 2 class_labels were given"):
        sample_tokens(den, table, sched, class_labels=[0, 1], num_samples=5, num_steps=1)
    assert sample_tokens(den, table, sched, class_labels=[0, 1], num_samples=2, num_steps=1).shape == (2, 16)
    # a compiled denoiser does not range-check labels (a host sync): the sampler does
    with pytest.raises(ValueError, match=r"class_labels must be in \[0, 4\] \(4 = the null class\), got \[5\]"):
        sample_tokens(den, table, sched, class_labels=[5], num_steps=2)
    assert sample_tokens(den, table, sched, class_labels=[4], num_steps=1).shape == (1, 16)  # the null class


# ---- the final draw, per-sample generators, labels (gaps a mutation run found), with stub denoisers ----

class FixedLogits(torch.nn.Module):
    """Logits (M, K) or (B, M, K) whatever z; records the labels it was called with."""

    def __init__(self, logits, num_classes=0):
        super().__init__()
        M, K = logits.shape[-2:]
        self.cfg = DenoiserConfig(codebook_size=K, embed_dim=4, seq_len=M, num_classes=num_classes)
        self.register_buffer("logits", logits.float())
        self.seen_y = []

    def forward(self, z, t, y=None):
        self.seen_y.append(None if y is None else y.clone())
        lg = self.logits if self.logits.dim() == 3 else self.logits.expand(1, *self.logits.shape)
        return lg.repeat(z.shape[0] // lg.shape[0], 1, 1)


def test_final_sample_draws_from_p_and_argmax_takes_its_mode():
    """final="sample": x ~ P(x | z_0; 0) (frequencies match softmax(logits)); final="argmax": its mode."""
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
    den = FixedLogits(probs.log().expand(64, 4).clone())
    table = torch.randn(5, 4)
    x = sample_tokens(den, table, ShiftedCosineSchedule(), num_samples=64, num_steps=1,
                      generator=torch.Generator().manual_seed(0))
    freq = torch.bincount(x.reshape(-1), minlength=4).float() / x.numel()
    torch.testing.assert_close(freq, probs, atol=0.02, rtol=0)  # 4096 draws: 3 std ≈ 0.023 at 0.4
    am = sample_tokens(den, table, ShiftedCosineSchedule(), num_samples=2, num_steps=1, final="argmax")
    assert (am == 3).all()


def test_per_sample_generators_draw_each_row_from_its_own_generator():
    """Row i's noise and final draw come from generator i alone: a batch gives the rows single runs give."""
    K, M = 8, 6
    tokens = torch.tensor([[0, 1, 2, 3, 4, 5], [7, 6, 5, 4, 3, 2]])
    den = FixedLogits(torch.log_softmax(torch.randn(2, M, K, generator=torch.Generator().manual_seed(3)), -1))
    solo = FixedLogits(den.logits.clone())
    table = torch.randn(K + 1, 4)
    sched = ShiftedCosineSchedule()
    gens = lambda seeds: [torch.Generator().manual_seed(s) for s in seeds]
    z_b, _ = sample_latents(den, table, sched, num_samples=2, num_steps=3, generator=gens([5, 6]))
    for i, seed in enumerate([5, 6]):
        solo.logits = den.logits[i:i + 1]
        z_i, _ = sample_latents(solo, table, sched, num_samples=1, num_steps=3, generator=gens([seed]))
        torch.testing.assert_close(z_b[i:i + 1], z_i, rtol=0, atol=0)
    # the final draw: row i from row i's own (peaked) distribution
    peaked = FixedLogits(30.0 * torch.nn.functional.one_hot(tokens, K).float())
    out = sample_tokens(peaked, table, sched, num_samples=2, num_steps=1, generator=gens([1, 2]))
    assert torch.equal(out, tokens)


def test_conditional_model_without_labels_samples_the_null_class():
    den = FixedLogits(torch.zeros(4, 5), num_classes=3)
    sample_latents(den, torch.randn(6, 4), ShiftedCosineSchedule(), num_samples=2, num_steps=1)
    assert all(torch.equal(y, torch.full((2,), 3)) for y in den.seen_y)
    with pytest.raises(ValueError, match="guidance_scale > 0 needs"):
        sample_latents(den, torch.randn(6, 4), ShiftedCosineSchedule(), num_samples=2, num_steps=1,
                       guidance_scale=1.0)


@pytest.mark.parametrize("kw,match", [
    (dict(class_labels=[-1]), r"class_labels must be in \[0, 3\]"),
    (dict(class_labels=[0], num_steps=0), "num_steps must be >= 1"),
    (dict(num_samples=-1), "num_samples must be >= 0"),
    (dict(class_labels=[0], guidance_interval=(0.7, 0.3)), r"0 <= lo <= hi <= 1, got \[0.7, 0.3\]"),
    (dict(class_labels=[0], guidance_interval=(-0.1, 1)), r"0 <= lo <= hi <= 1"),
    (dict(class_labels=[0], guidance_interval=(0.5,)), "two noise levels"),
    (dict(class_labels=[0], guidance_interval="ab"), "two noise levels"),
])
def test_bad_sampler_arguments_are_refused(kw, match):
    den = FixedLogits(torch.zeros(4, 5), num_classes=3)
    with pytest.raises(ValueError, match=match):
        sample_latents(den, torch.randn(6, 4), ShiftedCosineSchedule(), **{"num_steps": 1, **kw})


def test_class_label_tensor_checks_the_count():
    assert torch.equal(class_label_tensor([1.0, 2.0], 2), torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="num_images=3 but 2 class_labels"):
        class_label_tensor([1, 2], 3)

