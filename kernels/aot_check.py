"""Compile the kernels for H100 (sm_90) without a GPU: catches compile errors and shared-memory overflow.

    python -m vqlcmd.kernels.aot_check            # every autotuning config and the fixed small tiles
    python -m vqlcmd.kernels.aot_check --quick    # the fixed small tiles only (the CI test)

Machines without a GPU can still run Triton's whole compiler (the wheel bundles ptxas), so the
GPU path is checked where the interpreter cannot check it. Pointers and K, D are marked 16-aligned,
as the JIT marks them for K = 1024, D = 256; without that the compiler does not pipeline the loads
and the shared-memory figures would be too small. Must run with TRITON_INTERPRET unset.

Triton versions differ in what they accept (3.6, on the lent H100s, does not make a jit function's
default argument a constexpr; 3.8 does). To check against another version without installing it:

    pip download --no-deps triton==3.6.0 -d /tmp/w && python -m zipfile -e /tmp/w/triton-*.whl /tmp/t36
    chmod +x /tmp/t36/triton/backends/nvidia/bin/*
    PYTHONPATH=/tmp/t36 TRITON_CACHE_DIR=/tmp/t36-cache python -m vqlcmd.kernels.aot_check
"""
from __future__ import annotations

import argparse
import os
import sys

H100_SHARED_BYTES = 227 * 1024


def _signature(fn, io: str, consts: dict) -> tuple[dict, dict]:
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in consts:
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            wide = name in ("lse_ptr", "grad_lse_ptr", "delta_ptr", "dst_ptr", "dp_ptr")
            sig[name] = "*fp32" if wide else io
        else:
            sig[name] = "fp32" if name == "guidance" else "i32"
        if name.endswith("_ptr") or name in ("K", "D"):
            attrs[(i,)] = [["tt.divisibility", 16]]
    return sig, attrs


def check(quick: bool) -> list[str]:
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from . import _launch
    from . import softmax_embedding_average as sea

    if _launch.interpreted:
        raise SystemExit("aot_check: unset TRITON_INTERPRET (the kernels were decorated for the interpreter)")
    # EVEN_K / EVEN_D (set by the kernels' heuristics at a launch): K = 1024 and D = 256 fill every tile of
    # every config; MAX_GAP: the gap of bf16 operands, the width the fixed-max forward compiles for (16-bit only)
    even, gap = dict(EVEN_K=True, EVEN_D=True), sea.max_gap(tl.bfloat16)
    kernels = {"forward": (sea._forward_kernel.fn, dict(GUIDED=True, **even)),
               "forward_fixed_max": (sea._forward_fixed_max_kernel.fn, dict(GUIDED=True, MAX_GAP=gap, **even)),
               "grad_logits": (sea._grad_logits_kernel.fn, dict(STORE_P=True, **even)),
               "grad_table": (sea._grad_table_kernel.fn, dict(ATOMIC=True, **even)),
               "fused_backward": (sea._fused_backward_kernel, dict(ATOMIC=True))}
    # (name, operand width, constexprs, warps, stages, kind)
    jobs = [(name, width, dict(BLOCK_M=m, BLOCK_K=k, BLOCK_D=d), warps, stages, "small")
            for (name, width), (m, k, d, warps, stages) in _launch._SMALL_BLOCKS.items()]
    if not quick:
        jobs += [(name, width, dict(BLOCK_M=m, BLOCK_K=k, BLOCK_D=d), warps, stages, "tuned")
                 for (name, width), cfgs in _launch._CONFIGS.items() for (m, k, d, warps, stages) in cfgs]
    kernels["grad_logits_rows"] = (sea._grad_logits_rows_kernel.fn,
                                   dict(STORE_P=True, HAS_GRAD_LSE=True, **even))
    # the chunked variants' elementwise kernels: their fixed tiles at the goal shape (K = 1024)
    kernels["chunk"] = (sea._chunk_kernel, dict(WRITE_GRAD=True, WRITE_P=True))
    kernels["chunk_probs"] = (sea._chunk_probs_kernel, dict(GUIDED=True))
    for name in ("chunk", "chunk_probs"):
        for width, dot in ((16, tl.bfloat16), (32, tl.float32)):
            blk = _launch.blocks(name, 4096, 1024, 256, _cuda(), dot)
            warps = blk.pop("num_warps")
            jobs.append((name, width, blk, warps, blk.pop("num_stages", 3), "fixed"))
    problems = []
    for name, width, tiles, warps, stages, kind in jobs:
        fn, consts = kernels[name]
        consts = dict(consts, DOT_DTYPE=tl.float32 if width == 32 else tl.bfloat16, **tiles)
        sig, attrs = _signature(fn, "*fp32" if width == 32 else "*bf16", consts)
        shape = " ".join(f"{key[6:]}{value}" for key, value in tiles.items())
        label = f"{name} {'fp32' if width == 32 else 'bf16'} {kind} {shape} warps{warps} stages{stages}"
        try:
            compiled = triton.compile(ASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                                      options=dict(num_warps=warps, num_stages=stages))
        except Exception as exc:  # noqa: BLE001: report every failing config, not only the first
            problems.append(f"{label}: {type(exc).__name__}: {str(exc)[:200]}")
            continue
        shared = compiled.metadata.shared
        regs, spilled = _registers(compiled.asm["ptx"])
        print(f"{label}: {shared / 1024:.0f} KiB shared, {regs} registers, {spilled} bytes spilled", flush=True)
        if shared > H100_SHARED_BYTES:
            problems.append(f"{label}: needs {shared / 1024:.0f} KiB of shared memory, H100 has 227")
        if spilled:
            problems.append(f"{label}: spills {spilled} bytes of registers")
    return problems


def _cuda():
    import torch

    return torch.device("cuda")


def _registers(ptx: str) -> tuple[int, int]:
    """Registers per thread and bytes of spill stores, from the ptxas bundled with Triton."""
    import re
    import subprocess
    import tempfile

    import triton

    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(ptx)
        f.flush()
        info = subprocess.run([ptxas, "-arch=sm_90a", "-v", f.name, "-o", os.devnull], capture_output=True,
                              text=True, check=True).stderr
    regs = re.search(r"Used (\d+) registers", info)
    spilled = re.search(r"(\d+) bytes spill stores", info)
    return int(regs.group(1)) if regs else -1, int(spilled.group(1)) if spilled else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="only the fixed tiles for small problems")
    args = parser.parse_args()
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("aot_check: unset TRITON_INTERPRET first")
    problems = check(args.quick)
    for p in problems:
        print("PROBLEM", p, file=sys.stderr)
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()
