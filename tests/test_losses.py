"""The VQ-LCMD objective against an independent transcription of docs/method.md §7-8."""
import copy
import math

import pytest
import torch
import torch.nn.functional as F

from vqlcmd.diffusion import LossConfig, sample_drop_mask, training_losses
from vqlcmd.diffusion.losses import drop_labels
from vqlcmd.ema import EMA
from vqlcmd.embedding import TokenEmbedding, collapse_indicator
from vqlcmd.model import preset_config
from vqlcmd.network import VQLCMDNetwork
from vqlcmd.schedule import ShiftedCosineSchedule

K = 16


def _setup(seed=0, attn_dropout=0.0, **cfg_kw):
    torch.manual_seed(seed)
    net = VQLCMDNetwork(preset_config("tiny", attn_dropout=attn_dropout), **cfg_kw)
    with torch.no_grad():  # AdaLN starts at zero: perturb so that t and y reach the student's logits too
        for p in net.denoiser.parameters():
            p.add_(0.3 * torch.randn_like(p))
    teacher = copy.deepcopy(net)
    with torch.no_grad():
        for p in teacher.parameters():
            p.add_(0.05 * torch.randn_like(p))
    tokens = torch.randint(0, K, (4, 16))
    labels = torch.tensor([0, 1, 2, 3])
    return net, teacher, tokens, labels


def _alpha_sigma(tt, shift):
    lam = -2 * torch.log(torch.tan(math.pi * tt.clamp(1e-4, 1 - 1e-4) / 2)) + shift
    return torch.sigmoid(lam).sqrt()[:, None, None], torch.sigmoid(-lam).sqrt()[:, None, None]


def _transcribed_loss(net, teacher, x, y, seed, *, shift, p_drop, label_drop, beta_dm, beta_cm,
                      l0_fraction=1.0, drop_in_l0=False):
    """docs/method.md §7-8 with the draws in the documented order, differentiable in θ and E."""
    g = torch.Generator().manual_seed(seed)
    B, M = x.shape
    E, Ebar = net.embedding.weight, teacher.embedding.weight
    t = torch.rand(B, generator=g)
    s = t * torch.rand(B, generator=g)
    drop = torch.rand(B, M, generator=g) < p_drop
    y2 = torch.where(torch.rand(B, generator=g) < label_drop, torch.full_like(y, 4), y)
    B0 = math.ceil(l0_fraction * B)
    eps = torch.randn(B, M, E.shape[1], generator=g)
    eps0 = torch.randn(B0, M, E.shape[1], generator=g)
    (at, st), (as_, ss) = _alpha_sigma(t, shift), _alpha_sigma(s, shift)
    a0, s0 = _alpha_sigma(torch.zeros(B0), shift)
    z_t = at * E[torch.where(drop, torch.full_like(x, K), x)] + st * eps
    x0 = torch.where(drop[:B0], torch.full_like(x[:B0], K), x[:B0]) if drop_in_l0 else x[:B0]
    z_0 = a0 * E[x0] + s0 * eps0
    logits_t = net.denoiser(z_t, t, y2)
    logits_0 = net.denoiser(z_0, torch.zeros(B0), y2[:B0])
    psi = torch.softmax(logits_t, -1) @ E[:K]
    l_dm = ((E[x] - psi) ** 2).sum() / B
    l0 = -torch.log_softmax(logits_0, -1).gather(-1, x[:B0, :, None]).sum() / B0
    with torch.no_grad():
        z_s = as_ * Ebar[x] + (ss / st) * (z_t - at * Ebar[x])
        p = torch.softmax(teacher.denoiser(z_s, s, y2), -1)
    l_cm = (p * (p.log() - torch.log_softmax(logits_t, -1))).sum() / B
    return l0 + beta_dm * l_dm + beta_cm * l_cm, l0, l_dm, l_cm


def test_terms_match_independent_transcription():
    net, teacher, x, y = _setup()
    cfg = LossConfig(p_drop=0.3, label_drop=0.5)
    out = training_losses(net, teacher, ShiftedCosineSchedule(-1.0), x, y, cfg,
                          generator=torch.Generator().manual_seed(7), backend="reference")
    with torch.no_grad():
        loss, l0, l_dm, l_cm = _transcribed_loss(net, teacher, x, y, 7, shift=-1.0, p_drop=0.3, label_drop=0.5,
                                                 beta_dm=0.005, beta_cm=1.0)
    torch.testing.assert_close(out["l_dm"], l_dm, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(out["l0"], l0, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(out["l_cm"], l_cm, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(out["loss"].detach(), loss, rtol=1e-4, atol=1e-5)


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


# ---- the gradient, L0's options, the rates and the config's bounds (gaps a mutation run found) ----

def test_gradient_of_the_loss_matches_the_transcription():
    """Step 7: gradients reach E through z_t, Ψ̂ and the L_DM target, and β_CM weighs L_CM. Compared as the
    whole gradient of the documented loss in E and in one denoiser weight, with β's away from 1."""
    net, teacher, x, y = _setup()
    cfg = LossConfig(p_drop=0.3, label_drop=0.5, beta_dm=1.0, beta_cm=0.5)
    out = training_losses(net, teacher, ShiftedCosineSchedule(-1.0), x, y, cfg,
                          generator=torch.Generator().manual_seed(7), backend="reference")
    w = net.denoiser.head.weight
    g_E, g_w = torch.autograd.grad(out["loss"], [net.embedding.weight, w])
    ref, *_ = _transcribed_loss(net, teacher, x, y, 7, shift=-1.0, p_drop=0.3, label_drop=0.5, beta_dm=1.0,
                                beta_cm=0.5)
    r_E, r_w = torch.autograd.grad(ref, [net.embedding.weight, w])
    torch.testing.assert_close(out["loss"].detach(), ref.detach(), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(g_E, r_E, rtol=1e-3, atol=1e-5)
    torch.testing.assert_close(g_w, r_w, rtol=1e-3, atol=1e-5)


def test_l0_with_dropping_and_an_uneven_fraction():
    """drop_in_l0 decodes z_0 of the dropped x' of the same (first) images; B0 = ceil(l0_fraction * B)."""
    net, teacher, x, y = _setup()
    cfg = LossConfig(p_drop=0.5, label_drop=0.0, l0_fraction=0.3, drop_in_l0=True)
    with torch.no_grad():
        out = training_losses(net, teacher, ShiftedCosineSchedule(0.0), x, y, cfg,
                              generator=torch.Generator().manual_seed(2), backend="reference")
        _, l0, _, _ = _transcribed_loss(net, teacher, x, y, 2, shift=0.0, p_drop=0.5, label_drop=0.0,
                                        beta_dm=0.005, beta_cm=1.0, l0_fraction=0.3, drop_in_l0=True)
    torch.testing.assert_close(out["l0"], l0, rtol=1e-4, atol=1e-5)


def test_vlb_reports_the_unweighted_l_dm():
    """Returned l_dm is ‖E[x] − Ψ̂‖² summed over tokens and D, averaged over the batch, whatever the weighting."""
    net, teacher, x, y = _setup()
    cfg = LossConfig(p_drop=0.3, label_drop=0.5, weighting="vlb")
    with torch.no_grad():
        out = training_losses(net, teacher, ShiftedCosineSchedule(-1.0), x, y, cfg,
                              generator=torch.Generator().manual_seed(7), backend="reference")
        _, _, l_dm, _ = _transcribed_loss(net, teacher, x, y, 7, shift=-1.0, p_drop=0.3, label_drop=0.5,
                                          beta_dm=0.005, beta_cm=1.0)
    torch.testing.assert_close(out["l_dm"], l_dm, rtol=1e-4, atol=1e-5)


def test_random_ratio_draws_a_uniform_ratio_per_image():
    """"random_ratio": ratio ~ U(0,1) per image, so the per-image drop fractions spread like U(0,1)."""
    g = torch.Generator().manual_seed(0)
    mask = sample_drop_mask(LossConfig(drop_strategy="random_ratio"), torch.rand(2000, generator=g), 256, g)
    frac = mask.float().mean(1)
    assert abs(frac.std().item() - (1 / 12) ** 0.5) < 0.02  # 0.289; a fixed 0.5 ratio gives 0.031
    for q in (0.1, 0.5, 0.9):
        assert abs((frac < q).float().mean().item() - q) < 0.03


def test_label_drop_rate_is_p_and_goes_to_the_null_class():
    g = torch.Generator().manual_seed(0)
    labels = torch.randint(0, 10, (20000,), generator=g)
    out = drop_labels(labels, 10, 0.1, g)
    dropped = out != labels
    assert abs(dropped.float().mean().item() - 0.1) < 0.01  # 7 binomial std
    assert (out[dropped] == 10).all()


def test_config_bounds_are_the_documented_ones():
    LossConfig(p_drop=1.0, label_drop=1.0)  # [0, 1] both ends
    mask = sample_drop_mask(LossConfig(p_drop=1.0), torch.rand(3), 8)
    assert mask.all()
    for name in ("beta_dm", "beta_cm"):
        with pytest.raises(ValueError, match=f"{name} must be a finite number >= 0"):
            LossConfig(**{name: -0.1})


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_float16_student_runs_the_teacher_in_float16():
    """_teacher_autocast: a 16-bit student (bf16 or fp16) gets its fp32 teacher autocast to its dtype."""
    net, teacher, x, y = _setup()
    net = net.to(torch.float16)
    seen = []
    hook = teacher.denoiser.head.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    with torch.no_grad():
        training_losses(net, teacher, ShiftedCosineSchedule(), x, y, LossConfig(drop_strategy="none", label_drop=0.0),
                        generator=torch.Generator().manual_seed(1))
    hook.remove()
    assert seen == [torch.float16]


# ---- EMA (docs/method.md §9) ----

def test_ema_decay_zero_copies_the_source():
    src = torch.nn.Linear(3, 2)
    ema = EMA(src, decay=0.0)
    with torch.no_grad():
        src.weight.add_(1.0)
    ema.update(src)
    torch.testing.assert_close(ema.module.weight, src.weight, rtol=0, atol=0)


def test_ema_shadow_is_a_fixed_target_without_dropout():
    """The teacher's prediction is the student's target: the shadow runs in eval mode and needs no gradient,
    even when the source trains with dropout."""
    src = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.5)).train()
    ema = EMA(src, decay=0.9)
    assert not ema.module.training
    assert not any(p.requires_grad for p in ema.module.parameters())
    x = torch.randn(4, 8)
    torch.testing.assert_close(ema.module(x), ema.module(x), rtol=0, atol=0)
    torch.testing.assert_close(ema.module(x), ema.module[0](x), rtol=0, atol=0)


def test_ema_copies_persistent_buffers():
    src = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4)).train()
    ema = EMA(src, decay=0.9)
    src(torch.randn(16, 3) + 5.0)  # moves the running statistics
    ema.update(src)
    torch.testing.assert_close(ema.module[1].running_mean, src[1].running_mean, rtol=0, atol=0)
    assert ema.module[1].num_batches_tracked.item() == 1


def test_update_emas_walks_the_module_trees_once(monkeypatch):
    """The parameter lists are walked at the first update only (the walks of a 24-block denoiser cost more host
    time than the lerps); later updates still follow in-place changes of the source, its persistent buffers,
    and a bf16 compute copy."""
    from vqlcmd.ema import update_emas

    src = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4)).train()
    teacher, sampling = EMA(src, decay=0.5), EMA(src, decay=0.9)
    teacher.keep_compute_copy(torch.bfloat16)
    update_emas([teacher, sampling], src)
    before = [p.clone() for p in sampling.module.parameters()]
    with torch.no_grad():
        src[0].weight.add_(1.0)
    src(torch.randn(16, 3) + 5.0)
    walks = []
    original = torch.nn.Module.named_modules
    monkeypatch.setattr(torch.nn.Module, "named_modules", lambda *a, **k: walks.append(1) or original(*a, **k))
    update_emas([teacher, sampling], src)
    assert not walks
    for b, p, s in zip(before, sampling.module.parameters(), src.parameters()):
        torch.testing.assert_close(p, 0.9 * b + 0.1 * s, rtol=0, atol=1e-6)
    torch.testing.assert_close(sampling.module[1].running_mean, src[1].running_mean, rtol=0, atol=0)
    monkeypatch.undo()
    for c, m in zip(teacher.compute.parameters(), teacher.module.parameters()):
        assert torch.equal(c, m.to(torch.bfloat16))
    assert torch.equal(teacher.compute[1].running_mean, teacher.module[1].running_mean.to(torch.bfloat16))


def test_update_emas_casts_bf16_weights_sharing_a_flat_buffer_in_one_op():
    """DeepSpeed's bf16 weights are views of one flat buffer: they are cast to float32 in one op over it, with
    the values of a cast of each (the update equals the per-tensor reference exactly); weights of their own
    storage are cast one by one."""
    from torch.profiler import ProfilerActivity, profile

    from vqlcmd.ema import update_emas

    torch.manual_seed(0)
    src = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 5), torch.nn.Linear(5, 2))
    ema = EMA(src, decay=0.9)
    src = src.to(torch.bfloat16)
    params = list(src.parameters())
    flat = torch.randn(sum(p.numel() for p in params) + 3).to(torch.bfloat16)  # + padding, as DeepSpeed aligns
    offset = 0
    for p in params[:-1]:  # the last keeps its own storage
        p.data = flat[offset:offset + p.numel()].view_as(p)
        offset += p.numel()
    want = [torch.lerp(m, p.float(), 0.1) for m, p in zip(ema.module.parameters(), params)]  # each cast alone
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        update_emas([ema], src)
    casts = [e for e in prof.events() if e.name == "aten::_to_copy"]
    assert len(casts) == 2  # the flat buffer's, and the last weight's
    for w, m in zip(want, ema.module.parameters()):
        assert torch.equal(m, w)


def test_ema_state_dict_round_trip_keeps_the_decay():
    src = torch.nn.Linear(3, 2)
    a = EMA(src, decay=0.9)
    with torch.no_grad():
        src.weight.add_(1.0)
    a.update(src)
    b = EMA(torch.nn.Linear(3, 2), decay=0.5)
    b.load_state_dict(a.state_dict())
    assert b.decay == 0.9
    torch.testing.assert_close(b.module.weight, a.module.weight, rtol=0, atol=0)


# ---- Embeddings (docs/method.md §2) ----

def test_embedding_init_variance_and_layout():
    """Init N(0, D^{-1/2}) for all K+1 rows; row K is [mask]; an init table fills rows 0..K-1 only."""
    torch.manual_seed(0)
    emb = TokenEmbedding(1023, 256)
    assert emb.weight.shape == (1024, 256) and emb.mask_index == 1023
    assert abs(emb.weight.var().item() / 256 ** -0.5 - 1) < 0.02
    init = torch.arange(12.0).reshape(4, 3)
    emb = TokenEmbedding(4, 3, init=init, frozen=True)
    torch.testing.assert_close(emb.weight[:4], init, rtol=0, atol=0)
    assert not torch.equal(emb.weight[4], init[0])
    for bad in (torch.zeros(1, 3), torch.zeros(5, 3)):
        with pytest.raises(ValueError, match="init must be"):
            TokenEmbedding(4, 3, init=bad)


def test_collapse_indicator_known_value():
    """Mean distance over the n(n-1) ordered pairs of distinct rows over the mean row norm, in float64."""
    e = torch.tensor([[2.0, 0.0], [0.0, 1.0], [-1.0, 0.0]])
    d = [math.dist(a, b) for i, a in enumerate(e.tolist()) for j, b in enumerate(e.tolist()) if i != j]
    expected = (sum(d) / len(d)) / ((2.0 + 1.0 + 1.0) / 3)
    assert collapse_indicator(e) == pytest.approx(expected, rel=1e-6)
    with pytest.raises(ValueError, match="two rows"):
        collapse_indicator(torch.ones(1, 4))


@pytest.mark.parametrize("backend", ["reference", "auto"])  # auto: the C++ noise kernel and its Philox key
@pytest.mark.parametrize("strategy", ["fixed", "linear", "random_ratio"])
@pytest.mark.parametrize("attn_dropout", [0.0, 0.3])
def test_drawn_loss_is_the_loss_with_its_draws_taken_first(backend, strategy, attn_dropout):
    """draw_loss_randoms takes every number the loss would draw, in its order (the generator ends in the same
    state), and training_losses_drawn with them draws nothing and gives the same terms and gradients. With
    attention dropout, the key of the CPU attention kernel's masks is one of the draws, so nothing comes from
    the global generator either."""
    from vqlcmd import ops
    from vqlcmd.diffusion import draw_loss_randoms, training_losses_drawn

    net, teacher, x, y = _setup(attn_dropout=attn_dropout)
    if attn_dropout:
        if ops.why_not("short_attention", "compiled"):
            pytest.skip("the compiled extension is not built")
        for block in net.denoiser.blocks:
            block.attention_backend = "compiled"
        teacher.eval()  # as the EMA teacher runs: without dropout
    cfg = LossConfig(p_drop=0.3, label_drop=0.5, drop_strategy=strategy, l0_fraction=0.5)
    sched = ShiftedCosineSchedule(-1.0)
    g = torch.Generator().manual_seed(11)
    want = training_losses(net, teacher, sched, x, y, cfg, generator=g, backend=backend)
    after_loss = torch.rand(4, generator=g)
    want_grads = torch.autograd.grad(want["loss"], list(net.parameters()))
    g.manual_seed(11)
    draws = draw_loss_randoms(net, x, y, cfg, generator=g, backend=backend)
    assert ("dropout_seed" in draws) == (attn_dropout > 0)
    assert torch.equal(torch.rand(4, generator=g), after_loss)
    g.manual_seed(1234)  # nothing more is drawn from it, nor from torch's global generator
    cpu_state = torch.get_rng_state()
    got = training_losses_drawn(net, teacher, sched, x, y, cfg, draws, backend=backend)
    assert torch.equal(torch.get_rng_state(), cpu_state)
    assert torch.equal(torch.rand(4, generator=g), torch.rand(4, generator=torch.Generator().manual_seed(1234)))
    assert want.keys() == got.keys()
    for k in want:
        assert torch.equal(want[k], got[k]), k
    for a, b in zip(want_grads, torch.autograd.grad(got["loss"], list(net.parameters()))):
        assert torch.equal(a, b)


def test_loss_ops_names_every_fused_op_the_loss_calls_with_its_backend(monkeypatch):
    """LOSS_OPS is what engine.build.check_op_backend holds train.backend to: the ops the loss hands its backend."""
    import vqlcmd.ops as ops
    from vqlcmd.diffusion.losses import LOSS_OPS

    called = set()
    for name in [n for n in dir(ops) if callable(getattr(ops, n)) and not n.startswith("_")]:
        real = getattr(ops, name)

        def spy(*args, _name=name, _real=real, **kwargs):
            if kwargs.get("backend") == "reference":  # the loss's own (the model's attention names its own backend)
                called.add(_name)
            return _real(*args, **kwargs)

        monkeypatch.setattr(ops, name, spy)
    net, teacher, x, y = _setup()
    training_losses(net, teacher, ShiftedCosineSchedule(), x, y, LossConfig(), generator=torch.Generator().manual_seed(0),
                    backend="reference")
    assert called == set(LOSS_OPS)
