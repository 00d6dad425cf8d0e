"""The triton backend of softmax_embedding_average and guided_embedding_average against the reference.

On CPU these run in Triton's interpreter (tests/kernels/conftest.py), so row counts stay small;
the shapes still cross every tile edge: K = 1000 spans several K tiles with a ragged last one,
257 rows leave a one-row tail block and three dtable row splits (260 rows do at K = 1024, D = 256),
D = 48 and D = 300 are ragged.
The four backward variants (the fused kernel, the split kernels, the chunked one that leaves
its products to torch.mm, and "mm", the split dlogits kernel writing P for a torch.mm dtable;
VQLCMD_TRITON_BACKWARD) are run, the split and mm ones with either dlogits kernel (tiles, or
rows summing delta itself; VQLCMD_TRITON_DLOGITS), and the spy ``launched`` checks which kernels
a backward actually took. The defaults choose by the inputs' dtype, not by the interpreter's
float32 operands, so bf16 inputs run here the kernels a GPU runs for them by default. The chunked
variant's chunks are 128 rows under the interpreter.
"""
import pytest
import torch
from kernel_inputs import make

from vqlcmd import ops
from vqlcmd.ops import reference

# |actual - expected| <= rtol * |expected| + atol * max|expected|: bf16 outputs are rounded to
# 8 bits, and dlogits = P(dY·Eᵀ − delta) takes delta from the rounded output Y, as FlashAttention does.
TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 1e-2), torch.float16: (2e-3, 2e-3)}

# (leading dims, K, D)
SHAPES = [((2, 16), 1024, 256), ((2, 130), 1024, 256), ((1,), 1000, 48), ((257,), 1000, 48)]


def assert_close(actual, expected, dtype):
    rtol, atol = TOL[dtype]
    assert actual.dtype == expected.dtype
    scale = expected.float().abs().max().item()
    torch.testing.assert_close(actual.float(), expected.float(), rtol=rtol, atol=atol * max(scale, 1e-6))


def grads(fn, logits, table, upstream):
    logits = logits.detach().requires_grad_()
    table = table.detach().requires_grad_()
    out = fn(logits, table)
    out.backward(upstream)
    return out, logits.grad, table.grad


def triton_average(logits, table):
    return ops.softmax_embedding_average(logits, table, backend="triton")


@pytest.fixture
def launched(sea, monkeypatch):
    """Names of the kernels launched through the module's launcher, in order."""
    names = []
    original = sea._launch

    def spy(name, *args, **kwargs):
        names.append(name)
        return original(name, *args, **kwargs)

    monkeypatch.setattr(sea, "_launch", spy)
    return names


VARIANTS = ["fused", "split", "chunked", "mm"]


def is_16_bit(dtype):
    return dtype in (torch.bfloat16, torch.float16)


def forward_kernel(dtype):
    """What the default forward launches: the fixed-max kernel ("first-tile") for 16-bit inputs."""
    return "forward_fixed_max" if is_16_bit(dtype) else "forward"


def backward_kernels(sea, variant, N, D, dot, rows=False):
    """What a backward of both gradients launches through ``_launch`` under the interpreter; ``rows``: the
    rows dlogits kernel was asked for (the 16-bit default), which the split and mm backwards take."""
    dlogits = "grad_logits_rows" if rows and variant in ("split", "mm") else "grad_logits"
    if variant == "chunked":
        return ["chunk"] * -(-N // 128)
    if variant == "mm":  # the dtable product is a torch.mm, not a launch
        return [dlogits]
    return ["fused_backward"] if variant == "fused" and sea.fused_fits(D, dot) else [dlogits, "grad_table"]


def assert_matches_reference(lead, K, D, dtype, device):
    """Output and both gradients (non-unit upstream) of the triton backend against the reference; returns
    the inputs (logits, table)."""
    logits, table = make(lead, K, D, dtype, device)
    upstream = torch.randn(*lead, D, generator=torch.Generator().manual_seed(1)).to(device, dtype)
    for ours, theirs in zip(grads(triton_average, logits, table, upstream),
                            grads(reference.softmax_embedding_average, logits, table, upstream)):
        assert_close(ours, theirs, dtype)
    return logits, table


def test_auto_variants_follow_the_h200_measurements_by_input_dtype(sea, monkeypatch):
    # benchmarks/results/h200-2026-11-28.jsonl (bf16): the first-tile forward and the rows dlogits kernel
    # won; float32 keeps the one-pass forward (Triton 3.6 did not compile the fixed-max one for it) and
    # the tiles, and the split backward
    for env in ("VQLCMD_TRITON_FORWARD", "VQLCMD_TRITON_BACKWARD", "VQLCMD_TRITON_DLOGITS"):
        monkeypatch.delenv(env, raising=False)
    assert sea.forward_variant() == sea.backward_variant() == sea.dlogits_variant() == "auto"
    assert [f(is_16_bit=True) for f in (sea.forward_variant, sea.backward_variant, sea.dlogits_variant)] == [
        "first-tile", "mm", "rows"]
    assert [f(is_16_bit=False) for f in (sea.forward_variant, sea.backward_variant, sea.dlogits_variant)] == [
        "fused", "split", "tiles"]
    assert sea.backward_variant("fused", is_16_bit=True) == "fused"  # an explicit choice stands
    assert sea.forward_variant("chunked", is_16_bit=True) == "chunked"
    assert sea.dlogits_variant("tiles", is_16_bit=True) == "tiles"
    x = torch.empty(1)
    assert sea.sixteen_bit(x.bfloat16(), x.bfloat16()) and sea.sixteen_bit(x.half())
    assert not sea.sixteen_bit(x.bfloat16(), x)  # promotes to float32


def test_float32_operands_take_the_one_pass_forward_on_a_gpu(sea, monkeypatch):
    # Triton 3.6 failed to compile the fixed-max forward for float32 operands on an H200
    # (benchmarks/results/h200-2026-11-28-gpu-tests.txt): on a GPU (interpreted False here) float32
    # inputs launch the one-pass kernel, by default and when "first-tile" is asked for alike
    import triton.language as tl

    from vqlcmd.kernels import _launch

    monkeypatch.delenv("VQLCMD_TRITON_FORWARD", raising=False)
    monkeypatch.setattr(_launch, "interpreted", False)
    assert not _launch.fixed_max_fits(tl.float32)
    assert _launch.fixed_max_fits(tl.bfloat16) and _launch.fixed_max_fits(tl.float16)
    names = []
    monkeypatch.setattr(sea, "_launch", lambda name, *args, **kwargs: names.append(name))  # records, runs nothing
    logits, table = torch.randn(4, 32), torch.randn(32, 8)
    for variant in (None, "first-tile"):
        sea.forward(logits, table, variant=variant)
    assert names == ["forward", "forward"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_defaults_launch_what_a_gpu_runs_for_the_dtype(dtype, device, sea, launched, monkeypatch):
    # no variant asked for: bf16 takes the first-tile forward and the mm backward's rows dlogits kernel
    # (dtable by torch.mm), float32 the one-pass forward and the split backward's tile kernels; the same
    # launches on a GPU as in the interpreter
    for env in ("VQLCMD_TRITON_FORWARD", "VQLCMD_TRITON_BACKWARD", "VQLCMD_TRITON_DLOGITS"):
        monkeypatch.delenv(env, raising=False)
    assert_matches_reference((130,), 1000, 48, dtype, device)
    expected = {torch.bfloat16: ["forward_fixed_max", "grad_logits_rows"],
                torch.float32: ["forward", "grad_logits", "grad_table"]}
    assert launched == expected[dtype]


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lead,K,D", SHAPES)
def test_output_and_gradients_match_reference(lead, K, D, dtype, variant, device, sea, launched, monkeypatch):
    monkeypatch.setenv("VQLCMD_TRITON_BACKWARD", variant)
    logits, _ = assert_matches_reference(lead, K, D, dtype, device)
    if not torch.cuda.is_available():  # on a GPU fp32 never takes the fused kernel, and chunks are larger
        N = logits[..., 0].numel()
        assert launched == [forward_kernel(dtype), *backward_kernels(sea, variant, N, D, None, is_16_bit(dtype))]


@pytest.mark.parametrize("variant", ["split", "mm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lead,K,D", SHAPES)
def test_other_dlogits_kernel_matches_reference(lead, K, D, dtype, variant, device, sea, launched, monkeypatch):
    # the dlogits kernel the dtype does not take by default: for float32 the one over blocks of whole rows
    # (VQLCMD_TRITON_DLOGITS=rows, which sums delta itself; on a GPU float32 keeps the tiles), for bf16 the
    # tiles one after the delta kernel. K = 1024 and D = 256 fill the tiles (EVEN_K, EVEN_D), K = 1000 and
    # D = 48 do not
    rows = not is_16_bit(dtype)
    monkeypatch.setenv("VQLCMD_TRITON_BACKWARD", variant)
    monkeypatch.setenv("VQLCMD_TRITON_DLOGITS", "rows" if rows else "tiles")
    logits, _ = assert_matches_reference(lead, K, D, dtype, device)
    if not torch.cuda.is_available():
        N = logits[..., 0].numel()
        assert launched == [forward_kernel(dtype), *backward_kernels(sea, variant, N, D, None, rows)]


@pytest.mark.parametrize("forward,dlogits", [("fused", "tiles"), ("first-tile", "rows")])
@pytest.mark.parametrize("lead,K,D", [((3,), 7, 5), ((2,), 1, 3), ((5,), 300, 1)])
def test_tiny_shapes_every_kernel_variant(lead, K, D, forward, dlogits, device, monkeypatch):
    # one class, one embedding column, tiles far larger than the problem, through the mm backward
    monkeypatch.setenv("VQLCMD_TRITON_FORWARD", forward)
    monkeypatch.setenv("VQLCMD_TRITON_DLOGITS", dlogits)
    monkeypatch.setenv("VQLCMD_TRITON_BACKWARD", "mm")
    logits, table = make(lead, K, D, torch.float32, device)
    upstream = torch.randn(*lead, D, generator=torch.Generator().manual_seed(1)).to(device)
    (out, g_logits, g_table), (r_out, r_logits, r_table) = (
        grads(fn, logits, table, upstream) for fn in (triton_average, reference.softmax_embedding_average))
    assert_close(out, r_out, torch.float32)
    assert_close(g_table, r_table, torch.float32)
    # dlogits = P (dY·tableᵀ − delta) cancels to exactly 0 at K = 1: allow the rounding of its terms
    terms = (upstream.abs() @ table.abs().t()).max()
    torch.testing.assert_close(g_logits, r_logits, rtol=1e-5, atol=1e-6 * terms.item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lead,K,D", SHAPES)
def test_chunked_forward_matches_reference(lead, K, D, dtype, device, sea, launched, monkeypatch):
    # the chunked forward (softmax per chunk in Triton, P·table by torch.mm) with the chunked backward,
    # and the log-sum-exp it saves
    monkeypatch.setenv("VQLCMD_TRITON_FORWARD", "chunked")
    monkeypatch.setenv("VQLCMD_TRITON_BACKWARD", "chunked")
    logits, table = assert_matches_reference(lead, K, D, dtype, device)
    _, lse = sea.forward(logits.reshape(-1, K), table)
    torch.testing.assert_close(lse, logits.reshape(-1, K).float().logsumexp(-1), rtol=1e-5, atol=1e-5)
    if not torch.cuda.is_available():
        chunks = -(-logits[..., 0].numel() // 128)
        assert launched == ["chunk_probs"] * chunks + ["chunk"] * chunks + ["chunk_probs"] * chunks


@pytest.mark.parametrize("forward", ["fused", "first-tile"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lead,K,D", SHAPES)
def test_each_forward_and_its_log_sum_exp_match_reference(lead, K, D, dtype, forward, device, sea, launched,
                                                          monkeypatch):
    # the one-pass forward and the first-tile one (P·table against its first K tile's max, no online
    # rescaling; on a GPU float32 takes the one-pass kernel), and the log-sum-exp each saves; K = 1024 and
    # D = 256 fill every tile (the kernels' EVEN_K / EVEN_D path, no masks), K = 1000 and D = 48 end on
    # ragged ones
    monkeypatch.setenv("VQLCMD_TRITON_FORWARD", forward)
    logits, table = assert_matches_reference(lead, K, D, dtype, device)
    _, lse = sea.forward(logits.reshape(-1, K), table)
    torch.testing.assert_close(lse, logits.reshape(-1, K).float().logsumexp(-1), rtol=1e-5, atol=1e-5)
    if not torch.cuda.is_available():
        N = logits[..., 0].numel()
        name = "forward_fixed_max" if forward == "first-tile" else "forward"
        backward = backward_kernels(sea, "mm" if is_16_bit(dtype) else "split", N, D, None, is_16_bit(dtype))
        assert launched == [name, *backward, name]


@pytest.mark.parametrize("spread", [39.0, 41.0, 60.0, 95.0, 1e4])  # 95: e^95 is past float32
def test_first_tile_forward_sweeps_again_where_logits_spread_beyond_its_reference(spread, device, sea):
    # one row's max lies `spread` above its first K tile's: up to max_gap (40) the first sweep stands,
    # beyond it that program sweeps again from the true maxima; both must match the reference
    logits, table = make((130,), 1000, 24, torch.float32, device)
    logits[70, 900] = logits[70, :256].max() + spread  # 256: the interpreter's first K tile
    out, lse = sea.forward(logits, table, variant="first-tile")
    assert_close(out, reference.softmax_embedding_average(logits, table), torch.float32)
    torch.testing.assert_close(lse, logits.logsumexp(-1))


@pytest.mark.parametrize("guided", [False, True])
def test_first_tile_forward_with_a_first_tile_of_minus_inf_and_very_negative_logits(guided, device, sea):
    # a first K tile of -inf made the row's reference 0; logits near -200 then underflowed exp(s - 0) to 0
    # (out NaN, lse -inf), as the second sweep only looked for maxima far above the reference
    first = 256 if device.type == "cpu" else 512  # the first K tile: the interpreter's, or wider than a GPU's
    logits, table = make((4,), first + 344, 16, torch.float32, device)
    logits = 3 * logits - 200.0
    logits[:, :first] = float("-inf")
    uncond, w, expected = None, 0.0, reference.softmax_embedding_average(logits, table)
    if guided:  # classes masked in cond only stay masked: (1 + w)(-inf) - w u = -inf
        uncond = torch.where(logits.isinf(), 0.0, logits + 0.5 * torch.randn_like(logits))
        w = 2.0
        expected = reference.guided_embedding_average(logits, uncond, table, w)
    out, lse = sea.forward(logits, table, uncond=uncond, guidance=w, variant="first-tile")
    assert_close(out, expected, torch.float32)
    if not guided:
        torch.testing.assert_close(lse, logits.logsumexp(-1))


def test_guided_scores_keep_their_precision_at_large_guidance(device):
    # (1 + w) c - w u rounded each term at the logits' scale; c + w (c - u) cancels the offset c and u share
    cond, table = make((8,), 1000, 16, torch.float32, device)
    cond = 3 * cond + 100.0  # a per-row offset, which the softmax ignores
    uncond = cond + 0.5 * torch.randn_like(cond)
    w = 10.0
    exact = reference.guided_embedding_average(cond.double(), uncond.double(), table.double(), w).float()
    out = ops.guided_embedding_average(cond, uncond, table, w, backend="triton")
    torch.testing.assert_close(out, exact, rtol=1e-5, atol=1e-5 * exact.abs().max().item())


def _non_contiguous_inputs(device):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(40, 6, generator=g).t().to(device)  # (6, 40), column-major
    table = torch.randn(8, 40, generator=g).t().to(device)  # (40, 8), as a tied weight W.t()
    return logits, table


def test_backward_fake_impl_has_the_real_strides(device):
    # the fake copied the inputs' strides (empty_like) where the kernels return contiguous gradients, and
    # inductor then stopped on a stride assertion for a transposed logits or table
    from torch._subclasses.fake_tensor import FakeTensorMode

    logits, table = _non_contiguous_inputs(device)
    out, lse = torch.ops.vqlcmd_triton.softmax_embedding_average(logits, table)
    args = (torch.randn_like(out), None, out, lse, logits, table, True, True, False)
    real = torch.ops.vqlcmd_triton.softmax_embedding_average_backward(*args)
    with FakeTensorMode() as mode:
        fake = torch.ops.vqlcmd_triton.softmax_embedding_average_backward(
            *[mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args])
    assert [t.stride() for t in fake] == [t.stride() for t in real]


@pytest.mark.slow  # an inductor compile of the backward
def test_inductor_gradients_of_a_transposed_table(device):
    _, table = _non_contiguous_inputs(device)
    logits = torch.randn(6, 40, generator=torch.Generator().manual_seed(2)).to(device)
    upstream = torch.randn(6, 8, generator=torch.Generator().manual_seed(1)).to(device)

    def loss(x, w, backend):
        return (ops.softmax_embedding_average(x, w, backend=backend) * upstream).sum()

    def gradients(fn, backend):
        x, w = logits.detach().requires_grad_(), table.detach().requires_grad_()
        fn(x, w, backend).backward()
        return x.grad, w.grad

    from torch._inductor import config as inductor_config

    expected = gradients(loss, "reference")
    torch._dynamo.reset()
    with inductor_config.patch(force_disable_caches=True):  # a cached graph would hide the fake's strides
        got = gradients(torch.compile(loss, backend="inductor", fullgraph=True), "triton")
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_deterministic_mode_fixes_the_tiles_on_a_gpu(monkeypatch):
    # the autotuner picks tiles by timing and the tiles order the sums: under use_deterministic_algorithms
    # a large problem on a GPU gets the fixed tiles instead (the interpreter's tiles are fixed anyway)
    import triton.language as tl

    from vqlcmd.kernels import _launch

    monkeypatch.setattr(_launch, "interpreted", False)
    cuda = torch.device("cuda")
    assert _launch.blocks("forward", 32768, 1024, 256, cuda, tl.bfloat16) is None  # autotuned
    torch.use_deterministic_algorithms(True)
    try:
        fixed = _launch.blocks("forward", 32768, 1024, 256, cuda, tl.bfloat16)
    finally:
        torch.use_deterministic_algorithms(False)
    assert fixed is not None and fixed["BLOCK_K"] <= 1024


@pytest.mark.parametrize("forward", ["fused", "first-tile"])
def test_extreme_logits_stay_finite(forward, device, sea, monkeypatch):
    # logits of ±1e4, a row's max in its last K tile far above the first tiles' (what the one-pass
    # kernel rescales for and the first-tile one must sweep again for), rows of equal logits
    monkeypatch.setenv("VQLCMD_TRITON_FORWARD", forward)
    logits, table = make((6,), 1000, 24, torch.float32, device)
    logits[0, -1] = 1e4
    logits[1, 0] = 1e4
    logits[2] = -1e4
    logits[3, ::2] = 1e4
    logits[3, 1::2] = -1e4
    logits[4, 500] = 40.0  # one class beyond the others' exp range in float32 (e^-40 relative)
    upstream = torch.randn(6, 24).to(device)
    out, g_logits, g_table = grads(triton_average, logits, table, upstream)
    ref, r_logits, r_table = grads(reference.softmax_embedding_average, logits, table, upstream)
    assert torch.isfinite(out).all() and torch.isfinite(g_logits).all()
    assert_close(out, ref, torch.float32)
    # The backward recomputes P = exp(s − lse) from the float32 lse, as FlashAttention does: at |lse| ~
    # 1e4 its rounding (half an ulp, 4.9e-4) is a relative error of P that subtracting the row max avoids.
    lse_ulp = torch.finfo(torch.float32).eps * logits.abs().amax(-1, keepdim=True)
    bound = r_logits.abs() * lse_ulp + 1e-5 * r_logits.abs().max()
    assert ((g_logits - r_logits).abs() <= bound).all()
    assert_close(g_table, r_table, torch.float32)
    _, lse = sea.forward(logits, table)
    torch.testing.assert_close(lse, logits.logsumexp(-1))


# (need_logits, need_table): a single gradient takes its own split kernel whatever the variant
NEEDS = [(True, True), (True, False), (False, True)]


# (backward variant, which dlogits kernel): the fused and chunked backwards have their own, split and mm
# take the tiles one (after the delta kernel) or the rows one (which sums delta itself)
VARIANT_DLOGITS = [("fused", "tiles"), ("split", "tiles"), ("chunked", "tiles"), ("mm", "tiles"),
                   ("split", "rows"), ("mm", "rows"), ("fused", "rows")]


@pytest.mark.parametrize("variant,dlogits", VARIANT_DLOGITS)
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backward_kernels_with_lse_gradient(dtype, deterministic, variant, dlogits, device, sea, launched,
                                            monkeypatch):
    # The backward entry point directly: every (need_logits, need_table) pair, a gradient on lse as
    # well as on the output, atomic and split-by-split dtable sums. 300 rows: three row splits with
    # a ragged last one (splits are 128 rows under the interpreter).
    monkeypatch.setenv("VQLCMD_TRITON_DLOGITS", dlogits)
    N, K, D = 300, 1000, 48
    logits, table = make((N,), K, D, dtype, device, seed=2)
    g = torch.Generator().manual_seed(3)
    upstream = torch.randn(N, D, generator=g).to(device, dtype)
    grad_lse = torch.randn(N, generator=g).to(device)
    ref_logits, ref_table = logits.detach().requires_grad_(), table.detach().requires_grad_()
    ref_out = reference.softmax_embedding_average(ref_logits, ref_table)
    ref_lse = ref_logits.float().logsumexp(-1)
    ((ref_out.float() * upstream.float()).sum() + (ref_lse * grad_lse).sum()).backward()
    out, lse = sea.forward(logits, table)
    for need_logits, need_table in NEEDS:
        launched.clear()
        g_logits, g_table = sea.backward(upstream, out, lse, logits, table, grad_lse, need_logits=need_logits,
                                         need_table=need_table, deterministic=deterministic, variant=variant)
        assert (g_logits is None) != need_logits and (g_table is None) != need_table
        if need_logits:
            assert_close(g_logits, ref_logits.grad, dtype)
        if need_table:
            assert_close(g_table, ref_table.grad, dtype)
        fused = variant == "fused" and need_logits and need_table and sea.fused_fits(D, sea.dot_dtype(table))
        assert ("fused_backward" in launched) == fused, launched
        assert ("chunk" in launched) == (variant == "chunked"), launched
        # "mm" with both gradients: the dlogits kernel also writes P, and dtable is a torch.mm
        mm = variant == "mm" and need_logits
        assert ("grad_table" in launched) == (need_table and not fused and not mm and variant != "chunked"), launched
        rows = dlogits == "rows" and variant in ("split", "mm") and need_logits
        if not torch.cuda.is_available():  # on a GPU float32 keeps the tile kernel (rows_fit)
            assert ("grad_logits_rows" in launched) == rows and not (rows and "grad_logits" in launched), launched


def test_wide_tables_and_unknown_variants(sea, launched, monkeypatch):
    # D > 256 does not fit the fused kernel's on-chip dtable tile nor the rows kernel's dY block: the
    # split kernels take it
    logits, table = make((5,), 40, 300, torch.float32, "cpu")
    out, lse = sea.forward(logits, table)
    for dlogits in ("tiles", "rows"):
        monkeypatch.setenv("VQLCMD_TRITON_DLOGITS", dlogits)
        launched.clear()
        sea.backward(torch.randn_like(out), out, lse, logits, table)
        assert launched == ["grad_logits", "grad_table"]
    monkeypatch.setenv("VQLCMD_TRITON_DLOGITS", "row")
    with pytest.raises(ValueError, match="VQLCMD_TRITON_DLOGITS"):
        sea.backward(out, out, lse, logits, table)
    monkeypatch.delenv("VQLCMD_TRITON_DLOGITS")
    monkeypatch.setenv("VQLCMD_TRITON_BACKWARD", "fast")
    with pytest.raises(ValueError, match="VQLCMD_TRITON_BACKWARD"):
        sea.backward(out, out, lse, logits, table)
    monkeypatch.setenv("VQLCMD_TRITON_FORWARD", "two-pass")  # deleted: it lost on an H200
    with pytest.raises(ValueError, match="VQLCMD_TRITON_FORWARD must be one of auto, fused, first-tile, chunked"):
        sea.forward(logits, table)
    monkeypatch.setenv("VQLCMD_TRITON_FORWARD", "chunked")
    monkeypatch.setenv("VQLCMD_TRITON_BACKWARD", "chunked")
    monkeypatch.setenv("VQLCMD_TRITON_CHUNK_ROWS", "0")
    with pytest.raises(ValueError, match="VQLCMD_TRITON_CHUNK_ROWS"):
        sea.backward(out, out, lse, logits, table)


@pytest.mark.parametrize("chunk_rows", ["1", "50", "4096"])
def test_chunked_backward_any_chunk_size(chunk_rows, device, sea, launched, monkeypatch):
    # one-row chunks, a ragged last chunk (257 = 5 x 50 + 7) and one chunk larger than the batch
    monkeypatch.setenv("VQLCMD_TRITON_BACKWARD", "chunked")
    monkeypatch.setenv("VQLCMD_TRITON_CHUNK_ROWS", chunk_rows)
    N = 257 if chunk_rows != "1" else 5
    logits, table = make((N,), 1000, 48, torch.float32, device)
    upstream = torch.randn(N, 48, generator=torch.Generator().manual_seed(4)).to(device)
    out, g_logits, g_table = grads(triton_average, logits, table, upstream)
    ref, r_logits, r_table = grads(reference.softmax_embedding_average, logits, table, upstream)
    assert_close(g_logits, r_logits, torch.float32)
    assert_close(g_table, r_table, torch.float32)
    assert launched.count("chunk") == -(-N // min(int(chunk_rows), N))


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dlogits", ["tiles", "rows"])
def test_the_rows_kernel_replaces_the_delta_kernel_in_split_and_mm(dlogits, variant, device, sea, monkeypatch):
    # under the interpreter (float32 operands) and with 16-bit ones on a GPU; the fused and chunked
    # backwards read delta from memory whatever VQLCMD_TRITON_DLOGITS says
    delta_launches = []
    original = sea._delta_kernel

    class Spy:
        def __getitem__(self, grid):
            delta_launches.append(grid)
            return original[grid]

    monkeypatch.setattr(sea, "_delta_kernel", Spy())
    monkeypatch.setenv("VQLCMD_TRITON_DLOGITS", dlogits)
    dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    logits, table = make((40,), 100, 32, dtype, device)
    out, lse = sea.forward(logits, table)
    sea.backward(torch.randn_like(out), out, lse, logits, table, variant=variant)
    own = dlogits == "rows" and variant in ("split", "mm")
    assert len(delta_launches) == (0 if own else 1)


@pytest.mark.parametrize("dlogits", ["tiles", "rows"])
def test_mm_backward_rows_in_pieces_when_p_is_large(dlogits, device, sea, launched, monkeypatch):
    # P capped at 128 rows of K = 1000 float32 (interpreter) / 16-bit (GPU): 257 rows in three pieces,
    # the last of one row, each a dlogits launch and a product added into one float32 dtable; with
    # delta summed by the rows dlogits kernel, each piece reads its own rows of Y
    from vqlcmd.kernels import _launch

    monkeypatch.setenv("VQLCMD_TRITON_DLOGITS", dlogits)
    dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    p_bytes = dtype.itemsize  # P is stored in the dot operand dtype: the inputs' here
    monkeypatch.setenv("VQLCMD_TRITON_BACKWARD", "mm")
    monkeypatch.setattr(_launch, "MM_P_BYTES", 128 * 1000 * p_bytes)
    assert _launch.mm_rows(257, 1000, p_bytes) == 128 and _launch.mm_rows(100, 1000, p_bytes) == 100
    logits, table = make((257,), 1000, 48, dtype, device)
    upstream = torch.randn(257, 48, generator=torch.Generator().manual_seed(4)).to(device, dtype)
    out, g_logits, g_table = grads(triton_average, logits, table, upstream)
    ref, r_logits, r_table = grads(reference.softmax_embedding_average, logits, table, upstream)
    assert_close(g_logits, r_logits, dtype)
    assert_close(g_table, r_table, dtype)
    assert launched.count("grad_logits" if dlogits == "tiles" else "grad_logits_rows") == 3


@pytest.mark.parametrize("table_dtype", [torch.float16, torch.float32])
def test_float16_and_mixed_dtypes(table_dtype, device):
    # fp16 logits with an fp16 table, or an fp32 one (output promoted to fp32, as the reference does;
    # each gradient keeps its input's dtype)
    logits, table = make((40,), 300, 24, torch.float16, device)
    table = table.to(table_dtype)
    upstream = torch.randn(40, 24).to(device, table_dtype)
    for a, b in zip(grads(triton_average, logits, table, upstream),
                    grads(reference.softmax_embedding_average, logits, table, upstream)):
        assert_close(a, b, torch.float16)


def test_wide_embedding_is_tiled_over_d(device):
    logits, table = make((5,), 40, 300, torch.float32, device)
    upstream = torch.randn(5, 300).to(device)
    for a, b in zip(grads(triton_average, logits, table, upstream),
                    grads(reference.softmax_embedding_average, logits, table, upstream)):
        assert_close(a, b, torch.float32)


def test_only_logits_need_gradient(device):
    # frozen embeddings (paper ablation): no dtable work, gradient still right
    logits, table = make((33,), 100, 16, torch.float32, device)
    logits.requires_grad_()
    out = triton_average(logits, table)
    out.pow(2).sum().backward()
    expected = logits.detach().requires_grad_()
    reference.softmax_embedding_average(expected, table).pow(2).sum().backward()
    assert_close(logits.grad, expected.grad, torch.float32)


@pytest.mark.parametrize("variant", ["fused", "first-tile", "chunked"])
def test_masked_classes_are_ignored(variant, device, monkeypatch):
    # -inf logits (masked classes), including a whole first K tile, give no NaN
    monkeypatch.setenv("VQLCMD_TRITON_FORWARD", variant)
    monkeypatch.setenv("VQLCMD_TRITON_BACKWARD", "chunked" if variant == "chunked" else "split")
    logits, table = make((20,), 600, 16, torch.float32, device)
    logits[:, :300] = float("-inf")
    logits[3, 450:] = float("-inf")
    upstream = torch.randn(20, 16).to(device)
    out, g_logits, g_table = grads(triton_average, logits, table, upstream)
    ref, r_logits, r_table = grads(reference.softmax_embedding_average, logits, table, upstream)
    assert not out.isnan().any()
    assert_close(out, ref, torch.float32)
    assert_close(g_logits, r_logits, torch.float32)
    assert_close(g_table, r_table, torch.float32)


@pytest.mark.parametrize("variant", VARIANTS)
def test_deterministic_dtable_is_reproducible(variant, device, monkeypatch):
    monkeypatch.setenv("VQLCMD_TRITON_BACKWARD", variant)
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic torch.mm on CUDA (chunked)
    logits, table = make((257,), 64, 16, torch.float32, device)
    upstream = torch.randn(257, 16).to(device)
    _, _, atomic = grads(triton_average, logits, table, upstream)
    torch.use_deterministic_algorithms(True)
    try:
        first = grads(triton_average, logits, table, upstream)[2]
        second = grads(triton_average, logits, table, upstream)[2]
    finally:
        torch.use_deterministic_algorithms(False)
    assert torch.equal(first, second)
    assert_close(first, atomic, torch.float32)


@pytest.mark.parametrize("table_grad", [False, True])
def test_log_sum_exp_gradient(table_grad, device):
    # the op also returns lse for its backward; a gradient reaching it must still be right
    # (with a table gradient too, the fused backward folds it into delta)
    logits, table = make((9,), 70, 8, torch.float32, device)
    ours, our_table = logits.detach().requires_grad_(), table.detach().requires_grad_(table_grad)
    out, lse = torch.ops.vqlcmd_triton.softmax_embedding_average(ours, our_table)
    (out.sum() + 2 * lse.sum()).backward()
    theirs, their_table = logits.detach().requires_grad_(), table.detach().requires_grad_(table_grad)
    (reference.softmax_embedding_average(theirs, their_table).sum() + 2 * theirs.logsumexp(-1).sum()).backward()
    torch.testing.assert_close(lse, logits.logsumexp(-1))
    assert_close(ours.grad, theirs.grad, torch.float32)
    if table_grad:
        assert_close(our_table.grad, their_table.grad, torch.float32)


def test_empty_batch_and_non_contiguous_inputs(device):
    logits, table = make((6,), 40, 8, torch.float32, device)
    assert triton_average(logits[:0], table).shape == (0, 8)
    strided = logits.t().contiguous().t()  # column-major (6, 40)
    assert_close(triton_average(strided, table), reference.softmax_embedding_average(logits, table), torch.float32)


# ---- guided variant ---------------------------------------------------------------------------------

@pytest.mark.parametrize("forward", ["fused", "first-tile", "chunked"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lead,K,D,scale", [((2, 8), 1024, 256, 1.0), ((257,), 1000, 48, 3.5)])
def test_guided_matches_reference(lead, K, D, scale, dtype, forward, device, monkeypatch):
    monkeypatch.setenv("VQLCMD_TRITON_FORWARD", forward)
    cond, table = make(lead, K, D, dtype, device)
    uncond, _ = make(lead, K, D, dtype, device, seed=7)
    out = ops.guided_embedding_average(cond, uncond, table, scale, backend="triton")
    assert_close(out, reference.guided_embedding_average(cond, uncond, table, scale), dtype)


def test_guidance_zero_is_the_plain_op(device):
    cond, table = make((257,), 1000, 48, torch.float32, device)
    uncond = torch.randn_like(cond)
    guided = ops.guided_embedding_average(cond, uncond, table, 0.0, backend="triton")
    assert torch.equal(guided, triton_average(cond, table))
    # also with classes both models rule out (-inf − -inf gave a NaN row), and then at ω > 0 as the reference
    cond[:, 7] = uncond[:, 7] = float("-inf")
    guided = ops.guided_embedding_average(cond, uncond, table, 0.0, backend="triton")
    assert torch.equal(guided, triton_average(cond, table))
    guided = ops.guided_embedding_average(cond, uncond, table, 2.0, backend="triton")
    assert_close(guided, reference.guided_embedding_average(cond, uncond, table, 2.0), torch.float32)


# ---- dispatch, registration, tracing ----------------------------------------------------------------

def test_auto_never_picks_the_interpreter():
    x, t = torch.randn(3, 5), torch.randn(5, 2)
    assert ops._dispatch.resolve("softmax_embedding_average", "auto", x, t) is not \
        ops._dispatch._REGISTRY["softmax_embedding_average"]["triton"].fn


def test_unsupported_inputs_say_why(monkeypatch):
    x, t = torch.randn(3, 5, dtype=torch.float64), torch.randn(5, 2, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="float64"):
        ops.softmax_embedding_average(x, t, backend="triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert "TRITON_INTERPRET" in ops.why_not("guided_embedding_average", "triton", x.float(), t.float())


def test_opcheck(device):
    logits, table = make((3, 4), 50, 8, torch.float32, device)
    logits.requires_grad_()
    table.requires_grad_()
    torch.library.opcheck(torch.ops.vqlcmd_triton.softmax_embedding_average, (logits, table))
    torch.library.opcheck(torch.ops.vqlcmd_triton.guided_embedding_average,
                          (logits.detach(), torch.randn_like(logits.detach()), table.detach(), 1.5))


def test_traces_under_torch_compile(device):
    logits, table = make((4,), 50, 8, torch.float32, device)
    fn = torch.compile(triton_average, backend="aot_eager", fullgraph=True)
    assert_close(fn(logits, table), reference.softmax_embedding_average(logits, table), torch.float32)


# ---- GPU: compiled kernels, the autotuned path and the goal shape -----------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
@pytest.mark.parametrize("dtype,variant", [(torch.bfloat16, "fused"), (torch.bfloat16, "split"),
                                           (torch.bfloat16, "chunked"), (torch.bfloat16, "mm"),
                                           (torch.float16, "fused"),
                                           (torch.float16, "chunked"), (torch.float32, "fused"),
                                           (torch.float32, "chunked")])
def test_gpu_goal_shape(dtype, variant, deterministic, monkeypatch):
    monkeypatch.setenv("VQLCMD_TRITON_BACKWARD", variant)
    monkeypatch.setenv("VQLCMD_TRITON_FORWARD", "chunked" if variant == "chunked" else "auto")
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic torch.mm (chunked)
    logits, table = make((32, 1024), 1024, 256, dtype, "cuda")  # N = 32768: autotuned path
    upstream = torch.randn(32, 1024, 256, device="cuda", dtype=dtype)
    torch.use_deterministic_algorithms(deterministic)
    try:
        out, g_logits, g_table = grads(triton_average, logits, table, upstream)
    finally:
        torch.use_deterministic_algorithms(False)
    ref, r_logits, r_table = grads(reference.softmax_embedding_average, logits, table, upstream)
    assert_close(out, ref, dtype)
    assert_close(g_logits, r_logits, dtype)
    assert_close(g_table, r_table, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_fixed_max_forward_goal_shape(dtype, sea, launched, monkeypatch):
    # the autotuned first-tile forward (N = 32768; the 16-bit default), its log-sum-exp, and its guided
    # variant; rows 5 and 9 spread beyond max_gap, so that the row blocks holding them sweep again. (float32
    # takes the one-pass forward: test_float32_operands_take_the_one_pass_forward_on_a_gpu.)
    monkeypatch.delenv("VQLCMD_TRITON_FORWARD", raising=False)
    logits, table = make((32768,), 1024, 256, dtype, "cuda")
    logits[5, 1000] = 60.0
    logits[9000, 700] = 45.0
    out, lse = sea.forward(logits, table)
    assert_close(out, reference.softmax_embedding_average(logits, table), dtype)
    torch.testing.assert_close(lse, logits.float().logsumexp(-1), rtol=1e-5, atol=1e-5)
    uncond, _ = make((32768,), 1024, 256, dtype, "cuda", seed=3)
    guided = ops.guided_embedding_average(logits, uncond, table, 1.0, backend="triton")
    assert_close(guided, reference.guided_embedding_average(logits, uncond, table, 1.0), dtype)
    assert launched == ["forward_fixed_max"] * 2


@pytest.mark.gpu
@pytest.mark.parametrize("dlogits", ["rows", "tiles"])
@pytest.mark.parametrize("variant", ["mm", "split"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_dlogits_goal_shape(dtype, variant, dlogits, sea, launched, monkeypatch):
    # the autotuned dlogits kernels (N = 32768; rows, the 16-bit default, and tiles) in both backwards that
    # use them, against the reference
    monkeypatch.setenv("VQLCMD_TRITON_BACKWARD", variant)
    monkeypatch.setenv("VQLCMD_TRITON_DLOGITS", dlogits)
    logits, table = make((32, 1024), 1024, 256, dtype, "cuda")
    upstream = torch.randn(32, 1024, 256, device="cuda", dtype=dtype)
    out, g_logits, g_table = grads(triton_average, logits, table, upstream)
    ref, r_logits, r_table = grads(reference.softmax_embedding_average, logits, table, upstream)
    kernel, other = ("grad_logits_rows", "grad_logits") if dlogits == "rows" else ("grad_logits", "grad_logits_rows")
    assert kernel in launched and other not in launched, launched
    assert_close(out, ref, dtype)
    assert_close(g_logits, r_logits, dtype)
    assert_close(g_table, r_table, dtype)


def delta_rounding_bound(logits, table, upstream, dtype):
    """What taking delta = rowsum(dY ∘ Y) from the output Y rounded to ``dtype`` (as FlashAttention
    does) may move dlogits_k = P_k (dP_k − delta) by: P_k Σ_d |dY_d| |Y_d| eps. With peaked rows and
    few columns it can exceed the atol the tests scale by max|dlogits|: dP_k − delta cancels, the
    rounding of Y does not (seen on an H100 at K = 7, D = 5: 0.008 against 0.002 allowed)."""
    p = torch.softmax(logits.double(), -1)
    y = p @ table.double()
    return p * (upstream.double().abs() * y.abs()).sum(-1, keepdim=True) * torch.finfo(dtype).eps


@pytest.mark.gpu
@pytest.mark.parametrize("lead,K,D", [((3,), 7, 5), ((257,), 1000, 48), ((100,), 128, 32)])
def test_gpu_small_shapes(lead, K, D):
    dtype = torch.bfloat16
    logits, table = make(lead, K, D, dtype, "cuda")
    upstream = torch.randn(*lead, D, generator=torch.Generator().manual_seed(1)).to("cuda", dtype)
    (out, g_logits, g_table), (r_out, r_logits, r_table) = (
        grads(fn, logits, table, upstream) for fn in (triton_average, reference.softmax_embedding_average))
    assert_close(out, r_out, dtype)
    assert_close(g_table, r_table, dtype)
    rtol, atol = TOL[dtype]
    err = (g_logits.double() - r_logits.double()).abs()
    allowed = (rtol * r_logits.double().abs() + atol * r_logits.double().abs().max()
               + delta_rounding_bound(logits, table, upstream, dtype))
    assert (err <= allowed).all(), f"dlogits off by {(err - allowed).max().item():.3g} beyond the bound"


@pytest.mark.gpu
def test_gpu_auto_picks_triton_and_guided():
    cond, table = make((4096,), 1024, 256, torch.bfloat16, "cuda")
    uncond, _ = make((4096,), 1024, 256, torch.bfloat16, "cuda", seed=3)
    assert ops._dispatch.resolve("softmax_embedding_average", "auto", cond, table) is \
        ops._dispatch._REGISTRY["softmax_embedding_average"]["triton"].fn
    out = ops.guided_embedding_average(cond, uncond, table, 1.0)
    assert_close(out, reference.guided_embedding_average(cond, uncond, table, 1.0), torch.bfloat16)


def test_kernels_run_with_the_tensors_gpu_as_the_current_device(sea, monkeypatch):
    """Triton launches on the current device, not the tensors' (triton-lang/triton#2441): each entry point
    makes its first tensor's GPU current. A stand-in tensor on "cuda:1" records the device entered."""
    entered = []

    class Recorder:
        def __init__(self, device):
            self.device = device

        def __enter__(self):
            entered.append(self.device)

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(torch.cuda, "device", Recorder)

    class OnSecondGpu:
        device = torch.device("cuda", 1)

    wrapped = sea.on_tensor_device(lambda x, *a, **k: "ran")
    assert wrapped(OnSecondGpu()) == "ran" and entered == [torch.device("cuda", 1)]
    assert wrapped(x=OnSecondGpu()) == "ran" and len(entered) == 2  # by keyword too
    entered.pop()
    assert wrapped(torch.zeros(1)) == "ran" and len(entered) == 1  # CPU tensors: no guard
    assert all(hasattr(f, "__wrapped__") for f in (sea.forward, sea.backward))  # both entry points guarded


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_gpu_tensors_on_another_gpu_than_the_current_one():
    logits, table = make((512,), 1024, 256, torch.bfloat16, "cuda:1")
    uncond, _ = make((512,), 1024, 256, torch.bfloat16, "cuda:1", seed=3)
    upstream = torch.randn(512, 256, device="cuda:1", dtype=torch.bfloat16)
    with torch.cuda.device(0):
        out, dl, dt = grads(lambda a, b: ops.softmax_embedding_average(a, b, backend="triton"), logits, table,
                            upstream)
        guided = ops.guided_embedding_average(logits, uncond, table, 1.0, backend="triton")
    ref, rdl, rdt = grads(reference.softmax_embedding_average, logits, table, upstream)
    for actual, expected in ((out, ref), (dl, rdl), (dt, rdt)):
        assert actual.device == torch.device("cuda", 1)
        assert_close(actual, expected, torch.bfloat16)
    assert_close(guided, reference.guided_embedding_average(logits, uncond, table, 1.0), torch.bfloat16)


def test_gpu_tiles_compile_for_h100_without_a_gpu():
    # Triton's compiler and ptxas run without a GPU: the fixed small-problem tiles must compile for
    # sm_90, fit its shared memory and spill no registers (the full autotuning sweep: drop --quick)
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-m", "vqlcmd.kernels.aot_check", "--quick"], env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr


def test_chunked_products_without_the_float32_output_overload(sea, monkeypatch):
    # before PyTorch 2.8 there is no torch.mm(..., out_dtype=float32): the product is rounded to the
    # 16-bit operands' dtype, then widened (into ``out`` when given)
    monkeypatch.setattr(sea, "_MM_OUT_DTYPE", False)
    g = torch.Generator().manual_seed(5)
    a, b = torch.randn(33, 20, generator=g).bfloat16(), torch.randn(20, 7, generator=g).bfloat16()
    expected = (a.float() @ b.float()).bfloat16().float()
    out = torch.empty(33, 7)
    assert sea._mm_float32(a, b, out=out) is out and torch.equal(out, expected)
    assert sea._mm_float32(a, b).dtype == torch.float32


def test_autotuner_picks_read_back_per_problem():
    # what the benchmarks report beside a time: the configuration each autotuner chose for that (N, K, D)
    import triton

    from vqlcmd.kernels import _launch

    class FakeTuner:
        cache = {(32768, 1024, 256, True, "torch.bfloat16"): triton.Config(
                     dict(BLOCK_M=64, BLOCK_K=32, BLOCK_D=256), num_warps=4, num_stages=4),
                 (8192, 1024, 256, True, "torch.bfloat16"): triton.Config(
                     dict(BLOCK_M=128, BLOCK_K=64, BLOCK_D=256), num_warps=8, num_stages=3)}

    tuned = _launch.Tuned.__new__(_launch.Tuned)
    tuned._tuners = {16: FakeTuner()}
    assert tuned.picks(32768, 1024, 256) == ["M64 K32 D256 w4 s4"]
    assert tuned.picks(8192, 1024, 256) == ["M128 K64 D256 w8 s3"]
    assert tuned.picks(4096, 128, 32) == []


@pytest.mark.gpu
def test_gpu_deterministic_results_do_not_depend_on_the_autotuners_picks(sea, monkeypatch):
    # the same inputs under use_deterministic_algorithms, with every autotuner's cached pick changed in
    # between (as timing noise can change it from one run to the next): bit for bit the same results
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic torch.mm, should a variant use it
    torch.manual_seed(0)
    logits = torch.randn(8192, 1024, device="cuda", requires_grad=True)
    table = torch.randn(1024, 256, device="cuda", requires_grad=True)
    upstream = torch.randn(8192, 256, device="cuda")

    def run():
        logits.grad = table.grad = None
        out = ops.softmax_embedding_average(logits, table, backend="triton")
        out.backward(upstream)
        return out.detach().clone(), logits.grad.clone(), table.grad.clone()

    torch.use_deterministic_algorithms(True)
    try:
        first = run()
        for tuned in sea._TUNED.values():
            for tuner in tuned._tuners.values():
                for key in list(getattr(tuner, "cache", {})):
                    others = [c for c in tuner.configs if c.all_kwargs() != tuner.cache[key].all_kwargs()]
                    if others:
                        tuner.cache[key] = others[-1]
        second = run()
    finally:
        torch.use_deterministic_algorithms(False)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def test_a_second_derivative_is_refused_not_wrong(device):
    """create_graph=True took the kernels' backward as a constant: a second derivative came out silently
    wrong. It raises now; the reference backend serves double backward."""
    logits, table = make((3,), 40, 8, torch.float32, device)
    logits.requires_grad_()
    y = ops.softmax_embedding_average(logits, table, backend="triton")
    (g,) = torch.autograd.grad(y.square().sum(), logits, create_graph=True)
    with pytest.raises(RuntimeError, match="differentiate twice"):
        g.sum().backward()
