"""MaskGIT (Chang et al. 2022; Besnier & Chen 2023) on tiny cases: schedule, sampler, loss."""
import math

import pytest
import torch
import torch.nn.functional as F

from vqlcmd.baselines import MaskGITConfig, maskgit_losses, maskgit_sample, unmask_schedule
from vqlcmd.baselines.maskgit import mask_ratio
from vqlcmd.model import preset_config
from vqlcmd.network import VQLCMDNetwork


@pytest.mark.parametrize("mode", ["arccos", "cosine", "linear", "square"])
@pytest.mark.parametrize("steps", [1, 2, 3, 5, 8, 12, 15, 16])
def test_unmask_schedule_covers_every_token_once(mode, steps):
    sched = unmask_schedule(steps, 16, mode)
    assert sched.shape == (steps,) and int(sched.sum()) == 16 and int(sched.min()) >= 1


def test_arccos_schedule_follows_its_documented_grid():
    # the documented formula with 64 tokens and 8 steps, worked out independently (the grid is
    # linspace(1, 0, N+1)[1:], not Besnier & Chen's own linspace(1, 0, N): see unmask_schedule):
    # r = linspace(1, 0, 9)[1:], v = arccos(r)/(pi/2), round(v / sum(v) * 64), remainder to the last step
    r = torch.linspace(1, 0, 9, dtype=torch.float64)[1:]
    v = torch.arccos(r) / (math.pi / 2)
    expected = (v / v.sum() * 64).round().long()
    expected[-1] += 64 - int(expected.sum())
    assert unmask_schedule(8, 64, "arccos").tolist() == expected.tolist()
    # few tokens first, many last: the arccos schedule decodes the easy global structure slowly
    assert expected[0] < expected[-1]
    assert unmask_schedule(1, 64).tolist() == [64]


def test_mask_ratio_endpoints():
    r = torch.tensor([0.0, 1.0])
    for mode in ("cosine", "arccos", "linear", "square"):
        torch.testing.assert_close(mask_ratio(r, mode), torch.tensor([1.0, 0.0]), atol=1e-6, rtol=0)


@pytest.fixture
def net():
    torch.manual_seed(0)
    return VQLCMDNetwork(preset_config("tiny", attn_dropout=0.0)).eval()


@pytest.mark.parametrize("steps", [1, 3, 8])
@pytest.mark.parametrize("guidance", [0.0, 2.0])
def test_sampler_unmasks_the_scheduled_number_per_step(net, steps, guidance):
    y = torch.tensor([0, 1, 2, 3, 1])
    calls = []
    den_forward = net.denoiser.forward

    def spy(z, t, yy=None):
        # count the [mask] rows in the conditional half of each forward
        mask_row = net.embedding.table()[net.embedding.mask_index]
        calls.append((z[: len(y)] == mask_row).all(-1).sum(1))
        return den_forward(z, t, yy)

    net.denoiser.forward = spy
    ids, trace = maskgit_sample(net, class_labels=y, num_steps=steps, guidance_scale=guidance,
                                generator=torch.Generator().manual_seed(0), return_trace=True)
    sched = unmask_schedule(steps, 16)
    assert ids.shape == (5, 16) and int(ids.max()) < 16 and int(ids.min()) >= 0  # no [mask] left
    assert [t.sum(1).tolist() for t in trace] == [[int(k)] * 5 for k in sched]
    assert torch.stack(trace).sum(0).eq(1).all()  # every position decoded exactly once
    # the network saw M, M - k1, M - k1 - k2, ... masked tokens
    remaining = 16 - torch.cumsum(torch.cat([torch.zeros(1, dtype=torch.long), sched[:-1]]), 0)
    assert [c.tolist() for c in calls] == [[int(m)] * 5 for m in remaining]


def test_zero_steps_and_negative_guidance_are_refused(net):
    # both used to fall back silently: 0 steps to the config's count, ω < 0 to no guidance
    y = torch.tensor([0, 1])
    with pytest.raises(ValueError, match="num_steps must be >= 1, got 0"):
        maskgit_sample(net, class_labels=y, num_steps=0)
    with pytest.raises(ValueError, match="guidance_scale must be a finite number >= 0"):
        maskgit_sample(net, class_labels=y, num_steps=2, guidance_scale=-1.0)


def test_decoded_tokens_are_never_changed(net):
    # a denoiser that always prefers a different token: earlier decisions must still stand
    y = torch.tensor([0, 1])
    ids, trace = maskgit_sample(net, class_labels=y, num_steps=4, generator=torch.Generator().manual_seed(1),
                                return_trace=True)
    # replay: tokens chosen at step n equal the final ids at those positions (nothing overwritten later)
    seen = torch.zeros_like(trace[0])
    for new in trace:
        assert not (new & seen).any()
        seen |= new
    assert seen.all()


def test_guidance_is_on_logits(net, monkeypatch):
    # with ω ramping, the last step uses (1 + ω) cond − ω uncond exactly
    from vqlcmd.baselines import maskgit as mg

    y = torch.tensor([1, 2])
    captured = []
    real_softmax = torch.softmax

    def capture(x, dim=-1):
        captured.append(x.detach().clone())
        return real_softmax(x, dim=dim)

    monkeypatch.setattr(mg.torch, "softmax", capture)
    cfg = MaskGITConfig(gumbel_temperature=0.0)
    maskgit_sample(net, class_labels=y, num_steps=1, guidance_scale=3.0, cfg=cfg,
                   generator=torch.Generator().manual_seed(0))
    z = net.embedding.table()[torch.full((2, 16), 16)]
    t = torch.zeros(2)
    cond = net.denoiser(z, t, y).float()
    uncond = net.denoiser(z, t, torch.full_like(y, 4)).float()
    torch.testing.assert_close(captured[-1], 4.0 * cond - 3.0 * uncond, atol=1e-4, rtol=1e-4)


def test_loss_is_cross_entropy_on_masked_positions_only(net):
    torch.manual_seed(0)
    x = torch.randint(0, 16, (6, 16))
    y = torch.randint(0, 4, (6,))
    cfg = MaskGITConfig(label_smoothing=0.0)
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    out = maskgit_losses(net, x, y, cfg, label_drop=0.0, generator=g1)
    # recompute by hand with the same random stream: r, then the position scores
    r = torch.rand(6, generator=g2)
    n_mask = torch.ceil(torch.cos(0.5 * math.pi * r) * 16).long().clamp(1, 16)
    scores = torch.rand(6, 16, generator=g2)
    mask = scores.argsort(1).argsort(1) < n_mask[:, None]
    assert mask.sum(1).tolist() == n_mask.tolist()
    ids = torch.where(mask, torch.full_like(x, 16), x)
    logits = net.denoiser(net.embedding.table()[ids], torch.zeros(6), y)
    expected = F.cross_entropy(logits[mask], x[mask])
    torch.testing.assert_close(out["loss"], expected)
    out["loss"].backward()
    # the [mask] row gets gradient (it is an input); the loss is finite
    assert net.embedding.weight.grad[16].abs().sum() > 0


def test_loss_target_gradient_only_from_masked_logits(net):
    x = torch.randint(0, 16, (4, 16))
    logits_grad = {}

    den_forward = net.denoiser.forward

    def spy(z, t, y=None):
        out = den_forward(z, t, y)
        out.retain_grad()
        logits_grad["logits"] = out
        return out

    net.denoiser.forward = spy
    g = torch.Generator().manual_seed(5)
    out = maskgit_losses(net, x, None, MaskGITConfig(label_smoothing=0.1), label_drop=0.0, generator=g)
    out["loss"].backward()
    grad = logits_grad["logits"].grad.abs().sum(-1)  # (B, M)
    # recover the mask: masked positions are exactly the ones fed the [mask] row
    g = torch.Generator().manual_seed(5)
    r = torch.rand(4, generator=g)
    n_mask = torch.ceil(torch.cos(0.5 * math.pi * r) * 16).long().clamp(1, 16)
    mask = torch.rand(4, 16, generator=g).argsort(1).argsort(1) < n_mask[:, None]
    assert (grad[~mask] == 0).all() and (grad[mask] > 0).all()


def test_more_steps_than_tokens_decode_one_token_per_step(net):
    ids, trace = maskgit_sample(net, class_labels=torch.tensor([0, 3]), num_steps=50,
                                generator=torch.Generator().manual_seed(0), return_trace=True)
    assert len(trace) == 16 and all(t.sum(1).tolist() == [1, 1] for t in trace)
