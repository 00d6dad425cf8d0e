"""Tile sweep of the Triton softmax_embedding_average kernels, one kernel at a time (GPU only).

    python benchmarks/triton_tiles.py [--n 32768 --k 1024 --d 256] [--budget-s 100]

Times every configuration the autotuner knows (``kernels/_launch.py``'s ``_CONFIGS``) plus the
extra candidates below, each kernel launched alone and timed by CUDA-graph replay
(``triton.testing.do_bench_cudagraph``), and prints the autotuner's own pick beside them: the
check to run on a new card before editing ``_CONFIGS``. On an H100 at the goal shape (bf16) no
extra candidate beat the autotuner's picks by more than 1.5% (benchmarks/results/README.md).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# (BLOCK_M, BLOCK_K, BLOCK_D, num_warps, num_stages) beyond _CONFIGS: bigger and deeper tiles
EXTRA = {
    "forward": [(128, 64, 256, 8, 2), (128, 128, 256, 8, 2), (64, 64, 256, 4, 4), (128, 64, 256, 4, 3),
                (64, 32, 256, 4, 4), (128, 32, 256, 4, 4)],
    # the first-tile forward (the 16-bit default): no rescaling between products, so longer K tiles may pay
    "forward_first_tile": [(64, 128, 256, 4, 2), (128, 64, 256, 8, 2), (64, 32, 256, 4, 2), (64, 64, 256, 4, 2)],
    "grad_logits": [(128, 256, 64, 8, 3), (256, 128, 64, 8, 3), (128, 128, 128, 8, 2), (64, 256, 64, 8, 3),
                    (128, 64, 256, 8, 2), (128, 128, 64, 8, 4)],
    # the rows dlogits kernel (the 16-bit default): whole rows of dY on chip, K swept (P written, delta summed there)
    "grad_logits_rows": [(64, 32, 256, 4, 2), (128, 32, 256, 8, 4), (64, 16, 256, 4, 4), (128, 128, 256, 8, 2)],
    "grad_table": [(128, 128, 256, 8, 2), (64, 128, 256, 8, 3), (64, 256, 128, 8, 3), (128, 256, 128, 8, 2),
                   (128, 128, 128, 8, 4), (32, 128, 256, 8, 4)],
}
# a sweep whose kernel the autotuner tunes under another name (its configurations and its pick)
TUNED_AS = {"forward_first_tile": "forward_fixed_max"}


def make_launcher(N: int, K: int, D: int, device: torch.device, dtype: torch.dtype):
    """(launcher, tensors): ``launcher(name, cfg)`` returns a call of that kernel alone at that tile
    (BLOCK_M, BLOCK_K, BLOCK_D, num_warps, num_stages), on the inputs in ``tensors``, writing the outputs
    there: ``out`` and ``lse`` (the forwards), ``grad_logits`` (and ``p`` for grad_logits_rows) and ``dst``
    (dtable, added to: zero it first)."""
    import triton

    import kernels.softmax_embedding_average as sea
    from benchmarks.harness import environment
    from kernels import _launch

    g = torch.Generator(device).manual_seed(0)
    logits = (3 * torch.randn(N, K, device=device, generator=g)).to(dtype)
    table = torch.randn(K, D, device=device, generator=g).to(dtype)
    dy = torch.randn(N, D, device=device, generator=g).to(dtype)
    # the public launchers autotune, so their picks can be printed; both forwards and dlogits kernels
    out, lse = sea.forward(logits, table, variant="fused")
    sea.forward(logits, table, variant="first-tile")
    for dlogits in ("tiles", "rows"):
        with environment({"VQLCMD_TRITON_DLOGITS": dlogits}):
            sea.backward(dy, out, lse, logits, table)
    t = dict(logits=logits, table=table, dy=dy, out=out, lse=lse, grad_logits=torch.empty_like(logits),
             p=torch.empty_like(logits), delta=(dy.float() * out.float()).sum(-1), dst=torch.zeros(K, D, device=device))
    dot, n_split = _launch.dot_dtype(logits, table), _launch.splits(N)

    def launcher(name, cfg):
        m, k, d, warps, stages = cfg
        blk = dict(BLOCK_M=m, BLOCK_K=k, BLOCK_D=d, num_warps=warps, num_stages=stages, DOT_DTYPE=dot)
        if name == "forward":
            return lambda: sea._forward_kernel[(triton.cdiv(N, m), triton.cdiv(D, d))](
                logits, logits, table, t["out"], t["lse"], N, K, D, 0.0, GUIDED=False, **blk)
        if name == "forward_first_tile":  # its heuristics set EVEN_K and EVEN_D
            return lambda: sea._forward_fixed_max_kernel[(triton.cdiv(N, m), triton.cdiv(D, d))](
                logits, logits, table, t["out"], t["lse"], N, K, D, 0.0, GUIDED=False, MAX_GAP=sea.max_gap(dot), **blk)
        if name == "grad_logits":  # the split variant's kernel: no P output (its pointer is never read)
            return lambda: sea._grad_logits_kernel[(triton.cdiv(N, m), triton.cdiv(K, k))](
                logits, table, dy, t["lse"], t["delta"], t["grad_logits"], logits, N, K, D, STORE_P=False, **blk)
        if name == "grad_logits_rows":  # delta summed in the kernel (from dY and out), P written; whole rows
            rows_blk = dict(blk, BLOCK_D=max(d, triton.next_power_of_2(D)))
            return lambda: sea._grad_logits_rows_kernel[(triton.cdiv(N, m),)](
                logits, table, dy, out, lse, t["lse"], t["grad_logits"], t["p"], N, K, D,
                STORE_P=True, HAS_GRAD_LSE=False, **rows_blk)
        return lambda: sea._grad_table_kernel[(triton.cdiv(K, k), triton.cdiv(D, d), n_split)](
            logits, dy, t["lse"], t["dst"], N, K, D, triton.cdiv(N, n_split), ATOMIC=True, **blk)

    return launcher, t


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=32768)
    parser.add_argument("--k", type=int, default=1024)
    parser.add_argument("--d", type=int, default=256)
    parser.add_argument("--budget-s", type=float, default=100.0, help="stop sweeping after this long")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("triton_tiles.py times GPU kernels: no CUDA device here")
    import triton
    import triton.language as tl
    from triton.testing import do_bench_cudagraph

    import kernels.softmax_embedding_average as sea
    from kernels import _launch

    N, K, D = args.n, args.k, args.d
    launcher, _ = make_launcher(N, K, D, torch.device("cuda"), torch.bfloat16)
    start = time.time()
    print(f"# {torch.cuda.get_device_name()} | triton {triton.__version__} | N={N} K={K} D={D} bf16")
    for name, extra in EXTRA.items():
        tuned = TUNED_AS.get(name, name)
        print(f"== {name}: autotuner picked {getattr(sea._TUNED[tuned](tl.bfloat16), 'best_config', None)}")
        rows = []
        for cfg in dict.fromkeys(_launch._CONFIGS[(tuned, 16)] + extra):
            if time.time() - start > args.budget_s:
                print("  (time budget spent)")
                break
            try:
                fn = launcher(name, cfg)
                fn()
                torch.cuda.synchronize()
                rows.append((do_bench_cudagraph(fn, rep=30) * 1e3, str(cfg)))
            except Exception as exc:  # noqa: BLE001: a tile that does not fit is a result too
                rows.append((float("inf"), f"{cfg} {type(exc).__name__}: {str(exc)[:80]}"))
        for us, cfg in sorted(rows, key=lambda r: r[0]):
            print(f"  {us:8.1f} us  {cfg}", flush=True)


if __name__ == "__main__":
    main()
