"""Block sizes, autotuning configurations and dtype choices shared by the kernels' launchers.

On a GPU, large problems are autotuned over configurations chosen for H100 (Hopper: 228 KB of
shared memory per SM, 132 SMs), each clamped to the problem so that small K, D or N never get
tiles mostly made of padding. Small problems, and every launch under TRITON_INTERPRET=1, take
fixed block sizes from ``blocks``: autotuning a tiny launch costs more than it saves, and in the
interpreter it would only multiply the (slow) runs.
"""
from __future__ import annotations

import os
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
# the fused backward's row splits are whole multiples of this (the largest BLOCK_M of its configs)
SPLIT_ALIGN = 128
# The chunked backward's per-chunk P (16-bit or float32) and dP (float32) are sized to stay in L2
# between the kernels that write and read them: half of an H100's or H200's 50 MB, leaving the rest
# for the logits and dY streaming through. 4096 rows at K = 1024 with bf16 P.
CHUNK_L2_BYTES = 24 << 20
CHUNK_ENV = "VQLCMD_TRITON_CHUNK_ROWS"


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


# (BLOCK_M, BLOCK_K, BLOCK_D, num_warps, num_stages) for H100 with K ~ 1024, D ~ 256 in mind, each
# checked to fit its 227 KiB of shared memory and to spill no registers when compiled for sm_90
# (``python -m vqlcmd.kernels.aot_check`` runs that check without a GPU) with K and D multiples of the
# tiles, as the shipped configs have. Ragged sizes compile masked loads that do spill (an audit, not
# aot_check: K = 1000 up to 484 bytes in forward_fixed_max and 176 in the fp32 guided forward; D = 200,
# 8-72 bytes), a speed cost no GPU has timed.
# The forward keeps a (BLOCK_M, BLOCK_D) float32 accumulator and streams K; the D tile is the whole
# row when D <= 256 so that the softmax is computed once per row. float32 operands (tf32x3 splits
# each into two tf32 halves) need about twice the shared memory, hence their own smaller tiles.
_CONFIGS = {
    ("forward", 16): [
        (64, 64, 256, 4, 3), (64, 64, 256, 8, 3), (128, 64, 256, 8, 3), (128, 32, 256, 8, 4),
        (64, 128, 256, 8, 2), (32, 128, 256, 4, 2), (128, 64, 128, 8, 3), (64, 64, 128, 4, 4),
    ],
    ("forward", 32): [
        (64, 32, 256, 8, 2), (64, 32, 128, 4, 2), (32, 32, 256, 8, 2), (64, 16, 256, 8, 3), (128, 32, 128, 8, 2),
    ],
    # the fixed-max forward (first-tile): no rescaling between its products, so longer K tiles
    # cost no more per class; (64, 64, 256, 4, 3) and (128, 64, 256, 8, 3) spilled in first-tile's guided kernel
    # (128, 64, 256, 8, 2) left out: at 254 registers, the guided scores' mask of ruled-out classes spilled it
    ("forward_fixed_max", 16): [  # (64, 128, 256, 8, 2) dropped: Triton 3.6 (the lent GPUs') spills 64 bytes in it
        (64, 32, 256, 4, 4), (64, 32, 256, 4, 3), (64, 64, 256, 8, 3),
        (128, 32, 256, 8, 4), (128, 64, 128, 8, 3),
    ],
    # no float32-operand configs: Triton 3.6 failed to compile the fixed-max forward with tf32x3 products on
    # an H200 (a TritonGPUOptimizeThreadLocality pass error; benchmarks/results/h200-2026-11-28-gpu-tests.txt),
    # so float32 takes the one-pass forward on a GPU (``fixed_max_fits``)
    # (BLOCK_M, BLOCK_K) output tile of dlogits, D streamed in BLOCK_D steps
    ("grad_logits", 16): [
        (64, 64, 64, 4, 3), (128, 64, 64, 8, 3), (64, 128, 64, 8, 3), (128, 128, 64, 8, 3),
        (64, 64, 128, 4, 3), (128, 128, 32, 8, 4), (128, 64, 128, 8, 3),
    ],
    # (128, 128, 32, 8, 4) and (64, 128, 64, 8, 3) spilled 32-92 bytes with float32 operands (Triton 3.6, 3.8)
    ("grad_logits", 32): [
        (64, 64, 64, 4, 3), (128, 64, 64, 8, 3), (64, 128, 32, 8, 3), (128, 64, 32, 8, 4), (64, 64, 32, 4, 4),
    ],
    # the rows dlogits kernel: a (BLOCK_M, D <= BLOCK_D) dY block on chip, K swept in BLOCK_K steps
    ("grad_logits_rows", 16): [
        (64, 32, 256, 4, 4), (64, 32, 256, 4, 3), (64, 64, 256, 4, 2), (64, 64, 256, 4, 3),
        (128, 32, 256, 8, 3), (128, 64, 256, 8, 2), (64, 128, 256, 8, 2),
    ],
    # (BLOCK_K, BLOCK_D) accumulator of dtable, rows streamed in BLOCK_M steps
    ("grad_table", 16): [
        (64, 64, 128, 4, 3), (64, 128, 128, 8, 3), (32, 128, 256, 8, 3), (64, 64, 256, 8, 3),
        (128, 64, 64, 4, 3), (64, 128, 64, 4, 4), (128, 128, 128, 8, 3),
    ],
    ("grad_table", 32): [
        (64, 64, 128, 4, 3), (32, 64, 256, 8, 2), (64, 64, 64, 4, 3), (32, 64, 128, 4, 3), (32, 128, 128, 8, 2),
    ],
    # (BLOCK_K, D) float32 dtable accumulator in registers and the (BLOCK_K, D) table tile on chip for
    # the whole row split, rows streamed in BLOCK_M steps; D is never tiled (BLOCK_D clamps to D).
    # 8 warps: with 4, only the 64x32 and 32x64 tiles did not spill. No float32-operand configs: tf32x3 keeps
    # each operand as two tf32 halves, and at D = 256 even 16x16 tiles spilled (72-250 bytes, 4 or 8
    # warps), so float32 takes the split kernels on a GPU (see ``fused_fits``).
    ("fused_backward", 16): [
        (64, 64, 256, 8, 2), (64, 64, 256, 8, 3), (128, 64, 256, 8, 2), (64, 128, 256, 8, 2),
        (128, 32, 256, 8, 3), (32, 128, 256, 8, 2), (32, 64, 256, 8, 2), (64, 32, 256, 4, 2),
    ],
}
# fixed tiles for small problems on a GPU (no autotuning), by operand width
_SMALL_BLOCKS = {
    ("forward", 16): (64, 64, 256, 8, 3), ("forward", 32): (64, 32, 256, 8, 2),
    ("forward_fixed_max", 16): (64, 32, 256, 4, 3),
    ("grad_logits", 16): (64, 64, 64, 4, 3), ("grad_logits", 32): (64, 64, 64, 4, 3),
    ("grad_table", 16): (64, 64, 128, 4, 3), ("grad_table", 32): (64, 64, 128, 4, 3),
    ("fused_backward", 16): (64, 64, 256, 8, 2), ("grad_logits_rows", 16): (64, 32, 256, 4, 3),
}


def _width(dot) -> int:
    return 32 if dot == tl.float32 else 16


def _config(m, k, d, warps, stages):
    return triton.Config(dict(BLOCK_M=m, BLOCK_K=k, BLOCK_D=d), num_warps=warps, num_stages=stages)


def _clamp(kw: dict, N: int, K: int, D: int) -> dict:
    """Tiles no larger than the problem (rounded up to a power of two, at least 16)."""
    big = 1 << 30
    return dict(kw, BLOCK_M=min(kw["BLOCK_M"], _cap(N, big)), BLOCK_K=min(kw["BLOCK_K"], _cap(K, big)),
                BLOCK_D=min(kw["BLOCK_D"], _cap(D, big)))


def _clamp_configs(configs, named_args, **kwargs):
    """Clamp every config to the problem (small K, D or N) and drop the duplicates that makes."""
    args = {**named_args, **kwargs}
    seen, kept = set(), []
    for c in configs:
        kw = _clamp(c.kwargs, args["N"], args["K"], args["D"])
        key = (kw["BLOCK_M"], kw["BLOCK_K"], kw["BLOCK_D"], c.num_warps, c.num_stages)
        if key not in seen:
            seen.add(key)
            kept.append(triton.Config(kw, num_warps=c.num_warps, num_stages=c.num_stages))
    return kept


class Tuned:
    """``kernel`` autotuned over the H100 configurations of ``name``, one autotuner per operand width."""

    def __init__(self, kernel, name: str, variants: tuple = (), reset_to_zero: Optional[list] = None):
        # variants: constexpr switches (GUIDED, ATOMIC) that change the work, so are tuned apart
        self._tuners = {} if interpreted else {
            width: triton.autotune(configs=[_config(*c) for c in _CONFIGS[(name, width)]],
                                   key=["N", "K", "D", *variants],
                                   prune_configs_by={"early_config_prune": _clamp_configs},
                                   reset_to_zero=reset_to_zero)(kernel)
            for width in (16, 32) if (name, width) in _CONFIGS
        }

    def __call__(self, dot):
        return self._tuners[_width(dot)]

    def picks(self, N: int, K: int, D: int) -> list[str]:
        """The configurations the autotuners chose for problems of this (N, K, D), one per operand width
        and variant switch seen, as text: the benchmarks report them beside the times."""
        return [" ".join([*(f"{k[6:]}{v}" for k, v in cfg.kwargs.items()), f"w{cfg.num_warps}", f"s{cfg.num_stages}"])
                for tuner in self._tuners.values() for key, cfg in getattr(tuner, "cache", {}).items()
                if tuple(key[:3]) == (N, K, D)]


def blocks(name: str, N: int, K: int, D: int, device: torch.device, dot) -> Optional[dict]:
    """Fixed block sizes and launch options for this launch, or None to autotune.

    Under the interpreter each program step is numpy work on whole tiles, so bigger tiles mean
    fewer Python-level steps (128x256 runs the tests ~3x faster than 64x128) while K = 1000 still
    spans several tiles; on a GPU small problems, and every problem in deterministic mode, get the fixed
    tiles above, clamped to K and D.
    """
    if name == "delta":
        return dict(BLOCK_M=64, BLOCK_D=_cap(D, 256), num_warps=4)
    if name == "chunk_probs":
        # whole rows per program, two sweeps over K; memory-bound, so fixed tiles
        if interpreted:
            return dict(BLOCK_M=_cap(N, 128), BLOCK_K=_cap(K, 256))
        # float32 operands: 8 warps, as with 4 the guided scores' c + ω (c − u) spilled 8 bytes (ptxas, sm_90)
        return dict(BLOCK_M=8, BLOCK_K=_cap(K, 512), num_warps=4 if _width(dot) == 16 else 8)
    if name == "chunk":
        # elementwise over (rows, K): memory-bound, so one fixed tile (no autotuning) on a GPU too
        if interpreted:
            return dict(BLOCK_M=_cap(N, 128), BLOCK_K=_cap(K, 256))
        return dict(BLOCK_M=16, BLOCK_K=_cap(K, 256), num_warps=4)
    if interpreted:
        return dict(BLOCK_M=_cap(N, 128), BLOCK_K=_cap(K, 256), BLOCK_D=_cap(D, 256))
    # under torch.use_deterministic_algorithms the tiles are fixed too: the autotuner picks by timing, and
    # the tiles set the order of the sums, so two runs could differ in the last bits
    if device.type == "cuda" and N * K >= _SMALL and not torch.are_deterministic_algorithms_enabled():
        return None
    m, k, d, warps, stages = _SMALL_BLOCKS[(name, _width(dot))]
    return dict(_clamp(dict(BLOCK_M=m, BLOCK_K=k, BLOCK_D=d), N, K, D), num_warps=warps, num_stages=stages)


def splits(N: int) -> int:
    """Row splits of the dtable reduction: enough programs to fill an H100 at N ~ 32K rows.

    The interpreter uses short splits so that the CPU tests cover the cross-split sums.
    """
    rows = 128 if interpreted else 1024
    return max(1, min(triton.cdiv(N, rows), 32))


def chunk_rows(N: int, K: int, p_bytes: int) -> int:
    """Rows per chunk of the chunked backward: $VQLCMD_TRITON_CHUNK_ROWS, else what keeps a chunk's
    P (``p_bytes`` per element) and float32 dP within ``CHUNK_L2_BYTES``, in whole SPLIT_ALIGN blocks.

    The interpreter uses 128-row chunks so that the CPU tests cover several chunks and a ragged one.
    """
    env = os.environ.get(CHUNK_ENV)
    if env:
        try:
            rows = int(env)
        except ValueError:
            rows = 0
        if rows <= 0:
            raise ValueError(f"{CHUNK_ENV} must be a positive number of rows, got {env!r}")
    elif interpreted:
        rows = SPLIT_ALIGN
    else:
        rows = max(SPLIT_ALIGN, CHUNK_L2_BYTES // (max(K, 1) * (p_bytes + 4)) // SPLIT_ALIGN * SPLIT_ALIGN)
    return max(1, min(rows, N))


# the "mm" backward's transient P (rows, K) stays under this; larger problems go in pieces of rows
MM_P_BYTES = 256 << 20


def mm_rows(N: int, K: int, p_bytes: int) -> int:
    """Rows per piece of the mm backward: all N while P (N, K) at ``p_bytes`` per element fits
    ``MM_P_BYTES`` (one cuBLAS product, the case timed on the H100: 64 MiB at N = 32768, K = 1024),
    else whole SPLIT_ALIGN blocks that do. Pieces keep the backward's peak below eager's, which holds
    all of P (N, K) as an activation, when N·K grows (N = 65536 tokens at K = 16384 is 2 GiB of P)."""
    if N * K * p_bytes <= MM_P_BYTES:
        return max(N, 1)
    return min(N, max(SPLIT_ALIGN, MM_P_BYTES // (K * p_bytes) // SPLIT_ALIGN * SPLIT_ALIGN))


def _whole_rows_fit(name: str, D: int, dot) -> bool:
    """Whether kernel ``name``, which keeps whole rows of width D on chip (its D tile is never tiled
    further), serves this table width and dot operand: it has configurations for the operand width
    and D fits their widest D tile. The interpreter has no registers to spill, so there it runs for
    every dtype (with the 16-bit configurations' bound) and the CPU tests cover its logic with float32
    operands too."""
    configs = _CONFIGS.get((name, 16 if interpreted else _width(dot)))
    return configs is not None and D <= max(c[2] for c in configs)


def rows_fit(D: int, dot) -> bool:
    """Whether the rows dlogits kernel serves this table width and dot operand: D <= 256, and on a GPU
    16-bit operands (no float32 configurations: a tf32x3 dY block would take twice the registers and
    shared memory)."""
    return _whole_rows_fit("grad_logits_rows", D, dot)


def fixed_max_fits(dot) -> bool:
    """Whether the fixed-max forward serves this dot operand: 16-bit operands on a GPU (it has no float32
    configurations), any under the interpreter, whose CPU tests cover its logic with float32 operands too."""
    return interpreted or ("forward_fixed_max", _width(dot)) in _CONFIGS


def fused_fits(D: int, dot) -> bool:
    """Whether the fused backward, which holds a whole (BLOCK_K, D) dtable tile in registers, has
    configurations for this width of table and dot operand (D <= 256, 16-bit operands on a GPU); wider
    tables take the split kernels."""
    return _whole_rows_fit("fused_backward", D, dot)


def fused_splits(N: int) -> int:
    """Row splits of the fused backward: with K = 1024 in 64-column blocks, 16 splits at N = 8192 and 32
    at N >= 16384 give 256 and 512 programs, about 2 and 4 waves on 132 SMs. More splits would cost
    another float32 (K, D) dtable reduction each for little gain in occupancy.

    The interpreter uses short splits so that the CPU tests cover the cross-split sums.
    """
    rows = SPLIT_ALIGN if interpreted else 512
    return max(1, min(triton.cdiv(N, rows), 32))
