"""The CUDA kernels of the compiled backend against the reference backend (skipped without a GPU)."""
import pytest
import torch

from vqlcmd import ops
from vqlcmd.ops import _compiled

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(_compiled.unavailable() is not None,
                       reason=f"compiled backend not built: {_compiled.unavailable()}"),
    pytest.mark.skipif(_compiled.unavailable() is None and not _compiled.build_info().get("with_cuda"),
                       reason="vqlcmd._C was built without CUDA kernels"),
]

CUDA = torch.device("cuda")
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
       torch.float16: dict(atol=2e-3, rtol=2e-3)}


def close(actual, expected, dtype, scale=1.0):
    torch.testing.assert_close(actual.float(), expected.float(), **{k: v * scale for k, v in TOL[dtype].items()})


@pytest.mark.parametrize("emit", [True, False])
@pytest.mark.parametrize("dtype", list(TOL), ids=str)
@pytest.mark.parametrize("K", [1024, 1000, 7, 1])
def test_categorical_kl_cuda(K, dtype, emit, monkeypatch):
    monkeypatch.setattr(_compiled, "EMIT_KL_GRAD", emit)
    g = torch.Generator(CUDA).manual_seed(0)
    teacher = (3 * torch.randn(5, 67, K, device=CUDA, generator=g)).to(dtype)
    student = (3 * torch.randn(5, 67, K, device=CUDA, generator=g)).to(dtype)
    upstream = torch.rand(5, 67, device=CUDA, generator=g) + 0.5
    res = {}
    for backend in ("compiled", "reference"):
        s = student.clone().requires_grad_()
        kl = ops.categorical_kl(teacher, s, backend=backend)
        (kl * upstream).sum().backward()
        res[backend] = (kl, s.grad)
    torch.testing.assert_close(res["compiled"][0], res["reference"][0], atol=1e-4, rtol=1e-4)
    close(res["compiled"][1], res["reference"][1], dtype)


def test_categorical_kl_cuda_extreme_and_noncontiguous():
    g = torch.Generator(CUDA).manual_seed(1)
    teacher = 1e4 * torch.rand(1000, 64, device=CUDA, generator=g).t()  # strided
    student = -1e4 * torch.rand(64, 1000, device=CUDA, generator=g)
    kl = ops.categorical_kl(teacher, student, backend="compiled")
    ref = ops.categorical_kl(teacher.double(), student.double(), backend="reference").float()
    torch.testing.assert_close(kl, ref, rtol=1e-5, atol=1e-2)


def _kl_both_entry_points(teacher, student, upstream, monkeypatch):
    """(kl, grad) per backend; compiled through the emitted gradient and through categorical_kl_backward."""
    res = {}
    for backend, emit in (("compiled", True), ("compiled", False), ("reference", None)):
        if emit is not None:
            monkeypatch.setattr(_compiled, "EMIT_KL_GRAD", emit)
        s = student.clone().requires_grad_()
        kl = ops.categorical_kl(teacher, s, backend=backend)
        (kl * upstream).sum().backward()
        res[(backend, emit)] = (kl, s.grad)
    return res


# K <= 2048: register-resident kernel, one shape per K range (packs of 4 when K % 4 == 0, else
# single elements); K > 2048: the two-read kernel. 135 rows: no multiple of any shape's rows per block.
@pytest.mark.parametrize("dtype", list(TOL), ids=str)
@pytest.mark.parametrize("K", [1, 7, 12, 64, 100, 1000, 1024, 2047, 2048, 2049, 4096])
def test_categorical_kl_cuda_kernel_paths(K, dtype, monkeypatch):
    g = torch.Generator(CUDA).manual_seed(K)
    teacher = (3 * torch.randn(3, 45, K, device=CUDA, generator=g)).to(dtype)
    student = (3 * torch.randn(3, 45, K, device=CUDA, generator=g)).to(dtype)
    upstream = torch.rand(3, 45, device=CUDA, generator=g) + 0.5
    res = _kl_both_entry_points(teacher, student, upstream, monkeypatch)
    kl_ref, grad_ref = res[("reference", None)]
    for emit in (True, False):
        kl, grad = res[("compiled", emit)]
        torch.testing.assert_close(kl, kl_ref, atol=1e-4, rtol=1e-4)
        close(grad, grad_ref, dtype)


@pytest.mark.parametrize("K", [1024, 2048, 4096])
def test_categorical_kl_cuda_misaligned_rows(K, monkeypatch):
    """A contiguous view 4 bytes into its storage cannot take 16-byte loads: the single-element kernels serve it."""
    g = torch.Generator(CUDA).manual_seed(7)
    n = 37
    teacher = torch.randn(n * K + 1, device=CUDA, generator=g)[1:].view(n, K)
    student = torch.randn(n * K + 1, device=CUDA, generator=g)[1:].view(n, K)
    assert teacher.data_ptr() % 16 != 0 and teacher.is_contiguous()
    upstream = torch.rand(n, device=CUDA, generator=g) + 0.5
    res = _kl_both_entry_points(teacher, student, upstream, monkeypatch)
    for emit in (True, False):
        torch.testing.assert_close(res[("compiled", emit)][0], res[("reference", None)][0], atol=1e-4, rtol=1e-4)
        close(res[("compiled", emit)][1], res[("reference", None)][1], torch.float32)


@pytest.mark.parametrize("K", [7, 1000, 4096])
def test_categorical_kl_cuda_infinite_logits(K):
    """p_k = 0 adds 0 (also where log q_k = -inf), p_k > 0 with q_k = 0 gives +inf, a teacher row of -inf gives 0."""
    g = torch.Generator(CUDA).manual_seed(8)
    teacher = torch.randn(4, K, device=CUDA, generator=g)
    student = torch.randn(4, K, device=CUDA, generator=g)
    teacher[1, ::2] = -float("inf")
    student[1, ::2] = -float("inf")
    teacher[2] = -float("inf")
    student[3, teacher[3].argmax()] = -float("inf")
    kl = ops.categorical_kl(teacher, student, backend="compiled")
    ref = ops.categorical_kl(teacher.double(), student.double(), backend="reference").float()
    torch.testing.assert_close(kl, ref, atol=1e-4, rtol=1e-4)
    assert kl[2] == 0 and kl[3] == float("inf")
    grad = torch.ops.vqlcmd.categorical_kl(teacher, student, True)[1]
    s = student[:2].clone().requires_grad_()
    ops.categorical_kl(teacher[:2], s, backend="reference").sum().backward()
    torch.testing.assert_close(grad[:2], s.grad, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("K", [7, 1000, 4096])  # the one-read register path, and the two-pass one past 2048
def test_categorical_kl_cuda_nan_or_inf_teacher_is_nan(K):
    """A NaN or +inf teacher logit makes p NaN: such a term is not one of p = 0, so the row's KL is NaN (the
    header's kl_term / kl_sums_add test p == 0, not p > 0), as on the CPU and in the reference."""
    g = torch.Generator(CUDA).manual_seed(10)
    teacher = torch.randn(3, K, device=CUDA, generator=g)
    student = torch.randn(3, K, device=CUDA, generator=g)
    teacher[0, K // 2], teacher[1, 0] = float("nan"), float("inf")
    kl = ops.categorical_kl(teacher, student, backend="compiled")
    assert kl[:2].isnan().all() and torch.isfinite(kl[2])


def test_categorical_kl_cuda_extreme_logits_register_path():
    """Logits of +-1e4 on the one-read path (K <= 2048), fp32 and bf16, against float64."""
    g = torch.Generator(CUDA).manual_seed(9)
    for K in (7, 1024, 2048):
        teacher = 1e4 * torch.rand(50, K, device=CUDA, generator=g)
        student = -1e4 * torch.rand(50, K, device=CUDA, generator=g)
        for dtype in (torch.float32, torch.bfloat16):
            t, s = teacher.to(dtype), student.to(dtype)
            kl = ops.categorical_kl(t, s, backend="compiled")
            ref = ops.categorical_kl(t.double(), s.double(), backend="reference").float()
            torch.testing.assert_close(kl, ref, rtol=1e-5, atol=1e-2)


@pytest.mark.parametrize("dtype", list(TOL), ids=str)
@pytest.mark.parametrize("D", [256, 13])
def test_noise_embeddings_cuda(D, dtype):
    g = torch.Generator(CUDA).manual_seed(2)
    B, M, V = 4, 33, 65
    tokens = torch.randint(0, V - 1, (B, M), device=CUDA, generator=g)
    table = torch.randn(V, D, device=CUDA, generator=g).to(dtype)
    alpha, sigma = torch.rand(B, device=CUDA, generator=g), torch.rand(B, device=CUDA, generator=g)
    noise = torch.randn(B, M, D, device=CUDA, generator=g).to(dtype)
    drop = torch.rand(B, M, device=CUDA, generator=g) < 0.3
    upstream = torch.randn(B, M, D, device=CUDA, generator=g).to(dtype)
    res = {}
    for backend in ("compiled", "reference"):
        tab = table.clone().requires_grad_()
        z = ops.noise_embeddings(tokens, tab, alpha, sigma, noise=noise, drop_mask=drop, mask_index=V - 1,
                                 backend=backend)
        z.backward(upstream)
        res[backend] = (z, tab.grad)
    close(res["compiled"][0], res["reference"][0], dtype)
    close(res["compiled"][1], res["reference"][1], dtype, scale=4)


def test_noise_backward_cuda_deterministic_mode_matches_atomics():
    g = torch.Generator(CUDA).manual_seed(3)
    tokens = torch.randint(0, 5, (16, 256), device=CUDA, generator=g)
    grad = torch.randn(16, 256, 256, device=CUDA, generator=g)
    alpha = torch.rand(16, device=CUDA, generator=g)
    runs = [torch.ops.vqlcmd.noise_embeddings_backward(grad, tokens, None, -1, alpha, 5, True) for _ in range(3)]
    assert all(torch.equal(runs[0], r) for r in runs[1:])
    fast = torch.ops.vqlcmd.noise_embeddings_backward(grad, tokens, None, -1, alpha, 5, False)
    torch.testing.assert_close(fast, runs[0], atol=1e-3, rtol=1e-5)
    cpu = torch.ops.vqlcmd.noise_embeddings_backward(grad.cpu(), tokens.cpu(), None, -1, alpha.cpu(), 5, True)
    torch.testing.assert_close(runs[0].cpu(), cpu, atol=1e-3, rtol=1e-5)


@pytest.mark.parametrize("misaligned", [False, True])
@pytest.mark.parametrize("M", [3, 13])
@pytest.mark.parametrize("D", [256, 12, 5])
def test_noise_backward_cuda_hot_rows(D, M, misaligned):
    """Atomic backward against float64 when most tokens share a few rows (and the [mask] row): a thread's
    chunk of tokens merges equal rows and spans batches (M < chunk), grads of a misaligned view take the
    single-column kernel."""
    g = torch.Generator(CUDA).manual_seed(10)
    B, V = 7, 6
    tokens = torch.randint(0, 2, (B, M), device=CUDA, generator=g)
    drop = torch.rand(B, M, device=CUDA, generator=g) < 0.5
    grad = torch.randn(B * M * D + int(misaligned), device=CUDA, generator=g)[int(misaligned):].view(B, M, D)
    alpha = torch.rand(B, device=CUDA, generator=g) + 0.5
    ids = torch.where(drop, V - 1, tokens).reshape(-1)
    expected = torch.zeros(V, D, dtype=torch.float64, device=CUDA).index_add_(
        0, ids, (grad.double() * alpha.double()[:, None, None]).reshape(B * M, D))  # (-1, 0) is ambiguous: D = 0
    for deterministic in (False, True):
        out = torch.ops.vqlcmd.noise_embeddings_backward(grad, tokens, drop, V - 1, alpha, V, deterministic)
        torch.testing.assert_close(out.double(), expected, atol=1e-4, rtol=1e-5)


def test_noise_backward_cuda_bad_ids_raise():
    grad = torch.randn(1, 3, 8, device=CUDA)
    one = torch.ones(1, device=CUDA)
    for bad in ([[1, 9, 0]], [[1, -2, 0]]):
        for deterministic in (False, True):
            with pytest.raises(IndexError, match="outside the table"):
                torch.ops.vqlcmd.noise_embeddings_backward(grad, torch.tensor(bad, device=CUDA), None, -1, one, 5,
                                                           deterministic)
    torch.cuda.synchronize()


@pytest.mark.parametrize("N,D,V", [
    (16384, 256, 1025),  # the benchmark's shape
    (3 * 4096 + 5, 8, 1025),  # a ragged last chunk of tokens
    (40, 256, 3000),  # few tokens, most table rows untouched (zero)
    (64, 0, 10),  # D = 0: an empty gradient
])
def test_noise_backward_cuda_matches_float64(N, D, V):
    """The atomic backward against a float64 index_add, with 20% of tokens dropped to the [mask] row
    (summed in shared memory) and the rest spread over the table."""
    g = torch.Generator(CUDA).manual_seed(11)
    B = 4 if N % 4 == 0 else 1
    M = N // B
    tokens = torch.randint(0, V - 1, (B, M), device=CUDA, generator=g)
    drop = torch.rand(B, M, device=CUDA, generator=g) < 0.2
    grad = torch.randn(B, M, D, device=CUDA, generator=g).to(torch.bfloat16)
    alpha = torch.rand(B, device=CUDA, generator=g) + 0.5
    out = torch.ops.vqlcmd.noise_embeddings_backward(grad, tokens, drop, V - 1, alpha, V, False)
    ids = torch.where(drop, V - 1, tokens).reshape(-1)
    expected = torch.zeros(V, D, dtype=torch.float64, device=CUDA).index_add_(
        0, ids, (grad.double() * alpha.double()[:, None, None]).reshape(B * M, D))  # (-1, 0) is ambiguous: D = 0
    torch.testing.assert_close(out.double(), expected, atol=1e-3, rtol=1e-5)


@pytest.mark.parametrize("D", [256, 7])
def test_philox_noise_cuda_equals_cpu(D):
    """One algorithm in csrc/common/philox.h: same (seed, offset) gives the same noise on both devices."""
    draws = []
    for device in ("cpu", "cuda"):
        tokens = torch.zeros(8, 64, dtype=torch.long, device=device)
        table = torch.zeros(1, D, device=device)
        draws.append(torch.ops.vqlcmd.noise_embeddings(tokens, table, torch.zeros(8, device=device),
                                                       torch.ones(8, device=device), None, None, -1, 987654321, 12))
    torch.testing.assert_close(draws[1].cpu(), draws[0], atol=1e-5, rtol=1e-5)  # libm vs CUDA sin/cos/log ulps
    # the key read from a device tensor (the graph-safe path) is the same stream
    tokens, table = torch.zeros(8, 64, dtype=torch.long, device=CUDA), torch.zeros(1, D, device=CUDA)
    keyed = torch.ops.vqlcmd.noise_embeddings(tokens, table, torch.zeros(8, device=CUDA), torch.ones(8, device=CUDA),
                                              None, None, -1, 0, 12, torch.tensor([987654321], device=CUDA))
    assert torch.equal(keyed, draws[1])
    assert_standard_normal(draws[1])


def test_noise_cuda_generator_reproduces_and_advances():
    tokens = torch.zeros(4, 32, dtype=torch.long, device=CUDA)
    table = torch.zeros(1, 64, device=CUDA)
    a, s = torch.zeros(4, device=CUDA), torch.ones(4, device=CUDA)
    g1, g2 = torch.Generator(CUDA).manual_seed(9), torch.Generator(CUDA).manual_seed(9)
    first = ops.noise_embeddings(tokens, table, a, s, generator=g1, backend="compiled")
    second = ops.noise_embeddings(tokens, table, a, s, generator=g1, backend="compiled")
    assert not torch.equal(first, second)
    assert torch.equal(first, ops.noise_embeddings(tokens, table, a, s, generator=g2, backend="compiled"))


@pytest.mark.parametrize("z_dtype,table_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                                 (torch.float16, torch.float16)], ids=str)
def test_ddim_teacher_step_cuda(z_dtype, table_dtype):
    g = torch.Generator(CUDA).manual_seed(4)
    B, M, V, D = 4, 33, 65, 256
    tokens = torch.randint(0, V, (B, M), device=CUDA, generator=g)
    table = torch.randn(V, D, device=CUDA, generator=g).to(table_dtype)
    z_t = torch.randn(B, M, D, device=CUDA, generator=g).to(z_dtype)
    coef = [torch.rand(B, device=CUDA, generator=g) + 0.1 for _ in range(4)]
    close(ops.ddim_teacher_step(tokens, table, z_t, *coef, backend="compiled"),
          ops.ddim_teacher_step(tokens, table, z_t, *coef, backend="reference"), z_dtype)


def test_cuda_bad_ids_raise():
    table = torch.randn(5, 8, device=CUDA)
    bad = torch.tensor([[1, 9]], device=CUDA)
    one = torch.ones(1, device=CUDA)
    with pytest.raises(IndexError, match="outside the table"):
        torch.ops.vqlcmd.noise_embeddings(bad, table, one, one, None, None, -1, 0, 0)
    with pytest.raises(IndexError, match="outside the table"):
        torch.ops.vqlcmd.ddim_teacher_step(bad, table, torch.zeros(1, 2, 8, device=CUDA), one, one, one, one)
    torch.cuda.synchronize()  # the context survived


def test_cuda_id_checks_follow_the_switch_at_each_call(monkeypatch):
    """VQLCMD_CHECK_IDS is read at every call by the kernels as by Python (it was cached at the first one)."""
    table = torch.randn(5, 8, device=CUDA)
    bad = torch.tensor([[1, 9]], device=CUDA)
    z, one = torch.zeros(1, 2, 8, device=CUDA), torch.ones(1, device=CUDA)
    with pytest.raises(IndexError, match="outside the table"):
        torch.ops.vqlcmd.ddim_teacher_step(bad, table, z, one, one, one, one)
    monkeypatch.setenv("VQLCMD_CHECK_IDS", "off")
    out = torch.ops.vqlcmd.ddim_teacher_step(bad, table, z, one, one, one, one)
    assert out[0, 1].isnan().all() and out[0, 0].isfinite().all()  # the bad id's row is NaN, not a read
    monkeypatch.setenv("VQLCMD_CHECK_IDS", "sometimes")
    with pytest.raises(RuntimeError, match="VQLCMD_CHECK_IDS must be a yes/no value"):
        torch.ops.vqlcmd.ddim_teacher_step(bad, table, z, one, one, one, one)
    monkeypatch.setenv("VQLCMD_CHECK_IDS", "1")
    with pytest.raises(IndexError, match="outside the table"):
        torch.ops.vqlcmd.ddim_teacher_step(bad, table, z, one, one, one, one)


def test_opcheck_cuda():
    g = torch.Generator(CUDA).manual_seed(5)
    tokens = torch.randint(0, 9, (2, 5), device=CUDA, generator=g)
    table = torch.randn(10, 12, device=CUDA, generator=g, requires_grad=True)
    ab = torch.rand(2, device=CUDA, generator=g)
    t, s = torch.randn(3, 40, device=CUDA, generator=g), torch.randn(3, 40, device=CUDA, generator=g)
    torch.library.opcheck(torch.ops.vqlcmd.noise_embeddings.default, (tokens, table, ab, ab, None, None, -1, 3, 8))
    torch.library.opcheck(torch.ops.vqlcmd.ddim_teacher_step.default,
                          (tokens, table.detach(), torch.randn(2, 5, 12, device=CUDA), ab, ab, ab, ab))
    torch.library.opcheck(torch.ops.vqlcmd.categorical_kl.default, (t, s.requires_grad_(), True))


def capture(step):
    """(graph, its outputs): ``step`` warmed up on a side stream, as CUDA graphs need, then captured."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    return graph, captured


def assert_standard_normal(eps):
    """5-sigma bounds for the mean and variance of standard normal draws."""
    eps = eps.double()
    n = eps.numel()
    assert abs(eps.mean().item()) < 5 / n**0.5 and abs(eps.var().item() - 1) < 5 * (2 / n) ** 0.5


def test_drawn_noise_is_new_at_every_cuda_graph_replay():
    """The Philox key is drawn on the device inside the graph, so each replay draws new noise."""
    tokens = torch.zeros(8, 64, dtype=torch.long, device=CUDA)
    table = torch.zeros(1, 256, device=CUDA)
    a, s = torch.zeros(8, device=CUDA), torch.ones(8, device=CUDA)

    def step():
        return ops.noise_embeddings(tokens, table, a, s, backend="compiled")

    graph, captured = capture(step)
    draws = []
    for _ in range(2):
        graph.replay()
        draws.append(captured.clone())
    torch.cuda.synchronize()
    assert not torch.equal(draws[0], draws[1])
    for eps in draws:
        assert_standard_normal(eps)


def test_compiled_ops_replay_in_a_cuda_graph():
    """Under capture the id checks (a device sync) are off, so the ops capture; replays match eager."""
    g = torch.Generator(CUDA).manual_seed(6)
    B, M, V, D = 4, 16, 9, 32
    tokens = torch.randint(0, V, (B, M), device=CUDA, generator=g)
    table = torch.randn(V, D, device=CUDA, generator=g)
    noise = torch.randn(B, M, D, device=CUDA, generator=g)
    coef = [torch.rand(B, device=CUDA, generator=g) + 0.1 for _ in range(4)]

    def step():
        z = ops.noise_embeddings(tokens, table, coef[0], coef[1], noise=noise, backend="compiled")
        return z, ops.ddim_teacher_step(tokens, table, z, *coef, backend="compiled")

    eager = step()
    graph, captured = capture(step)
    noise.normal_(generator=g)  # replays read the new noise through the captured pointers
    expected = (ops.noise_embeddings(tokens, table, coef[0], coef[1], noise=noise, backend="reference"),)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(captured[0], expected[0])
    assert not torch.equal(captured[0], eager[0])


def test_raw_ops_refuse_tensors_on_another_device():
    """The dispatcher runs the CUDA kernel when any argument is on the GPU: a CPU argument is refused by
    name, instead of its host pointer being read on the device (an illegal access that ends the context)."""
    tokens = torch.randint(0, 10, (2, 3))
    table = torch.randn(10, 8)
    ones = torch.ones(2)
    z = torch.randn(2, 3, 8)
    cases = [
        ("tokens", lambda: torch.ops.vqlcmd.noise_embeddings(tokens, table.to(CUDA), ones.to(CUDA), ones.to(CUDA),
                                                             None, None, -1, 0, 0, None)),
        ("table", lambda: torch.ops.vqlcmd.noise_embeddings(tokens.to(CUDA), table, ones, ones, None, None, -1,
                                                            0, 0, None)),
        ("alpha", lambda: torch.ops.vqlcmd.noise_embeddings_backward(z.to(CUDA), tokens.to(CUDA), None, -1, ones,
                                                                     10, False)),
        ("alpha_t", lambda: torch.ops.vqlcmd.ddim_teacher_step(tokens.to(CUDA), table.to(CUDA), z.to(CUDA), ones,
                                                               ones.to(CUDA), ones.to(CUDA), ones.to(CUDA))),
        ("student_logits", lambda: torch.ops.vqlcmd.categorical_kl(z.to(CUDA), z, False)),
        ("grad_kl", lambda: torch.ops.vqlcmd.categorical_kl_backward(torch.ones(2, 3), z.to(CUDA), z.to(CUDA))),
    ]
    for name, call in cases:
        with pytest.raises(RuntimeError, match=f"{name} must be on"):
            call()
    torch.cuda.synchronize()  # the context survived
    assert torch.equal(torch.ones(3, device=CUDA).cpu(), torch.ones(3))


def test_categorical_kl_cuda_of_zero_classes_is_zero():
    t = torch.randn(3, 100, 0, device=CUDA)
    assert torch.equal(ops.categorical_kl(t, t.clone(), backend="compiled"), torch.zeros(3, 100, device=CUDA))
