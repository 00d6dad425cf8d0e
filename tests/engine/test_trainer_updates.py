"""Training engine on CPU (one rank), the parts the resume-equivalence tests cannot see: gradient accumulation,
the EMA updates against their formula, the loss's plumbing (config weights, EMA teacher), the seed's data order,
gradient clipping, the EMAs across a resume."""
import numpy as np
import pytest
import torch

from vqlcmd.data.loader import ShardLoader
from vqlcmd.diffusion import training_losses
from vqlcmd.engine.config_file import load_config, parse_vqlcmd_section
from vqlcmd.engine.trainer import Trainer


def _trainer(tmp_path, shards, make_config, ds_edit=None, vqlcmd_edit=None, **train):
    def edit(section):  # merged into the file's sections, as --set does
        for name, values in (vqlcmd_edit or {}).items():
            section[name] = {**section.get(name, {}), **values}

    ds, cfg = load_config(str(make_config(tmp_path, shards, **train)), edit=edit,
                          edit_deepspeed=lambda raw: raw.update(ds_edit or {}))
    return Trainer(ds, cfg, log=lambda *a, **k: None)


def _params(module):
    return [p.detach().double().clone() for p in module.parameters()]


def test_accumulation_feeds_micro_batches_averages_the_terms_and_updates_the_emas_once(tmp_path, tiny_shards,
                                                                                        make_config):
    tr = _trainer(tmp_path, tiny_shards, make_config,
                  ds_edit={"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "train_batch_size": 8},
                  vqlcmd_edit={"ema": {"teacher": 0.9, "sampling": 0.5}})
    assert (tr.micro, tr.gas) == (4, 2)
    before = _params(tr.net)
    for shadow in (tr.teacher.module, tr.sampling_ema.module):  # both start at the network's weights
        assert all(torch.equal(a, b) for a, b in zip(_params(shadow), before))
    sizes, per_micro = [], []
    read = tr.stepper.read_terms

    def recording(out, step):
        values = read(out, step)
        per_micro.append(values)
        return values

    tr.stepper.read_terms = recording

    def batches():
        for tokens, labels in tr.loader.forever():
            sizes.append(len(tokens))
            yield tokens, labels

    terms = tr.train_step(batches())
    assert sizes == [4, 4] and len(per_micro) == 2
    for k, v in terms.items():  # the logged step value: the mean over the micro-batches (as the gradients)
        assert v == pytest.approx((per_micro[0][k] + per_micro[1][k]) / 2, rel=1e-12), k
    after = _params(tr.net)
    assert any(not torch.equal(a, b) for a, b in zip(before, after))
    # ema.py: shadow <- eta * shadow + (1 - eta) * theta, once per optimizer step
    for shadow, eta in ((tr.teacher.module, 0.9), (tr.sampling_ema.module, 0.5)):
        for got, b, a in zip(_params(shadow), before, after):
            torch.testing.assert_close(got, eta * b + (1 - eta) * a, rtol=1e-6, atol=1e-7)


def test_zero_0s_own_grad_norm_covers_every_micro_batch(tmp_path, tiny_shards, make_config):
    """At ZeRO 0 the step computes the norm itself; with accumulation it must be the accumulated gradients'
    (DeepSpeed's own at ZeRO 2), not the first micro-batch's."""
    norms = {}
    for stage in (0, 2):
        tr = _trainer(tmp_path / str(stage), tiny_shards, make_config,
                      ds_edit={"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
                               "zero_optimization": {"stage": stage}})
        tr.train_step(tr.loader.forever())
        norms[stage] = float(tr.own_grad_norm if stage == 0 else tr.engine.get_global_grad_norm())
    assert norms[0] == pytest.approx(norms[2], rel=1e-4)


def test_the_loss_uses_the_configs_weights_and_the_ema_teacher_and_the_seed_orders_the_data(tmp_path, tiny_shards,
                                                                                            make_config):
    loss = {"beta_cm": 0.5, "beta_dm": 0.02}
    tr = _trainer(tmp_path, tiny_shards, make_config, vqlcmd_edit={"loss": loss}, seed=3)
    # the data order is train.seed's (ShardLoader's permutation for that seed), not the default seed's
    assert np.array_equal(tr.loader.epoch_indices(0), ShardLoader(tr.dataset, 8, seed=3).epoch_indices(0))
    assert not np.array_equal(tr.loader.epoch_indices(0), ShardLoader(tr.dataset, 8, seed=0).epoch_indices(0))
    with torch.no_grad():  # a teacher that has drifted from the student, as after some steps
        for p in tr.teacher.module.parameters():
            p.add_(0.05 * torch.randn_like(p))
    tokens, labels = next(iter(tr.loader))
    cfg_loss = parse_vqlcmd_section({"loss": loss}).loss

    def run(fn):
        torch.manual_seed(0)  # attention dropout
        return fn(torch.Generator().manual_seed(5))

    got = run(lambda g: tr.engine.module(tokens, labels, g))
    want = run(lambda g: training_losses(tr.net, tr.teacher.module, tr.schedule, tokens, labels, cfg_loss, generator=g,
                                         backend=tr.cfg.train.backend))
    for k in ("loss", "l0", "l_dm", "l_cm"):
        torch.testing.assert_close(got[k], want[k], rtol=1e-6, atol=1e-6)
    # docs/method.md eq. 14: L = L0 + beta_DM L_DM + beta_CM L_CM, with this config's betas
    torch.testing.assert_close(got["loss"], got["l0"] + 0.02 * got["l_dm"] + 0.5 * got["l_cm"], rtol=1e-6, atol=1e-6)
    own = run(lambda g: training_losses(tr.net, tr.net, tr.schedule, tokens, labels, cfg_loss, generator=g,
                                        backend=tr.cfg.train.backend))
    assert abs(float(own["l_cm"]) - float(got["l_cm"])) > 1e-4  # the teacher's weights matter here


def test_gradient_clipping_reaches_the_optimizer(tmp_path, tiny_shards, make_config):
    """gradient_clipping (DeepSpeed's) bounds the gradient's norm: at 1e-9 every entry is <= 1e-9, so AdamW's
    first step moves each weight by at most lr * 1e-9 / (1e-9 + eps) = lr / 11, where unclipped it moves ~lr."""
    moved = {}
    for clip in (1e-9, 0):
        tr = _trainer(tmp_path / str(clip), tiny_shards, make_config, ds_edit={"gradient_clipping": clip})
        before = _params(tr.net)
        tr.train_step(tr.loader.forever())
        moved[clip] = max(float((a - b).abs().max()) for a, b in zip(_params(tr.net), before)) / tr.step_lr
    assert moved[1e-9] <= 1 / 11 + 1e-6
    assert moved[0] > 0.5


def test_a_resume_restores_both_emas_and_the_weights(tmp_path, tiny_shards, make_config):
    """The resume-equivalence test compares losses, which the sampling EMA (the exported weights) never enters."""
    edit = {"ema": {"teacher": 0.9, "sampling": 0.5}}
    first = _trainer(tmp_path, tiny_shards, make_config, vqlcmd_edit=edit, steps=3)
    first.train(progress=False, until=2)
    saved = {name: _params(m) for name, m in (("net", first.net), ("teacher", first.teacher.module),
                                              ("sampling", first.sampling_ema.module))}
    again = _trainer(tmp_path, tiny_shards, make_config, vqlcmd_edit=edit, steps=3)
    assert again.load() and again.step == 2
    for name, m in (("net", again.net), ("teacher", again.teacher.module), ("sampling", again.sampling_ema.module)):
        assert all(torch.equal(a, b) for a, b in zip(_params(m), saved[name])), name
