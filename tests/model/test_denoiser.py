import pytest
import torch
from says_cuda import SaysCuda

from vqlcmd.model import PAPER_PARAMETERS, PRESETS, Denoiser, build_denoiser, num_parameters, preset_config
from vqlcmd.model.attention import attention, attention_backend_for, math_attention


def test_sdpa_and_math_attention_agree(gen):
    q, k, v = (torch.randn(2, 3, 17, 8, generator=gen) for _ in range(3))
    torch.testing.assert_close(attention(q, k, v, backend="sdpa"), attention(q, k, v, backend="math"),
                               atol=1e-5, rtol=1e-5)


def test_math_attention_is_permutation_equivariant(gen):
    """Bidirectional (no mask): permuting the tokens permutes the outputs."""
    q, k, v = (torch.randn(1, 2, 9, 4, generator=gen) for _ in range(3))
    perm = torch.randperm(9, generator=gen)
    out = math_attention(q, k, v)
    out_p = math_attention(q[:, :, perm], k[:, :, perm], v[:, :, perm])
    torch.testing.assert_close(out[:, :, perm], out_p, atol=1e-6, rtol=1e-5)


def test_auto_on_cpu_takes_the_compiled_kernel_with_or_without_dropout_and_flash_refuses_cpu():
    from vqlcmd import ops

    q = torch.randn(1, 1, 4, 8)
    built = ops.why_not("short_attention", "compiled", q, q, q) is None
    assert attention_backend_for(q, 0.0) == ("compiled" if built else "sdpa")
    assert attention_backend_for(q, 0.1) == ("compiled" if built else "sdpa")  # its dropout is in the kernel
    assert attention_backend_for(q.double(), 0.0) == "sdpa"
    with pytest.raises(RuntimeError):
        attention(q, q, q, backend="flash2")


def test_the_compiled_kernels_dropout_draws_its_seed_from_the_global_generator(gen):
    """attention(..., dropout_p, backend="compiled") keys its mask by a seed the global generator draws: a
    manual_seed reproduces the output, the next call drops other probabilities, and the output is the
    reference's for the seed drawn."""
    from vqlcmd import ops
    from vqlcmd.ops import reference

    q, k, v = (torch.randn(2, 2, 9, 4, generator=gen) for _ in range(3))
    if ops.why_not("short_attention", "compiled", q, k, v):
        pytest.skip("the compiled extension is not built")
    torch.manual_seed(5)
    first, second = (attention(q, k, v, dropout_p=0.5, backend="compiled") for _ in range(2))
    torch.manual_seed(5)
    seed = reference.philox_seed(None, q.device)
    torch.testing.assert_close(first, reference.short_attention(q, k, v, 0.5, seed), atol=1e-6, rtol=1e-5)
    torch.manual_seed(5)
    torch.testing.assert_close(attention(q, k, v, dropout_p=0.5, backend="compiled"), first, atol=0, rtol=0)
    assert not torch.equal(first, second)


def test_forward_shapes_and_dtype(gen):
    model = build_denoiser("tiny").eval()
    cfg = model.cfg
    z = torch.randn(3, cfg.seq_len, cfg.embed_dim, generator=gen)
    logits = model(z, torch.rand(3), torch.tensor([0, 1, cfg.num_classes]))
    assert logits.shape == (3, cfg.seq_len, cfg.codebook_size)
    unc = build_denoiser("tiny", num_classes=0)
    assert unc(z, torch.rand(3)).shape == logits.shape


def test_condition_changes_output_after_adaln_leaves_zero_init(gen):
    model = build_denoiser("tiny").eval()
    for m in model.modules():
        if hasattr(m, "to_ab"):
            torch.nn.init.normal_(m.to_ab.weight, std=0.5)
    z = torch.randn(1, 16, 8, generator=gen)
    t = torch.tensor([0.5])
    a = model(z, t, torch.tensor([0]))
    b = model(z, t, torch.tensor([1]))
    c = model(z, torch.tensor([0.9]), torch.tensor([0]))
    assert not torch.allclose(a, b) and not torch.allclose(a, c)


def test_bad_inputs_named():
    model = build_denoiser("tiny")
    with pytest.raises(ValueError, match="z must be"):
        model(torch.randn(2, 16, 5), torch.rand(2))
    with pytest.raises(IndexError, match="class labels"):
        model(torch.randn(2, 16, 8), torch.rand(2), torch.tensor([0, 9]))
    with pytest.raises(KeyError, match="unknown denoiser preset"):
        preset_config("huge")


def test_paper_presets_parameter_counts():
    """Paper: 56M (unconditional) and 246M (ImageNet). Our AdaLN on both norms of each block gives
    64.6M and 230.5M; the printed comparison is the check a reader wants, the bounds catch regressions."""
    with torch.device("meta"):
        counts = {name: num_parameters(build_denoiser(name)) for name in PAPER_PARAMETERS}
    for name, n in counts.items():
        print(f"{name}: {n / 1e6:.1f}M parameters (paper {PAPER_PARAMETERS[name] / 1e6:.0f}M)")
        assert 0.85 < n / PAPER_PARAMETERS[name] < 1.2
    assert set(PAPER_PARAMETERS) <= set(PRESETS)


def test_apex_layernorm_switch_says_what_is_missing():
    try:
        import apex  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="apex is not installed"):
            build_denoiser("tiny", norm_impl="apex")
    with pytest.raises(ValueError, match="norm_impl"):
        build_denoiser("tiny", norm_impl="fast")


def test_attention_dropout_only_in_training(gen):
    model = build_denoiser("tiny", attn_dropout=0.5)
    z = torch.randn(2, 16, 8, generator=gen)
    t, y = torch.rand(2), torch.tensor([0, 1])
    model.eval()
    torch.testing.assert_close(model(z, t, y), model(z, t, y))


def test_activation_switch_is_the_named_gelu(gen):
    """``activation`` picks the MLP's GELU: the block's MLP equals fc2(gelu(fc1 x)) with the exact (erf)
    or tanh form; configs without the field (saved before it existed) keep the tanh form."""
    x = torch.randn(5, 32, generator=gen)
    for name, approximate in (("gelu", "none"), ("gelu_tanh", "tanh")):
        mlp = build_denoiser("tiny", activation=name).blocks[0].mlp
        fc1, fc2 = mlp[0], mlp[2]
        want = fc2(torch.nn.functional.gelu(fc1(x), approximate=approximate))
        torch.testing.assert_close(mlp(x), want)
    assert build_denoiser("tiny").blocks[0].mlp[1].activation == "gelu_tanh"
    with pytest.raises(ValueError, match="activation must be one of"):
        build_denoiser("tiny", activation="relu")


def test_adaln_is_the_modulated_layernorm(gen):
    """AdaLayerNorm (the fused ``ops.ada_layer_norm`` on CPU) equals (1 + a) LayerNorm(h) + b with
    (a, b) = to_ab(cond), values and gradients of h, cond and the to_ab weights."""
    norm = build_denoiser("tiny").blocks[0].norm1
    torch.nn.init.normal_(norm.to_ab.weight, std=0.5, generator=gen)
    h = torch.randn(3, 16, 32, generator=gen, requires_grad=True)
    cond = torch.randn(3, 32, generator=gen, requires_grad=True)
    upstream = torch.randn(3, 16, 32, generator=gen)
    y = norm(h, cond)
    grads = torch.autograd.grad(y, (h, cond, norm.to_ab.weight), upstream)
    a, b = norm.to_ab(cond).unsqueeze(1).chunk(2, dim=-1)
    want = (1 + a) * torch.nn.functional.layer_norm(h, (32,)) + b
    want_grads = torch.autograd.grad(want, (h, cond, norm.to_ab.weight), upstream)
    torch.testing.assert_close(y, want, atol=1e-5, rtol=1e-5)
    for g, w in zip(grads, want_grads):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("capability, head_dim, expected", [((9, 0), 64, "flash2"), ((9, 0), 512, "sdpa"),
                                                           ((8, 6), 128, "flash2"), ((7, 5), 64, "sdpa"),
                                                           ((9, 0), 20, "flash2")])
def test_auto_attention_takes_flash_only_where_it_runs(monkeypatch, capability, head_dim, expected):
    # FlashAttention refuses GPUs before Ampere and head dims over 256: auto sent them there and crashed
    import importlib

    attn = importlib.import_module("vqlcmd.model.attention")  # the module (the package exports the function)
    monkeypatch.setattr(attn, "_fa3_func", None)
    monkeypatch.setattr(attn, "_fa2_func", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: capability)
    q = torch.randn(1, 2, 8, head_dim).to(torch.float16).as_subclass(SaysCuda)
    assert attn.attention_backend_for(q, 0.0) == expected
    monkeypatch.setattr(attn, "_fa3_func", lambda *a, **k: None)
    # FA3 also refuses head dims that are not a multiple of 8, which FA2 pads
    fa3 = capability[0] == 9 and head_dim <= 256 and head_dim % 8 == 0
    assert attn.attention_backend_for(q, 0.0) == ("flash3" if fa3 else expected)


@pytest.mark.parametrize("override, message", [
    ({"width": 129, "heads": 3}, "width must be even"), ({"width": 130, "heads": 4}, "divisible by heads"),
    ({"time_features": 255}, "time_features must be even"), ({"attn_dropout": 1.0}, r"attn_dropout must be in \[0, 1\)"),
    ({"attention_backend": "flash"}, "attention_backend must be one of"), ({"norm_impl": "fused"}, "norm_impl must be"),
    ({"heads": 0}, "heads must be an integer >= 1"), ({"width": 0}, "width must be an integer >= 1"),
    ({"num_classes": -1}, "num_classes must be an integer >= 0")])
def test_config_refuses_sizes_the_forward_cannot_run(override, message):
    """Each of these built a model that failed in its first forward, with a shape error naming no setting."""
    with pytest.raises(ValueError, match=message):
        preset_config("tiny", **override)


def test_labels_are_checked_by_shape_and_refused_by_an_unconditional_model(gen):
    den = build_denoiser("tiny").eval()
    z, t = torch.randn(2, 16, 8, generator=gen), torch.rand(2, generator=gen)
    with pytest.raises(ValueError, match=r"y must be \(B,\) = \(2,\), got \(1,\)"):
        den(z, t, torch.tensor([1]))  # was broadcast to the whole batch
    with pytest.raises(IndexError, match="class labels must be in"):
        den(z, t, torch.tensor([0, 5]))
    assert den(z[:0], t[:0], torch.zeros(0, dtype=torch.long)).shape == (0, 16, 16)
    with pytest.raises(ValueError, match="unconditional"):
        build_denoiser("tiny", num_classes=0)(z, t, torch.tensor([1, 2]))  # was ignored


def test_conditional_forward_traces_as_one_graph(gen):
    """The label range check is a host sync; while compiling it is left to where labels come in, so
    torch.compile traces a conditional forward without a graph break."""
    den = build_denoiser("tiny").eval()
    z, t, y = torch.randn(2, 16, 8, generator=gen), torch.rand(2, generator=gen), torch.tensor([0, 3])
    explained = torch._dynamo.explain(den)(z, t, y)
    assert explained.graph_break_count == 0 and explained.graph_count == 1, explained.break_reasons


def test_compiled_the_adaln_maps_are_one_matmul_with_the_eager_values_and_gradients():
    """Under torch.compile the denoiser stacks its 2·depth + 1 AdaLN maps into one matmul: the same logits and
    gradients as eager (float32 rounding), and the graph holds one linear of cond instead of one per map."""
    torch.manual_seed(0)
    den = Denoiser(preset_config("tiny", attn_dropout=0.0, num_classes=4))
    with torch.no_grad():  # AdaLN starts at zero: perturb so that the maps matter
        for p in den.parameters():
            p.add_(0.1 * torch.randn_like(p))
    z, t, y = torch.randn(3, 16, den.cfg.embed_dim), torch.rand(3), torch.tensor([0, 1, 4])
    want = den(z, t, y)
    want_grads = torch.autograd.grad(want.square().sum(), list(den.parameters()))
    graphs = []

    def backend(gm, inputs):
        graphs.append(gm)
        return gm.forward

    got = torch.compile(den, backend=backend, fullgraph=True)(z, t, y)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for a, b in zip(torch.autograd.grad(got.square().sum(), list(den.parameters())), want_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    linears = [n for n in graphs[0].graph.nodes if n.target is torch._C._nn.linear]
    # in_proj, the time MLP's two, qkv/proj/fc1/fc2 per block, the head, and one for all the AdaLN maps
    assert len(linears) == 1 + 2 + 4 * den.cfg.depth + 1 + 1


def test_a_dropout_seed_keys_the_training_forwards_attention_dropout(gen):
    """Training with attention dropout on a CPU (the compiled kernel): a given ``dropout_seed`` gives the same
    logits whatever the global generator's state, another seed other logits; each block takes its own key
    (seed + i: one shared key would drop the same probabilities in every block); in eval mode the seed is
    ignored."""
    from vqlcmd import ops

    model = build_denoiser("tiny").train()
    cfg = model.cfg
    probe = torch.empty(1, cfg.heads, cfg.seq_len, cfg.width // cfg.heads)
    if ops.why_not("short_attention", "compiled", probe, probe, probe):
        pytest.skip("the compiled extension is not built")
    assert cfg.attn_dropout > 0 and cfg.depth > 1
    z = torch.randn(2, cfg.seq_len, cfg.embed_dim, generator=gen)
    t, y = torch.rand(2, generator=gen), torch.tensor([0, 1])
    seed = torch.tensor([123])
    torch.manual_seed(0)
    a = model(z, t, y, dropout_seed=seed)
    torch.manual_seed(1)
    torch.testing.assert_close(model(z, t, y, dropout_seed=seed), a, atol=0, rtol=0)
    assert not torch.equal(model(z, t, y, dropout_seed=torch.tensor([124])), a)
    keys = []
    real = ops.short_attention

    def spy(*args, seed=None, **kwargs):
        keys.append(int(seed))
        return real(*args, seed=seed, **kwargs)

    with pytest.MonkeyPatch.context() as m:
        m.setattr(ops, "short_attention", spy)
        model(z, t, y, dropout_seed=seed)
    assert keys == [123 + i for i in range(cfg.depth)]
    model.eval()
    torch.testing.assert_close(model(z, t, y, dropout_seed=seed), model(z, t, y), atol=0, rtol=0)
