"""``benchmarks/cpu_arithmetic.py``: the CPU step's arithmetic, as oneDNN reports its kernels and as a torch
profile shows the long passes, is counted once and only where it is (no timing is asserted)."""
from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import cpu_arithmetic  # noqa: E402

LINES = """onednn_verbose,v1,info,oneDNN v3.12.0 (commit 80afa71049cd69a3df32adcccb623b12cd7baa22)
onednn_verbose,v1,primitive,exec,cpu,matmul,brg_matmul:avx10_1_512_amx,undef,src:bf16::blocked:ab::f0 wei:bf16::blocked:ba::f0 dst:bf16::blocked:ab::f0,attr-scratchpad:user,,32x64:64x192,0.0070
onednn_verbose,v1,primitive,exec,cpu,matmul,brg_matmul:avx10_1_512_amx,undef,src:bf16::blocked:ab::f0,,,32x64:64x64,0.0050
onednn_verbose,v1,primitive,exec,cpu,reorder,jit:uni,undef,src:f32::blocked:a::f0 dst:bf16::blocked:a::f0,,,64,0.0010
a line oneDNN did not write
""".splitlines()


def test_parse_onednn_verbose_sums_exec_times_per_step_and_kind():
    got = cpu_arithmetic.parse_onednn_verbose(LINES, steps=2)
    assert got["calls"] == pytest.approx(1.5)
    assert got["ms"] == pytest.approx(0.013 / 2)
    assert got["by_primitive"] == {"matmul": {"calls": 1.0, "ms": 0.006}, "reorder": {"calls": 0.5, "ms": 0.0005}}


def test_parse_onednn_verbose_names_a_line_without_a_time():
    with pytest.raises(ValueError, match="without a time"):
        cpu_arithmetic.parse_onednn_verbose(["onednn_verbose,v1,primitive,exec,cpu,matmul,x,undef,a,b,32x64:64x64,"],
                                            steps=1)


def _event(name, self_us):
    return SimpleNamespace(name=name, self_cpu_time_total=self_us)


def test_large_kernels_counts_long_passes_once_and_never_the_matmuls():
    prof = SimpleNamespace(events=lambda: [
        _event("aten::_fused_adamw_", 1800.0), _event("vqlcmd::ema_update_", 2400.0),
        _event("graph_0_cpp_fused_pow_sum_0", 1200.0),
        _event("graph_0_cpp_fused_native_dropout_3", 70.0),  # short: host time
        _event("aten::addmm", 500.0),  # oneDNN reports its kernel: not again here
        _event("## Call CompiledFxGraph abc", 3000.0),  # Python, not a kernel
    ])
    is_kernel = lambda n: n.startswith(("aten::", "vqlcmd::")) or "cpp_fused_" in n  # noqa: E731
    got = cpu_arithmetic.large_kernels(prof, steps=2, is_kernel=is_kernel)
    assert got["ms"] == pytest.approx((1800 + 2400 + 1200) / 1e3 / 2)
    assert got["count"] == 1.5
    assert list(got["commonest_ms"]) == ["vqlcmd::ema_update_", "aten::_fused_adamw_", "graph_0_cpp_fused_pow_sum_0"]
    split = cpu_arithmetic.split(10.0, {"ms": 1.0, "calls": 3, "by_primitive": {}}, got)
    assert split["arithmetic_ms"] == pytest.approx(1.0 + 2.7)
    assert split["host_only_ms"] == pytest.approx(10.0 - 3.7)


def test_onednn_exec_counts_the_bf16_matmuls_a_run_makes(capfd):
    a, b = torch.randn(32, 64, dtype=torch.bfloat16), torch.randn(64, 48, dtype=torch.bfloat16)

    def run():
        for _ in range(6):
            a @ b

    got = cpu_arithmetic.onednn_exec(run, steps=3)
    if got["calls"] == 0:
        pytest.skip("oneDNN serves no bf16 matmul on this CPU (no AVX512-BF16 or AMX)")
    assert got["by_primitive"]["matmul"]["calls"] == 2.0  # six products over three steps
    assert got["ms"] > 0
    print("after the run", flush=True)
    out = capfd.readouterr().out
    assert "after the run" in out and "onednn_verbose" not in out  # oneDNN's lines went to the log, fd 1 came back


def test_matmul_calls_count_the_outermost_call_with_its_children_once():
    linear = SimpleNamespace(name="aten::linear", cpu_time_total=30.0, cpu_parent=None)
    addmm = SimpleNamespace(name="aten::addmm", cpu_time_total=25.0, cpu_parent=linear)  # inside linear: in its 30
    mm = SimpleNamespace(name="aten::mm", cpu_time_total=20.0, cpu_parent=SimpleNamespace(name="phase:backward",
                                                                                          cpu_parent=None))
    copy = SimpleNamespace(name="aten::copy_", cpu_time_total=2.0, cpu_parent=addmm)
    prof = SimpleNamespace(events=lambda: [linear, addmm, mm, copy])
    assert cpu_arithmetic.matmul_calls_ms(prof, steps=1) == pytest.approx(0.050)
    onednn = {"ms": 0.012, "calls": 2, "by_primitive": {"matmul": {"calls": 2, "ms": 0.012}}}
    split = cpu_arithmetic.split(1.0, onednn, {"ms": 0.0, "count": 0, "threshold_us": 100.0, "commonest_ms": {}},
                                 matmul_ms=0.050)
    assert split["matmul_setup_ms"] == pytest.approx(0.038)
    assert split["host_only_ms"] == pytest.approx(0.988)
