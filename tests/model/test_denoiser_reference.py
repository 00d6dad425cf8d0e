"""The denoiser against an independent float64 transcription of its documented architecture
(docs/method.md §12; denoiser.py module docstring): linear D -> width + fixed sinusoidal positions,
time embedding sinusoids(1000 t) -> MLP, class embedding with a null row (C + 1 rows), SiLU of the
condition, pre-norm blocks with AdaLN (1 + a) LN(h) + b, bidirectional softmax(QK^T/sqrt(d))V,
MLP, final AdaLN, linear head to K logits."""
import math

import pytest
import torch
import torch.nn.functional as F

from vqlcmd.model import build_denoiser, preset_config
from vqlcmd.model.attention import attention, math_attention
from vqlcmd.model.denoiser import AdaLayerNorm, sinusoidal_features
from vqlcmd.network import VQLCMDNetwork


def _sinusoids64(x, dim, max_period=10000.0):
    # guided-diffusion / DiT ``timestep_embedding``: [cos(x w_i), sin(x w_i)], w_i = P^(-i / (dim/2))
    half = dim // 2
    i = torch.arange(half, dtype=torch.float64)
    w = max_period ** (-i / half)
    args = x.double()[:, None] * w[None]
    return torch.cat([args.cos(), args.sin()], dim=-1)


def test_sinusoidal_features_are_the_dit_timestep_embedding():
    x = torch.tensor([0.0, 1.0, 3.5, 250.0, 999.0])
    got = sinusoidal_features(x, 32)
    torch.testing.assert_close(got.double(), _sinusoids64(x, 32), atol=2e-4, rtol=0)
    # known values: position 0 is [1]*half + [0]*half; frequency 0 is cos(x), sin(x)
    assert torch.equal(got[0], torch.cat([torch.ones(16), torch.zeros(16)]))
    torch.testing.assert_close(got[2, [0, 16]], torch.tensor([math.cos(3.5), math.sin(3.5)]))


def _ln(h, eps=1e-5):
    mu = h.mean(-1, keepdim=True)
    var = ((h - mu) ** 2).mean(-1, keepdim=True)
    return (h - mu) / torch.sqrt(var + eps)


def _lin(x, layer):
    return x @ layer.weight.double().T + layer.bias.double()


def _adaln(h, cond, mod):
    a, b = _lin(cond, mod.to_ab).chunk(2, dim=-1)  # first half scales, second shifts
    return (1 + a[:, None]) * _ln(h) + b[:, None]


def _reference_forward(model, z, t, y):
    cfg = model.cfg
    z, B, M, W, H = z.double(), z.shape[0], z.shape[1], cfg.width, cfg.heads
    feats = _sinusoids64(1000.0 * t, cfg.time_features)
    cond = _lin(F.silu(_lin(feats, model.time_mlp[0])), model.time_mlp[2])
    if model.class_emb is not None:
        yy = torch.full((B,), cfg.num_classes) if y is None else y  # row C: the null class
        cond = cond + model.class_emb.weight.double()[yy]
    cond = F.silu(cond)
    h = _lin(z, model.in_proj) + _sinusoids64(torch.arange(cfg.seq_len), W)[:M]
    for blk in model.blocks:
        qkv = _lin(_adaln(h, cond, blk.norm1), blk.qkv).view(B, M, 3, H, W // H)
        q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))  # (B, H, M, hd)
        att = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(W // H), dim=-1) @ v
        h = h + _lin(att.transpose(1, 2).reshape(B, M, W), blk.proj)
        x = _lin(_adaln(h, cond, blk.norm2), blk.mlp[0])
        x = F.gelu(x, approximate="tanh") if cfg.activation == "gelu_tanh" else F.gelu(x)
        h = h + _lin(x, blk.mlp[2])
    return _lin(_adaln(h, cond, model.final_norm), model.head)


@pytest.mark.parametrize("num_classes, M, use_y", [(4, 16, True), (4, 11, True), (4, 16, False), (0, 13, False)])
def test_forward_matches_a_float64_transcription(gen, num_classes, M, use_y):
    """Random (non-zero) AdaLN maps so every path matters; float32 eval on CPU takes the compiled attention
    kernel, the reference the explicit softmax. M < seq_len uses the first M positions."""
    torch.manual_seed(0)
    model = build_denoiser("tiny", num_classes=num_classes).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3, generator=gen)
    z = torch.randn(3, M, 8, generator=gen)
    t = torch.tensor([0.02, 0.5, 0.97])
    y = torch.tensor([0, 3, num_classes]) if use_y else None
    with torch.no_grad():
        got = model(z, t, y)
        want = _reference_forward(model, z, t, y)
    assert got.dtype == torch.float32 and got.shape == (3, M, 16)
    torch.testing.assert_close(got.double(), want, atol=2e-4 * want.abs().max().item(), rtol=1e-4)


def test_fresh_adaln_is_plain_layernorm_for_any_condition(gen):
    """The modulation map is zero-initialised (denoiser.py docstring): a fresh AdaLN ignores the condition."""
    norm = AdaLayerNorm(32, 32)
    assert not norm.to_ab.weight.any() and not norm.to_ab.bias.any()
    h = torch.randn(2, 5, 32, generator=gen)
    torch.testing.assert_close(norm(h, torch.randn(2, 32, generator=gen)), F.layer_norm(h, (32,)))


def test_attention_dropout_is_applied_in_training_on_every_backend(gen):
    model = build_denoiser("tiny", attn_dropout=0.5).train()
    z, t, y = torch.randn(2, 16, 8, generator=gen), torch.rand(2, generator=gen), torch.tensor([0, 1])
    for m in model.modules():
        if hasattr(m, "to_ab"):
            torch.nn.init.normal_(m.to_ab.weight, std=0.5)
    with torch.no_grad():
        torch.manual_seed(0)
        a = model(z, t, y)
        b = model(z, t, y)
    assert not torch.allclose(a, b)  # training: a fresh dropout mask per call
    q = torch.randn(1, 1, 8, 4, generator=gen)
    for backend in ("sdpa", "math"):
        torch.manual_seed(1)
        assert not torch.allclose(attention(q, q, q, dropout_p=0.5, backend=backend), attention(q, q, q, backend=backend))


def test_math_attention_dropout_keeps_1_minus_p_and_is_unbiased(gen):
    """Dropout keeps each probability with chance 1 - p and rescales by 1 / (1 - p): with v = 1 every output
    is sum_j keep_j p_j / (1 - p), mean 1."""
    p = 0.2
    q, k = torch.randn(2, 2, 256, 4, generator=gen), torch.randn(2, 2, 256, 4, generator=gen)
    out = math_attention(q * 0, k, torch.ones(2, 2, 256, 1), dropout_p=p, generator=gen)  # uniform probs
    assert abs(out.mean().item() - 1.0) < 0.02


def test_label_and_time_shapes_are_checked(gen):
    den = build_denoiser("tiny").eval()
    z = torch.randn(2, 16, 8, generator=gen)
    with pytest.raises(IndexError, match="class labels must be in"):
        den(z, torch.rand(2), torch.tensor([-1, 0]))  # a negative label, not an Embedding index error
    with pytest.raises(ValueError, match=r"t must be \(B,\)"):
        den(z, torch.rand(2, 1))


def test_network_passes_its_embedding_switches():
    cfg = preset_config("tiny")
    net = VQLCMDNetwork(cfg, frozen_embeddings=True, l2_normalize=True)
    assert not net.embedding.weight.requires_grad and net.embedding.l2_normalize
    # rows normalised to D^(1/4), the expected norm of the paper's N(0, D^(-1/2)) init (embedding.py)
    torch.testing.assert_close(net.embedding.table().norm(dim=-1), torch.full((cfg.codebook_size + 1,),
                                                                                cfg.embed_dim ** 0.25))
    plain = VQLCMDNetwork(cfg)
    assert plain.embedding.weight.requires_grad and not plain.embedding.l2_normalize


def test_presets_are_the_documented_architectures():
    """docs/method.md §12: unconditional 15 layers / 8 heads / width 512; ImageNet 24 / 16 / 768 with
    1000 classes; attention dropout 0.1. The digits preset runs without dropout (presets.py)."""
    ffhq, imnet, digits = (preset_config(n) for n in ("ffhq-56m", "imagenet-246m", "digits-1m"))
    assert (ffhq.depth, ffhq.heads, ffhq.width, ffhq.num_classes, ffhq.attn_dropout) == (15, 8, 512, 0, 0.1)
    assert (imnet.depth, imnet.heads, imnet.width, imnet.num_classes, imnet.attn_dropout) == (24, 16, 768, 1000, 0.1)
    assert digits.attn_dropout == 0.0 and digits.num_classes == 10
    assert preset_config("tiny", depth=3).depth == 3
