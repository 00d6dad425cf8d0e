"""benchmarks/harness.py: how a CUDA case is timed when a CUDA graph cannot capture it, and the
environment switches a stage runs a kernel variant under."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import harness  # noqa: E402
from benchmarks.harness import Timing  # noqa: E402

LAUNCH = Timing(2.0, 0.1, 123, 10)


@pytest.fixture
def cuda_calls(monkeypatch):
    """with_graph_timing's CUDA-only calls, made callable here (no GPU): captures fail, syncs pass."""
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)

    def no_capture(fn, device):
        raise RuntimeError("operation failed due to a previous error during capture")

    monkeypatch.setattr(harness, "graph_replay_ms", no_capture)
    return monkeypatch


def test_uncapturable_case_gets_the_profilers_kernel_sum(cuda_calls):
    cuda_calls.setattr(harness, "kernel_sum_ms", lambda fn, device, setup=None: Timing(0.3, 0.01, 0, 5))
    t, how = harness.with_graph_timing(lambda: None, torch.device("cuda"), LAUNCH)
    assert (t.median_ms, t.spread_ms, t.reps) == (0.3, 0.01, 5)
    assert t.peak_mem_bytes == LAUNCH.peak_mem_bytes  # the peak comes from the launch-timed runs
    assert how["timing"].startswith("kernel sum (graph capture failed: ")
    assert "previous error during capture" in how["timing"]
    assert how["launch_ms"] == LAUNCH.median_ms


def test_without_a_profiler_the_launch_timing_stays_and_says_both_reasons(cuda_calls):
    def no_profiler(fn, device, setup=None):
        raise RuntimeError("the profiler recorded no CUDA activity")

    cuda_calls.setattr(harness, "kernel_sum_ms", no_profiler)
    t, how = harness.with_graph_timing(lambda: None, torch.device("cuda"), LAUNCH)
    assert t == LAUNCH
    assert how["timing"].startswith("launch (graph capture failed")
    assert "no CUDA activity" in how["timing"]


def test_cpu_timing_passes_through():
    assert harness.with_graph_timing(lambda: None, torch.device("cpu"), LAUNCH) == (LAUNCH, {})


@pytest.mark.gpu
def test_kernel_sum_reads_close_to_graph_replay():
    dev = torch.device("cuda")
    a = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16)
    b = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16)
    fn = lambda: a @ b  # noqa: E731: one big kernel, so the gaps a kernel sum leaves out are negligible
    replay = harness.graph_replay_ms(fn, dev).median_ms
    summed = harness.kernel_sum_ms(fn, dev).median_ms
    assert 0.8 * replay < summed < 1.1 * replay, (summed, replay)


def test_environment_sets_the_switches_and_restores_what_was_there(monkeypatch):
    monkeypatch.setenv("VQLCMD_TEST_KEPT", "before")
    monkeypatch.delenv("VQLCMD_TEST_NEW", raising=False)
    with pytest.raises(KeyError):
        with harness.environment({"VQLCMD_TEST_KEPT": "inside", "VQLCMD_TEST_NEW": "inside"}):
            assert os.environ["VQLCMD_TEST_KEPT"] == os.environ["VQLCMD_TEST_NEW"] == "inside"
            raise KeyError("the body failed")  # restored all the same
    assert os.environ["VQLCMD_TEST_KEPT"] == "before" and "VQLCMD_TEST_NEW" not in os.environ
    with harness.environment(None):
        assert os.environ["VQLCMD_TEST_KEPT"] == "before"


def test_kernel_fraction_of_copy_where_a_replay_falls_short(monkeypatch):
    # compiled_ops reports, beside a replay below the goal, the bandwidth over the kernels' own device time
    from benchmarks import stage_compiled_ops as stage

    built = []

    def build():
        built.append(True)
        return (lambda: None), None

    monkeypatch.setattr(stage, "kernel_sum_ms", lambda fn, device, setup=None: Timing(0.02, 0.001, 0, 5))
    extra = stage._kernel_fraction(build, torch.device("cuda"), nbytes=40_000_000, copy_bps=2.5e12)
    assert built and extra == {"kernel_ms": 0.02, "kernel_fraction_of_copy": 0.8}  # 40 MB in 20 µs at 2.5 TB/s

    def no_activity(fn, device, setup=None):
        raise RuntimeError("the profiler recorded no CUDA activity")

    monkeypatch.setattr(stage, "kernel_sum_ms", no_activity)
    extra = stage._kernel_fraction(build, torch.device("cuda"), nbytes=1, copy_bps=1.0)
    assert extra["kernel_ms"].startswith("n/a: ") and "no CUDA activity" in extra["kernel_ms"]


def test_peak_flops_tells_the_nvl_cards_apart():
    # the H100 NVL took the SXM peak (989 TFLOP/s), which understated its MFU by 16%
    from benchmarks import flops

    assert flops.peak_bf16_flops("NVIDIA H100 80GB HBM3") == flops.H100_SXM_PEAK_BF16_FLOPS
    assert flops.peak_bf16_flops("NVIDIA H100 PCIe") == flops.H100_PCIE_PEAK_BF16_FLOPS
    assert flops.peak_bf16_flops("NVIDIA H100 NVL") == flops.peak_bf16_flops("NVIDIA H200 NVL") == 835.5e12
    assert flops.peak_bf16_flops("NVIDIA H200") == flops.H200_PEAK_BF16_FLOPS
    assert flops.peak_bf16_flops("Tesla T4") is None


def test_cpu_peak_is_the_most_memory_held_at_once():
    # three 1 MiB buffers alive together, freed inside an enclosing op, then 2 MiB: the peak is 3 MiB.
    # Summing each op's self usage at its start read 0 B here (the enclosing op's frees came first).
    mib = 2**20

    def fn():
        with torch.profiler.record_function("outer"):
            a, b, c = (torch.empty(mib, dtype=torch.uint8) for _ in range(3))
            del a, b, c
            d = torch.empty(2 * mib, dtype=torch.uint8)
            del d

    assert harness.cpu_peak_bytes(fn) == 3 * mib


def test_cpu_peak_counts_from_what_the_call_held_when_it_started():
    """A call that drops a tensor held from before (x.grad = None) and makes a new one holds no more than
    before; the profiler saw no free of the old block, so both were counted (sdpa fwd+bwd: 10.2 MiB
    against 4.2)."""
    mib = 2**20
    held = {"grad": torch.empty(4 * mib, dtype=torch.uint8)}

    def replace():
        held["grad"] = None
        held["grad"] = torch.empty(4 * mib, dtype=torch.uint8)

    assert harness.cpu_peak_bytes(replace) == 0
    x = torch.randn(512, 512, requires_grad=True)  # 1 MiB

    def fwd_bwd():
        x.grad = None
        (x * x).sum().backward()  # x * x saved? no: x twice; its output 1 MiB, then the 1 MiB gradient

    assert harness.cpu_peak_bytes(fwd_bwd) <= 2 * mib + 4096
    calls = []
    assert harness.cpu_peak_bytes(lambda: calls.append("fn"), lambda: calls.append("setup")) == 0
    assert calls == ["setup", "fn", "setup", "fn"]  # a warm call, then the measured one, each after its setup


def test_cpu_peak_fails_loudly_without_the_profilers_memory_records():
    class NoRecords:
        profiler = object()  # no kineto_results

    with pytest.raises(RuntimeError, match="memory records"):
        harness._cpu_memory_records(NoRecords())


def test_a_failing_compiled_op_gives_a_failed_row_and_the_stage_goes_on(monkeypatch):
    from benchmarks import stage_compiled_ops as stage
    from benchmarks.harness import Context, Result, Skip
    from vqlcmd import ops

    if ops.why_not("categorical_kl", "compiled", torch.empty(1)) is not None:
        pytest.skip("the compiled extension is not built")
    real = ops.ddim_teacher_step

    def broken(*args, backend="auto", **kwargs):
        if backend == "compiled":
            raise RuntimeError("simulated kernel failure")
        return real(*args, backend=backend, **kwargs)

    monkeypatch.setattr(ops, "ddim_teacher_step", broken)
    ctx = Context(torch.device("cpu"), quick=True)
    # the ddim case, then one that must still be measured after it
    by_name = {c[:2]: c for c in stage._cases(ctx)}
    cases = [by_name["ddim_teacher_step", "fwd"], by_name["categorical_kl", "fwd"]]
    monkeypatch.setattr(stage, "_cases", lambda ctx: cases)
    rows = stage.run(ctx)
    failed = [r for r in rows if isinstance(r, Skip)]
    assert [(r.case, r.backend, r.failed) for r in failed] == [("ddim_teacher_step fwd", "compiled", True)]
    assert "simulated kernel failure" in failed[0].reason
    measured = {(r.case, r.backend) for r in rows if isinstance(r, Result)}
    assert measured == {("ddim_teacher_step fwd", "reference"), ("categorical_kl fwd", "reference"),
                        ("categorical_kl fwd", "compiled")}


def test_spread_stays_within_the_range_for_few_repetitions():
    # the exclusive quantiles gave an IQR of 1.5 for two timings 1 ms apart (quick mode times twice)
    assert harness.summarize([1.0, 2.0]).spread_ms == pytest.approx(0.5)
    assert harness.summarize([1.0, 2.0, 4.0]).spread_ms == pytest.approx(1.5)
    assert harness.summarize([5.0]).spread_ms == 0
