"""Block sizes, autotuning configurations and dtype choices shared by the kernels' launchers.

On a GPU, large problems are autotuned over configurations chosen for H100 (Hopper: 228 KB of
shared memory per SM, 132 SMs), each clamped to the problem so that small K, D or N never get
tiles mostly made of padding. Small problems, and every launch under TRITON_INTERPRET=1, take
fixed block sizes from ``blocks``: autotuning a tiny launch costs more than it saves, and in the
interpreter it would only multiply the (slow) runs.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl


@triton.jit
def _probe():
    pass


def _is_interpreted() -> bool:
    # triton.jit picks interpreter or compiler from TRITON_INTERPRET when a kernel is decorated;
    # ask a kernel decorated alongside ours rather than the environment, which may have changed since.
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(_probe, InterpretedFunction)


interpreted = _is_interpreted()

# tl.dot needs every dimension >= 16
_MIN_BLOCK = 16
# problems below this many logits (N*K) skip autotuning on a GPU
_SMALL = 1 << 18


def _cap(x: int, hi: int) -> int:
    return min(max(_MIN_BLOCK, triton.next_power_of_2(x)), hi)


def dot_dtype(*tensors: torch.Tensor):
    """tl.dot operand dtype: the inputs' 16-bit dtype on a GPU (tensor cores), else float32.

    The interpreter computes bf16 as raw bit patterns, so it always gets float32 operands.
    """
    promoted = tensors[0].dtype
    for t in tensors[1:]:
        promoted = torch.promote_types(promoted, t.dtype)
    if not interpreted and promoted == torch.bfloat16:
        return tl.bfloat16
    if not interpreted and promoted == torch.float16:
        return tl.float16
    return tl.float32


# (BLOCK_M, BLOCK_K, BLOCK_D, num_warps, num_stages), chosen for H100 with K ~ 1024, D ~ 256 in mind.
# The forward keeps a (BLOCK_M, BLOCK_D) float32 accumulator and streams K; the D tile is the whole
# row when D <= 256 so that the softmax is computed once per row. The tile is clamped to the problem.
_CONFIGS = {
    "forward": [
        (64, 64, 256, 4, 3), (64, 64, 256, 8, 3), (128, 64, 256, 8, 3), (128, 32, 256, 8, 4),
        (64, 128, 256, 8, 3), (32, 128, 256, 4, 4), (128, 64, 128, 8, 3), (64, 64, 128, 4, 4),
    ],
    # (BLOCK_M, BLOCK_K) output tile of dlogits, D streamed in BLOCK_D steps
    "grad_logits": [
        (64, 64, 64, 4, 3), (128, 64, 64, 8, 3), (64, 128, 64, 8, 3), (128, 128, 64, 8, 3),
        (64, 64, 128, 4, 3), (128, 128, 32, 8, 4), (128, 64, 128, 8, 3),
    ],
    # (BLOCK_K, BLOCK_D) accumulator of dtable, rows streamed in BLOCK_M steps
    "grad_table": [
        (64, 64, 128, 4, 3), (64, 128, 128, 8, 3), (32, 128, 256, 8, 3), (64, 64, 256, 8, 3),
        (128, 64, 64, 4, 3), (64, 128, 64, 4, 4), (128, 128, 128, 8, 3),
    ],
}


def _configs(name: str) -> list:
    return [triton.Config(dict(BLOCK_M=m, BLOCK_K=k, BLOCK_D=d), num_warps=w, num_stages=s)
            for m, k, d, w, s in _CONFIGS[name]]


def _clamp_configs(configs, named_args, **kwargs):
    """Clamp every tile to the problem (small K, D or N) and drop the duplicates that makes."""
    args = {**named_args, **kwargs}
    N, K, D = args["N"], args["K"], args["D"]
    seen, kept = set(), []
    for c in configs:
        kw = dict(c.kwargs)
        kw["BLOCK_M"] = min(kw["BLOCK_M"], _cap(N, 1 << 30))
        kw["BLOCK_K"] = min(kw["BLOCK_K"], _cap(K, 1 << 30))
        kw["BLOCK_D"] = min(kw["BLOCK_D"], _cap(D, 1 << 30))
        key = (kw["BLOCK_M"], kw["BLOCK_K"], kw["BLOCK_D"], c.num_warps, c.num_stages)
        if key not in seen:
            seen.add(key)
            kept.append(triton.Config(kw, num_warps=c.num_warps, num_stages=c.num_stages))
    return kept


def autotuned(kernel, name: str, reset_to_zero: Optional[list] = None):
    """``kernel`` autotuned over the H100 configurations for ``name`` (None under the interpreter)."""
    if interpreted:
        return None
    return triton.autotune(configs=_configs(name), key=["N", "K", "D"],
                           prune_configs_by={"early_config_prune": _clamp_configs},
                           reset_to_zero=reset_to_zero)(kernel)


def blocks(name: str, N: int, K: int, D: int, device: torch.device) -> Optional[dict]:
    """Fixed block sizes for this launch, or None to autotune.

    Under the interpreter each program step is numpy work on whole tiles, so bigger tiles mean
    fewer Python-level steps (128x256 runs the tests ~3x faster than 64x128) while K = 1000 still
    spans several tiles; on a GPU small problems get tiles sized to K and D.
    """
    if name == "delta":
        return dict(BLOCK_M=64, BLOCK_D=_cap(D, 256))
    if not interpreted and device.type == "cuda" and N * K >= _SMALL:
        return None
    if interpreted:
        return dict(BLOCK_M=_cap(N, 128), BLOCK_K=_cap(K, 256), BLOCK_D=_cap(D, 256))
    if name == "forward":
        return dict(BLOCK_M=_cap(N, 64), BLOCK_K=_cap(K, 64), BLOCK_D=_cap(D, 256))
    if name == "grad_logits":
        return dict(BLOCK_M=_cap(N, 64), BLOCK_K=_cap(K, 64), BLOCK_D=_cap(D, 64))
    return dict(BLOCK_M=_cap(N, 64), BLOCK_K=_cap(K, 64), BLOCK_D=_cap(D, 128))


def num_warps(blk: dict) -> int:
    """4 warps hold a 64x128 float32 accumulator comfortably; larger tiles get 8."""
    dims = sorted((blk["BLOCK_M"], blk["BLOCK_K"], blk["BLOCK_D"]))
    return 4 if dims[1] * dims[2] <= 64 * 128 else 8


def splits(N: int) -> int:
    """Row splits of the dtable reduction: enough programs to fill an H100 at N ~ 32K rows.

    The interpreter uses short splits so that the CPU tests cover the cross-split sums.
    """
    rows = 128 if interpreted else 1024
    return max(1, min(triton.cdiv(N, rows), 32))
