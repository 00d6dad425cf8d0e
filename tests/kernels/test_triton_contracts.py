"""Contract points of the triton backend that no other test pinned (found by mutation testing). Small
shapes: these run in Triton's interpreter on CPU (tests/conftest.py sets TRITON_INTERPRET=1)."""
import pytest
import torch
from kernel_inputs import make

from vqlcmd import ops
from vqlcmd.ops import reference

# CPU tensors, and the interpreter's tiles, row splits and launch choices (a GPU's differ): the GPU paths are
# checked by test_softmax_embedding_average.py on the device
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="pins the Triton interpreter's CPU behaviour")


# ---- what the triton backend refuses, and says so -------------------------------------------

def test_triton_refuses_empty_classes_and_float64_tables_by_name():
    # unsupported_average: K = 0 would leave the kernels' softmax sum at 0 (a NaN row, where the reference
    # gives zeros); a float64 operand is the reference's ("float64 stays float64"), not float32 kernels'
    x, t = torch.randn(3, 0), torch.randn(0, 4)
    with pytest.raises(RuntimeError, match=r"empty class or embedding dimension \(K=0, D=4\)"):
        ops.softmax_embedding_average(x, t, backend="triton")
    assert torch.equal(ops.softmax_embedding_average(x, t), torch.zeros(3, 4))  # auto: the reference
    x, t = torch.randn(3, 5), torch.randn(5, 2, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="float32, bfloat16 or float16 table, got torch.float64"):
        ops.softmax_embedding_average(x, t, backend="triton")
    with pytest.raises(RuntimeError, match="table, got torch.float64"):
        ops.guided_embedding_average(x, x, t, 1.0, backend="triton")


# ---- fake impls (torch.compile) of mixed dtypes ------------------------------------------------

def test_fake_impl_gives_the_real_dtypes_of_16_bit_logits_with_a_float32_table():
    # the fake (what torch.compile traces) must give the real op's dtypes: out in the promoted dtype (float32
    # here), lse float32 always
    from torch._subclasses.fake_tensor import FakeTensorMode

    logits, table = make((6,), 40, 8, torch.bfloat16, "cpu")
    table = table.float()
    real = torch.ops.vqlcmd_triton.softmax_embedding_average(logits, table)
    with FakeTensorMode() as mode:
        fake = torch.ops.vqlcmd_triton.softmax_embedding_average(mode.from_tensor(logits), mode.from_tensor(table))
    assert [t.dtype for t in real] == [torch.float32, torch.float32]
    assert [(t.dtype, t.shape) for t in fake] == [(t.dtype, t.shape) for t in real]


# ---- guided: the result's dtype is cond's and the table's, whatever uncond's ------------------

def test_guided_result_dtype_ignores_uncond_dtype():
    # reference.guided_embedding_average returns promote(cond, table): a float32 uncond beside bf16 cond and
    # table must not make the triton result float32
    cond, table = make((20,), 300, 16, torch.bfloat16, "cpu")
    uncond = (cond.float() + 0.5 * torch.randn(20, 300, generator=torch.Generator().manual_seed(3)))
    expected = reference.guided_embedding_average(cond, uncond, table, 2.0)
    out = ops.guided_embedding_average(cond, uncond, table, 2.0, backend="triton")
    assert out.dtype == expected.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected.float(), rtol=2e-2, atol=2e-2)


# ---- deterministic mode reaches the kernels ---------------------------------------------------

@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "custom-op"])
def test_deterministic_mode_reaches_the_backward(compiled, sea, monkeypatch):
    # the module docstring: dtable's cross-split sum uses atomics unless torch.use_deterministic_algorithms(True),
    # which selects a fixed-order sum; the interpreter's atomics add in order anyway, so the flag is checked
    # where it is handed over (eager autograd.Function and the custom op's backward alike)
    seen = []
    original = sea.backward

    def spy(*args, **kwargs):
        seen.append(kwargs["deterministic"])
        return original(*args, **kwargs)

    monkeypatch.setattr(sea, "backward", spy)
    logits, table = make((130,), 48, 8, torch.float32, "cpu")
    upstream = torch.randn(130, 8, generator=torch.Generator().manual_seed(1))
    results = []
    for mode in (False, True):
        x, w = logits.clone().requires_grad_(), table.clone().requires_grad_()
        torch.use_deterministic_algorithms(mode)
        try:
            if compiled:
                out = torch.ops.vqlcmd_triton.softmax_embedding_average(x, w)[0]
            else:
                out = ops.softmax_embedding_average(x, w, backend="triton")
            out.backward(upstream)
        finally:
            torch.use_deterministic_algorithms(False)
        results.append(w.grad)
    assert seen == [False, True]
    x, w = logits.clone().requires_grad_(), table.clone().requires_grad_()
    reference.softmax_embedding_average(x, w).backward(upstream)
    for g in results:
        torch.testing.assert_close(g, w.grad, rtol=1e-5, atol=1e-5)


# ---- variant choice: an explicit argument beats the environment -------------------------------

@pytest.fixture
def launches(sea, monkeypatch):
    """(name, constexpr switches) of every kernel launched through the module's launcher."""
    seen = []
    original = sea._launch

    def spy(name, *args, **const):
        seen.append((name, const))
        return original(name, *args, **const)

    monkeypatch.setattr(sea, "_launch", spy)
    return seen


def test_an_explicit_variant_beats_the_environment(sea, launches, monkeypatch):
    # forward_variant / backward_variant: "``variant``, else $VQLCMD_TRITON_..., else" the default
    logits, table = make((20,), 40, 8, torch.float32, "cpu")
    monkeypatch.setenv("VQLCMD_TRITON_FORWARD", "first-tile")
    monkeypatch.setenv("VQLCMD_TRITON_BACKWARD", "chunked")
    assert sea.forward_variant("fused") == "fused" and sea.backward_variant("split") == "split"
    out, lse = sea.forward(logits, table, variant="fused")
    sea.backward(torch.ones_like(out), out, lse, logits, table, variant="split")
    assert [name for name, _ in launches] == ["forward", "grad_logits", "grad_table"]
    torch.testing.assert_close(out, reference.softmax_embedding_average(logits, table))


@pytest.mark.parametrize("variant", ["split", "fused"])
def test_deterministic_backward_sums_the_splits_without_atomics(variant, sea, launches):
    # 300 rows: three row splits under the interpreter; deterministic=True must take the per-split partials
    # (ATOMIC=False), whose fixed-order sum is what makes dtable reproducible on a GPU
    logits, table = make((300,), 40, 8, torch.float32, "cpu")
    out, lse = sea.forward(logits, table)
    upstream = torch.randn(300, 8, generator=torch.Generator().manual_seed(1))
    x, w = logits.clone().requires_grad_(), table.clone().requires_grad_()
    reference.softmax_embedding_average(x, w).backward(upstream)
    for deterministic in (False, True):
        launches.clear()
        g_logits, g_table = sea.backward(upstream, out, lse, logits, table, deterministic=deterministic,
                                         variant=variant)
        atomic = [const["ATOMIC"] for name, const in launches if "ATOMIC" in const]
        assert atomic == [not deterministic], launches
        torch.testing.assert_close(g_table, w.grad, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(g_logits, x.grad, rtol=1e-5, atol=1e-5)


def test_whole_row_kernels_take_tables_up_to_256_wide():
    # fused_fits / rows_fit: "D <= 256" (the configs' widest D tile), 16-bit operands on a GPU
    import triton.language as tl

    from vqlcmd.kernels import _launch

    for fits in (_launch.fused_fits, _launch.rows_fit):
        assert fits(256, tl.bfloat16) and fits(1, tl.float16) and not fits(257, tl.bfloat16)


def test_mm_backward_keeps_p_whole_up_to_its_byte_cap(monkeypatch):
    # mm_rows: "all N while P (N, K) at p_bytes per element fits MM_P_BYTES", else whole 128-row blocks
    from vqlcmd.kernels import _launch

    monkeypatch.setattr(_launch, "MM_P_BYTES", 300 * 1000 * 2)
    assert _launch.mm_rows(300, 1000, 2) == 300  # exactly the cap: one piece
    assert _launch.mm_rows(301, 1000, 2) == 256  # over it: whole blocks of 128 rows that fit


@pytest.mark.parametrize("variant", ["fused", "first-tile"])
def test_a_fully_masked_row_gets_the_log_sum_exp_of_minus_inf(variant, sea):
    # _finite_reference: "a row of -inf logits (all classes masked) takes 0, so that it gets exp2(-inf) = 0
    # everywhere, as in the one-pass kernel": its lse is logsumexp's -inf (its average is the reference's NaN),
    # and the other rows of its program are unaffected
    logits, table = make((4,), 600, 8, torch.float32, "cpu")
    logits[1] = float("-inf")
    out, lse = sea.forward(logits, table, variant=variant)
    torch.testing.assert_close(lse, logits.logsumexp(-1))
    torch.testing.assert_close(out, reference.softmax_embedding_average(logits, table), rtol=1e-5, atol=1e-5,
                               equal_nan=True)
