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
    of either step bit for bit, fp32 (the flat step's norm and update are DeepSpeed's op for op)."""
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
