"""train.fast (vqlcmd/engine/step.py, deferred flushes): the default step's losses and updates, with no host reads inside a step."""
import contextlib
import math
import traceback

import pytest
import torch

from vqlcmd.engine.config_file import load_config
from vqlcmd.engine.trainer import NonFiniteLossError, Trainer

READS = ("item", "tolist", "numpy", "__bool__", "__float__", "__int__", "__index__", "__format__")


def _trainer(tmp_path, shards, make_config, *, bf16=False, model=None, ds_edit=None, **train):
    def edit(section):
        if model:
            section["model"] = {**section.get("model", {}), "overrides": model}

    ds, cfg = load_config(str(make_config(tmp_path, shards, **train)), edit=edit,
                          edit_deepspeed=lambda raw: raw.update(bf16={"enabled": bf16}, **(ds_edit or {})))
    return Trainer(ds, cfg, log=lambda *a, **k: None)


def _run(tr, steps: int) -> tuple[list, list]:
    batches = tr.loader.forever()
    losses = [{k: float(v) for k, v in tr.train_step(batches).items()} for _ in range(steps)]
    return losses, [p.detach().double().clone() for p in tr.net.parameters()]


def _compare(tmp_path, shards, make_config, steps, rtol, atol, bf16=False, model=None, ds_edit=None, **fast_train):
    ref = _run(_trainer(tmp_path / "default", shards, make_config, bf16=bf16, model=model, ds_edit=ds_edit), steps)
    tr = _trainer(tmp_path / "fast", shards, make_config, bf16=bf16, model=model, ds_edit=ds_edit, fast=True,
                  **fast_train)
    got = _run(tr, steps)
    for a, b in zip(ref[0], got[0]):
        assert a.keys() == b.keys()
        for k in a:
            assert b[k] == pytest.approx(a[k], rel=rtol, abs=atol), k
    for a, b in zip(ref[1], got[1]):
        torch.testing.assert_close(b, a, rtol=rtol, atol=atol)
    return tr


@pytest.mark.parametrize("step", ["flat", "deepspeed"])
@pytest.mark.parametrize("ds_edit", [None, {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}],
                         ids=["one micro-step", "accumulation"])
def test_the_fast_step_trains_as_the_default_step(tmp_path, tiny_shards, make_config, ds_edit, step):
    """fp32: the same draws, losses (averaged over micro-steps) and updates, to rounding, through DeepSpeed's
    engine step or the flat step (whose gradient norm is DeepSpeed's to the fp32 bit: the k-part of the qkv bias has
    a gradient of pure rounding noise, which AdamW scales up to a fraction of the rate, so any other rounding
    of the clipping factor moves those weights by ~1e-4)."""
    tr = _compare(tmp_path, tiny_shards, make_config, 3, rtol=1e-5, atol=1e-6, ds_edit=ds_edit, step=step)
    assert tr.teacher.compute is tr.teacher.module  # fp32: no copy
    assert (tr.stepper.flat is not None) == (step == "flat")


@pytest.mark.parametrize("step", ["flat", "deepspeed"])
def test_the_fast_step_in_bf16_runs_the_teacher_on_a_bf16_copy_of_its_fp32_ema(tmp_path, tiny_shards, make_config,
                                                                                step):
    """bf16: the teacher forward runs on bf16 weights rounded from the fp32 EMA instead of under autocast; the
    losses agree to bf16 rounding, and the copy follows the master at every update."""
    tr = _compare(tmp_path, tiny_shards, make_config, 3, rtol=0.05, atol=2e-2, bf16=True, step=step)
    assert next(tr.teacher.compute.parameters()).dtype == torch.bfloat16
    assert next(tr.teacher.module.parameters()).dtype == torch.float32
    for c, m in zip(tr.teacher.compute.parameters(), tr.teacher.module.parameters()):
        assert torch.equal(c, m.to(torch.bfloat16))


@contextlib.contextmanager
def _no_reads(monkeypatch, allowed: list):
    """Every way a tensor reaches the host raises, except while ``allowed`` is non-empty (a flush)."""
    originals = {name: getattr(torch.Tensor, name) for name in READS}
    caught = []

    def guard(name):
        def read(self, *args, **kwargs):
            if not allowed and not _adam_counter(self):
                caught.append(name)
                raise AssertionError(f"Tensor.{name} inside a step")
            return originals[name](self, *args, **kwargs)
        return read

    with monkeypatch.context() as m:
        for name in READS:
            m.setattr(torch.Tensor, name, guard(name))
        yield caught


def _adam_counter(t: torch.Tensor) -> bool:
    """A read of torch AdamW's step counter on a CPU (a CPU tensor, so no device sync; fused on a GPU, AdamW
    keeps it on the device and reads nothing): the flat step calls the optimizer outside DeepSpeed's step."""
    return t.device.type == "cpu" and t.ndim == 0 and any(
        "/torch/optim/" in frame.filename for frame in traceback.extract_stack(limit=8))


def _allowing(fn, allowed):
    def wrapped(*args, **kwargs):
        allowed.append(1)
        try:
            return fn(*args, **kwargs)
        finally:
            allowed.pop()
    return wrapped


def test_no_tensor_is_read_back_inside_a_fast_step(tmp_path, tiny_shards, make_config, monkeypatch):
    """Tensor.item / tolist / numpy / bool / float / int / index / format raise inside steps; only the flush and
    the logging of log steps (here 4 and 6), the final checkpoint, and DeepSpeed's own ZeRO step (its
    gradient-norm read, not ours) may read. The
    same guard catches the default step's per-micro-step read, so the guard does see reads."""
    allowed = []
    tr = _trainer(tmp_path / "fast", tiny_shards, make_config, fast=True, log_every=4)
    monkeypatch.setattr(tr.engine, "step", _allowing(tr.engine.step, allowed))
    monkeypatch.setattr(tr.stepper, "flush", _allowing(tr.stepper.flush, allowed))
    for name in ("_log_scalars", "save"):
        monkeypatch.setattr(tr, name, _allowing(getattr(tr, name), allowed))
    with _no_reads(monkeypatch, allowed) as caught:
        history = tr.train(progress=False)
    assert not caught
    assert [row["step"] for row in history] == [1, 2, 3, 4, 5, 6]
    assert all(math.isfinite(row["loss"]) for row in history)

    plain = _trainer(tmp_path / "default", tiny_shards, make_config)
    monkeypatch.setattr(plain.engine, "step", _allowing(plain.engine.step, allowed))
    with _no_reads(monkeypatch, allowed) as caught, pytest.raises(AssertionError, match="inside a step"):
        plain.train_step(plain.loader.forever())
    assert caught


def test_a_non_finite_loss_is_caught_at_the_next_flush_before_any_checkpoint(tmp_path, tiny_shards, make_config,
                                                                             monkeypatch):
    """The fast step names the step and term of a NaN loss at the next flush, which comes before every save:
    the checkpoint of step 4 is never written."""
    tr = _trainer(tmp_path, tiny_shards, make_config, fast=True, log_every=100, checkpoint_every=4)
    forward = tr.engine.module.forward

    def nan_at_step_3(*args, **kwargs):
        out = forward(*args, **kwargs)
        if tr.step == 2:
            out["l_dm"] = out["l_dm"] * float("nan")
        return out

    monkeypatch.setattr(tr.engine.module, "forward", nan_at_step_3)
    with pytest.raises(NonFiniteLossError, match=r"non-finite loss at step 3: term\(s\) l_dm .*found it at step 4"):
        tr.train(progress=False)
    assert not (tr.ckpt_dir).exists() or not any(tr.ckpt_dir.iterdir())


@pytest.mark.slow
@pytest.mark.parametrize("step", ["flat", "deepspeed"])
def test_the_compiled_fast_step_trains_as_the_eager_step_without_host_reads(tmp_path, tiny_shards, make_config,
                                                                           monkeypatch, step):
    """train.compile with train.fast: student forward+backward, teacher forward and the fused ops compiled (the
    generator's draws eager), the same losses and updates as the default eager step to float32 rounding, and
    after the compiling first step no host read inside steps. With the preset's attention dropout: the CPU
    attention kernel's masks are keyed by a seed drawn with the loss's other random numbers, so the compiled
    graph drops the probabilities the eager step drops. About 2-3 minutes on 2 shared cores, most of it
    compiling."""
    ref = _trainer(tmp_path / "default", tiny_shards, make_config)
    assert ref.net.denoiser.cfg.attn_dropout > 0
    tr = _trainer(tmp_path / "fast", tiny_shards, make_config, fast=True, compile=True, step=step)
    assert (tr.stepper.flat is not None) == (step == "flat")
    ref_batches, batches = ref.loader.forever(), tr.loader.forever()
    want = [ref.train_step(ref_batches) for _ in range(3)]
    got = [tr.train_step(batches)]  # compiles
    allowed = []
    monkeypatch.setattr(tr.engine, "step", _allowing(tr.engine.step, allowed))
    with _no_reads(monkeypatch, allowed) as caught:
        got += [tr.train_step(batches) for _ in range(2)]
    assert not caught
    for a, b in zip(want, got):
        assert a.keys() == b.keys()
        for k in a:
            assert float(b[k]) == pytest.approx(a[k], rel=1e-4, abs=1e-5), k
    # AdamW divides each gradient by its running RMS: where a gradient is ~0 (the zero-initialised AdaLN maps),
    # float32 rounding differences of the compiled kernels move a weight by a fraction of the rate (3e-3),
    # not of the weight: 9e-5 seen after 3 steps; a wrong update moves it by the whole rate
    for a, b in zip(ref.net.parameters(), tr.net.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=3e-4)


@pytest.mark.parametrize("check", [None, True], ids=["default: flagged", "check_grad_overflow: skipped"])
def test_bf16_non_finite_gradients_stop_the_fast_step_at_the_flush_or_are_skipped_when_asked(
        tmp_path, tiny_shards, make_config, check):
    """In bf16 the fast step turns DeepSpeed's per-tensor overflow check off (bf16.check_grad_overflow): a
    non-finite gradient at step 2 (finite loss) is then flagged from DeepSpeed's global norm and stops the run
    at the next flush, before the checkpoint of step 4; set true in the config, DeepSpeed skips the step as
    before and the run goes on."""
    bf16 = {"enabled": True, **({} if check is None else {"check_grad_overflow": check})}
    ds, cfg = load_config(str(make_config(tmp_path, tiny_shards, fast=True, steps=4, log_every=4,
                                          checkpoint_every=4)),
                          edit_deepspeed=lambda raw: raw.update(bf16=bf16))
    logs = []
    tr = Trainer(ds, cfg, log=logs.append)
    assert tr.resolved_config["bf16"]["check_grad_overflow"] is bool(check)
    assert tr.resolved_config["timers"]["throughput"]["enabled"] is False
    calls = []

    def poison(grad):  # the second step's gradient only
        calls.append(1)
        return grad * float("inf") if len(calls) == 2 else grad

    # on the head's output gradient: the flat step's parameters are views of its flat weights inside the loss,
    # so a hook on a parameter tensor would not see its gradient (a module's hooks still run)
    tr.net.denoiser.head.register_forward_hook(lambda module, args, out: out.register_hook(poison) and None)
    if check is None:
        with pytest.raises(NonFiniteLossError, match=r"non-finite gradients at a step in 1\.\.4 .*bf16\.check_grad"
                                                     r"_overflow.*no checkpoint was written"):
            tr.train(progress=False)
        assert not tr.ckpt_dir.exists() or not any(tr.ckpt_dir.iterdir())
    else:
        tr.train(progress=False)
        assert any("warning: step 2: DeepSpeed skipped the optimizer step" in line for line in logs)
        for module in (tr.net, tr.teacher.module, tr.sampling_ema.module):
            assert all(torch.isfinite(p).all() for p in module.parameters())


@pytest.mark.parametrize("step, want", [("deepspeed", ["__bool__"]), ("flat", [])])
def test_a_bf16_fast_step_reads_once_through_deepspeed_and_never_through_the_flat_step(
        tmp_path, tiny_shards, make_config, monkeypatch, step, want):
    """DeepSpeed's ZeRO 2 bf16 step reads the device once (clipping's norm) under the fast step's settings,
    where its overflow check and throughput timer read or synchronised four more times; the flat step clips
    on the device and reads nothing. (On a CPU torch's AdamW also reads its step counters, CPU tensors; fused
    on a GPU it does not: not counted.)"""
    tr = _trainer(tmp_path, tiny_shards, make_config, bf16=True, fast=True, step=step)
    batches = tr.loader.forever()
    tr.train_step(batches)
    from deepspeed.accelerator import get_accelerator

    state = tr.engine.optimizer.optimizer.state
    counters = {id(s["step"]) for s in state.values() if torch.is_tensor(s.get("step"))}
    reads = []
    originals = {name: getattr(torch.Tensor, name) for name in READS}

    def guard(name):
        def read(self, *args, **kwargs):
            if id(self) not in counters:
                reads.append(name)
            return originals[name](self, *args, **kwargs)
        return read

    with monkeypatch.context() as m:
        for name in READS:
            m.setattr(torch.Tensor, name, guard(name))
        m.setattr(get_accelerator(), "synchronize", lambda *a, **k: reads.append("synchronize"))
        tr.train_step(batches)
    assert reads == want


# (train.backend 'compiled' or 'triton' names a backend that not every op of the loss has: refused up front,
# tests/engine/test_trainer.py)
@pytest.mark.parametrize("backend, used", [("reference", "reference"), ("auto", "auto")])
def test_the_flat_step_updates_the_emas_with_the_runs_op_backend(tmp_path, tiny_shards, make_config, monkeypatch,
                                                                  backend, used):
    import vqlcmd.ops as ops

    seen, real = [], ops.ema_update_

    def spy(*args, backend="auto", **kwargs):
        seen.append(backend)
        return real(*args, backend=backend, **kwargs)

    monkeypatch.setattr(ops, "ema_update_", spy)
    tr = _trainer(tmp_path, tiny_shards, make_config, fast=True, step="flat", backend=backend)
    before = [p.detach().clone() for p in tr.teacher.module.parameters()]
    tr.train_step(tr.loader.forever())
    assert seen == [used]  # one update of both EMAs, through the backend the run names
    assert any(not torch.equal(a, b) for a, b in zip(before, tr.teacher.module.parameters()))
