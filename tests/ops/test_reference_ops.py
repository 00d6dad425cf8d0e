"""Reference ops against independent computations (loops, float64 gradcheck, hand formulas)."""
import pytest
import torch

from vqlcmd import ops
from vqlcmd.ops import reference


def test_every_op_has_reference_backend():
    for op in ops.__all__:
        if op in ("BACKENDS", "available_backends", "why_not"):
            continue
        assert "reference" in ops.available_backends(op)


def test_unknown_backend_and_unavailable_backend_errors():
    x = torch.randn(3, 5)
    with pytest.raises(ValueError, match="backend must be"):
        ops.categorical_kl(x, x, backend="cuda")
    with pytest.raises(ValueError, match="unknown op"):
        ops.available_backends("nope")


def test_unavailable_backend_says_why(monkeypatch):
    from vqlcmd.ops import _dispatch

    fake = _dispatch._Impl(fn=None, unavailable=lambda: "not built here", unsupported=_dispatch._never,
                           priority=lambda d: 5)
    monkeypatch.setitem(_dispatch._REGISTRY["categorical_kl"], "compiled", fake)
    x = torch.randn(2, 4)
    with pytest.raises(RuntimeError, match="not built here"):
        ops.categorical_kl(x, x, backend="compiled")
    assert "compiled" not in ops.available_backends("categorical_kl")
    ops.categorical_kl(x, x)  # auto skips it


@pytest.mark.parametrize("checks_ids", [False, True])
def test_public_range_check_runs_unless_the_backend_checks_ids_itself(checks_ids, monkeypatch):
    # a backend registered with checks_ids gets the bad ids (and owes the IndexError); any other is
    # protected by vqlcmd.ops' own check before it is called
    from vqlcmd.ops import _dispatch

    calls = []
    fake = _dispatch._Impl(fn=lambda *a, **k: calls.append(a), unavailable=_dispatch._never,
                           unsupported=_dispatch._never, priority=lambda d: 0, checks_ids=checks_ids)
    monkeypatch.setitem(_dispatch._REGISTRY["ddim_teacher_step"], "reference", fake)
    tokens, table, z = torch.tensor([[0, 9]]), torch.randn(4, 3), torch.randn(1, 2, 3)
    one = torch.ones(1)
    if checks_ids:
        ops.ddim_teacher_step(tokens, table, z, one, one, one, one, backend="reference")
        assert len(calls) == 1
    else:
        with pytest.raises(IndexError, match="tokens holds id 9"):
            ops.ddim_teacher_step(tokens, table, z, one, one, one, one, backend="reference")
        assert calls == []


@pytest.mark.parametrize("value,on", [(None, True), ("1", True), ("YES", True), ("on", True), ("0", False),
                                      ("false", False), ("No", False), ("off", False)])
def test_id_check_switch_words(value, on, monkeypatch):
    from vqlcmd.ops import _checks

    if value is None:
        monkeypatch.delenv("VQLCMD_CHECK_IDS", raising=False)
    else:
        monkeypatch.setenv("VQLCMD_CHECK_IDS", value)
    assert _checks.id_checks_switch() is on


def test_id_check_switch_refuses_other_words(monkeypatch):
    from vqlcmd.ops import _checks

    monkeypatch.setenv("VQLCMD_CHECK_IDS", "sometimes")
    with pytest.raises(ValueError, match="VQLCMD_CHECK_IDS must be a yes/no value .* got 'sometimes'"):
        _checks.id_checks_switch()


# ---- softmax_embedding_average ----------------------------------------------------------------

def test_softmax_embedding_average_matches_loop(gen):
    logits = torch.randn(2, 3, 7, generator=gen)
    table = torch.randn(7, 5, generator=gen)
    out = ops.softmax_embedding_average(logits, table, backend="reference")
    assert out.shape == (2, 3, 5)
    for i in range(2):
        for j in range(3):
            p = torch.exp(logits[i, j]) / torch.exp(logits[i, j]).sum()
            torch.testing.assert_close(out[i, j], sum(p[k] * table[k] for k in range(7)))


def test_softmax_embedding_average_gradcheck(gen):
    logits = torch.randn(4, 6, generator=gen, dtype=torch.float64, requires_grad=True)
    table = torch.randn(6, 3, generator=gen, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: ops.softmax_embedding_average(a, b, backend="reference"),
                                    (logits, table))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_softmax_embedding_average_low_precision_inputs(dtype, gen):
    logits = torch.randn(5, 11, generator=gen)
    table = torch.randn(11, 4, generator=gen)
    out = ops.softmax_embedding_average(logits.to(dtype), table.to(dtype))
    assert out.dtype == dtype
    ref = torch.softmax(logits.to(dtype).float(), -1) @ table.to(dtype).float()
    torch.testing.assert_close(out.float(), ref, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("op", ["plain", "guided", "attention"])
def test_float32_math_under_an_enclosing_16bit_autocast(op, gen):
    """The reference promises float32 math, as the kernels give whatever the autocast state: under the
    16-bit pipeline's autocast its matmuls ran in bf16 (7e-3 off float64 against 1e-6)."""
    a, b = torch.randn(6, 64, 256, generator=gen), torch.randn(6, 64, 256, generator=gen)
    table = torch.randn(256, 32, generator=gen)
    if op == "plain":
        f, args = ops.softmax_embedding_average, (a, table)
    elif op == "guided":
        f, args = (lambda c, u, t, **kw: ops.guided_embedding_average(c, u, t, 1.5, **kw)), (a, b, table)
    else:
        f, args = ops.short_attention, (a[None], b[None], a[None].flip(-1))
    expected = f(*[x.double() for x in args], backend="reference")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = f(*args, backend="reference")
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=2e-5)


def test_softmax_embedding_average_shape_errors():
    with pytest.raises(ValueError, match="K=5"):
        ops.softmax_embedding_average(torch.randn(2, 5), torch.randn(6, 3))
    with pytest.raises(TypeError, match=r"must be a float tensor \(float32, bfloat16, float16 or float64\), got torch.int64"):
        ops.softmax_embedding_average(torch.randint(0, 3, (2, 5)), torch.randn(5, 3))
    with pytest.raises(TypeError, match="gelu_tanh takes a floating-point tensor, got list"):
        ops.gelu_tanh([1.0])


# ---- guided_embedding_average -----------------------------------------------------------------

def test_guided_average_zero_scale_equals_plain(gen):
    c, u = torch.randn(2, 3, 9, generator=gen), torch.randn(2, 3, 9, generator=gen)
    table = torch.randn(9, 4, generator=gen)
    torch.testing.assert_close(ops.guided_embedding_average(c, u, table, 0.0),
                               ops.softmax_embedding_average(c, table))


def test_guided_average_keeps_classes_ruled_out_by_both_models_out(gen):
    # a class -inf in both logits: (1+ω)(-inf) − ω(-inf) made the whole row NaN, at ω = 0 too
    c, u = torch.randn(2, 9, generator=gen), torch.randn(2, 9, generator=gen)
    c[:, 3] = u[:, 3] = float("-inf")
    c[1, 5] = float("-inf")  # ruled out by the conditional model only
    table = torch.randn(9, 4, generator=gen)
    torch.testing.assert_close(ops.guided_embedding_average(c, u, table, 0.0), ops.softmax_embedding_average(c, table))
    u0 = u.clone()
    u0[0, 1] = float("-inf")  # ruled out by the unconditional model only: ω = 0 is still cond's distribution
    assert torch.equal(ops.guided_embedding_average(c, u0, table, 0.0), ops.softmax_embedding_average(c, table))
    assert torch.equal(reference.guided_log_probs(c, u0, 0.0), torch.log_softmax(c, -1))
    keep = [k for k in range(9) if k != 3]
    for w in (1.0, 3.0):
        expected = ops.guided_embedding_average(c[:, keep], u[:, keep], table[keep], w)
        torch.testing.assert_close(ops.guided_embedding_average(c, u, table, w), expected)
        probs = reference.guided_log_probs(c, u, w).exp()
        assert torch.isfinite(probs).all() and (probs[:, 3] == 0).all() and probs[1, 5] == 0


def test_guided_average_matches_formula(gen):
    c, u = torch.randn(4, 9, generator=gen), torch.randn(4, 9, generator=gen)
    table = torch.randn(9, 4, generator=gen)
    w = 1.5
    pc, pu = torch.softmax(c, -1), torch.softmax(u, -1)
    unnorm = pc ** (1 + w) / pu ** w  # P(.|y)^(1+ω) / P(.|∅)^ω
    expected = (unnorm / unnorm.sum(-1, keepdim=True)) @ table
    torch.testing.assert_close(ops.guided_embedding_average(c, u, table, w), expected, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=">= 0"):
        ops.guided_embedding_average(c, u, table, -1.0)
    for bad in (float("nan"), float("inf")):  # gave an all-NaN average
        with pytest.raises(ValueError, match="guidance_scale must be a finite number >= 0"):
            ops.guided_embedding_average(c, u, table, bad)
    with pytest.raises(TypeError, match="guidance_scale must be a real number, got Tensor"):
        ops.guided_embedding_average(c, u, table, torch.tensor([1.0, 2.0]))
    import numpy as np

    for same in (np.float32(1.5), torch.tensor(1.5)):  # accepted before the checks were added
        torch.testing.assert_close(ops.guided_embedding_average(c, u, table, same), expected, rtol=1e-5, atol=1e-5)


# ---- categorical_kl ---------------------------------------------------------------------------

def test_kl_nonnegative_zero_for_equal_and_matches_definition(gen):
    a, b = torch.randn(6, 13, generator=gen) * 3, torch.randn(6, 13, generator=gen) * 3
    kl = ops.categorical_kl(a, b)
    assert kl.shape == (6,) and kl.dtype == torch.float32
    assert (kl >= 0).all()
    torch.testing.assert_close(ops.categorical_kl(a, a), torch.zeros(6), atol=1e-6, rtol=0)
    p, q = torch.softmax(a.double(), -1), torch.softmax(b.double(), -1)
    torch.testing.assert_close(kl.double(), (p * (p / q).log()).sum(-1), rtol=1e-5, atol=1e-6)


def test_kl_gradient_to_student_only_and_gradcheck(gen):
    a = torch.randn(3, 2, 5, generator=gen, dtype=torch.float64, requires_grad=True)
    b = torch.randn(3, 2, 5, generator=gen, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda s: ops.categorical_kl(a, s, backend="reference"), (b,))
    ops.categorical_kl(a, b).sum().backward()
    assert a.grad is None and b.grad is not None
    # d KL / d student = softmax(student) - softmax(teacher)
    torch.testing.assert_close(b.grad, torch.softmax(b, -1) - torch.softmax(a, -1))


def test_kl_extreme_logits_finite():
    a = torch.tensor([[1e4, -1e4, 0.0], [-1e4, -1e4, -1e4]])
    b = torch.tensor([[0.0, 1e4, -1e4], [1e4, 0.0, -1e4]])
    kl = ops.categorical_kl(a, b)
    assert torch.isfinite(kl).all()
    torch.testing.assert_close(kl, torch.tensor([1e4, 1e4 - torch.log(torch.tensor(3.0)).item()]), rtol=1e-6, atol=0)


def test_kl_shape_mismatch():
    with pytest.raises(ValueError, match="one shape"):
        ops.categorical_kl(torch.randn(2, 5), torch.randn(2, 6))


# ---- noise_embeddings -------------------------------------------------------------------------

def _noise_inputs(gen, B=3, M=5, V=9, D=4):
    tokens = torch.randint(0, V - 1, (B, M), generator=gen)
    table = torch.randn(V, D, generator=gen)
    alpha, sigma = torch.rand(B, generator=gen), torch.rand(B, generator=gen)
    noise = torch.randn(B, M, D, generator=gen)
    drop = torch.rand(B, M, generator=gen) < 0.4
    return tokens, table, alpha, sigma, noise, drop


def test_noise_embeddings_matches_loop(gen):
    tokens, table, alpha, sigma, noise, drop = _noise_inputs(gen)
    z = ops.noise_embeddings(tokens, table, alpha, sigma, noise=noise, drop_mask=drop, mask_index=8)
    B, M = tokens.shape
    for b in range(B):
        for i in range(M):
            row = 8 if drop[b, i] else tokens[b, i]
            torch.testing.assert_close(z[b, i], alpha[b] * table[row] + sigma[b] * noise[b, i])


def test_noise_embeddings_generator_reproducible_and_standard_normal(gen):
    tokens, table, alpha, sigma, _, _ = _noise_inputs(gen, B=4, M=64, D=32)
    zero = torch.zeros(4)
    z1 = ops.noise_embeddings(tokens, table, zero, torch.ones(4), generator=torch.Generator().manual_seed(3))
    z2 = ops.noise_embeddings(tokens, table, zero, torch.ones(4), generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(z1, z2)
    assert abs(z1.mean()) < 0.05 and abs(z1.var() - 1) < 0.05


def test_noise_embeddings_gradcheck_in_table(gen):
    tokens, table, alpha, sigma, noise, drop = _noise_inputs(gen)
    table = table.double().requires_grad_()
    f = lambda tb: ops.noise_embeddings(tokens, tb, alpha.double(), sigma.double(), noise=noise.double(),
                                        drop_mask=drop, mask_index=8, backend="reference")
    assert torch.autograd.gradcheck(f, (table,))


def test_noise_embeddings_bad_inputs(gen):
    tokens, table, alpha, sigma, noise, drop = _noise_inputs(gen)
    with pytest.raises(IndexError, match="outside the table"):
        ops.noise_embeddings(tokens + 100, table, alpha, sigma, noise=noise)
    with pytest.raises(ValueError, match="mask_index"):
        ops.noise_embeddings(tokens, table, alpha, sigma, noise=noise, drop_mask=drop)
    with pytest.raises(ValueError, match="alpha must have shape"):
        ops.noise_embeddings(tokens, table, alpha[:2], sigma, noise=noise)
    with pytest.raises(TypeError, match="int64"):
        ops.noise_embeddings(tokens.float(), table, alpha, sigma, noise=noise)
    with pytest.raises(ValueError, match="noise must have shape"):
        ops.noise_embeddings(tokens, table, alpha, sigma, noise=noise[:, :2])
    with pytest.raises(TypeError, match=r"mask_index must be an integer \(a table row\), got 2.7"):
        ops.noise_embeddings(tokens, table, alpha, sigma, noise=noise, drop_mask=drop, mask_index=2.7)
    import numpy as np

    a = ops.noise_embeddings(tokens, table, alpha, sigma, noise=noise, drop_mask=drop, mask_index=np.int64(2))
    torch.testing.assert_close(a, ops.noise_embeddings(tokens, table, alpha, sigma, noise=noise, drop_mask=drop,
                                                       mask_index=2))


# ---- ddim_teacher_step ------------------------------------------------------------------------

def test_ddim_teacher_step_formula_and_no_grad(gen):
    tokens, table, alpha_t, sigma_t, z_t, _ = _noise_inputs(gen)
    alpha_s, sigma_s = torch.rand(3, generator=gen), torch.rand(3, generator=gen) + 0.1
    table.requires_grad_()
    z_s = ops.ddim_teacher_step(tokens, table, z_t, alpha_t, sigma_t, alpha_s, sigma_s)
    assert not z_s.requires_grad
    e = table.detach()[tokens]
    r = (sigma_s / sigma_t)[:, None, None]
    expected = alpha_s[:, None, None] * e + r * (z_t - alpha_t[:, None, None] * e)
    torch.testing.assert_close(z_s, expected)


def test_ddim_teacher_step_on_clean_trajectory_is_exact(gen):
    """With z_t = α_t e + σ_t ε, one DDIM step lands on α_s e + σ_s ε (the same PF-ODE trajectory)."""
    tokens, table, alpha_t, _, eps, _ = _noise_inputs(gen)
    sigma_t = (1 - alpha_t**2).sqrt()
    alpha_s = torch.rand(3, generator=gen)
    sigma_s = (1 - alpha_s**2).sqrt()
    e = table[tokens]
    z_t = alpha_t[:, None, None] * e + sigma_t[:, None, None] * eps
    z_s = ops.ddim_teacher_step(tokens, table, z_t, alpha_t, sigma_t, alpha_s, sigma_s)
    torch.testing.assert_close(z_s, alpha_s[:, None, None] * e + sigma_s[:, None, None] * eps, rtol=1e-4,
                               atol=1e-5)


def test_ddim_teacher_step_gradcheck_free_and_float64(gen):
    tokens, table, a, s, z, _ = _noise_inputs(gen)
    out = reference.ddim_teacher_step(tokens, table.double(), z.double(), a, s, a, s)
    assert out.dtype == torch.float64


def test_ddim_shape_error(gen):
    tokens, table, a, s, z, _ = _noise_inputs(gen)
    with pytest.raises(ValueError, match="z_t must have shape"):
        ops.ddim_teacher_step(tokens, table, z[:, :, :2], a, s, a, s)


def test_noise_embeddings_sums_a_bf16_tables_gradient_in_float32(gen):
    """The reference, float32 math by contract, summed a bf16 table's gradient in bf16: 512 uses of a row
    were about 2-3% off the float64 sum, against the 0.1-0.3% that rounding the sum once to bf16 costs."""
    B, M, V, D = 8, 256, 4, 8
    tokens = torch.randint(0, V, (B, M), generator=gen)
    table = torch.randn(V, D, generator=gen).bfloat16().requires_grad_()
    alpha, sigma = torch.rand(B, generator=gen), torch.rand(B, generator=gen)
    grad = torch.randn(B, M, D, generator=gen).bfloat16()
    z = ops.noise_embeddings(tokens, table, alpha, sigma, noise=torch.zeros(B, M, D), backend="reference")
    z.backward(grad)
    truth = torch.zeros(V, D, dtype=torch.float64).index_add_(
        0, tokens.reshape(-1), (alpha[:, None, None].double() * grad.double()).reshape(-1, D))
    err = (table.grad.double() - truth).norm() / truth.norm()
    assert err < 3e-3, err


def test_guided_average_errors_name_its_own_arguments():
    """They named teacher_logits / student_logits, the KL's arguments, whose check it shares."""
    table = torch.randn(5, 3)
    with pytest.raises(ValueError, match=r"cond_logits \(2, 5\) and uncond_logits \(3, 5\) must have one shape"):
        ops.guided_embedding_average(torch.randn(2, 5), torch.randn(3, 5), table, 1.0)
    with pytest.raises(TypeError, match="uncond_logits"):
        ops.guided_embedding_average(torch.randn(2, 5), torch.zeros(2, 5, dtype=torch.long), table, 1.0)


def test_the_reference_philox_stream_is_philox4x32_10():
    """reference.philox_words against Random123's known-answer vector (counter 0, key 0: kat_vectors,
    "philox4x32 10"), and element n is word n % 4 of block n / 4 for a negative 64-bit key too (the key's two
    words taken from its bits), as csrc/common/philox.h's philox_block gives them (test_compiled_ops checks
    the kernels' masks against this stream)."""
    from vqlcmd.ops import reference

    words = reference.philox_words(torch.tensor([0]), 4)
    assert [hex(w) for w in words.tolist()] == ["0x6627e8d5", "0xe169c58d", "0xbc57ac4c", "0x9b00dbd8"]
    stream = reference.philox_words(torch.tensor([-5]), 11)
    assert stream.min() >= 0 and stream.max() < 2 ** 32
    assert torch.equal(stream[:7], reference.philox_words(torch.tensor([-5]), 7))
