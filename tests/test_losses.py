"""The VQ-LCMD objective against an independent transcription of VQ-LCMD.md's training step."""
import copy
import math

import pytest
import torch
import torch.nn.functional as F

from vqlcmd.diffusion import LossConfig, sample_drop_mask, training_losses
from vqlcmd.ema import EMA
from vqlcmd.embedding import collapse_indicator
from vqlcmd.model import preset_config
from vqlcmd.network import VQLCMDNetwork
from vqlcmd.schedule import ShiftedCosineSchedule


def _setup(seed=0, **cfg_kw):
    torch.manual_seed(seed)
    net = VQLCMDNetwork(preset_config("tiny", attn_dropout=0.0), **cfg_kw)
    teacher = copy.deepcopy(net)
    with torch.no_grad():  # a teacher that differs from the student, as after some EMA steps
        for p in teacher.parameters():
            p.add_(0.05 * torch.randn_like(p))
    tokens = torch.randint(0, 16, (4, 16))
    labels = torch.tensor([0, 1, 2, 3])
    return net, teacher, tokens, labels


def test_terms_match_independent_transcription():
    net, teacher, x, y = _setup()
    sched = ShiftedCosineSchedule(-1.0)
    cfg = LossConfig(p_drop=0.3, label_drop=0.5)
    out = training_losses(net, teacher, sched, x, y, cfg, generator=torch.Generator().manual_seed(7),
                          backend="reference")

    # Same draws, in the order the training step documents: t, s, drop mask, label drop, ε, ε0.
    g = torch.Generator().manual_seed(7)
    B, M = x.shape
    E, Ebar, K = net.embedding.weight, teacher.embedding.weight, 16
    t = torch.rand(B, generator=g)
    s = t * torch.rand(B, generator=g)
    drop = torch.rand(B, M, generator=g) < 0.3
    y2 = torch.where(torch.rand(B, generator=g) < 0.5, torch.full_like(y, 4), y)
    eps = torch.randn(B, M, E.shape[1], generator=g)
    eps0 = torch.randn(B, M, E.shape[1], generator=g)

    def a_s(tt):
        lam = -2 * torch.log(torch.tan(math.pi * tt.clamp(1e-4, 1 - 1e-4) / 2)) - 1.0
        return torch.sigmoid(lam).sqrt()[:, None, None], torch.sigmoid(-lam).sqrt()[:, None, None]

    (at, st), (as_, ss), (a0, s0) = a_s(t), a_s(s), a_s(torch.zeros(B))
    x_drop = torch.where(drop, torch.full_like(x, K), x)
    z_t = at * E[x_drop] + st * eps
    z_0 = a0 * E[x] + s0 * eps0
    z_s = as_ * Ebar[x] + (ss / st) * (z_t - at * Ebar[x])
    with torch.no_grad():
        logits_t = net.denoiser(z_t, t, y2)
        logits_0 = net.denoiser(z_0, torch.zeros(B), y2)
        teacher_logits = teacher.denoiser(z_s, s, y2)
    psi = torch.softmax(logits_t, -1) @ E[:K]
    l_dm = ((E[x] - psi) ** 2).sum() / B
    l0 = -torch.log_softmax(logits_0, -1).gather(-1, x[..., None]).sum() / B
    p, logq = torch.softmax(teacher_logits, -1), torch.log_softmax(logits_t, -1)
    l_cm = (p * (p.log() - logq)).sum() / B

    torch.testing.assert_close(out["l_dm"], l_dm.detach(), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(out["l0"], l0, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(out["l_cm"], l_cm, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(out["loss"].detach(), l0 + 0.005 * l_dm.detach() + l_cm, rtol=1e-4, atol=1e-5)


def test_vlb_weight_is_minus_half_the_derivative_of_the_snr():
    """weighting="vlb": L_∞ = E_t[−½ SNR'(t) ‖E[x] − Ψ̂‖²] (paper eq. vlb), with SNR' taken by autograd of
    the paper's SNR(t) = exp(−2 log tan(πt/2) + shift) rather than from the schedule's own derivative."""
    net, teacher, x, y = _setup()
    sched = ShiftedCosineSchedule(-1.0)
    cfg = LossConfig(p_drop=0.0, drop_strategy="none", label_drop=0.0, beta_cm=0.0, weighting="vlb")
    out = training_losses(net, teacher, sched, x, y, cfg, generator=torch.Generator().manual_seed(5),
                          backend="reference")
    g = torch.Generator().manual_seed(5)
    B, M = x.shape
    E, K = net.embedding.weight, 16
    t = torch.rand(B, generator=g)
    torch.rand(B, generator=g)  # s
    eps = torch.randn(B, M, E.shape[1], generator=g)
    t64 = t.double().requires_grad_(True)
    snr = torch.exp(-2 * torch.log(torch.tan(math.pi * t64 / 2)) - 1.0)
    (dsnr,) = torch.autograd.grad(snr.sum(), t64)
    lam = torch.log(snr.detach()).float()[:, None, None]
    z_t = torch.sigmoid(lam).sqrt() * E[x] + torch.sigmoid(-lam).sqrt() * eps
    with torch.no_grad():
        psi = torch.softmax(net.denoiser(z_t, t, y), -1) @ E[:K]
        sq_err = ((E[x] - psi) ** 2).sum(dim=(1, 2)).double()
    assert (dsnr < 0).all()  # SNR falls with t, so the weight is positive
    torch.testing.assert_close(out["l_vlb"].double(), (-0.5 * dsnr * sq_err).mean(), rtol=1e-4, atol=0)


def test_l0_fraction_decodes_the_first_images_only():
    net, teacher, x, y = _setup()
    sched = ShiftedCosineSchedule(0.0)
    cfg = LossConfig(p_drop=0.0, drop_strategy="none", label_drop=0.0, l0_fraction=0.5)
    out = training_losses(net, teacher, sched, x, y, cfg, generator=torch.Generator().manual_seed(3),
                          backend="reference")
    g = torch.Generator().manual_seed(3)
    B, M = x.shape
    E = net.embedding.weight
    torch.rand(B, generator=g), torch.rand(B, generator=g)  # t, s
    torch.randn(B, M, E.shape[1], generator=g)  # ε of z_t
    eps0 = torch.randn(2, M, E.shape[1], generator=g)  # ε0 for ceil(0.5 * 4) = 2 images
    lam = -2 * torch.log(torch.tan(torch.tensor(math.pi * 1e-4 / 2)))
    z_0 = torch.sigmoid(lam).sqrt() * E[x[:2]] + torch.sigmoid(-lam).sqrt() * eps0
    with torch.no_grad():
        logits_0 = net.denoiser(z_0, torch.zeros(2), y[:2])
    l0 = -torch.log_softmax(logits_0, -1).gather(-1, x[:2, :, None]).sum() / 2
    torch.testing.assert_close(out["l0"], l0, rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="l0_fraction"):
        LossConfig(l0_fraction=0.0)


def test_gradients_reach_student_and_embeddings_not_teacher():
    net, teacher, x, y = _setup()
    out = training_losses(net, teacher, ShiftedCosineSchedule(), x, y, LossConfig())
    out["loss"].backward()
    assert net.embedding.weight.grad is not None and net.embedding.weight.grad.abs().sum() > 0
    assert all(p.grad is not None for p in net.denoiser.parameters() if p.requires_grad)
    assert all(p.grad is None for p in teacher.parameters())


def test_dm_target_carries_gradient_to_embeddings():
    """Item 7 of the training step: E gets gradient through the L_DM target E[x] too."""
    net, teacher, x, y = _setup()
    cfg = LossConfig(beta_cm=0.0, beta_dm=1.0)
    net.denoiser.requires_grad_(False)
    out = training_losses(net, teacher, ShiftedCosineSchedule(), x, y, cfg, generator=torch.Generator().manual_seed(0))
    g_total = torch.autograd.grad(out["loss"], net.embedding.weight)[0]
    assert g_total[x.unique()].abs().sum() > 0


def test_ablation_switches():
    net, teacher, x, y = _setup(frozen_embeddings=True)
    out = training_losses(net, teacher, ShiftedCosineSchedule(), x, y, LossConfig(beta_cm=0.0, drop_strategy="none"))
    assert "l_cm" not in out  # not computed, so not reported as a 0 that reads like perfect consistency
    out["loss"].backward()
    assert net.embedding.weight.grad is None  # fixed embeddings

    net, teacher, x, y = _setup(l2_normalize=True)
    norms = net.embedding.table().norm(dim=-1)
    torch.testing.assert_close(norms, torch.full_like(norms, 8 ** 0.25))
    vlb = training_losses(net, teacher, ShiftedCosineSchedule(), x, y, LossConfig(weighting="vlb"),
                          generator=torch.Generator().manual_seed(0))
    assert torch.isfinite(vlb["loss"])
    # the weighted term is logged: the loss is l0 + l_vlb + β_CM l_cm (l_dm alone hid what dominates it)
    torch.testing.assert_close(vlb["loss"].detach(), vlb["l0"] + vlb["l_vlb"] + vlb["l_cm"])
    assert "l_vlb" not in out
    with pytest.raises(ValueError, match="drop_strategy"):
        LossConfig(drop_strategy="sometimes")


@pytest.mark.parametrize("strategy,expected", [("fixed", 0.2), ("linear", None), ("random_ratio", 0.5)])
def test_drop_mask_rates(strategy, expected):
    g = torch.Generator().manual_seed(0)
    t = torch.rand(4000, generator=g)
    mask = sample_drop_mask(LossConfig(drop_strategy=strategy), t, 64, g)
    if strategy == "linear":  # per-image ratio = t
        torch.testing.assert_close(mask.float().mean(1), t, atol=0.35, rtol=0)  # > 5 binomial std
        assert abs(mask.float().mean() - t.mean()) < 0.01
    else:
        assert abs(mask.float().mean() - expected) < 0.01
    assert sample_drop_mask(LossConfig(drop_strategy="none"), t, 64, g) is None


def test_ema_update_is_lerp_in_float32():
    src = torch.nn.Linear(3, 2).to(torch.bfloat16)
    ema = EMA(src, decay=0.9)
    before = [p.clone() for p in ema.module.parameters()]
    with torch.no_grad():
        for p in src.parameters():
            p.add_(1.0)
    ema.update(src)
    for b, p, s in zip(before, ema.module.parameters(), src.parameters()):
        assert p.dtype == torch.float32
        torch.testing.assert_close(p, 0.9 * b + 0.1 * s.float())
    with pytest.raises(ValueError, match="decay"):
        EMA(src, decay=1.0)


def test_collapse_indicator_values():
    g = torch.Generator().manual_seed(0)
    random_rows = torch.randn(200, 64, generator=g)
    assert abs(collapse_indicator(random_rows) - math.sqrt(2)) < 0.05
    collapsed = torch.ones(50, 8) + 1e-3 * torch.randn(50, 8, generator=g)
    assert collapse_indicator(collapsed) < 0.01


def test_training_lowers_loss_on_structured_tokens():
    """Tiny model, synthetic data with structure: each class is a fixed token pattern with 10% noise."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    patterns = torch.randint(0, 16, (4, 16), generator=g)

    def batch(n=32):
        y = torch.randint(0, 4, (n,), generator=g)
        x = patterns[y].clone()
        noise = torch.rand(n, 16, generator=g) < 0.1
        return torch.where(noise, torch.randint(0, 16, (n, 16), generator=g), x), y

    net = VQLCMDNetwork(preset_config("tiny", attn_dropout=0.0))
    teacher = EMA(net, 0.99)
    opt = torch.optim.AdamW(net.parameters(), lr=5e-3)
    sched, cfg = ShiftedCosineSchedule(), LossConfig()
    history = []
    for step in range(100):
        x, y = batch(16)
        out = training_losses(net, teacher.module, sched, x, y, cfg, generator=g)
        opt.zero_grad()
        out["loss"].backward()
        opt.step()
        teacher.update(net)
        history.append(out["l0"].item() + cfg.beta_dm * out["l_dm"].item())
    first, last = sum(history[:20]) / 20, sum(history[-20:]) / 20
    assert last < 0.5 * first, (first, last)


@pytest.mark.parametrize("student_dtype", [torch.bfloat16, torch.float32])
def test_teacher_multiplies_in_the_students_precision(student_dtype):
    """Under bf16 training (DeepSpeed casts the student) the fp32 EMA teacher runs its matmuls in bf16
    under autocast, keeping fp32 weights; an fp32 run keeps an fp32 teacher. Its logits stay within
    bf16 rounding of the fp32 teacher's."""
    net, teacher, x, y = _setup()
    net = net.to(student_dtype)
    seen = []
    hook = teacher.denoiser.head.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    cfg = LossConfig(drop_strategy="none", label_drop=0.0)
    with torch.no_grad():
        out = training_losses(net, teacher, ShiftedCosineSchedule(), x, y, cfg, generator=torch.Generator().manual_seed(1))
    hook.remove()
    assert seen == [student_dtype]
    assert all(p.dtype == torch.float32 for p in teacher.parameters())
    assert torch.isfinite(out["l_cm"])
    if student_dtype == torch.bfloat16:  # the same step with the teacher left in fp32
        from vqlcmd.diffusion import losses
        real = losses._teacher_autocast
        losses._teacher_autocast = lambda *a: torch.autocast("cpu", enabled=False)
        try:
            with torch.no_grad():
                ref = training_losses(net, teacher, ShiftedCosineSchedule(), x, y, cfg,
                                      generator=torch.Generator().manual_seed(1))
        finally:
            losses._teacher_autocast = real
        assert torch.allclose(out["l_cm"], ref["l_cm"], rtol=0.05), (out["l_cm"], ref["l_cm"])


def test_an_outer_autocast_reaches_the_teacher():
    """With fp32 weights under the caller's bf16 autocast (the train-step benchmarks), the teacher's own
    context was a disabled autocast, which switched the caller's off: fp32 matmuls again."""
    net, teacher, x, y = _setup()
    seen = []
    hooks = [m.head.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
             for m in (net.denoiser, teacher.denoiser)]
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        training_losses(net, teacher, ShiftedCosineSchedule(), x, y, LossConfig(), generator=torch.Generator().manual_seed(1))
    for h in hooks:
        h.remove()
    assert seen == [torch.bfloat16, torch.bfloat16]  # student, teacher


def test_ema_keeps_its_own_float32_positions_under_a_bf16_source():
    """The denoiser's positions are a non-persistent buffer the model rebuilds; copying a bf16 student's
    rounded them in the fp32 teacher and sampling EMA."""
    net = VQLCMDNetwork(preset_config("tiny"))
    ema = EMA(net, 0.5)
    exact = ema.module.denoiser.pos.clone()
    net = net.bfloat16()
    assert not torch.equal(net.denoiser.pos.float(), exact)  # bf16 rounding is visible
    ema.update(net)
    assert ema.module.denoiser.pos.dtype == torch.float32 and torch.equal(ema.module.denoiser.pos, exact)


def test_beta_dm_under_the_vlb_weighting_is_warned_about_not_silently_dropped():
    with pytest.warns(UserWarning, match="loss.beta_dm = 0.5 is not used"):
        LossConfig(weighting="vlb", beta_dm=0.5)
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        LossConfig(weighting="vlb")  # the default β_DM: nothing to say
        LossConfig(beta_dm=0.5)  # lcmd uses it
