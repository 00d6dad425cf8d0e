"""``benchmarks/host_overhead.py``: the engine's fast step at imagenet-246m's structure runs, and its counts
see what they count (the timings mean nothing here)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import host_overhead  # noqa: E402


@pytest.mark.parametrize("bf16", ["false", "true"])
def test_host_overhead_reports_phases_ops_and_reads(tmp_path, bf16, capsys):
    out = tmp_path / "rows.jsonl"
    host_overhead.main(["--steps", "1", "--warmup", "1", "--bf16", bf16, "--set", '{"depth": 2}', "--profile",
                        "torch", "--reads", "--json", str(out)])
    row = json.loads(out.read_text())
    assert row["param_tensors"] == 12 * 2 + 12  # 12 per block and 12 around them: 300 at the preset's depth 24
    assert set(row["host_ms_by_phase"]) == set(host_overhead.PHASES)
    assert row["ms_per_step"] > 0 and row["kernel_ops"] > 0
    split = row["cpu_arithmetic"]  # (benchmarks/cpu_arithmetic.py): the step's time less oneDNN's and the long passes'
    assert split["host_only_ms"] == pytest.approx(row["ms_per_step"] - split["onednn_exec_ms"] - split["large_kernel_ms"],
                                                  abs=2e-3)
    by_phase = row["kernel_ops_by_phase"]
    # bf16: the EMA casts DeepSpeed's flat bf16 buffer in one op, not one per weight (35 of them here)
    assert 0 < by_phase["ema"] < 8
    # the fast step's one read-back is the flush's; DeepSpeed's clipping reads its norm in engine.step
    assert any(k.startswith("other tolist[cpu]") and "flush" in k for k in row["reads_per_step"])
    assert any(k.startswith("update, other __bool__[cpu]") for k in row["reads_per_step"])
    assert not any("synchronize" in k or "has_overflow" in k for k in row["reads_per_step"])
    assert "host_overhead:" in capsys.readouterr().out


def test_the_compare_table_gives_the_host_work_without_the_cpus_arithmetic():
    def row(ms, arithmetic, setup):
        return {"ms_per_step": ms, "top_level_ops": 100.0, "host_ms_by_phase": {p: 0.0 for p in host_overhead.PHASES},
                "cpu_arithmetic": {"threshold_us": 100.0, "arithmetic_ms": arithmetic, "host_only_ms": ms - arithmetic,
                                   "matmul_setup_ms": setup}}

    table = host_overhead.compare_table(row(100.0, 20.0, 30.0), row(40.0, 20.0, 10.0))
    assert "| of it, host work | | | 80.0 | 20.0 |" in table
    assert "| 30.0 | 10.0 |" in table  # the matmuls' set-up
    assert table.endswith("host ms ratio 0.400, host work without the CPU's arithmetic 0.250")


def test_alternating_pairs_give_each_pairs_ratio_and_their_median():
    def row(ms, host_only):
        return {"ms_per_step": ms, "cpu_arithmetic": {"host_only_ms": host_only}}

    pairs = [(row(100.0, 80.0), row(40.0, 20.0)), (row(150.0, 120.0), row(45.0, 36.0)),
             (row(120.0, 100.0), row(30.0, 20.0))]
    text = host_overhead.pair_ratios(pairs)
    assert text.startswith("over 3 alternating pairs, host ms ratio: median 0.300 (range 0.250-0.400; "
                           "0.400, 0.300, 0.250)")
    assert text.endswith("host work ratio: median 0.250 (range 0.200-0.300; 0.250, 0.300, 0.200)")
    assert "host work" not in host_overhead.pair_ratios([({"ms_per_step": 10.0}, {"ms_per_step": 5.0})] * 2)
