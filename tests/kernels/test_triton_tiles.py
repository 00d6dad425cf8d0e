"""benchmarks/triton_tiles.py launches each kernel on its own with the kernel's full argument list, a
copy of the library's: each launcher must compute what the library computes (under the interpreter on
CPU), so a kernel whose signature changes cannot leave the sweep timing only failures."""
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


@pytest.mark.parametrize("cfg", [(16, 16, 32, 4, 2), (32, 64, 16, 4, 2)])
def test_each_launcher_computes_what_the_library_does(cfg, device):
    import kernels.softmax_embedding_average as sea
    from benchmarks.triton_tiles import make_launcher

    N, K, D = 260, 48, 32  # three dtable row splits under the interpreter, ragged tiles along N
    launcher, t = make_launcher(N, K, D, device, torch.float32)
    ref_out, ref_lse = sea.forward(t["logits"], t["table"])
    ref_logits, ref_table = sea.backward(t["dy"], ref_out, ref_lse, t["logits"], t["table"])
    for name in ("out", "lse", "grad_logits"):
        t[name].zero_()
    launcher("forward", cfg)()
    torch.testing.assert_close(t["out"], ref_out)
    torch.testing.assert_close(t["lse"], ref_lse)
    for name in ("out", "lse"):  # K = 48: whole K tiles at BLOCK_K = 16, one ragged at 64
        t[name].zero_()
    launcher("forward_first_tile", cfg)()
    torch.testing.assert_close(t["out"], ref_out)
    torch.testing.assert_close(t["lse"], ref_lse)
    launcher("grad_logits", cfg)()
    torch.testing.assert_close(t["grad_logits"], ref_logits)
    for name in ("grad_logits", "p"):
        t[name].zero_()
    launcher("grad_logits_rows", cfg)()  # its launcher widens BLOCK_D to the whole row (D = 32)
    torch.testing.assert_close(t["grad_logits"], ref_logits)
    torch.testing.assert_close(t["p"], torch.softmax(t["logits"], -1))
    t["dst"].zero_()
    launcher("grad_table", cfg)()
    torch.testing.assert_close(t["dst"], ref_table)
