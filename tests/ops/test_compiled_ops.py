"""The compiled backend (csrc/, torch.ops.vqlcmd.*) on CPU against the reference backend.

Liger-Kernel style: odd sizes, fp32 tight and bf16/fp16 with a tolerance per dtype,
upstream gradients that are not all ones; plus opcheck, torch.compile and the
Philox noise stream. GPU checks are in test_compiled_gpu.py.
"""
import functools
import math
import subprocess
import sys

import pytest
import torch

from vqlcmd import ops
from vqlcmd.ops import _compiled, reference

pytestmark = pytest.mark.skipif(_compiled.unavailable() is not None,
                                reason=f"compiled backend not built: {_compiled.unavailable()}")

# bf16 keeps 8 mantissa bits, fp16 11: the outputs are rounded to the input dtype.
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
       torch.float16: dict(atol=2e-3, rtol=2e-3)}
DTYPES = list(TOL)


def close(actual, expected, dtype, scale=1.0):
    tol = {k: v * scale for k, v in TOL[dtype].items()}
    torch.testing.assert_close(actual.float(), expected.float(), **tol)


def assert_backends_match_float64(op, leaves, upstream, out64, grads64, dtype, grad_scales):
    """``op``'s output and the gradients of every input (non-unit ``upstream``), on the compiled and the
    reference backend, against float64 results: each in the inputs' shape and dtype, the output within 4x
    the dtype's tolerance and each gradient within its ``grad_scales`` multiple of it."""
    for backend in ("compiled", "reference"):
        inputs = [x.clone().requires_grad_() for x in leaves]
        out = op(*inputs, backend=backend)
        grads = torch.autograd.grad(out, inputs, upstream)
        assert out.shape == out64.shape and out.dtype == dtype
        assert all(g.shape == x.shape and g.dtype == dtype for g, x in zip(grads, leaves))
        close(out, out64, dtype, scale=4.0)
        for g, r, s in zip(grads, grads64, grad_scales, strict=True):
            close(g, r, dtype, scale=s)


def assert_compiled_graph_matches_reference(op, tensors, value_tol=None, grad_tol=None):
    """``2 * op(*tensors)`` under torch.compile (fullgraph, aot_eager: the fake and autograd
    registrations) gives the reference backend's values and input gradients."""
    fn = torch.compile(lambda *xs: op(*xs) * 2, fullgraph=True, backend="aot_eager")
    inputs = [x.clone().requires_grad_() for x in tensors]
    y = fn(*inputs)
    y.sum().backward()
    ref_inputs = [x.clone().requires_grad_() for x in tensors]
    y_ref = 2 * op(*ref_inputs, backend="reference")
    y_ref.sum().backward()
    torch.testing.assert_close(y, y_ref, **(value_tol or {}))
    for a, b in zip(inputs, ref_inputs):
        torch.testing.assert_close(a.grad, b.grad, **(grad_tol or {}))


def test_backend_is_registered_and_reports_build():
    for op in ("noise_embeddings", "ddim_teacher_step", "categorical_kl"):
        assert "compiled" in ops.available_backends(op)
    info = _compiled.build_info()
    assert {"with_cuda", "cuda_version", "cuda_arch_list", "compiler", "cpu_vector", "openmp"} <= set(info)
    assert "compiled backend" in _compiled.describe()
    if "OpenMP" in torch.__config__.parallel_info():
        # at::parallel_for is an inline OpenMP pragma: a build without -fopenmp runs every CPU kernel on
        # one thread, silently
        assert info["openmp"], "vqlcmd._C was compiled without OpenMP; its CPU kernels use one thread"


def test_auto_prefers_compiled_on_cpu_and_float64_falls_back():
    x = torch.randn(4, 9)
    assert ops._dispatch.resolve("categorical_kl", "auto", x, x) is _compiled.categorical_kl
    x64 = x.double()
    assert ops._dispatch.resolve("categorical_kl", "auto", x64, x64) is not _compiled.categorical_kl
    with pytest.raises(RuntimeError, match="float64"):
        ops.categorical_kl(x64, x64, backend="compiled")


# ---- categorical_kl --------------------------------------------------------------------------

def _kl_both(teacher, student, upstream, emit, monkeypatch):
    monkeypatch.setattr(_compiled, "EMIT_KL_GRAD", emit)
    out = {}
    for backend in ("compiled", "reference"):
        s = student.detach().clone().requires_grad_()
        kl = ops.categorical_kl(teacher, s, backend=backend)
        (kl * upstream).sum().backward()
        out[backend] = (kl, s.grad)
    return out


@pytest.mark.parametrize("emit", [True, False], ids=["emit-grad", "recompute"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("K", [1024, 1000, 7, 1])
def test_categorical_kl_matches_reference(K, dtype, emit, gen, monkeypatch):
    teacher = (3 * torch.randn(2, 13, K, generator=gen)).to(dtype)
    student = (3 * torch.randn(2, 13, K, generator=gen)).to(dtype)
    upstream = torch.rand(2, 13, generator=gen) + 0.5
    out = _kl_both(teacher, student, upstream, emit, monkeypatch)
    (kl, g), (kl_ref, g_ref) = out["compiled"], out["reference"]
    assert kl.dtype == torch.float32 and g.dtype == dtype
    torch.testing.assert_close(kl, kl_ref, atol=2e-5 * max(1, math.log(K)), rtol=1e-4)  # float32 math either way
    close(g, g_ref, dtype)


def test_categorical_kl_extreme_logits(gen, monkeypatch):
    K = 1000
    teacher = torch.where(torch.rand(6, K, generator=gen) < 0.5, -1e4, 1e4) * torch.rand(6, K, generator=gen)
    student = 1e4 * torch.randn(6, K, generator=gen).clamp(-1, 1)
    student[0] = teacher[0]  # KL = 0 exactly in exact arithmetic
    out = _kl_both(teacher, student, torch.rand(6, generator=gen), True, monkeypatch)
    (kl, g), (kl_ref, g_ref) = out["compiled"], out["reference"]
    assert torch.isfinite(kl).all() and torch.isfinite(g).all()
    torch.testing.assert_close(kl, kl_ref, rtol=1e-5, atol=1e-2)  # 1e4-sized terms: absolute error of ~ulp(1e4)
    torch.testing.assert_close(g, g_ref, rtol=1e-5, atol=1e-6)
    assert abs(kl[0].item()) < 1e-2


@pytest.mark.parametrize("K", [7, 19, 1000])
def test_categorical_kl_infinite_logits(K, gen):
    """p_k = 0 adds 0 (also where log q_k = -inf), p_k > 0 with q_k = 0 gives +inf, a teacher row of -inf gives 0
    (the CPU kernel's vector part gave NaN for a row whose first K - K % 8 logits were all -inf)."""
    teacher = torch.randn(5, K, generator=gen)
    student = torch.randn(5, K, generator=gen)
    teacher[1, ::2] = -float("inf")
    student[1, ::2] = -float("inf")
    teacher[2] = -float("inf")
    student[3, teacher[3].argmax()] = -float("inf")
    teacher[4, :K - max(K % 8, 1)] = -float("inf")  # finite: the tail that fills no vector, or the last logit
    kl = ops.categorical_kl(teacher, student, backend="compiled")
    ref = ops.categorical_kl(teacher.double(), student.double(), backend="reference").float()
    torch.testing.assert_close(kl, ref, atol=1e-4, rtol=1e-4)
    assert kl[2] == 0 and kl[3] == float("inf")
    rows = [0, 1, 4]  # the rows with a finite gradient
    grad = torch.ops.vqlcmd.categorical_kl(teacher, student, True)[1][rows]
    s = student[rows].clone().requires_grad_()
    ops.categorical_kl(teacher[rows], s, backend="reference").sum().backward()
    torch.testing.assert_close(grad, s.grad, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("K", [4, 19, 1000])
@pytest.mark.parametrize("backend", ["reference", "compiled"])
def test_categorical_kl_of_a_nan_or_inf_teacher_is_nan(K, backend, gen):
    """A NaN or +inf teacher logit makes p NaN; both backends dropped such terms as if p were 0, and a row
    scored KL 0 (finite) while its gradient was NaN, which the engine's non-finite check did not see."""
    teacher, student = torch.randn(3, K, generator=gen), torch.randn(3, K, generator=gen)
    teacher[0, K // 2], teacher[1, 0] = float("nan"), float("inf")
    kl = ops.categorical_kl(teacher, student, backend=backend)
    assert kl[:2].isnan().all() and torch.isfinite(kl[2])


def test_categorical_kl_of_zero_classes_is_zero():
    # K = 0 rows are empty sums; the kernels left their output uninitialised
    for shape in ((4, 0), (3, 100, 0)):
        t, s = torch.randn(shape), torch.randn(shape, requires_grad=True)
        kl = ops.categorical_kl(t, s, backend="compiled")
        assert torch.equal(kl, torch.zeros(shape[:-1]))
        kl.sum().backward()
        assert s.grad.shape == shape


def test_categorical_kl_mixed_dtypes_and_noncontiguous(gen):
    teacher = torch.randn(37, 24, generator=gen)[:, ::2]  # fp32 EMA teacher, strided
    student = torch.randn(12, 37, generator=gen).to(torch.bfloat16).t().requires_grad_()
    kl = ops.categorical_kl(teacher, student, backend="compiled")
    kl_ref = ops.categorical_kl(teacher, student, backend="reference")
    torch.testing.assert_close(kl, kl_ref, atol=1e-5, rtol=1e-5)
    up = torch.randn(37, generator=gen)
    g, = torch.autograd.grad((kl * up).sum(), student)
    g_ref, = torch.autograd.grad((kl_ref * up).sum(), student)
    close(g, g_ref, torch.bfloat16)


def test_categorical_kl_empty_batch_and_no_grad():
    t = torch.randn(0, 5, 11)
    s = torch.randn(0, 5, 11, requires_grad=True)
    kl = ops.categorical_kl(t, s, backend="compiled")
    assert kl.shape == (0, 5)
    kl.sum().backward()
    assert s.grad.shape == s.shape
    with torch.no_grad():  # no gradient is emitted when none is wanted
        _, grad = torch.ops.vqlcmd.categorical_kl(t, s, False)
    assert grad.numel() == 0


# ---- noise_embeddings ------------------------------------------------------------------------

def _noise_inputs(gen, B=3, M=17, V=21, D=13, dtype=torch.float32):
    tokens = torch.randint(0, V - 1, (B, M), generator=gen)
    table = torch.randn(V, D, generator=gen).to(dtype)
    alpha, sigma = torch.rand(B, generator=gen), torch.rand(B, generator=gen)
    drop = torch.rand(B, M, generator=gen) < 0.3
    return tokens, table, alpha, sigma, drop


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("D", [256, 13, 1])
def test_noise_embeddings_matches_reference(D, dtype, gen):
    tokens, table, alpha, sigma, drop = _noise_inputs(gen, D=D, dtype=dtype)
    noise = torch.randn(*tokens.shape, D, generator=gen).to(dtype)
    upstream = torch.randn(*tokens.shape, D, generator=gen).to(dtype)
    res = {}
    for backend in ("compiled", "reference"):
        tab = table.clone().requires_grad_()
        z = ops.noise_embeddings(tokens, tab, alpha, sigma, noise=noise, drop_mask=drop, mask_index=20,
                                 backend=backend)
        z.backward(upstream)
        res[backend] = (z, tab.grad)
    (z, g), (z_ref, g_ref) = res["compiled"], res["reference"]
    assert z.dtype == dtype and g.dtype == dtype
    close(z, z_ref, dtype)
    close(g, g_ref, dtype, scale=4)  # a row's gradient sums up to B*M terms


def test_noise_embeddings_noncontiguous_mixed_noise_dtype_int32_tokens(gen):
    tokens, table, alpha, sigma, drop = _noise_inputs(gen)
    tokens = tokens.t().contiguous().t().int()  # strided int32 ids
    table = torch.randn(13, 21, generator=gen).t()  # (21, 13), strided
    noise = torch.randn(13, 3, 17, generator=gen).permute(1, 2, 0)  # fp32 noise, strided
    z = ops.noise_embeddings(tokens, table.bfloat16(), alpha, sigma, noise=noise, drop_mask=drop, mask_index=0,
                             backend="compiled")
    z_ref = ops.noise_embeddings(tokens, table.bfloat16(), alpha, sigma, noise=noise, drop_mask=drop, mask_index=0,
                                 backend="reference")
    close(z, z_ref, torch.bfloat16)


def test_noise_embeddings_grads_of_alpha_sigma_noise(gen):
    tokens, table, alpha, sigma, drop = _noise_inputs(gen)
    noise = torch.randn(*tokens.shape, 13, generator=gen)
    upstream = torch.randn_like(noise)
    grads = {}
    for backend in ("compiled", "reference"):
        ins = [x.clone().requires_grad_() for x in (table, alpha, sigma, noise)]
        z = ops.noise_embeddings(tokens, ins[0], ins[1], ins[2], noise=ins[3], backend=backend)
        grads[backend] = torch.autograd.grad(z, ins, upstream)
    for a, b in zip(*grads.values()):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_noise_embeddings_sigma_grad_regenerates_drawn_noise(gen):
    tokens, table, alpha, _, _ = _noise_inputs(gen)
    sigma = torch.rand(3, generator=gen).requires_grad_()
    z = ops.noise_embeddings(tokens, table, alpha, sigma, generator=torch.Generator().manual_seed(5),
                             backend="compiled")
    eps = (z - alpha[:, None, None] * table[tokens]) / sigma[:, None, None]
    g, = torch.autograd.grad(z.sum(), sigma)
    torch.testing.assert_close(g, eps.detach().sum((1, 2)), atol=1e-4, rtol=1e-4)


def test_noise_embeddings_sigma_grad_uses_the_float32_noise_of_a_bf16_table(gen):
    # the backward regenerated the drawn noise through the bf16 table, so it came back rounded to bf16,
    # while the forward had added float32 noise
    tokens, table, alpha, _, _ = _noise_inputs(gen)
    sigma = torch.rand(3, generator=gen).requires_grad_()
    z = ops.noise_embeddings(tokens, table.bfloat16(), alpha, sigma, generator=torch.Generator().manual_seed(5),
                             backend="compiled")
    eps = ops.noise_embeddings(tokens, table, torch.zeros(3), torch.ones(3),  # the same draw, float32
                               generator=torch.Generator().manual_seed(5), backend="compiled")
    upstream = torch.randn(z.shape, generator=gen).bfloat16()
    g, = torch.autograd.grad(z, sigma, upstream)
    torch.testing.assert_close(g, (upstream.float() * eps).sum((1, 2)), rtol=1e-4, atol=1e-3)


def test_noise_embeddings_empty_and_bad_ids(gen):
    table = torch.randn(5, 4, requires_grad=True)
    for shape in ((0, 3), (2, 0)):
        tokens = torch.zeros(shape, dtype=torch.long)
        z = ops.noise_embeddings(tokens, table, torch.ones(shape[0]), torch.ones(shape[0]), backend="compiled")
        assert z.shape == (*shape, 4)
        z.sum().backward()
    bad = torch.tensor([[0, 5]])
    with pytest.raises(IndexError, match="token id 5 outside"):  # the kernel checks, no crash
        ops.noise_embeddings(bad, table, torch.ones(1), torch.ones(1), backend="compiled")
    with pytest.raises(IndexError, match="tokens holds id 5"):  # the reference backend: the Python check
        ops.noise_embeddings(bad, table, torch.ones(1), torch.ones(1), backend="reference")
    with pytest.raises(IndexError, match="outside the table"):  # the op itself, without the public function
        torch.ops.vqlcmd.noise_embeddings(bad, table, torch.ones(1), torch.ones(1), None, None, -1, 0, 0)
    with pytest.raises(IndexError, match="outside"):
        torch.ops.vqlcmd.noise_embeddings_backward(torch.ones(1, 2, 4), -bad, None, -1, torch.ones(1), 5, False)


def test_noise_embeddings_backward_is_deterministic(gen):
    tokens = torch.randint(0, 4, (8, 300), generator=gen)  # many repeats per row
    grad = torch.randn(8, 300, 64, generator=gen)
    alpha = torch.rand(8, generator=gen)
    runs = [torch.ops.vqlcmd.noise_embeddings_backward(grad, tokens, None, -1, alpha, 4, True) for _ in range(3)]
    assert all(torch.equal(runs[0], r) for r in runs[1:])
    ref = torch.zeros(4, 64).index_add_(0, tokens.reshape(-1), (alpha[:, None, None] * grad).reshape(-1, 64))
    torch.testing.assert_close(runs[0], ref, atol=1e-4, rtol=1e-5)


# ---- Philox noise --------------------------------------------------------------------------------

_MASK = 0xFFFFFFFF


def philox4x32_10(ctr, key):
    """Plain-Python Philox4x32-10 (Salmon et al. 2011), independent of csrc/common/philox.h."""
    c, (k0, k1) = list(ctr), key
    for i in range(10):
        if i:
            k0, k1 = (k0 + 0x9E3779B9) & _MASK, (k1 + 0xBB67AE85) & _MASK
        p0, p1 = 0xD2511F53 * c[0], 0xCD9E8D57 * c[2]
        c = [((p1 >> 32) ^ c[1] ^ k0) & _MASK, p1 & _MASK, ((p0 >> 32) ^ c[3] ^ k1) & _MASK, p0 & _MASK]
    return c


def test_python_philox_matches_random123_known_answers():
    assert philox4x32_10([0] * 4, [0, 0]) == [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]
    assert philox4x32_10([_MASK] * 4, [_MASK, _MASK]) == [0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD]


def _normal_at(seed, offset, n):
    seed &= (1 << 64) - 1
    c = offset + n // 4
    x = philox4x32_10([c & _MASK, c >> 32, 0, 0], [seed & _MASK, seed >> 32])
    lane = n % 4
    a, b = x[lane & 2], x[(lane & 2) + 1]
    u1, u2 = ((a >> 9) + 0.5) / 2**23, ((b >> 9) + 0.5) / 2**23
    r, th = math.sqrt(-2 * math.log(u1)), 2 * math.pi * (u2 - 0.5)  # angle in [-pi, pi)
    return r * (math.sin(th) if lane & 1 else math.cos(th))


def _drawn(seed, offset, B=2, M=3, D=7):
    z = torch.zeros(1, D)
    return torch.ops.vqlcmd.noise_embeddings(torch.zeros(B, M, dtype=torch.long), z, torch.zeros(B), torch.ones(B),
                                             None, None, -1, seed, offset)


# the last three wrap the counter's low word inside the AVX2 path's group of eight blocks: the high word carries
@pytest.mark.parametrize("seed,offset", [(0, 0), (-12345678901234, 3), (2**62 + 7, 1 << 33),
                                         (0x5DEECE66D, 2**32 - 3), (0x5DEECE66D, 2**33 - 1), (0x5DEECE66D, 2**40 - 5)])
def test_kernel_noise_is_the_documented_philox_stream(seed, offset):
    eps = _drawn(seed, offset).reshape(-1)  # D = 7: rows straddle Philox blocks
    expected = torch.tensor([_normal_at(seed, offset, n) for n in range(eps.numel())])
    torch.testing.assert_close(eps, expected, atol=2e-5, rtol=1e-5)


def test_philox_noise_is_standard_normal():
    eps = _drawn(2024, 0, B=16, M=256, D=256).reshape(-1).double()  # 1M draws
    n = eps.numel()
    assert abs(eps.mean().item()) < 5 / math.sqrt(n)
    assert abs(eps.var().item() - 1) < 5 * math.sqrt(2 / n)
    assert abs((eps.abs() < 1).double().mean().item() - 0.682689) < 5 * math.sqrt(0.2167 / n)
    assert abs((eps ** 3).mean().item()) < 5 * math.sqrt(15 / n)  # skewness 0
    pairs = eps.reshape(-1, 2)  # Box-Muller partners must be uncorrelated
    assert abs((pairs[:, 0] * pairs[:, 1]).mean().item()) < 5 / math.sqrt(n / 2)


def test_generated_noise_reproduces_per_seed_and_differs_per_call(gen):
    tokens, table, alpha, sigma, _ = _noise_inputs(gen)

    def draw(g):
        return ops.noise_embeddings(tokens, table, alpha, sigma, generator=g, backend="compiled")

    g1, g2 = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    first, second = draw(g1), draw(g1)
    assert torch.equal(first, draw(g2)) and torch.equal(second, draw(g2))
    assert not torch.equal(first, second)
    torch.manual_seed(3)
    a = ops.noise_embeddings(tokens, table, alpha, sigma, backend="compiled")
    torch.manual_seed(3)
    assert torch.equal(a, ops.noise_embeddings(tokens, table, alpha, sigma, backend="compiled"))


def test_seed_tensor_replaces_the_int_seed():
    # the key a graph-captured call reads on the device: same stream as the int seed of that value
    for seed, offset in ((5, 0), (-12345678901234, 3)):
        z = torch.zeros(1, 7)
        args = (torch.zeros(2, 3, dtype=torch.long), z, torch.zeros(2), torch.ones(2), None, None, -1)
        from_tensor = torch.ops.vqlcmd.noise_embeddings(*args, 99, offset, torch.tensor([seed]))
        assert torch.equal(from_tensor, _drawn(seed, offset))
        assert not torch.equal(from_tensor, _drawn(99, offset))
    for bad, message in ((torch.tensor([1, 2]), "one int64"), (torch.tensor([1.0]), "one int64")):
        with pytest.raises(RuntimeError, match=message):
            torch.ops.vqlcmd.noise_embeddings(*args, 0, 0, bad)


def test_drawn_noise_under_torch_compile_differs_per_call(gen):
    # the key is drawn inside the compiled graph, so each call of the compiled function draws anew,
    # and torch.manual_seed still reproduces
    tokens, table, alpha, sigma, _ = _noise_inputs(gen)

    def noisy(ids, tab):
        return ops.noise_embeddings(ids, tab, alpha, sigma, backend="compiled")

    torch._dynamo.reset()
    compiled = torch.compile(noisy, fullgraph=True, backend="aot_eager")
    torch.manual_seed(11)
    first, second = compiled(tokens, table), compiled(tokens, table)
    assert not torch.equal(first, second)
    torch.manual_seed(11)
    assert torch.equal(compiled(tokens, table), first)
    eps = (second - alpha[:, None, None] * table[tokens]) / sigma[:, None, None]
    assert abs(eps.mean().item()) < 5 / eps.numel() ** 0.5
    # the Python range check cannot run inside the graph; the kernel's own check still stops bad ids
    with pytest.raises(IndexError, match="outside the table"):
        compiled(torch.full_like(tokens, table.shape[0]), table)


@pytest.mark.parametrize("backend", ["compiled", "reference"])
def test_noise_embeddings_ids_checked_where_read(backend, gen):
    """A dropped position reads the [mask] row, so its id is never used: both backends accept any id
    there, give the same result, and both refuse the id where it is read."""
    tokens = torch.randint(0, 6, (2, 5), generator=gen)
    table, noise = torch.randn(7, 4, generator=gen), torch.randn(2, 5, 4, generator=gen)
    alpha, sigma = torch.rand(2, generator=gen), torch.rand(2, generator=gen)
    drop = torch.zeros(2, 5, dtype=torch.bool)
    drop[1, 2] = True
    bad = tokens.clone()
    bad[1, 2] = 99
    out = ops.noise_embeddings(bad, table, alpha, sigma, noise=noise, drop_mask=drop, mask_index=6, backend=backend)
    expected = ops.noise_embeddings(tokens, table, alpha, sigma, noise=noise, drop_mask=drop, mask_index=6,
                                    backend="reference")
    torch.testing.assert_close(out, expected)
    with pytest.raises(IndexError, match="99,? outside the table"):
        ops.noise_embeddings(bad, table, alpha, sigma, noise=noise, drop_mask=torch.zeros_like(drop), mask_index=6,
                             backend=backend)


# ---- ddim_teacher_step -----------------------------------------------------------------------

@pytest.mark.parametrize("z_dtype,table_dtype", [(d, d) for d in DTYPES] + [(torch.bfloat16, torch.float32)],
                         ids=str)
@pytest.mark.parametrize("D", [256, 13])
def test_ddim_teacher_step_matches_reference(D, z_dtype, table_dtype, gen):
    B, M, V = 3, 17, 21
    tokens = torch.randint(0, V, (B, M), generator=gen)
    table = torch.randn(V, D, generator=gen).to(table_dtype)
    z_t = torch.randn(B, D, M, generator=gen).to(z_dtype).transpose(1, 2)  # non-contiguous
    coef = [torch.rand(B, generator=gen) + 0.1 for _ in range(4)]
    out = ops.ddim_teacher_step(tokens, table, z_t, *coef, backend="compiled")
    ref = ops.ddim_teacher_step(tokens, table, z_t, *coef, backend="reference")
    assert out.dtype == z_dtype
    close(out, ref, z_dtype)


def test_ddim_teacher_step_float64_table(gen):
    tokens = torch.randint(0, 5, (2, 3), generator=gen)
    table, z_t = torch.randn(5, 8, generator=gen, dtype=torch.float64), torch.randn(2, 3, 8, generator=gen)
    coef = [torch.rand(2, generator=gen) + 0.1 for _ in range(4)]
    torch.testing.assert_close(ops.ddim_teacher_step(tokens, table, z_t, *coef, backend="compiled"),
                               ops.ddim_teacher_step(tokens, table, z_t, *coef, backend="reference"))


def test_ddim_teacher_step_empty_bad_ids_and_no_grad():
    table = torch.randn(5, 4, requires_grad=True)
    out = ops.ddim_teacher_step(torch.zeros(0, 3, dtype=torch.long), table, torch.zeros(0, 3, 4),
                                *[torch.ones(0)] * 4, backend="compiled")
    assert out.shape == (0, 3, 4)
    out = ops.ddim_teacher_step(torch.zeros(1, 3, dtype=torch.long), table, torch.zeros(1, 3, 4),
                                *[torch.ones(1)] * 4, backend="compiled")
    assert not out.requires_grad  # the teacher is a fixed target
    with pytest.raises(IndexError, match="outside the table"):
        torch.ops.vqlcmd.ddim_teacher_step(torch.tensor([[7]]), table, torch.zeros(1, 1, 4), *[torch.ones(1)] * 4)
    with pytest.raises(IndexError, match="token id 7 outside"):  # through the public function: the kernel's check
        ops.ddim_teacher_step(torch.tensor([[7]]), table, torch.zeros(1, 1, 4), *[torch.ones(1)] * 4,
                              backend="compiled")


# ---- torch.library: opcheck and torch.compile ------------------------------------------------------

def _opcheck_cases(gen):
    tokens, table, alpha, sigma, drop = _noise_inputs(gen)
    noise = torch.randn(*tokens.shape, 13, generator=gen)
    tab = table.clone().requires_grad_()
    t, s = torch.randn(5, 7, 33, generator=gen), torch.randn(5, 7, 33, generator=gen)
    return [
        ("noise_embeddings", (tokens, tab, alpha, sigma, noise, drop, 20, 0, 0)),
        ("noise_embeddings", (tokens, tab, alpha, sigma, None, None, -1, 11, 4)),
        ("noise_embeddings", (tokens, tab, alpha, sigma, None, drop, 20, 0, 2, torch.tensor([-7]))),
        ("noise_embeddings_backward", (noise, tokens, drop, 20, alpha, 21, True)),
        ("ddim_teacher_step", (tokens, table, noise, alpha, sigma, alpha, sigma)),
        ("categorical_kl", (t, s.clone().requires_grad_(), True)),
        ("categorical_kl", (t, s.clone().requires_grad_(), False)),
        ("categorical_kl_backward", (torch.rand(5, 7, generator=gen), t, s)),
    ]


@pytest.mark.parametrize("case", range(8))
def test_opcheck(case, gen):
    name, args = _opcheck_cases(gen)[case]
    torch.library.opcheck(getattr(torch.ops.vqlcmd, name).default, args)


def test_torch_compile_fullgraph_traces_the_ops(gen):
    tokens, table, alpha, sigma, drop = _noise_inputs(gen)
    noise = torch.randn(*tokens.shape, 13, generator=gen)
    teacher = torch.randn(3, 17, 21, generator=gen)

    def step(tab):
        z = torch.ops.vqlcmd.noise_embeddings(tokens, tab, alpha, sigma, noise, drop, 20, 0, 0)
        z_s = torch.ops.vqlcmd.ddim_teacher_step(tokens, tab.detach(), z.detach(), alpha, sigma, alpha, sigma)
        logits = z @ tab.t()  # (B, M, V) stands in for the denoiser
        kl, _ = torch.ops.vqlcmd.categorical_kl(teacher, logits, True)
        return kl.sum() + z_s.square().mean()

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    t1, t2 = table.clone().requires_grad_(), table.clone().requires_grad_()
    loss, loss_ref = compiled(t1), step(t2)
    loss.backward()
    loss_ref.backward()
    torch.testing.assert_close(loss, loss_ref)
    torch.testing.assert_close(t1.grad, t2.grad)


# ---- gelu_tanh -------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", [1, 7, 1000, 70001])
def test_gelu_tanh_matches_torch(n, dtype, gen):
    """Values and gradients (non-unit upstream) against F.gelu(approximate="tanh"), odd sizes that
    leave a scalar tail after the vector loop, and a range that reaches the saturated tails."""
    x = (torch.randn(n, generator=gen) * 4).to(dtype)
    upstream = torch.randn(n, generator=gen).to(dtype)
    out = {}
    for backend in ("compiled", "reference"):
        xr = x.clone().requires_grad_()
        y = ops.gelu_tanh(xr, backend=backend)
        y.backward(upstream)
        out[backend] = (y, xr.grad)
    assert out["compiled"][0].dtype == dtype
    close(out["compiled"][0], out["reference"][0], dtype)
    close(out["compiled"][1], out["reference"][1], dtype, scale=2.0)


def test_gelu_tanh_is_more_accurate_than_float32_rounding_needs():
    """Against the float64 formula: the sigmoid form avoids the cancellation of 1 + tanh(u) for negative
    x, so its relative error stays near float32 rounding where PyTorch's tanh form loses digits."""
    x = torch.linspace(-9, 9, 100001)
    exact = torch.nn.functional.gelu(x.double(), approximate="tanh")
    y = ops.gelu_tanh(x, backend="compiled").double()
    big = exact.abs() > 1e-3
    assert ((y - exact).abs() / exact.abs())[big].max() < 2e-6
    assert (y - exact).abs().max() < 1e-6
    # saturated tails: exactly x for large x, -0 (not NaN) for very negative x
    ends = ops.gelu_tanh(torch.tensor([-1e4, -200.0, 200.0, 1e4]), backend="compiled")
    assert torch.equal(ends, torch.tensor([0.0, 0.0, 200.0, 1e4]))
    xr = torch.tensor([-1e4, 1e4], requires_grad=True)
    ops.gelu_tanh(xr, backend="compiled").sum().backward()
    assert torch.equal(xr.grad, torch.tensor([0.0, 1.0]))


def test_gelu_tanh_noncontiguous_empty_and_dispatch(gen):
    x = torch.randn(6, 10, generator=gen).t()  # non-contiguous
    torch.testing.assert_close(ops.gelu_tanh(x, backend="compiled"), ops.gelu_tanh(x, backend="reference"))
    assert ops.gelu_tanh(torch.empty(0, 3), backend="compiled").shape == (0, 3)
    assert ops._dispatch.resolve("gelu_tanh", "auto", x) is _compiled.gelu_tanh
    assert ops._dispatch.resolve("gelu_tanh", "auto", x.double()) is not _compiled.gelu_tanh
    with pytest.raises(TypeError, match="floating-point"):
        ops.gelu_tanh(torch.ones(3, dtype=torch.long))
    assert "CPU kernel only" in _compiled._gelu_unsupported(torch.empty(1, device="meta"))


def test_gelu_tanh_opcheck_and_compile(gen):
    x = torch.randn(3, 37, generator=gen)
    torch.library.opcheck(torch.ops.vqlcmd.gelu_tanh.default, (x.clone().requires_grad_(),))
    torch.library.opcheck(torch.ops.vqlcmd.gelu_tanh_backward.default, (torch.randn_like(x), x))
    assert_compiled_graph_matches_reference(ops.gelu_tanh, (x,))


# ---- ada_layer_norm ----------------------------------------------------------------------------

def _ada_float64(h, scale, shift, upstream, eps=1e-5):
    """(1 + scale) LayerNorm(h) + shift and its gradients, in float64 from the formula itself."""
    h64, a64, b64 = (x.detach().double().requires_grad_() for x in (h, scale, shift))
    mean = h64.mean(-1, keepdim=True)
    var = ((h64 - mean) ** 2).mean(-1, keepdim=True)
    y = (1 + a64[:, None]) * (h64 - mean) / torch.sqrt(var + eps) + b64[:, None]
    grads = torch.autograd.grad(y, (h64, a64, b64), upstream.double())
    return y.detach(), grads


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(2, 3, 128), (1, 1, 7), (3, 5, 1000), (4, 2, 1), (5, 64, 48)])
def test_ada_layer_norm_matches_float64(shape, dtype, gen):
    """Values and all three gradients (non-unit upstream) of both backends against the float64 formula;
    odd widths leave a scalar tail after the vector loop, W = 1 normalises to 0."""
    B, M, W = shape
    h = (torch.randn(shape, generator=gen) * 3 + 1).to(dtype)
    scale = (torch.randn(B, W, generator=gen) * 0.5).to(dtype)
    shift = torch.randn(B, W, generator=gen).to(dtype)
    upstream = torch.randn(shape, generator=gen).to(dtype)
    y64, g64 = _ada_float64(h, scale, shift, upstream)
    # d scale and d shift sum M rows: their rounding grows with M
    assert_backends_match_float64(ops.ada_layer_norm, (h, scale, shift), upstream, y64, g64, dtype,
                                  grad_scales=(8.0, 8.0 * M, 8.0 * M))


@pytest.mark.parametrize("eps", [1e-5, 1e-3, 0.5])
def test_ada_layer_norm_uses_its_eps_argument(eps, gen):
    """Rows whose variance (~1e-4) is comparable to eps: y = (1 + a)(h - mean) / sqrt(var + eps) + b depends on
    eps and on where it enters, so the kernel must take the eps it is given (every other test used 1e-5)."""
    B, M, W = 2, 6, 40  # W = 40: five vectors of 8, no scalar tail
    h = 3 + 1e-2 * torch.randn(B, M, W, generator=gen)
    scale, shift = 0.5 * torch.randn(B, W, generator=gen), torch.randn(B, W, generator=gen)
    upstream = torch.randn(B, M, W, generator=gen)
    y64, g64 = _ada_float64(h, scale, shift, upstream, eps)
    inputs = [x.clone().requires_grad_() for x in (h, scale, shift)]
    y = ops.ada_layer_norm(*inputs, eps=eps, backend="compiled")
    grads = torch.autograd.grad(y, inputs, upstream)
    torch.testing.assert_close(y.double(), y64, atol=1e-4, rtol=1e-4)
    for g, r in zip(grads, g64):
        torch.testing.assert_close(g.double(), r, atol=1e-3 * r.abs().max().item(), rtol=1e-4)


def test_ada_layer_norm_float32_modulation_gets_float32_gradients(gen):
    """A bf16 h with float32 (scale, shift), as under autocast with a float32 conditioning path: the kernel sums
    d scale = sum dy * n and d shift = sum dy in float32 (docs/building.md: float32 accumulation) and hands them to the
    float32 parameters unrounded; a detour through h's bf16 costs ~3 significant digits."""
    B, M, W = 2, 16, 24
    h = torch.randn(B, M, W, generator=gen).bfloat16()
    scale, shift = 0.3 * torch.randn(B, W, generator=gen), torch.randn(B, W, generator=gen)
    upstream = torch.randn(B, M, W, generator=gen).bfloat16()
    _, (_, da64, db64) = _ada_float64(h, scale, shift, upstream)
    inputs = [h, scale.clone().requires_grad_(), shift.clone().requires_grad_()]
    y = ops.ada_layer_norm(*inputs, backend="compiled")
    da, db = torch.autograd.grad(y, inputs[1:], upstream)
    assert da.dtype == db.dtype == torch.float32
    torch.testing.assert_close(db.double(), db64, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(da.double(), da64, atol=1e-4, rtol=1e-4)


def test_ada_layer_norm_statistics_of_zero_width_rows_are_pytorchs():
    # they were returned unwritten (heap garbage); PyTorch's native_layer_norm gives mean 0, rstd NaN
    h = torch.randn(2, 3, 0)
    _, mean, rstd = torch.ops.vqlcmd.ada_layer_norm(h, torch.randn(2, 0), torch.randn(2, 0), 1e-5)
    _, ref_mean, ref_rstd = torch.native_layer_norm(h, (0,), None, None, 1e-5)
    torch.testing.assert_close(mean, ref_mean.reshape(2, 3), equal_nan=True)
    torch.testing.assert_close(rstd, ref_rstd.reshape(2, 3), equal_nan=True)


def test_ada_layer_norm_rows_far_from_zero(gen):
    """Two-pass moments: rows with a mean of 1000 and unit spread normalise as accurately as
    PyTorch's LayerNorm does (a one-pass E[x^2] - E[x]^2 would lose every digit of the variance)."""
    h = 1000 + torch.randn(4, 16, 128, generator=gen)
    scale, shift = torch.zeros(4, 128), torch.zeros(4, 128)
    y64, _ = _ada_float64(h, scale, shift, torch.ones_like(h))
    err = (ops.ada_layer_norm(h, scale, shift, backend="compiled").double() - y64).abs().max()
    err_ref = (ops.ada_layer_norm(h, scale, shift, backend="reference").double() - y64).abs().max()
    assert err < max(2 * err_ref, 1e-4), (err, err_ref)


@pytest.mark.parametrize("h_dtype,mod_dtype", [(torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16)])
def test_ada_layer_norm_mixed_dtypes_give_the_same_dtypes_on_every_backend(h_dtype, mod_dtype, gen):
    # the reference promoted (bf16 h, float32 modulation -> float32) where the kernel keeps h's dtype
    h = torch.randn(2, 5, 24, generator=gen).to(h_dtype)
    scale, shift = (torch.randn(2, 24, generator=gen).to(mod_dtype) for _ in range(2))
    upstream = torch.randn(2, 5, 24, generator=gen).to(h_dtype)
    out = {}
    for backend in ("compiled", "reference"):
        inputs = [x.clone().requires_grad_() for x in (h, scale, shift)]
        y = ops.ada_layer_norm(*inputs, backend=backend)
        out[backend] = (y, *torch.autograd.grad(y, inputs, upstream))
    assert [t.dtype for t in out["reference"]] == [h_dtype, h_dtype, mod_dtype, mod_dtype]
    for a, b in zip(out["compiled"], out["reference"]):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a.float(), b.float(), atol=0.1, rtol=0.02)


def test_ada_layer_norm_noncontiguous_empty_errors_and_dispatch(gen):
    h = torch.randn(3, 40, 9, generator=gen).transpose(1, 2)  # (3, 9, 40), non-contiguous
    ab = torch.randn(3, 80, generator=gen)
    scale, shift = ab.chunk(2, dim=-1)  # the denoiser's strided (B, W) views
    upstream = torch.randn(3, 9, 40, generator=gen)
    out = {}
    for backend in ("compiled", "reference"):
        inputs = [x.clone().requires_grad_() for x in (h, scale, shift)]
        y = ops.ada_layer_norm(*inputs, backend=backend)
        out[backend] = (y, *torch.autograd.grad(y, inputs, upstream))
    for a, b in zip(out["compiled"], out["reference"]):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-5)
    for shape in ((0, 3, 8), (2, 0, 8)):
        e = torch.empty(shape, requires_grad=True)
        s = torch.zeros(shape[0], 8, requires_grad=True)
        y = ops.ada_layer_norm(e, s, s, backend="compiled")
        assert y.shape == shape
        y.sum().backward()
        assert torch.equal(s.grad, torch.zeros_like(s))
    assert ops._dispatch.resolve("ada_layer_norm", "auto", h, scale, shift) is _compiled.ada_layer_norm
    assert ops._dispatch.resolve("ada_layer_norm", "auto", h.double(), scale, shift) is not _compiled.ada_layer_norm
    assert "CPU kernel only" in _compiled._ada_unsupported(*(torch.empty(1, 1, 1, device="meta"),) * 3)
    with pytest.raises(ValueError, match="scale must have shape"):
        ops.ada_layer_norm(h, scale[:, :5], shift)
    with pytest.raises(ValueError, match=r"h must be \(B, M, W\)"):
        ops.ada_layer_norm(h[0], scale, shift)
    with pytest.raises(ValueError, match="eps"):
        ops.ada_layer_norm(h, scale, shift, eps=0.0)


def test_ada_layer_norm_opcheck_and_compile(gen):
    h, scale, shift = torch.randn(2, 5, 37, generator=gen), torch.randn(2, 37, generator=gen), torch.randn(
        2, 37, generator=gen)
    torch.library.opcheck(torch.ops.vqlcmd.ada_layer_norm.default,
                          (h.clone().requires_grad_(), scale.clone().requires_grad_(), shift.clone(), 1e-5))
    _, mean, rstd = torch.ops.vqlcmd.ada_layer_norm(h, scale, shift, 1e-5)
    torch.library.opcheck(torch.ops.vqlcmd.ada_layer_norm_backward.default,
                          (torch.randn_like(h), h, scale, mean, rstd))
    assert_compiled_graph_matches_reference(ops.ada_layer_norm, (h, scale, shift),
                                            grad_tol=dict(atol=2e-5, rtol=1e-5))


# ---- short_attention ---------------------------------------------------------------------------

def _attention_float64(q, k, v, upstream):
    """softmax(q kᵀ / √hd) v and its three gradients, in float64 from the formula itself."""
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    p = torch.softmax(q64 @ k64.transpose(-2, -1) / math.sqrt(q.shape[-1]), dim=-1)
    out = p @ v64
    return out.detach(), torch.autograd.grad(out, (q64, k64, v64), upstream.double())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(2, 3, 17, 8), (1, 1, 1, 4), (3, 2, 64, 32), (1, 2, 130, 5), (2, 1, 9, 1)])
def test_short_attention_matches_float64(shape, dtype, gen):
    """Values and the gradients of q, k and v (non-unit upstream) against float64; lengths that are
    not a multiple of the vector width leave scalar tails in the softmax, M = 1 attends to itself."""
    q, k, v = ((torch.randn(shape, generator=gen) * 1.5).to(dtype) for _ in range(3))
    upstream = torch.randn(shape, generator=gen).to(dtype)
    o64, g64 = _attention_float64(q, k, v, upstream)
    assert_backends_match_float64(ops.short_attention, (q, k, v), upstream, o64, g64, dtype,
                                  grad_scales=(8.0 * math.sqrt(shape[2]),) * 3)


def test_short_attention_takes_the_denoisers_strided_views_and_large_scores(gen):
    """q, k, v as the denoiser makes them (permuted views of one (B, M, 3, H, hd) projection), scores
    of a few hundred (the softmax must subtract the row maximum), and the output's (B, M, H, hd)
    memory, which makes the heads' merge a free view."""
    B, M, H, hd = 3, 20, 2, 8
    qkv = (torch.randn(B, M, 3, H, hd, generator=gen) * 6).requires_grad_()
    upstream = torch.randn(B, H, M, hd, generator=gen)
    results = {}
    for backend in ("compiled", "reference"):
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        out = ops.short_attention(q, k, v, backend=backend)
        results[backend] = (out, torch.autograd.grad(out, qkv, upstream)[0])
    o64, _ = _attention_float64(*qkv.detach().permute(2, 0, 3, 1, 4), upstream)
    assert torch.isfinite(results["compiled"][0]).all()
    torch.testing.assert_close(results["compiled"][0].double(), o64, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(results["compiled"][1], results["reference"][1], atol=1e-4, rtol=1e-4)
    out = results["compiled"][0]
    assert out.transpose(1, 2).is_contiguous()


def test_short_attention_empty_errors_and_dispatch(gen):
    for shape in ((0, 2, 5, 4), (2, 0, 5, 4), (2, 2, 0, 4)):
        q = torch.empty(shape, requires_grad=True)
        out = ops.short_attention(q, q, q, backend="compiled")
        assert out.shape == shape
        out.sum().backward()
    q = torch.randn(2, 2, 6, 4, generator=gen)
    assert ops._dispatch.resolve("short_attention", "auto", q, q, q) is _compiled.short_attention
    assert ops._dispatch.resolve("short_attention", "auto", *(q.double(),) * 3) is not _compiled.short_attention
    long = torch.empty(1, 1, _compiled.SHORT_ATTENTION_MAX_LEN + 1, 4)
    assert "up to" in ops.why_not("short_attention", "compiled", long, long, long)
    assert "CPU kernel only" in _compiled._attn_unsupported(*(torch.empty(1, 1, 1, 1, device="meta"),) * 3)
    with pytest.raises(ValueError, match=r"q must be \(B, H, M, hd\)"):
        ops.short_attention(q[0], q[0], q[0])
    with pytest.raises(ValueError, match="k must have shape"):
        ops.short_attention(q, q[:, :, :5], q)
    with pytest.raises(ValueError, match="one dtype"):
        ops.short_attention(q, q.half(), q)
    with pytest.raises(RuntimeError, match="up to"):
        ops.short_attention(long, long, long, backend="compiled")


def test_short_attention_opcheck_and_compile(gen):
    q, k, v = (torch.randn(2, 3, 11, 6, generator=gen) for _ in range(3))
    torch.library.opcheck(torch.ops.vqlcmd.short_attention.default,
                          (q.clone().requires_grad_(), k.clone().requires_grad_(), v.clone().requires_grad_()))
    out, lse = torch.ops.vqlcmd.short_attention(q, k, v)
    torch.library.opcheck(torch.ops.vqlcmd.short_attention_backward.default,
                          (torch.randn_like(q), q, k, v, out, lse))
    assert_compiled_graph_matches_reference(ops.short_attention, (q, k, v),
                                            value_tol=dict(atol=1e-5, rtol=1e-5),
                                            grad_tol=dict(atol=2e-5, rtol=1e-5))


def _attention_dropout_float64(q, k, v, keep, dropout_p, upstream):
    """(P ∘ keep / (1 − p)) v and its three gradients in float64, the mask given."""
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    p = torch.softmax(q64 @ k64.transpose(-2, -1) / math.sqrt(q.shape[-1]), dim=-1)
    out = (p * keep / (1.0 - dropout_p)) @ v64
    return out.detach(), torch.autograd.grad(out, (q64, k64, v64), upstream.double())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(2, 3, 17, 8), (1, 1, 1, 4), (2, 4, 16, 16), (1, 2, 33, 5)])
def test_short_attention_dropout_matches_float64_with_the_reference_mask(shape, dtype, gen):
    """Attention dropout: values and gradients of both backends against float64 with the mask the reference
    draws for the seed (reference.dropout_keep); odd M puts a Philox block across two rows and two heads, which
    the kernel's regeneration in the backward must split as the forward did."""
    q, k, v = ((torch.randn(shape, generator=gen) * 1.5).to(dtype) for _ in range(3))
    upstream = torch.randn(shape, generator=gen).to(dtype)
    seed, p = torch.tensor([-1234567890123456789]), 0.3
    keep = reference.dropout_keep(seed, (*shape[:3], shape[2]), p)
    o64, g64 = _attention_dropout_float64(q, k, v, keep.double(), p, upstream)
    assert_backends_match_float64(functools.partial(ops.short_attention, dropout_p=p, seed=seed), (q, k, v),
                                  upstream, o64, g64, dtype, grad_scales=(8.0 * math.sqrt(shape[2]),) * 3)


def test_short_attention_dropout_keeps_1_minus_p_and_draws_from_the_generator(gen):
    """The mask keeps a fraction 1 − p (10^6 draws: within 5 standard deviations), the same seed keeps the same
    probabilities, and without a seed each call draws one from ``generator``: the same generator state gives the
    same output, the next call another."""
    seed = torch.tensor([7])
    keep = reference.dropout_keep(seed, (1000, 1000), 0.1)
    assert abs(keep.double().mean().item() - 0.9) < 5 * math.sqrt(0.9 * 0.1 / 1e6)
    assert torch.equal(keep, reference.dropout_keep(seed, (1000, 1000), 0.1))
    assert not torch.equal(keep, reference.dropout_keep(torch.tensor([8]), (1000, 1000), 0.1))
    q, k, v = (torch.randn(2, 2, 12, 4, generator=gen) for _ in range(3))
    outs = [ops.short_attention(q, k, v, dropout_p=0.5, generator=torch.Generator().manual_seed(3),
                                backend="compiled") for _ in range(2)]
    torch.testing.assert_close(outs[0], outs[1], atol=0, rtol=0)
    g = torch.Generator().manual_seed(3)
    first, second = (ops.short_attention(q, k, v, dropout_p=0.5, generator=g, backend="compiled") for _ in range(2))
    assert torch.equal(first, outs[0]) and not torch.equal(first, second)
    undropped = ops.short_attention(q, k, v, backend="compiled")
    assert not torch.equal(first, undropped)


def test_short_attention_dropout_errors_opcheck_and_compile(gen):
    q, k, v = (torch.randn(2, 3, 11, 6, generator=gen) for _ in range(3))
    seed = torch.tensor([42])
    for bad in (-0.1, 1.0):
        with pytest.raises(ValueError, match=r"dropout_p must be in \[0, 1\)"):
            ops.short_attention(q, k, v, dropout_p=bad, seed=seed)
    with pytest.raises(ValueError, match="seed must be a one-element int64"):
        ops.short_attention(q, k, v, dropout_p=0.1, seed=torch.tensor([1.0]))
    with pytest.raises(RuntimeError, match="needs a seed"):
        torch.ops.vqlcmd.short_attention(q, k, v, 0.1)
    torch.library.opcheck(torch.ops.vqlcmd.short_attention.default,
                          (q.clone().requires_grad_(), k.clone().requires_grad_(), v.clone().requires_grad_(), 0.2,
                           seed))
    out, lse = torch.ops.vqlcmd.short_attention(q, k, v, 0.2, seed)
    torch.library.opcheck(torch.ops.vqlcmd.short_attention_backward.default,
                          (torch.randn_like(q), q, k, v, out, lse, 0.2, seed))
    assert_compiled_graph_matches_reference(functools.partial(ops.short_attention, dropout_p=0.2, seed=seed),
                                            (q, k, v), value_tol=dict(atol=1e-5, rtol=1e-5),
                                            grad_tol=dict(atol=2e-5, rtol=1e-5))


@pytest.mark.parametrize("archs, capability, serves", [("9.0", (8, 0), False), ("9.0", (9, 0), True),
                                                       ("8.0", (8, 6), True), ("8.0", (9, 0), False),
                                                       ("8.0+PTX", (9, 0), True), ("8.0;9.0", (10, 0), False),
                                                       ("9.0a", (9, 0), True), ("8.0 9.0", (9, 0), True),
                                                       # CMake's form (CMakeLists.txt records it): it was trusted
                                                       ("90", (8, 0), False), ("90", (9, 0), True),
                                                       ("90", (10, 0), True), ("90-real", (10, 0), False),
                                                       ("90a", (10, 0), False), ("80-real;90-virtual", (8, 6), True),
                                                       ("10.0a", (10, 3), False), ("100a", (10, 0), True),
                                                       # names and suffixes it cannot read: the build is trusted
                                                       ("8.0;Hopper", (9, 0), True), ("10.0f", (9, 0), True)])
def test_compiled_cuda_kernels_are_claimed_only_for_gpus_they_were_built_for(monkeypatch, archs, capability, serves):
    # an sm_90 build was picked by auto on an A100: the first step died with "no kernel image is available"
    import types

    monkeypatch.setattr(_compiled, "build_info", lambda: {"with_cuda": True, "cuda_arch_list": archs})
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: capability)
    x = types.SimpleNamespace(is_floating_point=lambda: True, dtype=torch.float32, device=torch.device("cuda", 0))
    why = _compiled.unsupported(x, x)
    assert (why is None) is serves, why
    if not serves:
        assert f"not this GPU's {capability[0]}.{capability[1]}" in why and "TORCH_CUDA_ARCH_LIST" in why


def test_an_extension_older_than_the_code_falls_back_to_the_reference():
    """A _C built before an op was added (a pull without a rebuild) made `import vqlcmd` raise "operator
    vqlcmd::... does not exist"; the reference now serves, and the reason says to rebuild. Simulated by a
    _C that defines no ops at all."""
    code = ("import sys, types; sys.modules['vqlcmd._C'] = types.ModuleType('vqlcmd._C'); import torch, vqlcmd; "
            "from vqlcmd import ops; from vqlcmd.ops import _compiled; "
            "print(ops.available_backends('categorical_kl')); print(_compiled.describe()); "
            "print(float(ops.categorical_kl(torch.zeros(1, 3), torch.zeros(1, 3))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        "['reference']",
        "compiled backend: unavailable: vqlcmd._C is older than this code: it lacks noise_embeddings, "
        "noise_embeddings_backward, ddim_teacher_step, categorical_kl, categorical_kl_backward, gelu_tanh, "
        "gelu_tanh_backward, ada_layer_norm, ada_layer_norm_backward, short_attention, short_attention_backward, "
        "ema_update_; "
        "rebuild it with `pip install --no-build-isolation -e .`",
        "0.0"]


def test_a_second_derivative_is_refused_not_wrong(gen):
    """create_graph=True took the kernels' backward ops as constants: d2/dx2 of x**2 + gelu_tanh(x) came out as
    2 everywhere (gelu's term dropped), silently. Each op's second derivative now raises."""
    x = torch.randn(2, 5, 8, generator=gen, requires_grad=True)
    scale, shift = torch.randn(2, 8, generator=gen), torch.randn(2, 8, generator=gen)
    q = torch.randn(1, 2, 5, 4, generator=gen, requires_grad=True)
    table = torch.randn(6, 8, generator=gen, requires_grad=True)
    tokens, ab = torch.randint(0, 6, (2, 5), generator=gen), torch.rand(2, generator=gen)
    cases = {"gelu_tanh": lambda: ops.gelu_tanh(x, backend="compiled"),
             "ada_layer_norm": lambda: ops.ada_layer_norm(x, scale, shift, backend="compiled"),
             "short_attention": lambda: ops.short_attention(q, q, q, backend="compiled"),
             "categorical_kl": lambda: ops.categorical_kl(torch.randn(2, 5, 8, generator=gen), x, backend="compiled"),
             "noise_embeddings": lambda: ops.noise_embeddings(tokens, table, ab, ab, noise=torch.zeros(2, 5, 8),
                                                              backend="compiled")}
    for name, f in cases.items():
        inputs = [t for t in (x, q, table) if t.requires_grad]
        out = f()
        grads = torch.autograd.grad(out.square().sum(), inputs, create_graph=True, allow_unused=True)
        total = sum(g.sum() for g in grads if g is not None and g.requires_grad)
        with pytest.raises(RuntimeError, match=f"vqlcmd::{name}: the compiled backend has no second derivative"):
            total.backward()
    # first order is unchanged
    y = (x ** 2 + ops.gelu_tanh(x, backend="compiled")).sum()
    (g,) = torch.autograd.grad(y, x)
    (g_ref,) = torch.autograd.grad((x ** 2 + ops.gelu_tanh(x, backend="reference")).sum(), x)
    torch.testing.assert_close(g, g_ref, atol=1e-5, rtol=1e-5)


# ---- ema_update_ -------------------------------------------------------------------------------

@pytest.mark.parametrize("source_dtype", DTYPES)
@pytest.mark.parametrize("n", [0, 7, 2048, 2049, 40_000 + 3])  # empty, under a vector, one block, odd tails
def test_ema_update_is_torch_lerp_bit_for_bit_with_its_copies(source_dtype, n, gen):
    """The kernel against the reference (a cast, ``lerp_`` per shadow, ``copy_`` per copy): both EMAs of the
    engine (w = 1 - η small), w = 0 and 1 (an EMA of decay 0 is the source), and w >= 0.5 (torch.lerp's other
    branch); copies in bf16, fp16 and fp32; on two threads, so blocks land in different tasks."""
    source = torch.randn(n, generator=gen).to(source_dtype)
    weights = [0.01, 1e-4, 0.0, 1.0, 0.5, 0.7]
    shadows = [torch.randn(n, generator=gen) for _ in weights]
    copies = [torch.empty(n, dtype=d) for d in (torch.bfloat16, torch.float16, torch.float32)]
    copy_of = [0, 4, 5]
    mine, theirs = [s.clone() for s in shadows], [s.clone() for s in shadows]
    mine_copies, their_copies = [c.clone() for c in copies], [c.clone() for c in copies]
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        ops.ema_update_(mine, source, weights, mine_copies, copy_of, backend="compiled")
    finally:
        torch.set_num_threads(threads)
    ops.ema_update_(theirs, source, weights, their_copies, copy_of, backend="reference")
    for a, b in zip(mine + mine_copies, theirs + their_copies):
        if _compiled.build_info().get("cpu_vector") == "AVX2":  # at::vec's fmadd is an FMA, as ATen's lerp
            assert torch.equal(a, b)
        else:
            torch.testing.assert_close(a, b, atol=0, rtol=2 ** -22)
    # eq. 16 itself, in float64: θ̄ + w (θ - θ̄)
    for s, w, out in zip(shadows, weights, mine):
        expected = s.double() + w * (source.double() - s.double())
        torch.testing.assert_close(out.double(), expected, atol=1e-6, rtol=1e-6)
    assert torch.equal(mine_copies[0], mine[0].bfloat16()) and torch.equal(mine_copies[2], mine[5])


def test_ema_update_refuses_bad_inputs_by_name(gen):
    src = torch.randn(10, generator=gen)
    good = [torch.zeros(10)]
    with pytest.raises(ValueError, match="one weight per shadow"):
        ops.ema_update_(good, src, [0.1, 0.2])
    with pytest.raises(ValueError, match=r"shadows\[0\] must be a contiguous float32 tensor of the source's 10"):
        ops.ema_update_([torch.zeros(10, dtype=torch.bfloat16)], src, [0.1])
    with pytest.raises(ValueError, match=r"shadows\[0\] must be"):
        ops.ema_update_([torch.zeros(11)], src, [0.1])
    with pytest.raises(ValueError, match=r"weights\[0\] \(1 - decay\) must be in \[0, 1\]"):
        ops.ema_update_(good, src, [1.5])
    with pytest.raises(ValueError, match=r"copy_of\[0\] = 1 names no shadow"):
        ops.ema_update_(good, src, [0.1], [torch.zeros(10, dtype=torch.bfloat16)], [1])
    with pytest.raises(ValueError, match="one shadow per copy"):
        ops.ema_update_(good, src, [0.1], [torch.zeros(10)], [])
    with pytest.raises(ValueError, match="source must be contiguous"):
        ops.ema_update_(good, torch.randn(10, 2, generator=gen)[:, 0], [0.1])
    # the kernel checks for itself too (its own callers: torch.ops.vqlcmd.ema_update_)
    with pytest.raises(RuntimeError, match="shadow 0 must be a contiguous float32 tensor"):
        torch.ops.vqlcmd.ema_update_([torch.zeros(11)], src, [0.1], [], [])
    assert "CPU kernel only" in _compiled._ema_unsupported(torch.empty(1, device="meta"))


def test_ema_update_opcheck(gen):
    src = torch.randn(300, generator=gen).bfloat16()
    torch.library.opcheck(torch.ops.vqlcmd.ema_update_.default,
                          ([torch.randn(300, generator=gen), torch.randn(300, generator=gen)], src, [0.01, 0.5],
                           [torch.empty(300, dtype=torch.bfloat16)], [0]))
