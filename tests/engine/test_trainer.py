"""Training engine on CPU (gloo, one rank): resume equivalence, checkpoints, non-finite stop, pipeline export."""
import json
import math

import pytest
import torch

from vqlcmd.engine.checkpoint import CheckpointManager
from vqlcmd.engine.config import ConfigError
from vqlcmd.engine.config_file import load_config
from vqlcmd.engine.trainer import NonFiniteLossError, Trainer
from vqlcmd.pipeline import VQLCMDPipeline

KEYS = ("loss", "l0", "l_dm", "l_cm")


@pytest.fixture
def trainer(make_config):
    def build(tmp_path, shards, **train):
        ds, cfg = load_config(str(make_config(tmp_path, shards, **train)))
        return Trainer(ds, cfg, log=lambda *a, **k: None)

    return build


def test_resume_gives_the_same_losses(tmp_path, tiny_shards, trainer):
    n = 4
    straight = trainer(tmp_path / "a", tiny_shards, steps=2 * n).train(progress=False)

    first = trainer(tmp_path / "b", tiny_shards, steps=2 * n)
    part1 = first.train(progress=False, until=n)
    del first
    second = trainer(tmp_path / "b", tiny_shards, steps=2 * n)
    part2 = second.train(progress=False)
    assert [h["step"] for h in part1 + part2] == list(range(1, 2 * n + 1))
    for a, b in zip(straight, part1 + part2):
        for k in KEYS:
            assert a[k] == pytest.approx(b[k], rel=1e-6, abs=1e-7), (a["step"], k)
    # the loss actually moves (not a frozen run that trivially matches)
    assert straight[0]["loss"] != straight[-1]["loss"]


def test_checkpoints_and_previews_do_not_change_the_run(tmp_path, tiny_shards, trainer, monkeypatch):
    """Exporting the pipeline loads the tokenizer, whose modules initialise from the global generator that attention
    dropout (0.1 in 'tiny') draws from: a run that saved checkpoints went on differently from one that did not,
    and from one resumed from those checkpoints."""
    plain = trainer(tmp_path / "a", tiny_shards, steps=6).train(progress=False)
    build = Trainer.pipeline

    def pipeline_drawing_from_the_global_rng(self):
        torch.randn(1000)
        if self.device.type == "cuda":
            torch.randn(1000, device=self.device)
        return build(self)

    monkeypatch.setattr(Trainer, "pipeline", pipeline_drawing_from_the_global_rng)
    saving = trainer(tmp_path / "b", tiny_shards, steps=6, checkpoint_every=2).train(progress=False)
    assert [h["loss"] for h in saving] == [h["loss"] for h in plain]


def test_checkpoints_are_complete_and_pruned(tmp_path, tiny_shards, trainer):
    tr = trainer(tmp_path, tiny_shards, steps=6, checkpoint_every=2, keep_checkpoints=2)
    tr.train(progress=False)
    ck = tmp_path / "run" / "checkpoints"
    names = sorted(p.name for p in ck.iterdir() if p.is_dir())
    assert names == ["step_0000004", "step_0000006"]
    assert (ck / "latest").read_text().strip() == "step_0000006"
    saved = json.loads((ck / "step_0000006" / "config.json").read_text())
    assert saved["vqlcmd"]["model"]["preset"] == "tiny"
    # a crash mid-write leaves a .partial folder; latest still names a complete checkpoint
    (ck / "step_0000008.partial").mkdir()
    from vqlcmd.engine.checkpoint import latest_tag

    assert latest_tag(ck) == "step_0000006"


def test_exported_pipeline_loads_and_samples(tmp_path, tiny_shards, trainer):
    tr = trainer(tmp_path, tiny_shards, steps=2)
    tr.train(progress=False)
    folder = tmp_path / "run" / "pipeline"
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "manifest.json", "model.safetensors"]  # (issue 45: the manifest)
    pipe = VQLCMDPipeline.from_pretrained(folder)
    # the exported weights are the sampling EMA's
    for a, b in zip(pipe.network.parameters(), tr.sampling_ema.module.parameters()):
        torch.testing.assert_close(a, b.cpu())
    tokens = pipe([0, 1, 2], num_steps=3, output_type="tokens", generator=torch.Generator().manual_seed(0))
    assert tokens.shape == (3, 4, 4)


@pytest.mark.parametrize("stage", [0, 2])
def test_non_finite_gradients_with_a_finite_loss_never_reach_the_weights(tmp_path, tiny_shards, make_config, stage):
    """ZeRO 0's plain AdamW stepped on them (clipped inf: NaN), and the NaN weights reached the EMAs, the
    checkpoint and, at the last step, the exported pipeline with exit 0; ZeRO 1/2 skip such a step, now
    with a warning."""
    ds, cfg = load_config(str(make_config(tmp_path, tiny_shards, steps=3, checkpoint_every=1)))
    logs = []
    tr = Trainer({**ds, "zero_optimization": {"stage": stage}}, cfg, log=logs.append)
    weight = tr.net.denoiser.head.weight
    calls = []

    def poison(grad):  # the second step's gradient only
        calls.append(1)
        return grad * float("inf") if len(calls) == 2 else grad

    weight.register_hook(poison)
    if stage == 0:
        with pytest.raises(NonFiniteLossError, match=r"non-finite gradients at step 2 .*the last checkpoint, "
                                                     r".*step_0000001, is intact"):
            tr.train(progress=False)
    else:
        tr.train(progress=False)
        assert any("warning: step 2: DeepSpeed skipped the optimizer step" in line for line in logs)
    for module in (tr.net, tr.teacher.module, tr.sampling_ema.module):
        assert all(torch.isfinite(p).all() for p in module.parameters())


def test_non_finite_loss_stops_with_step_and_term(tmp_path, tiny_shards, trainer):
    tr = trainer(tmp_path, tiny_shards, steps=4)
    with torch.no_grad():
        tr.net.embedding.weight[3, 0] = float("nan")
    with pytest.raises(NonFiniteLossError, match=r"step 1: term\(s\) .*loss"):
        tr.train(progress=False)
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_interval_grids_use_grid_steps(tmp_path, tiny_shards, trainer, monkeypatch):
    """Grids saved during training sample with sample.grid_steps (a cheap preview); unset, num_steps."""
    tr = trainer(tmp_path, tiny_shards, steps=2)
    calls = []

    class RecordingPipeline:
        def __call__(self, labels, *, output_type, generator, num_steps):
            calls.append(num_steps)
            return torch.zeros(len(labels), 1, 8, 8)

    tr.tokenizer_dir = tmp_path  # grids are only drawn when images can be decoded
    monkeypatch.setattr(tr, "pipeline", RecordingPipeline)
    assert tr.save_sample_grid().exists()
    tr.cfg.sample.grid_steps = 3
    tr.save_sample_grid()
    assert calls == [tr.cfg.sample.num_steps, 3]


def test_preview_grids_show_at_most_grid_rows_classes(tmp_path, tiny_shards, trainer, monkeypatch):
    """A row per class up to report.GRID_ROWS, then that many classes spread over the labels: ImageNet's
    1000 classes made each preview 8000 images, sampled and decoded in one go."""
    from vqlcmd.engine import report

    tr = trainer(tmp_path, tiny_shards, steps=1)
    asked = []

    class RecordingPipeline:
        def __call__(self, labels, *, output_type, generator, num_steps):
            asked.append(labels.tolist())
            return torch.zeros(len(labels), 1, 8, 8)

    tr.tokenizer_dir = tmp_path
    monkeypatch.setattr(tr, "pipeline", RecordingPipeline)
    per = tr.cfg.sample.per_class
    tr.save_sample_grid()
    monkeypatch.setattr(report, "GRID_ROWS", 2)  # the tiny data's 4 classes, shown as 2
    tr.save_sample_grid()
    assert asked == [[c for c in range(4) for _ in range(per)], [c for c in (0, 3) for _ in range(per)]]


def test_grid_classes_spread_over_the_labels():
    from vqlcmd.engine.report import grid_classes

    assert grid_classes(7).tolist() == list(range(7))
    picked = grid_classes(1000).tolist()
    assert len(set(picked)) == 10 and picked == sorted(picked) and picked[0] == 0 and picked[-1] == 999
    assert grid_classes(0).tolist() == []


def test_auto_precision_is_resolved_and_recorded(tmp_path, tiny_shards, make_config, monkeypatch):
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: {"avx512_bf16": False, "amx_bf16": False})
    path = make_config(tmp_path, tiny_shards, steps=1)
    path.write_text(path.read_text().replace('"zero_optimization"', '"bf16": {"enabled": "auto"}, "zero_optimization"'))
    ds, cfg = load_config(str(path))
    tr = Trainer(ds, cfg, log=lambda *a, **k: None)
    assert tr.bf16 is False and tr.net.embedding.weight.dtype == torch.float32
    assert json.loads((tmp_path / "run" / "config.json").read_text())["bf16"]["enabled"] is False


@pytest.mark.parametrize("first, then", [(False, True), (True, False)])
def test_resume_in_another_precision_is_refused(tmp_path, tiny_shards, make_config, first, then):
    ds, cfg = load_config(str(make_config(tmp_path, tiny_shards, steps=2, checkpoint_every=2)))
    Trainer({**ds, "bf16": {"enabled": first}}, cfg, log=lambda *a, **k: None).train(progress=False)
    name = {True: "bf16", False: "fp32"}
    with pytest.raises(ConfigError, match=f"trained in {name[first]} but this run trains in {name[then]}; "
                                          f"set bf16.enabled to {str(first).lower()}"):
        Trainer({**ds, "bf16": {"enabled": then}}, cfg, log=lambda *a, **k: None).train(progress=False)
    assert json.loads((tmp_path / "run" / "config.json").read_text())["bf16"]["enabled"] is first  # not overwritten


def test_zero_stage_0_with_bf16_is_refused(tmp_path, tiny_shards, make_config):
    """DeepSpeed's FP16_UnfusedOptimizer (ZeRO 0 + bf16) takes an AdamW step on zero gradients as it starts."""
    ds, cfg = load_config(str(make_config(tmp_path, tiny_shards, steps=2)))
    with pytest.raises(ConfigError, match=r"zero_optimization\.stage 0 with bf16 .* Use stage 1"):
        Trainer({**ds, "bf16": {"enabled": True}, "zero_optimization": {"stage": 0}}, cfg, log=lambda *a, **k: None)
    Trainer({**ds, "bf16": {"enabled": True}, "zero_optimization": {"stage": 1}}, cfg, log=lambda *a, **k: None)


def test_a_zero_0_bf16_run_from_before_the_refusal_still_resumes(tmp_path, tiny_shards, make_config, monkeypatch):
    """Its stage and precision cannot change on resume, so refusing it left no way on (the messages went in
    a circle); it resumes with a warning."""
    ds, cfg = load_config(str(make_config(tmp_path, tiny_shards, steps=2, checkpoint_every=2)))
    ds = {**ds, "bf16": {"enabled": True}, "zero_optimization": {"stage": 0}}
    with monkeypatch.context() as m:  # the old code, which accepted it
        m.setattr(CheckpointManager, "resumes_zero0_bf16", lambda self: True)
        Trainer(ds, cfg, log=lambda *a, **k: None).train(progress=False)
    logs = []
    cfg.train.steps = 3
    tr = Trainer(ds, cfg, log=logs.append)
    tr.train(progress=False)
    assert tr.step == 3 and any("warning: resuming a ZeRO 0 bf16 run" in line for line in logs)


def test_resume_from_zero_2_at_zero_1_trains_on(tmp_path, tiny_shards, make_config):
    ds, cfg = load_config(str(make_config(tmp_path, tiny_shards, steps=2, checkpoint_every=2)))
    Trainer(ds, cfg, log=lambda *a, **k: None).train(progress=False)
    cfg.train.steps = 3
    tr = Trainer({**ds, "zero_optimization": {"stage": 1}}, cfg, log=lambda *a, **k: None)
    tr.train(progress=False)
    assert tr.step == 3


def _folders(path):
    return sorted(p.name for p in path.iterdir())


def test_fresh_run_refuses_a_folder_with_checkpoints(tmp_path, tiny_shards, trainer):
    trainer(tmp_path, tiny_shards, steps=4, checkpoint_every=2).train(progress=False)
    ck = tmp_path / "run" / "checkpoints"
    before, config = _folders(ck), (tmp_path / "run" / "config.json").read_text()
    # before, such a run wrote step_0000002 beside the old step_0000004, pruned its own by step number and
    # left `latest` naming a folder that no longer existed
    with pytest.raises(ConfigError, match=r"train\.resume is false but .*checkpoints holds an earlier run's "
                                          r"checkpoints \(latest step_0000004\); choose another train\.output_dir"):
        trainer(tmp_path, tiny_shards, steps=2, resume=False)
    assert _folders(ck) == before and (tmp_path / "run" / "config.json").read_text() == config


@pytest.mark.parametrize("change, match", [
    ({"model": {"preset": "tiny", "overrides": {"depth": 1}}}, r"vqlcmd\.model = .* but this run has .*\"depth\": 1"),
    ({"embedding": {"frozen": True}}, r"vqlcmd\.embedding = \{\"frozen\": false"),
    ({"schedule": {"shift": -1.0}}, r"vqlcmd\.schedule = \{\"shift\": 0\.0.* but this run has \{\"shift\": -1\.0"),
    ({"micro": 4}, r"trained at a global batch of 8 \(1 rank\(s\) x micro-batch 8 x accumulation 1\) but this "
                   r"run's is 4; .*set train_batch_size 8"),
    # DeepSpeed's own errors called the checkpoint corrupt; the loader's a raw ValueError after loading it
    ({"stage": 0}, r"trained at zero_optimization\.stage 2 but this run has stage 0; .*: resume with stage 1 or 2$"),
    ({"train": {"seed": 1}}, r"trained with train\.seed 0 but this run has 1; .*resume with the same seed"),
])
def test_resume_with_another_setup_is_refused_up_front(tmp_path, tiny_shards, make_config, change, match):
    ds, cfg = load_config(str(make_config(tmp_path, tiny_shards, steps=2)))
    Trainer(ds, cfg, log=lambda *a, **k: None).train(progress=False)
    section = cfg.to_dict()
    for key, value in change.items():
        if key not in ("micro", "stage"):
            section[key] = {**section[key], **value} if key == "train" else value
    from vqlcmd.engine.config_file import parse_vqlcmd_section

    ds2 = {**ds, "train_micro_batch_size_per_gpu": change.get("micro", 8),
           "zero_optimization": {**ds["zero_optimization"], "stage": change.get("stage", 2)}}
    with pytest.raises(ConfigError, match=match):
        Trainer(ds2, parse_vqlcmd_section(section), log=lambda *a, **k: None)


def test_resume_on_other_shards_is_refused_up_front(tmp_path, tiny_shards, trainer):
    """Shards of another tokenizer with the same codebook, grid and count passed every check: the run trained
    on, and its pipeline named the new tokenizer for a model half trained on the old one's ids."""
    from vqlcmd.data.shards import open_shard, write_shard

    trainer(tmp_path, tiny_shards, steps=2).train(progress=False)
    moved = tmp_path / "moved"
    tiny_shards.rename(moved)  # another folder holding the same shards resumes
    trainer(tmp_path, moved, steps=3).train(progress=False)
    for f in sorted(moved.glob("*.vqtok")):
        s = open_shard(f)
        write_shard(f, s.tokens[:], s.labels[:], {**s.header, "tokenizer_id": "another-tokenizer"})
    with pytest.raises(ConfigError, match=r"step_0000003 was trained on other data \(token shards or image tree\): "
                                          r"\{\"tokenizer_id\": \[\"synthetic-test\", \"another-tokenizer\"\]\}"):
        trainer(tmp_path, moved, steps=4)


def test_a_resume_trains_with_the_configs_rates(tmp_path, tiny_shards, make_config):
    """The checkpoint brought back the old lr, betas, weight decay and EMA rates, while config.json and the pipeline
    recorded the new ones."""
    from vqlcmd.engine.config_file import parse_vqlcmd_section

    ds, cfg = load_config(str(make_config(tmp_path, tiny_shards, steps=4)))
    Trainer(ds, cfg, log=lambda *a, **k: None).train(progress=False, until=2)
    section = cfg.to_dict()
    section["optimizer"].update(lr=1e-3, betas=[0.8, 0.95], weight_decay=0.1)
    section["ema"].update(teacher=0.9, sampling=0.5)
    lines = []
    tr = Trainer(ds, parse_vqlcmd_section(section), log=lines.append)
    tr.train(progress=False, until=3)
    groups = tr.engine.optimizer.param_groups
    assert all(tuple(g["betas"]) == (0.8, 0.95) and g["weight_decay"] == 0.1 for g in groups)
    assert tr.step_lr == pytest.approx(1e-3)  # step 3: past the 2 warm-up steps, cosine at its start
    assert (tr.teacher.decay, tr.sampling_ema.decay) == (0.9, 0.5)
    said = next(line for line in lines if line.startswith("resuming with the config's"))
    assert "optimizer.lr 0.001 (checkpoint: 0.003)" in said and "ema.teacher 0.9 (checkpoint: 0.99)" in said


def test_same_model_spelled_differently_still_resumes(tmp_path, tiny_shards, make_config):
    ds, cfg = load_config(str(make_config(tmp_path, tiny_shards, steps=2)))
    Trainer(ds, cfg, log=lambda *a, **k: None).train(progress=False)
    from vqlcmd.engine.config_file import parse_vqlcmd_section

    section = cfg.to_dict()
    # the tiny preset's own depth; the attention path changes neither the weights nor the function
    section["model"]["overrides"] = {"depth": 2, "attention_backend": "math"}
    section["train"]["steps"] = 3
    history = Trainer(ds, parse_vqlcmd_section(section), log=lambda *a, **k: None).train(progress=False)
    assert [h["step"] for h in history] == [3]


def test_a_damaged_checkpoint_is_set_aside_by_name_and_the_run_falls_back(tmp_path, tiny_shards, trainer,
                                                                         make_config):
    """A truncated file stopped the run with a way back for a person to take (issue 45: an unattended job
    could not); now the checkpoint fails its manifest, is set aside whole, and the previous one resumes."""
    straight = trainer(tmp_path / "straight", tiny_shards, steps=6).train(progress=False)
    trainer(tmp_path, tiny_shards, steps=4, checkpoint_every=2).train(progress=False)
    ck = tmp_path / "run" / "checkpoints"
    (states,) = (ck / "step_0000004").glob("*model_states.pt")
    truncated = states.read_bytes()[:100]
    states.write_bytes(truncated)  # truncated, as a full disk or a lost write leaves it
    lines = []
    history = Trainer(*load_config(str(make_config(tmp_path, tiny_shards, steps=6))), log=lines.append).train(
        progress=False)
    assert [h["step"] for h in history] == [3, 4, 5, 6]
    assert [h["loss"] for h in history] == [h["loss"] for h in straight[2:]]
    assert (ck / "step_0000004.corrupt" / states.name).read_bytes() == truncated  # kept, not deleted
    assert any("step_0000004" in line and states.name in line for line in lines), lines


def test_a_micro_batch_the_data_cannot_fill_is_a_config_error(tmp_path, tiny_shards, make_config):
    ds, cfg = load_config(str(make_config(tmp_path, tiny_shards, steps=1)))
    with pytest.raises(ConfigError, match=r"train_micro_batch_size_per_gpu=200: 96 samples cannot fill one batch"):
        Trainer({**ds, "train_micro_batch_size_per_gpu": 200}, cfg, log=lambda *a, **k: None)


def test_a_finished_run_launched_again_keeps_its_checkpoint(tmp_path, tiny_shards, trainer):
    # it saved the last step again, replacing (first deleting) the complete checkpoint it had resumed from
    trainer(tmp_path, tiny_shards, steps=2).train(progress=False)
    step = tmp_path / "run" / "checkpoints" / "step_0000002"
    before = step.stat().st_ino
    (tmp_path / "run" / "pipeline" / "model.safetensors").unlink()  # as a crash between the two leaves it
    assert trainer(tmp_path, tiny_shards, steps=2).train(progress=False) == []
    assert step.stat().st_ino == before
    assert (tmp_path / "run" / "pipeline" / "model.safetensors").is_file()  # exported again


def test_a_checkpoint_missing_other_ranks_files_names_the_shared_filesystem(tmp_path, tiny_shards, trainer):
    # on nodes that do not share output_dir, rank 0 published a checkpoint holding its own files only
    from vqlcmd.engine.checkpoint import CheckpointError

    tr = trainer(tmp_path, tiny_shards, steps=1)
    tr.world = tr.checkpoints.world = 2  # as if a second rank had written its state on another node's disk
    with pytest.raises(CheckpointError, match=r"lacks the state of rank\(s\) \[1\] .* filesystem that all nodes share"):
        tr.save()


def test_batch_size_keys_that_disagree_are_config_errors(tmp_path, tiny_shards, make_config):
    # a train_batch_size beside the micro-batch was dropped unread (a global batch of 16 where 32 was asked),
    # and one that the ranks x accumulation did not divide was rounded down
    ds, cfg = load_config(str(make_config(tmp_path, tiny_shards, steps=1)))
    with pytest.raises(ConfigError, match=r"train_batch_size=32 but train_micro_batch_size_per_gpu=8 x "
                                          r"gradient_accumulation_steps=1 x 1 rank\(s\) = 8"):
        Trainer({**ds, "train_batch_size": 32}, cfg, log=lambda *a, **k: None)
    only_total = {k: v for k, v in ds.items() if k != "train_micro_batch_size_per_gpu"}
    with pytest.raises(ConfigError, match=r"train_batch_size=9 is not a multiple of 1 rank\(s\) x "
                                          r"gradient_accumulation_steps=2: .* \(e\.g\. 8\)"):
        Trainer({**only_total, "train_batch_size": 9, "gradient_accumulation_steps": 2}, cfg, log=lambda *a, **k: None)
    agreeing = Trainer({**ds, "train_batch_size": 8}, cfg, log=lambda *a, **k: None)
    assert (agreeing.micro, agreeing.gas) == (8, 1)


def test_compile_keeps_the_checkpoint_keys(tmp_path, tiny_shards, trainer):
    # torch.compile(module) wrapped the denoiser: its keys became net.denoiser._orig_mod.*, so a checkpoint
    # written with train.compile could not be resumed without it, nor the reverse
    plain = trainer(tmp_path / "a", tiny_shards, steps=1)
    compiled = trainer(tmp_path / "b", tiny_shards, steps=1, compile=True)
    assert list(compiled.engine.module.state_dict()) == list(plain.engine.module.state_dict())


def test_a_checkpoint_of_the_old_compile_wrapper_still_loads(tmp_path, tiny_shards, trainer):
    # until in-place compiling, train.compile saved the denoiser's weights as net.denoiser._orig_mod.*
    tr = trainer(tmp_path, tiny_shards, steps=1)
    state = {k: v.clone() for k, v in tr.engine.module.state_dict().items()}
    old = {k.replace("net.denoiser.", "net.denoiser._orig_mod.", 1): v + 1 for k, v in state.items()}
    assert any("_orig_mod" in k for k in old)
    tr.engine.module.load_state_dict(old)
    for k, v in tr.engine.module.state_dict().items():
        torch.testing.assert_close(v, state[k] + 1)


def _scalars(run_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tb"))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_logged_lr_is_the_one_each_step_used_and_grad_norm_is_logged(tmp_path, tiny_shards, make_config):
    """train/lr was read after the scheduler had moved on (one step late), and ZeRO 0 in fp32 logged no grad norm
    (DeepSpeed keeps none for a plain client optimizer); the run's own must equal DeepSpeed's at ZeRO 2."""
    got = {}
    for stage in (0, 2):
        path = make_config(tmp_path / str(stage), tiny_shards, steps=4, log_every=1)
        cfg = json.loads(path.read_text())
        cfg["zero_optimization"]["stage"] = stage
        path.write_text(json.dumps(cfg))
        ds, c = load_config(str(path))
        Trainer(ds, c, log=lambda *a, **k: None).train(progress=False)
        got[stage] = _scalars(tmp_path / str(stage) / "run")
    # the documented schedule: warm-up (k + 1) / 2 over 2 steps, then cosine to 0.1 at step 4; step n uses k = n - 1
    factor = [0.5, 1.0, 1.0, 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5))]
    for stage in (0, 2):
        assert [s for s, _ in got[stage]["train/lr"]] == [1, 2, 3, 4]
        assert [v for _, v in got[stage]["train/lr"]] == pytest.approx([3e-3 * f for f in factor], rel=1e-6)
    norms = [[v for _, v in got[stage]["train/grad_norm"]] for stage in (0, 2)]
    assert len(norms[0]) == 4 and all(v > 0 for v in norms[0])
    assert norms[0] == pytest.approx(norms[1], rel=1e-4)


def test_the_embedding_tables_mean_row_norm_is_logged_beside_the_losses(tmp_path, tiny_shards, trainer):
    """L_DM and L_CM scale with the table's norm: their curves are read against embedding/mean_row_norm, the mean
    Euclidean norm of the K token rows (the [mask] row left out), logged at each log step."""
    tr = trainer(tmp_path, tiny_shards, steps=3, log_every=1)
    tr.train(progress=False)
    logged = _scalars(tmp_path / "run")["embedding/mean_row_norm"]
    assert [s for s, _ in logged] == [1, 2, 3]
    rows = tr.net.embedding.table()[:16].detach().double()  # the tiny preset's K = 16
    want = sum(math.sqrt(sum(float(x) ** 2 for x in row)) for row in rows) / len(rows)
    assert logged[-1][1] == pytest.approx(want, rel=1e-6)
    assert logged[0][1] != pytest.approx(logged[-1][1], rel=1e-9)  # read at each log step, not once


def test_a_signal_stops_at_the_step_boundary_with_a_checkpoint_and_the_run_resumes_exactly(
        tmp_path, tiny_shards, trainer, monkeypatch):
    """Ctrl-C or a preemption's SIGTERM lost everything since the last checkpoint (a raw KeyboardInterrupt)."""
    import os
    import signal

    from vqlcmd.engine.trainer import TrainingInterrupted

    straight = trainer(tmp_path / "a", tiny_shards, steps=6).train(progress=False)
    step = Trainer.train_step

    def step_with_a_signal(self, batches):
        if self.step == 2:  # arrives during step 3: the run finishes it, saves, stops
            os.kill(os.getpid(), signal.SIGTERM)
        return step(self, batches)

    monkeypatch.setattr(Trainer, "train_step", step_with_a_signal)
    before = signal.getsignal(signal.SIGTERM)
    tr = trainer(tmp_path / "b", tiny_shards, steps=6)
    with pytest.raises(TrainingInterrupted, match=r"stopped by SIGTERM after step 3; checkpoint .*step_0000003"):
        tr.train(progress=False)
    assert signal.getsignal(signal.SIGTERM) is before
    ck = tmp_path / "b" / "run" / "checkpoints"
    assert (ck / "latest").read_text().strip() == "step_0000003"
    monkeypatch.setattr(Trainer, "train_step", step)
    rest = tr.train(progress=False)  # the same trainer goes on (as after a Ctrl-C in a notebook)
    assert [h["step"] for h in rest] == [4, 5, 6]
    assert [h["loss"] for h in rest] == [h["loss"] for h in straight[3:]]


def test_ctrl_c_under_the_cli_saves_and_exits_with_the_shells_code(tmp_path, tiny_shards, make_config):
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    cfg = make_config(tmp_path, tiny_shards, steps=100000, log_every=1)
    script = Path(__file__).resolve().parents[2] / "scripts" / "train.py"
    proc = subprocess.Popen([sys.executable, str(script), "--config", str(cfg), "--no-progress"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 300
    while time.time() < deadline and not (tmp_path / "run" / "tb").is_dir():
        time.sleep(0.5)
    time.sleep(3)  # some steps in
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 128 + signal.SIGINT, out[-3000:]
    assert "SIGINT: stopping at step" in out and "launch the same command again to resume" in out
    latest = (tmp_path / "run" / "checkpoints" / "latest").read_text().strip()
    assert latest.startswith("step_") and int(latest[5:]) > 0


def test_the_launchers_sigterm_after_ctrl_c_is_not_a_second_ctrl_c(tmp_path, tiny_shards, trainer):
    import os
    import signal

    tr = trainer(tmp_path, tiny_shards, steps=2)
    with tr._stop_on_signals():
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGTERM)  # as the deepspeed launcher forwards Ctrl-C
        os.kill(os.getpid(), signal.SIGTERM)
        assert tr.signal_seen == signal.SIGINT
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C again: stop now


def test_a_failing_preview_loses_no_checkpoint(tmp_path, tiny_shards, trainer, monkeypatch):
    """The preview grid was drawn before the checkpoint of the same step: a preview that failed (sampling,
    decoding, a full disk) lost every step since the last checkpoint, the first 10,000 with ds_imagenet."""
    def broken(self, *a, **k):
        raise RuntimeError("preview failed")

    monkeypatch.setattr(Trainer, "save_sample_grid", broken)
    with pytest.raises(RuntimeError, match="preview failed"):
        trainer(tmp_path, tiny_shards, steps=4, checkpoint_every=2, sample_every=2).train(progress=False)
    assert (tmp_path / "run" / "checkpoints" / "step_0000002").is_dir()


@pytest.mark.parametrize("backend, op", [("compiled", "softmax_embedding_average"), ("triton", "noise_draw")])
def test_an_op_backend_the_loss_cannot_use_is_refused_before_the_set_up(tmp_path, tiny_shards, make_config, monkeypatch,
                                                                        backend, op):
    """train.backend names one backend for every fused op of the loss; each of 'compiled' and 'triton' lacks one of
    them, so such a run stopped at its first step, after DeepSpeed's set-up and the compile."""
    import vqlcmd.engine.trainer as trainer_module

    def no_engine(*args, **kwargs):
        raise AssertionError("DeepSpeed's engine was built before the backend was checked")

    monkeypatch.setattr(trainer_module, "build_engine", no_engine)
    ds, cfg = load_config(str(make_config(tmp_path, tiny_shards, backend=backend)))
    with pytest.raises(ConfigError, match=rf"train\.backend '{backend}' cannot run method 'vqlcmd': its loss calls "
                                          rf"{op}, and {op} has no '{backend}' backend .*'auto' picks"):
        Trainer(ds, cfg, log=lambda *a, **k: None)
