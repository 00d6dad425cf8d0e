"""train.step (vqlcmd/engine/flat_step.py): checkpoints written under the flat step resume under DeepSpeed's
engine step and the other way round, a resume under the flat step is bit-exact, the flat step on two gloo ranks
trains as DeepSpeed's ZeRO 2 step does on its own partitions, and the refusals and the choice of ``auto``.
The tiny preset with its attention dropout: the random streams are per slot and saved in the rank state."""
import os

import pytest
import torch
import torch.multiprocessing as mp

from test_fast_step import _trainer
from vqlcmd.engine.config import ConfigError
from vqlcmd.engine.config_file import load_config
from vqlcmd.engine.trainer import Trainer

STEPS = 4
ACCUMULATION = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}
GAS = {"one micro-step": None, "accumulation": ACCUMULATION}


def _train(tmp_path, shards, make_config, step, ds_edit=None, until=None):
    """A fast run of STEPS steps in ``tmp_path`` (resuming what is there) with ``train.step`` = ``step``, stopped
    at ``until``: (its history, its final weights)."""
    tr = _trainer(tmp_path, shards, make_config, ds_edit=ds_edit, fast=True, step=step, steps=STEPS, log_every=1)
    assert (tr.stepper.flat is not None) == (step == "flat")
    history = tr.train(progress=False, until=until)
    return history, [p.detach().clone() for p in tr.net.parameters()]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, tiny_shards_module):
    """uninterrupted(make_config, step, gas id): the STEPS-step run, once per module."""
    runs = {}

    def get(make_config, step, gas):
        if (step, gas) not in runs:
            folder = tmp_path_factory.mktemp(f"{step}-{gas.replace(' ', '-')}")
            runs[step, gas] = _train(folder, tiny_shards_module, make_config, step, GAS[gas])
        return runs[step, gas]

    return get


def _resumed(tmp_path, shards, make_config, first, then, ds_edit=None):
    """Steps 1-2 under ``train.step`` = ``first``, saved; steps 3-4 resumed in a new Trainer under ``then``."""
    part1, _ = _train(tmp_path, shards, make_config, first, ds_edit, until=2)
    assert [row["step"] for row in part1] == [1, 2]
    assert (tmp_path / "run" / "checkpoints" / "step_0000002").is_dir()
    part2, weights = _train(tmp_path, shards, make_config, then, ds_edit)
    assert [row["step"] for row in part2] == [3, 4]
    return part2, weights


def _assert_exact(got, want):
    (history, weights), (ref_history, ref_weights) = got, want
    assert history == [row for row in ref_history if row["step"] > 2]
    assert len(weights) == len(ref_weights)
    assert all(torch.equal(a, b) for a, b in zip(weights, ref_weights))


@pytest.mark.parametrize("first, then", [("flat", "deepspeed"), ("deepspeed", "flat")])
def test_a_checkpoint_of_either_step_resumes_under_the_other(tmp_path, tiny_shards_module, make_config,
                                                              uninterrupted, first, then):
    """The flat step writes DeepSpeed's checkpoint from DeepSpeed's own buffers (weights, fp32 partition, AdamW
    moments, step counters, rate schedule): resumed under the other step, steps 3-4 are the uninterrupted runs'
    of either step bit for bit, fp32 (the flat step's norm is DeepSpeed's to the fp32 bit, its update DeepSpeed's own)."""
    got = _resumed(tmp_path, tiny_shards_module, make_config, first, then)
    _assert_exact(got, uninterrupted(make_config, then, "one micro-step"))
    _assert_exact(got, uninterrupted(make_config, first, "one micro-step"))
    history = uninterrupted(make_config, then, "one micro-step")[0]
    assert history[0]["loss"] != history[-1]["loss"]  # it trains: not a frozen run matching trivially


@pytest.mark.parametrize("gas", list(GAS))
def test_a_resume_under_the_flat_step_is_bit_exact(tmp_path, tiny_shards_module, make_config, uninterrupted, gas):
    """Flat 2 steps, saved, resumed, flat 2 more: the losses of steps 3-4 and the final weights are the
    uninterrupted flat run's exactly (torch.equal), with one micro-step and with micro 4 x accumulation 2."""
    got = _resumed(tmp_path, tiny_shards_module, make_config, "flat", "flat", GAS[gas])
    _assert_exact(got, uninterrupted(make_config, "flat", gas))


def _two_rank_worker(rank, port, configs, out):
    """Rank ``rank`` of 2 (gloo): each config of ``configs`` trained 3 steps; its rows (averaged over ranks), its
    weights and its ZeRO partition's size to ``out``/rank<r>.pt."""
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    result = {}
    for step, path in configs:
        ds, cfg = load_config(path, edit_deepspeed=lambda raw: raw.update(bf16={"enabled": False}))
        tr = Trainer(ds, cfg, log=lambda *a, **k: None)
        batches = tr.loader.forever()
        for _ in range(3):
            tr.train_step(batches)
        opt, flat = tr.engine.optimizer, tr.stepper.flat
        result[step] = {"rows": tr.stepper.flush(), "weights": [p.detach().clone() for p in tr.net.parameters()],
                        "partition": opt.single_partition_of_fp32_groups[0].numel(),
                        "flat": opt.bit16_groups_flat[0].numel(),
                        "flat_part": None if flat is None else (flat.parts[0].numel(), flat.parts[0].storage_offset())}
        del tr, opt, flat
    torch.save(result, os.path.join(out, f"rank{rank}.pt"))


def test_the_flat_step_on_two_ranks_trains_as_deepspeeds_zero2_step(tmp_path, tiny_shards_module, make_config):
    """Two gloo ranks, ZeRO 2, fp32, 3 steps: the flat step (the full fp32 gradient reduce-scattered in place,
    each rank's half divided by the world size, clipped and stepped as DeepSpeed's fp32 partition, then the flat
    16-bit buffer all-gathered in place)
    against DeepSpeed's (bucketed reduce-scatter into the same partitions). The losses averaged over ranks and
    the final weights are equal bit for bit: a sum of two addends is the same in either order, and halving it
    is exact, so both reductions give the same mean gradient, and the norm (to the fp32 bit) and AdamW are DeepSpeed's.
    Each rank steps its own half: the fp32 partitions and the flat step's gradient slices tile the flat buffer."""
    from vqlcmd.engine.distributed import free_port

    configs = [(step, str(make_config(tmp_path / step, tiny_shards_module, fast=True, step=step, steps=3)))
               for step in ("flat", "deepspeed")]
    mp.spawn(_two_rank_worker, args=(free_port(), configs, str(tmp_path)), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in (0, 1)]
    flat, ds = ranks[0]["flat"], ranks[0]["deepspeed"]
    assert [row["step"] for row in flat["rows"]] == [1, 2, 3]
    assert flat["rows"] == ds["rows"]
    assert flat["rows"][0]["loss"] != flat["rows"][-1]["loss"]
    for rank in ranks:  # the all-gather left both ranks with the same weights, under either step
        for step in ("flat", "deepspeed"):
            assert all(torch.equal(a, b) for a, b in zip(rank[step]["weights"], ds["weights"])), step
    numel = sum(w.numel() for w in ds["weights"])
    for r, rank in enumerate(ranks):
        size, total = rank["flat"]["partition"], rank["flat"]["flat"]
        assert 2 * size == total >= numel and size < numel
        assert rank["flat"]["flat_part"] == (size, r * size)  # the flat step clips and steps this rank's half
        assert rank["deepspeed"]["partition"] == size


def _built(tmp_path, shards, make_config, *, zero=2, bf16=False, ds_edit=None, **train):
    """A Trainer of a fast tiny run at ZeRO ``zero``, and its log lines."""
    logs = []
    ds, cfg = load_config(str(make_config(tmp_path, shards, fast=True, **train)),
                          edit_deepspeed=lambda raw: raw.update(bf16={"enabled": bf16},
                                                                zero_optimization={"stage": zero}, **(ds_edit or {})))
    return Trainer(ds, cfg, log=lambda line, *a, **k: logs.append(str(line))), logs


def _step_lines(logs):
    return [line for line in logs if line.startswith("step: ")]


def test_train_step_flat_without_train_fast_is_refused_at_config_load(tmp_path, tiny_shards_module, make_config):
    with pytest.raises(ConfigError, match=r"train\.step 'flat' is the fast step's \(set train\.fast true"):
        load_config(str(make_config(tmp_path, tiny_shards_module, step="flat")))
    load_config(str(make_config(tmp_path, tiny_shards_module, step="deepspeed")))  # (DeepSpeed's: any step)


FP32_ACCUMULATION = {"data_types": {"grad_accum_dtype": "fp32"}}


@pytest.mark.parametrize("zero, bf16, ds_edit, optimizer", [(0, False, None, "AdamW"),
                                                            (1, True, FP32_ACCUMULATION, "BF16_Optimizer")],
                         ids=["ZeRO 0 fp32", "ZeRO 1 bf16, fp32 accumulation"])
def test_a_run_deepspeed_steps_without_zero_1_2s_optimizer_refuses_flat_and_auto_falls_back(
        tmp_path, tiny_shards_module, make_config, zero, bf16, ds_edit, optimizer):
    """ZeRO 0 (a plain client optimizer) and ZeRO 1 in bf16 with fp32 gradient accumulation (DeepSpeed's
    BF16_Optimizer; with bf16 accumulation, the default, ZeRO 1 keeps its DeepSpeedZeroOptimizer) keep no flat
    ZeRO 1/2 partition to step: "flat" is refused naming the optimizer DeepSpeed chose, "auto" takes
    DeepSpeed's step and says why."""
    refusal = rf"train\.step 'flat' cannot drive this run: DeepSpeed steps a {optimizer} here \(the flat step "
    with pytest.raises(ConfigError, match=refusal + r"drives ZeRO 1/2's DeepSpeedZeroOptimizer"):
        _built(tmp_path / "flat", tiny_shards_module, make_config, zero=zero, bf16=bf16, ds_edit=ds_edit,
               step="flat")
    tr, logs = _built(tmp_path / "auto", tiny_shards_module, make_config, zero=zero, bf16=bf16, ds_edit=ds_edit)
    assert tr.stepper.flat is None
    assert _step_lines(logs) == [f"step: DeepSpeed's engine (DeepSpeed steps a {optimizer} here (the flat step "
                                 "drives ZeRO 1/2's DeepSpeedZeroOptimizer: zero_optimization.stage 1 or 2, not "
                                 "stage 1 in bf16 with data_types.grad_accum_dtype fp32))"]


@pytest.mark.parametrize("zero, bf16, step, flat", [(2, False, "auto", True), (2, False, "flat", True),
                                                    (2, False, "deepspeed", False), (1, True, "auto", True)],
                         ids=["ZeRO 2 auto", "ZeRO 2 flat", "ZeRO 2 deepspeed", "ZeRO 1 bf16 auto"])
def test_at_zero_1_2_auto_takes_the_flat_step_and_the_log_says_which(tmp_path, tiny_shards_module, make_config,
                                                                      zero, bf16, step, flat):
    """ZeRO 1 in bf16 with DeepSpeed's default (bf16) gradient accumulation keeps DeepSpeedZeroOptimizer: flat."""
    tr, logs = _built(tmp_path, tiny_shards_module, make_config, zero=zero, bf16=bf16, step=step)
    assert (tr.stepper.flat is not None) == flat
    (line,) = _step_lines(logs)
    if flat:
        assert line.startswith("step: flat (one gradient buffer, clipped and stepped on DeepSpeed's flat ZeRO")
    else:
        assert line == "step: DeepSpeed's engine (train.step is 'deepspeed')"


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_at_zero_1_the_flat_step_trains_as_deepspeeds_step(tmp_path, tiny_shards_module, make_config, bf16):
    """ZeRO 1 (which ``auto`` also takes flat; test_fast_step compares at ZeRO 2): 3 steps, one rank, the same
    losses and weights under either step, bit for bit, in fp32 and in bf16."""
    runs = {}
    for step in ("flat", "deepspeed"):
        tr = _trainer(tmp_path / step, tiny_shards_module, make_config, bf16=bf16, fast=True, step=step,
                      ds_edit={"zero_optimization": {"stage": 1}})
        assert (tr.stepper.flat is not None) == (step == "flat")
        batches = tr.loader.forever()
        for _ in range(3):
            tr.train_step(batches)
        runs[step] = tr.stepper.flush(), [p.detach().clone() for p in tr.net.parameters()]
    (flat_rows, flat_weights), (ds_rows, ds_weights) = runs["flat"], runs["deepspeed"]
    assert flat_rows == ds_rows
    assert all(torch.equal(a, b) for a, b in zip(flat_weights, ds_weights))


@pytest.mark.parametrize("compiled", [False, True])
def test_cuda_graphs_are_off_without_cuda_and_say_why(tmp_path, tiny_shards_module, make_config, monkeypatch,
                                                      compiled):
    """train.cuda_graphs asks for torch.compile's "reduce-overhead" mode on the flat step's loss; on a CPU (or
    without train.compile) the run warns that there are no CUDA graphs and compiles (or not) as without it."""
    import vqlcmd.engine.flat_step as flat_step

    modes = []
    compile_ = flat_step.torch.compile

    def spy(fn, **kw):  # the flat loss's compile only (torch.compile is one function for all its callers)
        if getattr(fn, "__name__", "") == "_loss_of_leaves":
            modes.append(kw.get("mode"))
            assert kw.get("dynamic") is False
        return compile_(fn, **kw)

    monkeypatch.setattr(flat_step.torch, "compile", spy)
    tr, logs = _built(tmp_path, tiny_shards_module, make_config, compile=compiled, cuda_graphs=True)
    assert tr.stepper.flat is not None
    assert modes == ([None] if compiled else [])
    said = "train.compile is off" if not compiled else "the device is cpu"
    assert any(line.startswith("warning: train.cuda_graphs is on but") and said in line for line in logs), logs
    assert _step_lines(logs) == ["step: flat (one gradient buffer, clipped and stepped on DeepSpeed's flat ZeRO "
                                 "buffers)"]



def _loss_trainer(tmp_path, shards, make_config, p_drop, **train):
    """A tiny fast flat run (no attention dropout: inductor draws its own) with ``loss.p_drop`` = ``p_drop``."""
    def edit(section):
        section["model"] = {**section.get("model", {}), "overrides": {"attn_dropout": 0.0}}
        section["loss"] = {**section.get("loss", {}), "p_drop": p_drop}

    ds, cfg = load_config(str(make_config(tmp_path, shards, fast=True, step="flat", **train)), edit=edit)
    tr = Trainer(ds, cfg, log=lambda *a, **k: None)
    assert tr.stepper.flat is not None
    return tr


@pytest.mark.slow
def test_two_compiled_flat_steps_in_one_process_each_run_their_own_graph(tmp_path, tiny_shards_module, make_config):
    """The compiled loss checks only the guards on its inputs, the modules' train/eval flags and the step's serial
    (flat_step._guards_kept), and Dynamo's cache is the code's, shared by every FlatStep: a second run in the
    same process whose loss differs only in a constant the graph bakes in (loss.p_drop 0.1 and 0.9) still gets
    its own graph, its losses its own eager step's, not the first run's."""
    runs = {name: _loss_trainer(tmp_path / name.replace(" ", "-"), tiny_shards_module, make_config, p_drop,
                                compile=compiled)
            for name, p_drop, compiled in (("a", 0.1, True), ("b", 0.9, True), ("a eager", 0.1, False),
                                           ("b eager", 0.9, False))}
    batches = {name: tr.loader.forever() for name, tr in runs.items()}
    losses = {name: [] for name in runs}
    for _ in range(2):  # interleaved, all alive: a dead run's graphs leave the cache with it
        for name, tr in runs.items():
            losses[name].append(float(tr.train_step(batches[name])["loss"]))
    assert losses["a"] == pytest.approx(losses["a eager"], rel=1e-4, abs=1e-5)
    assert losses["b"] == pytest.approx(losses["b eager"], rel=1e-4, abs=1e-5)
    assert losses["a eager"] != pytest.approx(losses["b eager"], rel=1e-3)  # one graph for both would fail


def test_the_compiled_loss_keeps_the_guards_on_its_inputs_train_flags_and_serial_only():
    """_guards_kept: a guard on what the loss reads through the FlatStep (``self.``...) is dropped unless it is a
    module's ``training`` flag or the step's serial; guards on the inputs and globals stay."""
    from types import SimpleNamespace

    from vqlcmd.engine.flat_step import _guards_kept

    names = {"leaves[0]": True, "tokens": True, "kwargs['draws'][0]": True, "G['torch'].float32": True,
             "self.serial": True, "self._forward._modules['inner'].training": True,
             "self._forward._modules['inner']._modules['net']._modules['denoiser'].training": True,
             "self.groups[0][2][11][1]": False, "self._forward._modules['inner'].cfg.loss.p_drop": False,
             "self._forward._modules['teacher']._parameters['weight']": False}
    got = _guards_kept([SimpleNamespace(name=n) for n in names])
    assert dict(zip(names, got)) == names


def test_the_norms_square_is_the_fp64_sum_of_squares_eager_in_chunks_and_compiled(monkeypatch):
    """flat_step._square_sum, the global norm's square: eager in bounded fp64 chunks, compiled in one pass, both
    the fp64 sum of squares rounded to fp32 (what DeepSpeed's per-parameter fp64 norms combine to)."""
    import vqlcmd.engine.flat_step as flat_step

    g = torch.Generator().manual_seed(0)
    x = torch.randn(100_003, generator=g) * torch.logspace(-4, 2, 100_003)
    parts = [x[:60_000], x[60_000:]]
    want = (x.double() ** 2).sum().float()
    monkeypatch.setattr(flat_step, "_CHUNK", 7_000)  # several chunks per part, a short last one
    assert torch.equal(flat_step._square_sum(parts), want)
    assert torch.equal(torch.compile(flat_step._square_sum, dynamic=False)(parts), want)
