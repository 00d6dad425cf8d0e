"""attention(backend="flash4"): FlashAttention-4 (flash-attn-4's flash_attn.cute) as an explicit backend.

On CPU the package's function is replaced by a reference in its own layout, (B, M, H, hd), returning what it
returns, (out, lse): the transposes, the fallback to SDPA with dropout and the refusals are tested here; the
kernel itself only by the GPU test at the end (scripts/gpu_check.sh installs the package for it)."""
import importlib
import math
import sys
import types

import pytest
import torch
from says_cuda import SaysCuda
import torch.nn.functional as F

attn = importlib.import_module("vqlcmd.model.attention")  # the module (the package exports the function)


def _reference_in_fa4_layout(calls):
    def flash_attn_func(q, k, v, softmax_scale=None, causal=False, **kwargs):
        calls.append({"shapes": (q.shape, k.shape, v.shape), "softmax_scale": softmax_scale, "causal": causal,
                      **kwargs})
        s = torch.einsum("bmhd,bnhd->bhmn", q, k) * softmax_scale  # (B, H, M, N)
        out = torch.einsum("bhmn,bnhd->bmhd", torch.softmax(s, dim=-1), v)  # (B, M, H, hd)
        return out, torch.logsumexp(s, dim=-1).float()  # lse (B, H, M), float32, as FA4's
    return flash_attn_func


@pytest.fixture
def fake_fa4(monkeypatch):
    calls = []
    module = types.ModuleType("flash_attn.cute")
    module.flash_attn_func = _reference_in_fa4_layout(calls)
    monkeypatch.setitem(sys.modules, "flash_attn.cute", module)
    monkeypatch.setattr(attn, "_fa4_func", None)
    return calls


def test_flash4_is_a_backend_auto_does_not_take(monkeypatch):
    from vqlcmd.model import DenoiserConfig

    assert "flash4" in attn.ATTENTION_BACKENDS
    assert DenoiserConfig(attention_backend="flash4").attention_backend == "flash4"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (9, 0))
    q = torch.randn(1, 16, 8, 48).to(torch.bfloat16).as_subclass(SaysCuda)
    assert attn.attention_backend_for(q, 0.0) != "flash4"


def test_layout_forward_and_backward_match_sdpa(fake_fa4, monkeypatch):
    """Distinct B, H, M, hd: a transpose on the wrong axes would attend over heads or batch and miss SDPA."""
    monkeypatch.setattr(attn, "flash4_why_not", lambda q, k, v: None)  # the CPU tensors pass for a GPU's
    g = torch.Generator().manual_seed(0)
    B, H, M, hd = 2, 3, 5, 8
    q, k, v, up = (torch.randn(B, H, M, hd, generator=g, dtype=torch.float64) for _ in range(4))
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out = attn.attention(*leaves, backend="flash4")
    assert out.shape == (B, H, M, hd)
    assert fake_fa4[0]["shapes"] == ((B, M, H, hd),) * 3
    assert fake_fa4[0]["causal"] is False and fake_fa4[0]["softmax_scale"] == pytest.approx(1 / math.sqrt(hd))
    grads = torch.autograd.grad(out, leaves, up)
    ref_leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    want = F.scaled_dot_product_attention(*ref_leaves)
    torch.testing.assert_close(out, want)
    for got, w in zip(grads, torch.autograd.grad(want, ref_leaves, up)):
        torch.testing.assert_close(got, w)


def test_the_denoisers_strided_qkv_views_go_in_as_views(fake_fa4, monkeypatch):
    """The model's q, k, v are views into one qkv tensor: they reach FA4 in its layout, last dim contiguous,
    uncopied (FA4 takes strided inputs whose last stride is 1)."""
    monkeypatch.setattr(attn, "flash4_why_not", lambda q, k, v: None)
    seen = []
    reference = sys.modules["flash_attn.cute"].flash_attn_func

    def spy(q, k, v, **kw):
        seen.append((q.stride(-1), q.data_ptr()))
        return reference(q, k, v, **kw)

    sys.modules["flash_attn.cute"].flash_attn_func = spy
    B, M, H, hd = 2, 6, 4, 8
    qkv = torch.randn(B, M, 3, H, hd)
    q, k, v = qkv.permute(2, 0, 3, 1, 4)
    out = attn.attention(q, k, v, backend="flash4")
    assert seen == [(1, qkv.data_ptr())]
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v))


def test_under_dynamo_the_call_is_left_to_run_eagerly(fake_fa4, monkeypatch):
    """train.compile compiles the loss: FA4's call becomes a graph break (Dynamo does not trace the CuTe DSL's
    launch), with the same values and gradients as uncompiled."""
    monkeypatch.setattr(attn, "flash4_why_not", lambda q, k, v: None)
    reference, traced = sys.modules["flash_attn.cute"].flash_attn_func, []

    def spy(*a, **kw):
        traced.append(torch.compiler.is_compiling())
        return reference(*a, **kw)

    sys.modules["flash_attn.cute"].flash_attn_func = spy
    q, k, v = (torch.randn(2, 3, 8, 16, requires_grad=True) for _ in range(3))
    compiled = torch.compile(lambda q, k, v: attn.attention(q, k, v, backend="flash4").sum(), backend="eager",
                             fullgraph=False)
    got = compiled(q, k, v)
    grads = torch.autograd.grad(got, (q, k, v))
    assert traced == [False]
    want = F.scaled_dot_product_attention(q, k, v).sum()
    torch.testing.assert_close(got, want)
    for g, w in zip(grads, torch.autograd.grad(want, (q, k, v))):
        torch.testing.assert_close(g, w)


def test_with_dropout_flash4_runs_sdpa(fake_fa4):
    """FA4 has no dropout: training with attn_dropout > 0 takes SDPA (same random stream as backend='sdpa')."""
    q, k, v = (torch.randn(2, 2, 8, 16) for _ in range(3))
    torch.manual_seed(0)
    got = attn.attention(q, k, v, dropout_p=0.3, backend="flash4")
    torch.manual_seed(0)
    want = attn.attention(q, k, v, dropout_p=0.3, backend="sdpa")
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert fake_fa4 == []
    assert attn.resolved_backend("flash4", q, 0.3) == "sdpa"
    assert attn.resolved_backend("flash4", q, 0.0) == "flash4"


def test_the_log_names_what_trains(fake_fa4):
    from vqlcmd.engine.build import attention_words
    from vqlcmd.model import preset_config

    assert attention_words(preset_config("tiny", attention_backend="flash4", attn_dropout=0.0), "cpu",
                           False) == "flash4"
    words = attention_words(preset_config("tiny", attention_backend="flash4", attn_dropout=0.1), "cpu", False)
    assert words.startswith("sdpa/")


def _cuda_like(*shape, dtype=torch.bfloat16):
    return torch.zeros(*shape).to(dtype).as_subclass(SaysCuda)


@pytest.mark.parametrize("capability, hd, dtype, message", [
    ((8, 0), 64, torch.bfloat16, "needs an SM90 or SM100 GPU, this is SM80"),
    ((12, 0), 64, torch.bfloat16, "needs an SM90 or SM100 GPU, this is SM120"),
    ((9, 0), 64, torch.float32, "needs fp16 or bf16"),
    ((9, 0), 20, torch.bfloat16, "multiple of 8 in 8..256 on SM90, got 20"),
    ((10, 0), 192, torch.float16, "multiple of 8 in 8..128 or 256 on SM100, got 192"),
])
def test_refusals_name_what_is_missing(monkeypatch, fake_fa4, capability, hd, dtype, message):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: capability)
    q = _cuda_like(1, 2, 8, hd, dtype=dtype)
    with pytest.raises(RuntimeError, match=message):
        attn.attention(q, q, q, backend="flash4")
    assert fake_fa4 == []


@pytest.mark.parametrize("capability, hd", [((9, 0), 48), ((9, 0), 64), ((9, 0), 256), ((10, 0), 48),
                                            ((10, 0), 128), ((10, 0), 256)])
def test_what_fa4_takes_passes(monkeypatch, capability, hd):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: capability)
    q = _cuda_like(1, 2, 8, hd)
    assert attn.flash4_why_not(q, q, q) is None


def test_cpu_tensors_and_a_missing_package_are_named(monkeypatch):
    q = torch.randn(1, 2, 8, 16, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="needs CUDA tensors, got cpu"):
        attn.attention(q, q, q, backend="flash4")
    monkeypatch.setattr(attn, "flash4_why_not", lambda q, k, v: None)
    monkeypatch.setattr(attn, "_fa4_func", None)
    monkeypatch.setitem(sys.modules, "flash_attn.cute", None)  # None in sys.modules: the import fails
    with pytest.raises(RuntimeError, match=r"needs the flash-attn-4 package \(pip install --pre flash-attn-4\)"):
        attn.attention(q, q, q, backend="flash4")


def _real_fa4_or_skip():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    major, minor = torch.cuda.get_device_capability()
    if major not in (9, 10):
        pytest.skip(f"FA4 runs on SM90/SM100, this is SM{major}{minor}")
    try:
        attn.flash4_func()
    except RuntimeError as e:
        pytest.skip(str(e))


@pytest.mark.gpu
@pytest.mark.parametrize("hd", [48, 64])
def test_the_real_kernel_matches_sdpa(hd):
    """imagenet-246m's attention (16 heads, M = 256, hd 48) and hd 64, bf16, forward and backward."""
    _real_fa4_or_skip()
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, up = (torch.randn(4, 16, 256, hd, device="cuda", dtype=torch.bfloat16, generator=g)
                   for _ in range(4))
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out = attn.attention(*leaves, backend="flash4")
    grads = torch.autograd.grad(out, leaves, up)
    ref = [x.float().requires_grad_() for x in (q, k, v)]  # fp32 math: the reference both are measured against
    want = F.scaled_dot_product_attention(*ref)
    want_grads = torch.autograd.grad(want, ref, up.float())
    bf16 = [x.clone().requires_grad_() for x in (q, k, v)]
    sdpa = F.scaled_dot_product_attention(*bf16)
    sdpa_grads = torch.autograd.grad(sdpa, bf16, up)
    # FA4 no further from fp32 than SDPA's own bf16 kernel is (plus a little slack)
    for got, same_dtype, exact in zip((out, *grads), (sdpa, *sdpa_grads), (want, *want_grads)):
        err, sdpa_err = (got.float() - exact).abs().max().item(), (same_dtype.float() - exact).abs().max().item()
        assert err <= 2 * sdpa_err + 1e-3, (err, sdpa_err)
