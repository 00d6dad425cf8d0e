"""Contract points of vqlcmd.ops that no other test pinned (found by mutation testing): each test
names the documented behaviour it holds and checks it against an independent computation."""
import math

import pytest
import torch
import torch.nn.functional as F

from vqlcmd import ops
from vqlcmd.ops import _compiled, reference

compiled = pytest.mark.skipif(_compiled.unavailable() is not None, reason="compiled backend not built")


# ---- reference: float64 math whenever a float64 input is given --------------------------------

def test_a_float64_input_gets_float64_math(gen):
    # reference.math_dtype: "float64 stays float64" -- also beside a float32 operand (the result is float64,
    # the promoted dtype, so its digits must be float64's, not float32's cast up)
    logits = torch.randn(6, 37, generator=gen, dtype=torch.float64) * 4
    table = torch.randn(37, 5, generator=gen)
    out = ops.softmax_embedding_average(logits, table, backend="reference")
    assert out.dtype == torch.float64
    expected = torch.softmax(logits, -1) @ table.double()
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    kl = ops.categorical_kl(logits, logits.float().roll(1, -1), backend="reference")
    p, q = torch.softmax(logits, -1), torch.softmax(logits.float().double().roll(1, -1), -1)
    assert kl.dtype == torch.float64
    torch.testing.assert_close(kl, (p * (p / q).log()).sum(-1), rtol=1e-12, atol=1e-12)


# ---- guided: a class only the unconditional model rules out -----------------------------------

def test_guided_row_is_nan_where_only_uncond_rules_a_class_out(gen):
    # vqlcmd.ops.guided_embedding_average: "one that only uncond rules out has an infinite guided weight,
    # and its row is NaN for ω > 0"; a class cond rules out stays out (that row stays finite)
    c, u = torch.randn(3, 9, generator=gen), torch.randn(3, 9, generator=gen)
    table = torch.randn(9, 4, generator=gen)
    u[0, 4] = float("-inf")  # uncond only
    c[1, 2] = float("-inf")  # cond only
    out = ops.guided_embedding_average(c, u, table, 1.5, backend="reference")
    assert out[0].isnan().all()
    keep = [k for k in range(9) if k != 2]
    w = 1.5
    lc, lu = torch.log_softmax(c[1, keep].double(), -1), torch.log_softmax(u[1, keep].double(), -1)
    expected = torch.softmax((1 + w) * lc - w * lu, -1) @ table[keep].double()
    torch.testing.assert_close(out[1].double(), expected, rtol=1e-5, atol=1e-6)
    assert torch.isfinite(out[2]).all()


# ---- noise_embeddings: result dtype, float64 noise, ids and mask_index ------------------------

def _backends(op):
    return [b for b in ("reference", "compiled") if b in ops.available_backends(op)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_noise_embeddings_result_has_the_tables_dtype(dtype, gen):
    # docstring: "the result has ``table``'s dtype" (float32 alpha, sigma and noise beside a 16-bit table)
    tokens = torch.randint(0, 7, (2, 5), generator=gen)
    table = torch.randn(7, 4, generator=gen).to(dtype)
    alpha, sigma, noise = torch.rand(2, generator=gen), torch.rand(2, generator=gen), torch.randn(2, 5, 4, generator=gen)
    expected = alpha[:, None, None] * table.float()[tokens] + sigma[:, None, None] * noise
    for backend in _backends("noise_embeddings"):
        z = ops.noise_embeddings(tokens, table, alpha, sigma, noise=noise, backend=backend)
        assert z.dtype == dtype, backend
        torch.testing.assert_close(z.float(), expected, rtol=1e-2, atol=1e-2)


@compiled
def test_noise_embeddings_takes_float64_noise_on_every_backend(gen):
    # check_noise_inputs accepts any float noise; the kernels take 16/32-bit only, so the compiled wrapper
    # casts it (auto picks compiled here: it resolves on the float32 table)
    tokens = torch.randint(0, 7, (2, 5), generator=gen)
    table = torch.randn(7, 4, generator=gen)
    alpha, sigma = torch.rand(2, generator=gen), torch.rand(2, generator=gen)
    noise = torch.randn(2, 5, 4, generator=gen, dtype=torch.float64)
    expected = (alpha[:, None, None] * table[tokens] + sigma[:, None, None] * noise.float())
    for backend in ("compiled", "auto"):
        z = ops.noise_embeddings(tokens, table, alpha, sigma, noise=noise, backend=backend)
        torch.testing.assert_close(z, expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("op", ["noise_embeddings", "ddim_teacher_step"])
def test_a_negative_id_is_a_named_index_error(op, gen):
    # check_token_range: "an IndexError naming an id outside [0, num_rows)" -- below the range too (the
    # reference's own indexing would only say "index out of range in self")
    table = torch.randn(5, 4, generator=gen)
    tokens = torch.tensor([[0, 3, -1, 2]])
    one = torch.ones(1)
    with pytest.raises(IndexError, match=r"tokens holds id -1, outside the table's rows \[0, 5\)"):
        if op == "noise_embeddings":
            ops.noise_embeddings(tokens, table, one, one, noise=torch.zeros(1, 4, 4), backend="reference")
        else:
            ops.ddim_teacher_step(tokens, table, torch.zeros(1, 4, 4), one, one, one, one, backend="reference")
    tokens = torch.tensor([[-2, 7]])  # both ends out: the low one is named
    with pytest.raises(IndexError, match="tokens holds id -2"):
        ops.noise_embeddings(tokens, table, one, one, noise=torch.zeros(1, 2, 4), backend="reference")


def test_mask_index_must_be_a_row_of_the_table(gen):
    # check_noise_inputs: mask_index an integer in [0, V); True is not row 1
    tokens = torch.randint(0, 5, (1, 3), generator=gen)
    table, one, noise = torch.randn(5, 4, generator=gen), torch.ones(1), torch.zeros(1, 3, 4)
    drop = torch.tensor([[True, False, True]])
    for backend in _backends("noise_embeddings"):
        with pytest.raises(IndexError, match=r"mask_index 5 outside the table's rows \[0, 5\)"):
            ops.noise_embeddings(tokens, table, one, one, noise=noise, drop_mask=drop, mask_index=5, backend=backend)
        with pytest.raises(TypeError, match="mask_index must be an integer"):
            ops.noise_embeddings(tokens, table, one, one, noise=noise, drop_mask=drop, mask_index=True, backend=backend)
    z = ops.noise_embeddings(tokens, table, one, one, noise=noise, drop_mask=drop, mask_index=4, backend="reference")
    torch.testing.assert_close(z[0, 0], table[4])


def test_inputs_on_two_devices_are_refused_by_name():
    # check_same_device: "all inputs must be on one device", listing each (a meta tensor stands in for a GPU)
    with pytest.raises(ValueError, match="one device, got logits on cpu, table on meta"):
        ops.softmax_embedding_average(torch.randn(2, 5), torch.randn(5, 3, device="meta"))
    tokens, one = torch.zeros(1, 2, dtype=torch.long), torch.ones(1)
    with pytest.raises(ValueError, match="sigma on meta"):
        ops.noise_embeddings(tokens, torch.randn(3, 4), one, torch.ones(1, device="meta"), noise=torch.zeros(1, 2, 4))


# ---- ada_layer_norm: the default eps ----------------------------------------------------------

def test_ada_layer_norm_default_eps_is_layernorms(gen):
    # the docstring: LayerNorm over W as F.layer_norm(h, (W,), eps=eps), eps=1e-5 by default (nn.LayerNorm's);
    # rows of small spread (variance ~1e-6) show the eps
    h = torch.randn(2, 3, 16, generator=gen) * 1e-3
    scale, shift = torch.randn(2, 16, generator=gen) * 0.1, torch.randn(2, 16, generator=gen)
    h64 = h.double()
    n = (h64 - h64.mean(-1, keepdim=True)) / torch.sqrt(h64.var(-1, unbiased=False, keepdim=True) + 1e-5)
    expected = (1 + scale.double()[:, None]) * n + shift.double()[:, None]
    for backend in ops.available_backends("ada_layer_norm"):
        if backend == "triton":
            continue
        torch.testing.assert_close(ops.ada_layer_norm(h, scale, shift, backend=backend).double(), expected,
                                   rtol=1e-4, atol=1e-5)
    assert F.layer_norm(h, (16,)).sub(n.float()).abs().max() < 1e-4  # the same default as torch's


# ---- compiled backend: the Python side --------------------------------------------------------

@compiled
def test_compiled_alpha_gradient_reads_the_mask_row_where_dropped(gen):
    # z = alpha * table[mask_index if dropped else token] + ...: d z / d alpha reads the [mask] row where dropped
    tokens = torch.randint(0, 8, (3, 6), generator=gen)
    table = torch.randn(9, 5, generator=gen)
    drop = torch.rand(3, 6, generator=gen) < 0.5
    alpha, sigma = torch.rand(3, generator=gen).requires_grad_(), torch.rand(3, generator=gen)
    noise, upstream = torch.randn(3, 6, 5, generator=gen), torch.randn(3, 6, 5, generator=gen)
    z = ops.noise_embeddings(tokens, table, alpha, sigma, noise=noise, drop_mask=drop, mask_index=8,
                             backend="compiled")
    (g,) = torch.autograd.grad(z, alpha, upstream)
    rows = torch.where(drop, 8, tokens)
    torch.testing.assert_close(g, (upstream * table[rows]).sum((1, 2)), rtol=1e-5, atol=1e-5)


@compiled
def test_compiled_kl_emits_its_gradient_only_when_one_is_wanted(gen, monkeypatch):
    # VQLCMD_KL_EMIT_GRAD: the forward writes d KL / d student only for a student that needs a gradient, with
    # grad mode on: else the (N, K) buffer would be written for nothing (sampling, evaluation)
    seen = []
    op = torch.ops.vqlcmd.categorical_kl

    def spy(teacher, student, emit):
        seen.append(emit)
        return op(teacher, student, emit)

    monkeypatch.setattr(torch.ops.vqlcmd, "categorical_kl", spy)
    monkeypatch.setattr(_compiled, "EMIT_KL_GRAD", True)
    t, s = torch.randn(4, 7, generator=gen), torch.randn(4, 7, generator=gen)
    ops.categorical_kl(t, s, backend="compiled")
    with torch.no_grad():
        ops.categorical_kl(t, s.requires_grad_(), backend="compiled")
    ops.categorical_kl(t, s, backend="compiled")
    assert seen == [False, False, True]


@compiled
def test_compiled_noise_backward_is_told_about_deterministic_mode(gen, monkeypatch):
    # the CUDA backward sums a table row's gradients in a fixed order only when told (its `deterministic`
    # argument, from torch.use_deterministic_algorithms); the CPU kernel is fixed-order anyway, so the
    # wiring is what can be checked here
    seen = []
    op = torch.ops.vqlcmd.noise_embeddings_backward

    def spy(*args):
        seen.append(args[-1])
        return op(*args)

    monkeypatch.setattr(torch.ops.vqlcmd, "noise_embeddings_backward", spy)
    tokens, one = torch.randint(0, 4, (2, 3), generator=gen), torch.ones(2)
    for mode in (False, True):
        table = torch.randn(4, 5, generator=gen, requires_grad=True)
        torch.use_deterministic_algorithms(mode)
        try:
            ops.noise_embeddings(tokens, table, one, one, noise=torch.zeros(2, 3, 5), backend="compiled").sum().backward()
        finally:
            torch.use_deterministic_algorithms(False)
        torch.testing.assert_close(table.grad, torch.zeros(4, 5).index_add_(0, tokens.reshape(-1), torch.ones(6, 5)))
    assert seen == [False, True]
