"""What ``auto`` picks where committed GPU measurements decide it (vqlcmd/ops/_triton.py)."""
import torch

from vqlcmd.ops import _dispatch, _triton


def _ranked(op: str, device: torch.device) -> list:
    return [name for name, impl in sorted(_dispatch._impls(op).items(), key=lambda kv: -kv[1].priority(device))]


def test_inside_torch_compile_auto_leaves_the_average_to_inductor_on_cuda(monkeypatch):
    """torch.compile of the reference softmax and matmul beat the Triton kernels at the goal size on the H100
    and the H200 (benchmarks/results): inside a compiled graph the reference ranks first on CUDA; eager calls
    keep the kernels first, and the guided op (where Triton won, 3.97x against 2.86x) is unchanged."""
    cuda = torch.device("cuda")
    assert _ranked("softmax_embedding_average", cuda)[0] == "triton"
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    ranked = _ranked("softmax_embedding_average", cuda)
    assert ranked.index("reference") < ranked.index("triton")
    assert _ranked("guided_embedding_average", cuda)[0] == "triton"
    assert _triton._average_priority(torch.device("cpu")) < _dispatch._impls("softmax_embedding_average")[
        "reference"].priority(torch.device("cpu"))


def test_inside_torch_compile_auto_leaves_norm_and_gelu_to_inductor_on_cpu(monkeypatch):
    """On the CPU the C++ kernels rank first eagerly and below the reference inside a compiled graph, where
    inductor fuses the reference (benchmarks/sampling_overhead.py: 175 ops per compiled step against 248)."""
    from vqlcmd.ops import _compiled

    if _compiled.unavailable() is not None:
        return
    cpu = torch.device("cpu")
    for op in ("ada_layer_norm", "gelu_tanh"):
        assert _ranked(op, cpu)[0] == "compiled"
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    for op in ("ada_layer_norm", "gelu_tanh"):
        assert _ranked(op, cpu)[0] == "reference"
        assert _ranked(op, torch.device("cuda"))[0] != "reference"
