"""``benchmarks/sampling_overhead.py``: a guided sampling step at imagenet-246m's structure is counted, and the
count is the step's (the timings mean nothing here)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import sampling_overhead  # noqa: E402


class Dispatched(TorchDispatchMode):
    """Every op that reaches the Python dispatch key: composite ops arrive decomposed, nested ops as well."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


def _dispatched_per_step(guidance: float, depth: int) -> float:
    from vqlcmd.samplers import sample_latents
    from vqlcmd.schedule import ShiftedCosineSchedule

    den, table = sampling_overhead.build("tiny", "cpu", depth=depth)
    counts = {}
    for n in (1, 3):
        with Dispatched() as mode:
            sample_latents(den, table, ShiftedCosineSchedule(), class_labels=[0, 1], num_steps=n,
                           guidance_scale=guidance, generator=torch.Generator().manual_seed(0))
        counts[n] = mode.n
    return (counts[3] - counts[1]) / 2


def test_the_row_counts_the_guided_step(tmp_path, capsys):
    out = tmp_path / "rows.jsonl"
    sampling_overhead.main(["--steps", "3", "--json", str(out)])
    row = json.loads(out.read_text())
    assert "sampling_overhead:" in capsys.readouterr().out
    assert row["stage"] == "sampling" and row["compile"] is False and row["depth"] == 24 and row["width"] == 64
    assert row["torch"] == torch.__version__ and row["commit"] and row["device_name"]
    assert row["ms_per_step"] > 0 and row["inductor_kernels"] == 0  # eager: no generated kernels
    # every op of the step is seen at the Python dispatch key; the top-level ones are a part of them (a composite
    # op such as linear arrives decomposed there, into more than one)
    dispatched = _dispatched_per_step(1.0, depth=24)
    assert row["top_level_ops"] <= dispatched <= row["ops"]
    assert row["kernel_ops"] <= row["top_level_ops"]


def test_the_count_is_per_guided_step():
    """The per-step count grows with the depth by the blocks' own ops, and the rest of the step is small; an
    unguided step dispatches fewer (no concatenation of the null rows, no guided average): the count is of the
    step, not of the run's set-up."""
    rows = {d: sampling_overhead.measure(depth=d, steps=3, repeats=1) for d in (2, 4)}
    per_block = (rows[4]["top_level_ops"] - rows[2]["top_level_ops"]) / 2
    assert per_block > 10
    base = rows[2]["top_level_ops"] - 2 * per_block  # the step without its blocks: small
    assert 0 < base < 6 * per_block
    unguided = sampling_overhead.measure(depth=2, steps=3, repeats=1, guidance=0.0)
    assert unguided["top_level_ops"] < rows[2]["top_level_ops"]  # the guided step's concatenations and guidance
    with pytest.raises(ValueError, match="steps must be >= 2"):
        sampling_overhead.measure(steps=1)


@pytest.mark.slow  # torch.compile of the 24-layer step: about a minute on the shared 2-core CPU
def test_the_compiled_step_dispatches_fewer_ops():
    eager = sampling_overhead.measure(steps=3, repeats=1)
    compiled = sampling_overhead.measure(steps=3, repeats=1, compile=True)
    assert compiled["compile"] is True and compiled["inductor_kernels"] > 0
    assert compiled["top_level_ops"] < eager["top_level_ops"]
