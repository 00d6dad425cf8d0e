"""The CI gate on the host work of the training step (issue 44): the compiled flat step at imagenet-246m's
structure (24 blocks, 300 parameter tensors, K = 1024, 1000 classes; tiny tensors, batch 2, bf16) dispatches
no more than 10% more ops, kernel-launching ops or compiled kernels per step than the figures committed in
benchmarks/results/op_count_gate.json (measured with benchmarks/host_overhead.py at that commit). A change
that adds per-parameter work to the step, or breaks its graph, fails here. Most of the ~2-4 minutes is
compiling."""
from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import host_overhead  # noqa: E402


def test_the_gate_names_what_rose_above_the_committed_counts():
    gate = {"top_level_ops": 1000, "kernel_ops": 900, "compiled_kernels": 300, "commit": "abc"}
    assert host_overhead.gate_failures(dict(gate, top_level_ops=1100, kernel_ops=990, compiled_kernels=330),
                                       gate) == []
    failures = host_overhead.gate_failures(dict(gate, top_level_ops=1101, compiled_kernels=400), gate)
    assert [f.split(":")[0] for f in failures] == ["top_level_ops", "compiled_kernels"]
    assert "committed 1000" in failures[0] and "abc" in failures[0]


def test_the_compiled_flat_step_dispatches_no_more_than_the_committed_ops(tmp_path):
    gate = json.loads(host_overhead.GATE.read_text())
    out = tmp_path / "row.jsonl"
    host_overhead.main(["--step", "flat", "--compile", "--bf16", "true", "--profile", "torch", "--steps", "1",
                        "--warmup", "2", "--json", str(out)])
    row = json.loads(out.read_text())
    assert row["step"] == "flat" and row["param_tensors"] == 300
    assert not host_overhead.gate_failures(row, gate), host_overhead.gate_failures(row, gate)
