"""Compiled-backend (csrc/) contracts that tests/ops/test_compiled_ops.py left out, each found by a
mutation of the CPU kernels or of their torch.library registrations that survived that file: the
ops' own argument checks (the Python wrappers check first, so only a direct torch.ops call reaches
them), short_attention's edge lengths, the seed/offset that the noise backward regenerates from, and the
fake (meta) implementations for bf16 and strided inputs.
"""
import math

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from vqlcmd import ops
from vqlcmd.ops import _compiled

pytestmark = pytest.mark.skipif(_compiled.unavailable() is not None,
                                reason=f"compiled backend not built: {_compiled.unavailable()}")

def test_noise_sigma_grad_regenerates_the_ops_own_seed_and_offset(gen):
    """Drawn noise (no seed_tensor): d z / d sigma = sum of upstream * eps with the eps of this call's
    (seed, offset), which the backward regenerates from the saved int arguments."""
    tokens = torch.randint(0, 9, (3, 5), generator=gen)
    table = torch.randn(9, 11, generator=gen)
    alpha = torch.rand(3, generator=gen)
    sigma = (torch.rand(3, generator=gen) + 0.1).requires_grad_()
    z = torch.ops.vqlcmd.noise_embeddings(tokens, table, alpha, sigma, None, None, -1, 11, 4)
    upstream = torch.randn(z.shape, generator=gen)
    (g,) = torch.autograd.grad(z, sigma, upstream)
    eps = torch.ops.vqlcmd.noise_embeddings(tokens, table, torch.zeros(3), torch.ones(3), None, None, -1, 11, 4)
    assert not torch.equal(eps, torch.ops.vqlcmd.noise_embeddings(tokens, table, torch.zeros(3), torch.ones(3),
                                                                  None, None, -1, 4, 11))
    torch.testing.assert_close(g, (upstream * eps).sum((1, 2)), atol=1e-4, rtol=1e-5)


def test_ops_refuse_mis_sized_arguments_themselves(gen):
    """torch.ops.vqlcmd.* is public (torch.compile graphs call it with no Python check before it): a per-image
    coefficient, a noise tensor or an upstream gradient of the wrong size must raise, not be read past its end."""
    tokens = torch.randint(0, 5, (3, 4), generator=gen)
    table = torch.randn(5, 8, generator=gen)
    ones3 = torch.ones(3)
    with pytest.raises(RuntimeError, match=r"alpha must have shape \(3,\)"):
        torch.ops.vqlcmd.noise_embeddings(tokens, table, torch.ones(2), ones3, None, None, -1, 0, 0)
    with pytest.raises(RuntimeError, match=r"sigma must have shape \(3,\)"):
        torch.ops.vqlcmd.noise_embeddings(tokens, table, ones3, torch.ones(1, 3), None, None, -1, 0, 0)
    with pytest.raises(RuntimeError, match=r"noise must be \(B, M, D\)"):
        torch.ops.vqlcmd.noise_embeddings(tokens, table, ones3, ones3, torch.zeros(3, 4, 7), None, -1, 0, 0)
    with pytest.raises(RuntimeError, match=r"alpha must have shape \(3,\)"):
        torch.ops.vqlcmd.noise_embeddings_backward(torch.ones(3, 4, 8), tokens, None, -1, torch.ones(2), 5, False)
    with pytest.raises(RuntimeError, match=r"sigma_s must have shape \(3,\)"):
        torch.ops.vqlcmd.ddim_teacher_step(tokens, table, torch.zeros(3, 4, 8), ones3, ones3, ones3, torch.ones(2))
    t, s = torch.randn(4, 6, 9, generator=gen), torch.randn(4, 6, 9, generator=gen)
    with pytest.raises(RuntimeError, match=r"grad_kl must hold one value per row \(24\)"):
        torch.ops.vqlcmd.categorical_kl_backward(torch.ones(4, 5), t, s)


def test_short_attention_serves_the_longest_length_it_claims(gen):
    """SHORT_ATTENTION_MAX_LEN (= csrc's kMaxLen) tokens are served by the compiled kernel, per the Python side's
    claim; one more token is refused."""
    M = _compiled.SHORT_ATTENTION_MAX_LEN
    q, k, v = (torch.randn(1, 1, M, 4, generator=gen) for _ in range(3))
    assert ops.why_not("short_attention", "compiled", q, k, v) is None
    out = ops.short_attention(q, k, v, backend="compiled")
    p = torch.softmax(q.double() @ k.double().transpose(-2, -1) / 2.0, dim=-1)
    torch.testing.assert_close(out.double(), p @ v.double(), atol=1e-5, rtol=1e-5)


def test_short_attention_zero_head_dim_lse():
    """hd = 0: every score is 0, so each row's softmax is uniform and its log-sum-exp is log M (the op's second
    output, float32 (B, H, M))."""
    q = torch.empty(2, 3, 5, 0)
    out, lse = torch.ops.vqlcmd.short_attention(q, q, q)
    assert out.shape == (2, 3, 5, 0) and lse.dtype == torch.float32
    torch.testing.assert_close(lse, torch.full((2, 3, 5), math.log(5)))


def _fake_matches_real(op, *args):
    """The fake (meta) implementation's outputs have the real kernel's shapes, dtypes and strides."""
    real = op(*args)
    with FakeTensorMode() as mode:
        fake = op(*[mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args])
    real = real if isinstance(real, tuple) else (real,)
    fake = fake if isinstance(fake, tuple) else (fake,)
    assert len(real) == len(fake)
    for r, f in zip(real, fake):
        assert (f.shape, f.dtype, f.stride()) == (r.shape, r.dtype, r.stride()), (op, f, r)


def test_fake_implementations_match_the_kernels_for_bf16_and_strided_inputs(gen):
    """torch.compile traces the ops through their fakes; opcheck covers float32 contiguous inputs only, where a
    fake that forgot the float32 of the KL, the statistics or the table gradient coincides with the real op."""
    bf = torch.bfloat16
    t, s = torch.randn(3, 5, 9, generator=gen).to(bf), torch.randn(3, 5, 9, generator=gen).to(bf)
    _fake_matches_real(torch.ops.vqlcmd.categorical_kl.default, t, s, True)
    _fake_matches_real(torch.ops.vqlcmd.categorical_kl.default, t, s, False)
    tokens = torch.randint(0, 6, (3, 5), generator=gen)
    _fake_matches_real(torch.ops.vqlcmd.noise_embeddings_backward.default, torch.randn(3, 5, 8, generator=gen).to(bf),
                       tokens, None, -1, torch.rand(3, generator=gen), 6, False)
    h = torch.randn(2, 5, 16, generator=gen).to(bf)
    mod = torch.randn(2, 16, generator=gen).to(bf)
    _fake_matches_real(torch.ops.vqlcmd.ada_layer_norm.default, h, mod, mod, 1e-5)
    q = torch.randn(2, 3, 7, 4, generator=gen).to(bf)
    _fake_matches_real(torch.ops.vqlcmd.short_attention.default, q, q, q)
    x = torch.randn(6, 10, generator=gen).t()  # strided: the kernel returns a contiguous tensor
    _fake_matches_real(torch.ops.vqlcmd.gelu_tanh.default, x)


@pytest.mark.parametrize("emit", [False, True], ids=["recompute", "emit-grad"])
def test_kl_second_derivative_is_refused_in_both_modes(emit, monkeypatch):
    """With VQLCMD_KL_EMIT_GRAD=1 the backward scales the emitted gradient, a constant to autograd: a second
    derivative came out silently wrong (d2KL/dstudent2 dropped) where recompute mode raises. Emit mode refuses
    any create_graph=True backward (it keeps no student to raise from later)."""
    monkeypatch.setattr(_compiled, "EMIT_KL_GRAD", emit)
    g = torch.Generator().manual_seed(0)
    teacher = torch.randn(2, 8, generator=g)
    student = torch.randn(2, 8, generator=g, requires_grad=True)
    with pytest.raises(RuntimeError, match="vqlcmd::categorical_kl: the compiled backend has no second derivative"):
        kl = ops.categorical_kl(teacher, student, backend="compiled")
        (grad,) = torch.autograd.grad(kl.square().sum(), student, create_graph=True)
        torch.autograd.grad((grad * torch.arange(8.0)).sum(), student)
    # first order is the same in both modes
    kl = ops.categorical_kl(teacher, student, backend="compiled")
    (grad,) = torch.autograd.grad(kl.square().sum(), student)
    (ref,) = torch.autograd.grad(ops.categorical_kl(teacher, student, backend="reference").square().sum(), student)
    torch.testing.assert_close(grad, ref, rtol=1e-5, atol=1e-6)
