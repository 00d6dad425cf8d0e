"""The sampling loop reads nothing back to the host, and its compiled step (``compile=True``) samples what the
eager one samples: each step is one compiled graph, with the random draws made eagerly in the same order."""
import time

import pytest
import torch

from vqlcmd import samplers
from vqlcmd.model import build_denoiser
from vqlcmd.samplers import sample_latents, sample_tokens
from vqlcmd.schedule import ShiftedCosineSchedule

READS = ("item", "tolist", "numpy", "__bool__", "__float__", "__int__", "__index__")


def _model(depth=2):
    torch.manual_seed(0)
    model = build_denoiser("tiny", depth=depth).eval()
    with torch.no_grad():  # AdaLN starts at zero: perturb so that t and y reach the logits
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return model


@pytest.fixture
def no_reads_after_checks(monkeypatch):
    """From the moment the sampler's labels are checked (``resolve_labels``, which reads their range once) every
    tensor read-back raises; the readings that happened are recorded too, should a caller swallow the error."""
    seen = []
    check = samplers.resolve_labels
    originals = {name: getattr(torch.Tensor, name) for name in READS}

    def read(name):
        def trap(self, *a, **k):
            seen.append(name)
            raise AssertionError(f"host read Tensor.{name} inside the sampling loop")
        return trap

    def armed(*args, **kwargs):  # each sampler call: its checks may read, what follows may not
        for name, fn in originals.items():
            monkeypatch.setattr(torch.Tensor, name, fn)
        out = check(*args, **kwargs)
        for name in READS:
            monkeypatch.setattr(torch.Tensor, name, read(name))
        return out

    monkeypatch.setattr(samplers, "resolve_labels", armed)
    return seen


@pytest.mark.parametrize("sampler", ["ancestral", "ddim"])
@pytest.mark.parametrize("interval", [None, (0.3, 0.7)])
def test_the_guided_loop_reads_nothing_back(sampler, interval, no_reads_after_checks):
    model, table = _model(), torch.randn(17, 8)
    tokens = sample_tokens(model, table, ShiftedCosineSchedule(), class_labels=torch.tensor([0, 3]), num_steps=4,
                           sampler=sampler, guidance_scale=1.5, guidance_interval=interval,
                           generator=torch.Generator().manual_seed(0))
    z, _ = sample_latents(model, table, ShiftedCosineSchedule(), class_labels=[1, 2], num_steps=3, sampler=sampler,
                          guidance_scale=1.0, generator=[torch.Generator().manual_seed(s) for s in (1, 2)])
    assert tokens.shape == (2, 16) and z.shape == (2, 16, 8)
    assert not no_reads_after_checks


def test_the_trap_fires_on_a_read(no_reads_after_checks):
    """The fixture sees a read that happens after the checks: a denoiser that reads its input back."""

    class Reads(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner, self.cfg = inner, inner.cfg

        def forward(self, z, t, y=None):
            if t[0] > 0.5:  # a host read: bool(tensor)
                pass
            return self.inner(z, t, y)

    with pytest.raises(AssertionError, match=r"host read Tensor.__bool__"):
        sample_tokens(Reads(_model()), torch.randn(17, 8), ShiftedCosineSchedule(), class_labels=[0], num_steps=2,
                      guidance_scale=1.0)
    assert no_reads_after_checks == ["__bool__"]


def test_the_loop_does_not_check_the_labels_again(monkeypatch):
    """The denoiser's own label check (a read-back per call) is skipped inside the loop: the sampler checked them."""
    model = _model()
    calls = []
    real_min = torch.Tensor.min
    monkeypatch.setattr(torch.Tensor, "min", lambda self, *a, **k: calls.append(1) or real_min(self, *a, **k))
    sample_tokens(model, torch.randn(17, 8), ShiftedCosineSchedule(), class_labels=[0, 1], num_steps=3,
                  guidance_scale=1.0)
    assert len(calls) == 1  # resolve_labels', not one per denoiser call
    with pytest.raises(IndexError, match="class labels"):  # outside the sampler the denoiser still checks
        model(torch.randn(1, 16, 8), torch.rand(1), torch.tensor([9]))


# ---- compile=True ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("sampler", ["ancestral", "ddim"])
def test_compiled_steps_sample_what_eager_steps_sample(sampler):
    """Guided (a guidance interval, so guided and unguided steps both run) and unguided, seeded: the compiled
    loop gives eager's latents to float tolerance and the same tokens (argmax and drawn)."""
    torch._dynamo.reset()
    model, table, sched = _model(depth=1), torch.randn(17, 8), ShiftedCosineSchedule(-1.0)
    t0 = time.perf_counter()
    for w, interval in ((1.5, (0.0, 0.5)), (0.0, None)):
        kw = dict(class_labels=torch.tensor([0, 3]), num_steps=4, sampler=sampler, guidance_scale=w,
                  guidance_interval=interval)
        g = lambda: torch.Generator().manual_seed(7)  # noqa: E731
        z_e, lp_e = sample_latents(model, table, sched, generator=g(), **kw)
        z_c, lp_c = sample_latents(model, table, sched, generator=g(), compile=True, **kw)
        torch.testing.assert_close(z_c, z_e, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(lp_c, lp_e, rtol=1e-4, atol=1e-4)
        tok_e = sample_tokens(model, table, sched, generator=g(), **kw)
        tok_c = sample_tokens(model, table, sched, generator=g(), compile=True, **kw)
        assert torch.equal(tok_c, tok_e)
        # the draws differ between seeds, so equal tokens above are not a constant
        assert not torch.equal(sample_tokens(model, table, sched, generator=torch.Generator().manual_seed(8),
                                             compile=True, **kw), tok_c)
    print(f"compile + sampling ({sampler}): {time.perf_counter() - t0:.1f} s")


def test_a_compiled_step_is_one_graph_and_compiles_once_per_variant():
    """fullgraph=True would raise on a graph break; a second call of the same variant compiles nothing new."""
    torch._dynamo.reset()
    model, table, sched = _model(depth=1), torch.randn(17, 8), ShiftedCosineSchedule()
    counters = torch._dynamo.utils.counters
    counters.clear()
    kw = dict(class_labels=[0, 3], num_steps=3, sampler="ddim", guidance_scale=1.0, compile=True)
    sample_latents(model, table, sched, **kw)
    frames = counters["stats"]["unique_graphs"]
    assert frames == 2  # the step and the final call
    sample_latents(model, table, sched, **kw)
    assert counters["stats"]["unique_graphs"] == frames
    assert not counters["graph_break"]


def test_the_pipeline_compiles_the_step(monkeypatch):
    """enable_fast_sampling routes the diffusion samplers through compile=True (torch.compile's default mode for
    "compile"), on one denoiser module for every call; disable_fast_sampling turns it off."""
    from vqlcmd import VQLCMDNetwork, preset_config
    from vqlcmd.pipeline import VQLCMDPipeline

    torch.manual_seed(1)
    tiny_pipeline = VQLCMDPipeline(VQLCMDNetwork(preset_config("tiny")), ShiftedCosineSchedule(),
                                   class_names=list("abcd"))
    seen = []
    real = samplers.sample_latents

    def spy(denoiser, *a, **kw):
        seen.append((denoiser, kw.get("compile"), kw.get("compile_mode")))
        return real(denoiser, *a, **{**kw, "compile": False})  # the spy checks the routing, not torch.compile

    monkeypatch.setattr(samplers, "sample_latents", spy)
    kw = dict(num_steps=2, guidance_scale=1.0, output_type="tokens", generator=torch.Generator().manual_seed(0))
    eager = tiny_pipeline([0, 1], **kw)
    tiny_pipeline.enable_fast_sampling("compile")
    try:
        kw["generator"] = torch.Generator().manual_seed(0)
        fast = tiny_pipeline([0, 1], **kw)
        tiny_pipeline([2], num_steps=1, output_type="tokens")
    finally:
        tiny_pipeline.disable_fast_sampling()
    tiny_pipeline([2], num_steps=1, output_type="tokens")
    assert [(c, m) for _, c, m in seen] == [(False, None), (True, None), (True, None), (False, None)]
    assert seen[1][0] is seen[2][0]
    assert torch.equal(fast, eager)
