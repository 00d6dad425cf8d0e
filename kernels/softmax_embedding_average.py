"""Triton kernels for Ψ̂ = softmax(logits) @ table (VQ-LCMD.md, training step 5 and sampling).

``softmax(logits) @ table`` is attention with precomputed scores, so it is computed the way
FlashAttention computes attention: the forward streams K in tiles with an online softmax
(running max and sum) and ``tl.dot`` against table tiles, so the (N, K) probabilities never
exist in memory; it saves only the per-row log-sum-exp. The backward recomputes P from it:

    dlogits = P ∘ (dY·tableᵀ − delta),  delta = rowsum(dY ∘ Y)  (minus dLSE when LSE has a gradient)
    dtable  = Pᵀ·dY, summed over row splits (atomics, or per-split partials when deterministic)

After a small kernel computes delta, the backward can be one fused kernel, as FlashAttention-2's is:
each program owns one K block (BLOCK_K classes: a (BLOCK_K, D) table tile, loaded once, and a
(BLOCK_K, D) float32 dtable accumulator, both on chip) and one row split, and streams the split's
rows in BLOCK_M blocks. For each it reads the logits tile once, recomputes P = exp(s − lse) once,
forms dP = dY·tableᵀ against the resident table tile, stores dlogits = P ∘ (dP − delta), and adds
Pᵀ·dY to the accumulator, which it adds into dtable at the end. So the (N, K) logits are read once
and written once, and dY is read once per K block. D must fit one tile (D <= 256), and on a GPU the
operands must be 16-bit (float32's tf32x3 halves do not fit beside the tiles in registers).
Otherwise (the default "split" variant, or when only one gradient is needed, or D > 256) two
split kernels run instead: one over (row block, K block) tiles for dlogits and one over
(K block, D block, row split) for dtable, each recomputing P.

Measured on an H200 (N = 32768, K = 1024, D = 256, bf16, CUDA-graph replay, Triton 3.6): fused
0.20 ms, split 0.197 ms, and the split one was ahead at N = 8192 and 16384 too (0.060 vs 0.067,
0.108 vs 0.127 ms). Both run their two products (34 GFLOP) at about 200 TFLOP/s, while cuBLAS
does them in 0.073 ms: the backward is bound by how Triton issues the matrix products, not by the
logits traffic that the fusion saves. So "split" is the default and "fused" stays selectable
(VQLCMD_TRITON_BACKWARD=fused) for the tuning that could make it pay off.

Hence the "chunked" variants (VQLCMD_TRITON_FORWARD / VQLCMD_TRITON_BACKWARD = chunked), which
leave the products to cuBLAS and keep the softmax parts in Triton, chunk by chunk of rows: the
forward writes a chunk's P (and lse) and multiplies it by the table; the backward forms the chunk's
dP = dY·tableᵀ in float32, then one elementwise pass reads the logits once, writes dlogits once and
writes P for dtable += Pᵀ·dY. A chunk's P and dP (``chunk_rows``: 24 MiB, 4096 rows at K = 1024)
are meant to live in L2, so the traffic to memory is about the fused kernels' (logits in, dlogits
out), and only the log-sum-exp is saved for the backward, as before. Measured on an H100 (same
shape, profiler kernel sums): 426 µs fwd+bwd against 282 for the default kernels and 325 for
eager. cuBLAS runs the 4096-row chunk products at 190-325 TFLOP/s, well below its ~490 on whole
matrices, and the float32 dtable additions add 18 µs. The chunked forward took 0.127 ms with
4096-row chunks, 0.182 with 2048 and 0.096 with 8192, against 0.070 for the fused one. So they stay
opt-in, kept for cards or cuBLAS versions where that balance differs.

The "mm" backward (VQLCMD_TRITON_BACKWARD=mm) takes the one lesson of those numbers that chunking
did not spoil: cuBLAS is fast on whole matrices. The split dlogits kernel also writes P (N, K) in
the operand dtype, and cuBLAS computes dtable = Pᵀ·dY in one product, in place of the 113 µs dtable
kernel. P lives only during the backward, and at most 256 MiB of it at once (``MM_P_BYTES``:
larger N·K go in pieces of rows, so the peak stays below eager's, which keeps all of P as an
activation). Measured on an H100 (fwd+bwd, bf16, K = 1024, D = 256, profiler kernel sums at
N = 32768, CUDA-graph replay below): 246 µs against 286 for "split" at N = 32768 (241 once the
dlogits kernel loaded its epilogue operands ahead of its product loop), 78 against 94 µs at
N = 8192, and 19.6 against 28.5 µs at N = 4096, K = 128, D = 32. So the default, "auto", is "mm"
for 16-bit operands. For float32 it is "split": cuBLAS would run Pᵀ·dY as a full-precision SGEMM
(PyTorch leaves TF32 off), where the split kernel uses tf32x3.

The "fixed-max" forwards (VQLCMD_TRITON_FORWARD=first-tile or two-pass) answer what the H100
numbers say of the one-pass one, which runs its products at ~245 TFLOP/s: its loop is bound by
instruction issue, not by the tensor cores or memory. Compiled for sm_90 (the (64, 32, 256) tile
with 4 warps that the autotuner picked on the H100; Triton 3.6 and 3.8 agree within a few
instructions), the one-pass loop as timed was 450 instructions per thread and K tile, 128 of them
the rescale of the (64, 256) float32 accumulator by exp(m_old − m_new); exp2 of one FMA and
unmasked tiles (EVEN_K) bring it to 350, but the rescale stays, and because it reads the
accumulator between products, each product is waited for (WARPGROUP.DEPBAR 0) before the next
tile's softmax. The softmax needs no running max, only a per-row reference m with every s − m
below ``max_gap`` (exp stays finite; l and P·table scale alike), so ``_forward_fixed_max_kernel``
computes P = exp2(s·log2e − m·log2e) against a fixed m: no rescale, and each product stays in
flight (DEPBAR 1) while the next tile's exponentials run. "first-tile" takes m from the first K
tile and tracks the true max as it sweeps (258-270 instructions per tile), sweeping again from the
true maxima only in a row block where some row's logits spread beyond max_gap (40; 10 for fp16
operands), which trained logits rarely do beyond their first 32-128 classes. "two-pass" sweeps for
the maxima first (~30 instructions per tile: packed bf16 max) and then the product (233-241), so it
reads the logits twice, the second time from L2 (hinted evict_last). Neither is the default yet:
no GPU has timed them (benchmarks: ``triton-first-tile``, ``triton-two-pass``).

The dlogits kernel (114 of the mm backward's 241 µs on the H100) moves 192 MB (logits in, dlogits
and P out), 64 µs at copy speed, and runs its product at ~150 TFLOP/s: bound by neither. Each of
its programs computes one (rows, classes) tile in four D steps at D = 256, so it fills and drains
its load pipeline around a short product (sm_90 SASS: a 62-instruction D loop between a long
prologue and epilogue). VQLCMD_TRITON_DLOGITS=rows (``dlogits_variant``) runs
``_grad_logits_rows_kernel`` instead: a program holds a block of whole dY rows on chip and sweeps
every class, so the next tiles' loads are in flight during this one's product and epilogue, dY is
read once per row block instead of once per K block, and delta is summed there once per row block
(no delta kernel: 14 µs). Not the default yet: no GPU has timed it (benchmarks: ``triton-rows``).

In the split and mm backwards the dlogits kernel can also sum delta itself (VQLCMD_TRITON_DELTA=fused,
``delta_variant``) from the dY tiles of its product loop and the matching Y tiles, which saves the
delta kernel (14 µs of the mm backward's 241 on the H100) for more reads of Y from L2. It is not
the default yet: no GPU has timed it.

Shapes: logits (N, K), table (K, D), out (N, D), lse (N,). Math is float32 throughout.
Under TRITON_INTERPRET=1 (the CPU tests) the interpreter keeps bfloat16 as raw 16-bit
patterns, so every tile is converted to float32 right after loading and DOT_DTYPE, the
``tl.dot`` operand dtype, is float32 there; on a GPU it is the inputs' 16-bit dtype so that
bf16/fp16 run on tensor cores (fp32 inputs use tf32x3, which keeps fp32 accuracy).
"""
from __future__ import annotations

import os
from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from ._launch import (SPLIT_ALIGN, Tuned, blocks, chunk_rows, dot_dtype, fused_fits, fused_splits, interpreted,
                      mm_rows, rows_fit, splits)


LOG2E = tl.constexpr(1.4426950408889634)  # exp(x) = exp2(x · log2 e)


@triton.jit
def _score_tile(logits_ptr, uncond_ptr, row_off, ks, k_in, guidance, GUIDED: tl.constexpr, EVICT: tl.constexpr):
    """The float32 scores of a (rows, BLOCK_K) tile, -inf past K; EVICT: the loads' L2 eviction policy
    ("" for the default; passed every time: Triton 3.6 does not make a default argument a constexpr)."""
    s = tl.load(logits_ptr + row_off[:, None] + ks[None, :], mask=k_in[None, :], other=0.0,
                eviction_policy=EVICT).to(tl.float32)
    if GUIDED:
        # (1+ω) log P(·|y) − ω log P(·|∅) differs from (1+ω) c − ω u by a per-row constant,
        # which the renormalising softmax removes (VQ-LCMD.md, classifier-free guidance).
        u = tl.load(uncond_ptr + row_off[:, None] + ks[None, :], mask=k_in[None, :], other=0.0,
                    eviction_policy=EVICT)
        s = (1.0 + guidance) * s - guidance * u.to(tl.float32)
    return tl.where(k_in[None, :], s, float("-inf"))


@triton.jit
def _online_softmax_step(m_i, l_i, s):
    """One tile of the online softmax: (new running max, rescale of the old terms, exp(s − max), new sum)."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # A tile of -inf logits (masked classes) leaves m_new = -inf; shifting by 0 keeps exp() NaN-free.
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2((m_i - m_use) * LOG2E)
    p = tl.exp2(s * LOG2E - (m_use * LOG2E)[:, None])  # one FMA per element (see _grad_logits_kernel)
    return m_new, alpha, p, l_i * alpha + tl.sum(p, 1)


@triton.jit
def _forward_block(N, K, D, EVEN_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """A forward program's (rows, row offsets into the logits, table columns, columns in range)."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    # Rows past N re-read row N-1 and are never stored: no fully masked (-inf) softmax rows.
    row_off = tl.minimum(rows, N - 1).to(tl.int64) * K
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    return rows, row_off, cols, (cols < D) | EVEN_D


@triton.jit
def _store_average(out_ptr, lse_ptr, acc, l_i, m, rows, cols, d_in, N, D):
    """out = acc / l and lse = m + log l for the program's rows (lse once, by the first column block)."""
    row_in = rows < N
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * D + cols[None, :], acc / l_i[:, None],
             mask=row_in[:, None] & d_in[None, :])
    tl.store(lse_ptr + rows, m + tl.log(l_i), mask=row_in & (tl.program_id(1) == 0))


@triton.heuristics({"EVEN_K": lambda args: args["K"] % args["BLOCK_K"] == 0,
                    "EVEN_D": lambda args: args["D"] % args["BLOCK_D"] == 0})
@triton.jit
def _forward_kernel(
    logits_ptr, uncond_ptr, table_ptr, out_ptr, lse_ptr,
    N, K, D, guidance,
    GUIDED: tl.constexpr, DOT_DTYPE: tl.constexpr, EVEN_K: tl.constexpr, EVEN_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # EVEN_K / EVEN_D (set from K, D and the tile): no masks along a dimension the tiles divide.
    rows, row_off, cols, d_in = _forward_block(N, K, D, EVEN_D, BLOCK_M, BLOCK_D)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_in = (ks < K) | EVEN_K
        s = _score_tile(logits_ptr, uncond_ptr, row_off, ks, k_in, guidance, GUIDED, "")
        m_new, alpha, p, l_i = _online_softmax_step(m_i, l_i, s)
        t = tl.load(table_ptr + ks[:, None] * D + cols[None, :], mask=k_in[:, None] & d_in[None, :], other=0.0)
        acc = tl.dot(p.to(DOT_DTYPE), t.to(DOT_DTYPE), acc * alpha[:, None], input_precision="tf32x3")
        m_i = m_new
    _store_average(out_ptr, lse_ptr, acc, l_i, m_i, rows, cols, d_in, N, D)


@triton.jit
def _finite_reference(m):
    """The fixed-max sweep's per-row reference from row maxima m: a row of -inf logits (all classes
    masked) takes 0, so that it gets exp2(-inf) = 0 everywhere, as in the one-pass kernel."""
    return tl.where(m == float("-inf"), 0.0, m)


@triton.jit
def _fixed_max_sweep(logits_ptr, uncond_ptr, table_ptr, row_off, cols, d_in, K, D, guidance, m_ref, m_seen,
                     GUIDED: tl.constexpr, DOT_DTYPE: tl.constexpr, EVEN_K: tl.constexpr, TRACK: tl.constexpr,
                     EVICT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr):
    """One sweep over K with a fixed per-row reference m_ref in place of the running max:
    P = exp2(s·log2e − m_ref·log2e), so the accumulator only feeds the products and is never
    rescaled. Returns (the row maxima seen, updated when TRACK, the sum of P, P·table)."""
    m2 = m_ref * LOG2E
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_in = (ks < K) | EVEN_K
        s = _score_tile(logits_ptr, uncond_ptr, row_off, ks, k_in, guidance, GUIDED, EVICT)
        if TRACK:
            m_seen = tl.maximum(m_seen, tl.max(s, 1))
        p = tl.exp2(s * LOG2E - m2[:, None])
        l_i += tl.sum(p, 1)
        t = tl.load(table_ptr + ks[:, None] * D + cols[None, :], mask=k_in[:, None] & d_in[None, :], other=0.0)
        acc = tl.dot(p.to(DOT_DTYPE), t.to(DOT_DTYPE), acc, input_precision="tf32x3")
    return m_seen, l_i, acc


@triton.heuristics({"EVEN_K": lambda args: args["K"] % args["BLOCK_K"] == 0,
                    "EVEN_D": lambda args: args["D"] % args["BLOCK_D"] == 0})
@triton.jit
def _forward_fixed_max_kernel(
    logits_ptr, uncond_ptr, table_ptr, out_ptr, lse_ptr,
    N, K, D, guidance,
    GUIDED: tl.constexpr, DOT_DTYPE: tl.constexpr, MAX_FIRST: tl.constexpr, MAX_GAP: tl.constexpr,
    EVEN_K: tl.constexpr, EVEN_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # The one-pass kernel rescales its (BLOCK_M, BLOCK_D) accumulator by exp(m_old − m_new) after
    # every K tile; that read of the accumulator makes the compiler wait for each product before the
    # next tile's softmax (sm_90 SASS: WARPGROUP.DEPBAR gsb0 0x0), and the rescale is a third of the
    # loop's instructions. Any per-row reference m with every s − m below MAX_GAP gives the same
    # softmax without rescaling (exp(s − m) stays finite, and l, P·table are scaled alike), and the
    # products stay in flight while the next tile's exponentials run. Where m comes from:
    # MAX_FIRST ("two-pass"): a first sweep finds each row's max, at the price of reading the
    # program's logits twice (the second time from L2: the first sweep's loads are hinted evict_last).
    # Else ("first-tile"): the first K tile's max, and the sweep tracks the true max as it goes; only
    # if some row's max passes its reference by MAX_GAP (trained logits rarely spread that far beyond
    # their first 32-128 classes) does the program sweep again from the true maxima.
    rows, row_off, cols, d_in = _forward_block(N, K, D, EVEN_D, BLOCK_M, BLOCK_D)
    m_seen = tl.full([BLOCK_M], float("-inf"), tl.float32)
    if MAX_FIRST:
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_in = (ks < K) | EVEN_K
            s = _score_tile(logits_ptr, uncond_ptr, row_off, ks, k_in, guidance, GUIDED, "evict_last")
            m_seen = tl.maximum(m_seen, tl.max(s, 1))
        m_ref = _finite_reference(m_seen)
        m_seen, l_i, acc = _fixed_max_sweep(logits_ptr, uncond_ptr, table_ptr, row_off, cols, d_in, K, D, guidance,
                                            m_ref, m_seen, GUIDED, DOT_DTYPE, EVEN_K, False, "evict_first",
                                            BLOCK_M, BLOCK_K, BLOCK_D)
    else:
        ks = tl.arange(0, BLOCK_K)
        k_in = (ks < K) | EVEN_K
        s = _score_tile(logits_ptr, uncond_ptr, row_off, ks, k_in, guidance, GUIDED, "")
        m_ref = _finite_reference(tl.max(s, 1))
        m_seen, l_i, acc = _fixed_max_sweep(logits_ptr, uncond_ptr, table_ptr, row_off, cols, d_in, K, D, guidance,
                                            m_ref, m_seen, GUIDED, DOT_DTYPE, EVEN_K, True, "",
                                            BLOCK_M, BLOCK_K, BLOCK_D)
        if tl.max(m_seen - m_ref, 0) > MAX_GAP:  # exp(s − m_ref) may have overflowed: sweep from the maxima
            m_ref = _finite_reference(m_seen)
            m_seen, l_i, acc = _fixed_max_sweep(logits_ptr, uncond_ptr, table_ptr, row_off, cols, d_in, K, D,
                                                guidance, m_ref, m_seen, GUIDED, DOT_DTYPE, EVEN_K, False, "",
                                                BLOCK_M, BLOCK_K, BLOCK_D)
    _store_average(out_ptr, lse_ptr, acc, l_i, m_ref, rows, cols, d_in, N, D)


def max_gap(dot) -> float:
    """How far (in logits) the fixed-max forward lets a row's max pass its reference: exp(gap) must stay
    finite in the ``tl.dot`` operand dtype and leave the float32 sums room (K · e^40 · |table| for
    bf16 and float32 operands; float16 stops at 65504, so e^10)."""
    return 10.0 if dot == tl.float16 else 40.0


@triton.jit
def _store_dlogits(grad_logits_ptr, p_ptr, s, lse, dy_t, delta, rows, ks, k_in, N, K,
                   STORE_P: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """dlogits = P ∘ (dY·tableᵀ − delta) for a (rows, ks) tile of logits s, with P = exp(s − lse),
    stored (and P too, with STORE_P, in the operand dtype for cuBLAS). exp2 of one FMA per element, as
    FlashAttention scales its scores: tl.exp would subtract, then multiply by log2 e (sm_90 SASS showed
    the dlogits kernel's epilogue 20% shorter at a 128x128 tile)."""
    p = tl.exp2(s.to(tl.float32) * LOG2E - (lse * LOG2E)[:, None])
    grad = p * (dy_t - delta[:, None])
    mask = (rows < N)[:, None] & k_in[None, :]
    offs = rows.to(tl.int64)[:, None] * K + ks[None, :]
    tl.store(grad_logits_ptr + offs, grad, mask=mask)
    if STORE_P:
        tl.store(p_ptr + offs, p.to(DOT_DTYPE), mask=mask)


@triton.jit
def _delta_kernel(grad_out_ptr, out_ptr, grad_lse_ptr, delta_ptr, N, D,
                  HAS_GRAD_LSE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_in = rows < N
    row_off = rows.to(tl.int64) * D
    delta = tl.zeros([BLOCK_M], tl.float32)
    for d0 in range(0, D, BLOCK_D):
        ds = d0 + tl.arange(0, BLOCK_D)
        mask = row_in[:, None] & (ds < D)[None, :]
        dy = tl.load(grad_out_ptr + row_off[:, None] + ds[None, :], mask=mask, other=0.0).to(tl.float32)
        y = tl.load(out_ptr + row_off[:, None] + ds[None, :], mask=mask, other=0.0).to(tl.float32)
        delta += tl.sum(dy * y, 1)
    if HAS_GRAD_LSE:
        # d lse / d logits = P, so a gradient on lse folds into the same P ∘ (· − delta) term.
        delta -= tl.load(grad_lse_ptr + rows, mask=row_in, other=0.0).to(tl.float32)
    tl.store(delta_ptr + rows, delta, mask=row_in)


@triton.heuristics({"EVEN_K": lambda args: args["K"] % args["BLOCK_K"] == 0,
                    "EVEN_D": lambda args: args["D"] % args["BLOCK_D"] == 0})
@triton.jit
def _grad_logits_kernel(
    logits_ptr, table_ptr, grad_out_ptr, out_ptr, grad_lse_ptr, lse_ptr, delta_ptr, grad_logits_ptr, p_ptr,
    N, K, D,
    STORE_P: tl.constexpr, FUSED_DELTA: tl.constexpr, HAS_GRAD_LSE: tl.constexpr, DOT_DTYPE: tl.constexpr,
    EVEN_K: tl.constexpr, EVEN_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # STORE_P: also write P (the "mm" backward hands Pᵀ·dY to cuBLAS). FUSED_DELTA: sum delta =
    # rowsum(dY ∘ Y) − dLSE here, from the dY tiles the product loop loads anyway, instead of reading
    # it from delta_ptr (the delta kernel's output); out_ptr and grad_lse_ptr are read only then.
    # EVEN_K / EVEN_D (set from K, D and the tile): no masks along a dimension the tiles divide.
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    safe_rows = tl.minimum(rows, N - 1).to(tl.int64)
    ks = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    k_in = (ks < K) | EVEN_K
    # The epilogue's operands are loaded before the product loop so that their memory latency
    # overlaps it rather than following it.
    s = tl.load(logits_ptr + safe_rows[:, None] * K + ks[None, :], mask=k_in[None, :], other=0.0)
    lse = tl.load(lse_ptr + safe_rows)
    if FUSED_DELTA:
        delta = tl.zeros([BLOCK_M], tl.float32)
        if HAS_GRAD_LSE:
            delta -= tl.load(grad_lse_ptr + safe_rows).to(tl.float32)
    else:
        delta = tl.load(delta_ptr + safe_rows)
    dy_t = tl.zeros([BLOCK_M, BLOCK_K], tl.float32)  # dY · tableᵀ for this tile
    for d0 in range(0, D, BLOCK_D):
        ds = d0 + tl.arange(0, BLOCK_D)
        d_in = (ds < D) | EVEN_D
        dy = tl.load(grad_out_ptr + safe_rows[:, None] * D + ds[None, :], mask=d_in[None, :], other=0.0)
        if FUSED_DELTA:
            y = tl.load(out_ptr + safe_rows[:, None] * D + ds[None, :], mask=d_in[None, :], other=0.0)
            delta += tl.sum(dy.to(tl.float32) * y.to(tl.float32), 1)
        t = tl.load(table_ptr + ks[:, None] * D + ds[None, :], mask=k_in[:, None] & d_in[None, :], other=0.0)
        dy_t = tl.dot(dy.to(DOT_DTYPE), tl.trans(t.to(DOT_DTYPE)), dy_t, input_precision="tf32x3")
    _store_dlogits(grad_logits_ptr, p_ptr, s, lse, dy_t, delta, rows, ks, k_in, N, K, STORE_P, DOT_DTYPE)


@triton.heuristics({"EVEN_K": lambda args: args["K"] % args["BLOCK_K"] == 0,
                    "EVEN_D": lambda args: args["D"] == args["BLOCK_D"]})
@triton.jit
def _grad_logits_rows_kernel(
    logits_ptr, table_ptr, grad_out_ptr, out_ptr, grad_lse_ptr, lse_ptr, grad_logits_ptr, p_ptr,
    N, K, D,
    STORE_P: tl.constexpr, HAS_GRAD_LSE: tl.constexpr, DOT_DTYPE: tl.constexpr,
    EVEN_K: tl.constexpr, EVEN_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # dlogits (and P with STORE_P) for a block of whole rows: the program keeps the block's dY
    # (BLOCK_M, D <= BLOCK_D: the configs' 256, clamped to D's power of two) on chip and sweeps K, one
    # (BLOCK_M, BLOCK_K) tile of dY·tableᵀ per step.
    # The tile kernel runs one such tile per program, four D steps long at D = 256, so each program
    # fills and drains its load pipeline around a short product, re-reads its dY block from L2 once
    # per K block, and reads Y again for delta if it sums its own. Here the loads of the next K
    # tiles are in flight during this one's product and epilogue, dY is read once, and delta =
    # rowsum(dY ∘ Y) − dLSE is summed once per row block, so no delta kernel runs before it.
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    safe_rows = tl.minimum(rows, N - 1).to(tl.int64)
    ds = tl.arange(0, BLOCK_D)
    d_in = (ds < D) | EVEN_D
    dy = tl.load(grad_out_ptr + safe_rows[:, None] * D + ds[None, :], mask=d_in[None, :], other=0.0)
    y = tl.load(out_ptr + safe_rows[:, None] * D + ds[None, :], mask=d_in[None, :], other=0.0)
    delta = tl.sum(dy.to(tl.float32) * y.to(tl.float32), 1)
    if HAS_GRAD_LSE:
        # d lse / d logits = P, so a gradient on lse folds into the same P ∘ (· − delta) term.
        delta -= tl.load(grad_lse_ptr + safe_rows).to(tl.float32)
    lse = tl.load(lse_ptr + safe_rows)
    dy = dy.to(DOT_DTYPE)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_in = (ks < K) | EVEN_K
        t = tl.load(table_ptr + ks[:, None] * D + ds[None, :], mask=k_in[:, None] & d_in[None, :], other=0.0)
        dy_t = tl.dot(dy, tl.trans(t.to(DOT_DTYPE)), input_precision="tf32x3")  # (BLOCK_M, BLOCK_K)
        s = tl.load(logits_ptr + safe_rows[:, None] * K + ks[None, :], mask=k_in[None, :], other=0.0)
        _store_dlogits(grad_logits_ptr, p_ptr, s, lse, dy_t, delta, rows, ks, k_in, N, K, STORE_P, DOT_DTYPE)


@triton.heuristics({"EVEN_K": lambda args: args["K"] % args["BLOCK_K"] == 0,
                    "EVEN_D": lambda args: args["D"] % args["BLOCK_D"] == 0})
@triton.jit
def _grad_table_kernel(
    logits_ptr, grad_out_ptr, lse_ptr, dst_ptr,
    N, K, D, rows_per_split,
    ATOMIC: tl.constexpr, DOT_DTYPE: tl.constexpr, EVEN_K: tl.constexpr, EVEN_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # EVEN_K / EVEN_D (set from K, D and the tile): no masks along a dimension the tiles divide.
    pid_k = tl.program_id(0)
    pid_d = tl.program_id(1)
    pid_s = tl.program_id(2)
    ks = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    ds = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    k_in = (ks < K) | EVEN_K
    d_in = (ds < D) | EVEN_D
    acc = tl.zeros([BLOCK_K, BLOCK_D], tl.float32)  # Pᵀ·dY over this split's rows
    start = pid_s * rows_per_split
    end = tl.minimum(start + rows_per_split, N)
    for r0 in range(start, end, BLOCK_M):
        rows = r0 + tl.arange(0, BLOCK_M)
        live = rows < end
        safe_rows = tl.minimum(rows, N - 1).to(tl.int64)
        s = tl.load(logits_ptr + safe_rows[:, None] * K + ks[None, :], mask=k_in[None, :], other=0.0).to(tl.float32)
        lse2 = tl.load(lse_ptr + safe_rows) * LOG2E
        p = tl.where(live[:, None] & k_in[None, :], tl.exp2(s * LOG2E - lse2[:, None]), 0.0)
        dy = tl.load(grad_out_ptr + safe_rows[:, None] * D + ds[None, :], mask=live[:, None] & d_in[None, :],
                     other=0.0)
        acc = tl.dot(tl.trans(p.to(DOT_DTYPE)), dy.to(DOT_DTYPE), acc, input_precision="tf32x3")
    offs = ks[:, None] * D + ds[None, :]
    mask = k_in[:, None] & d_in[None, :]
    if ATOMIC:
        tl.atomic_add(dst_ptr + offs, acc, mask=mask)
    else:
        tl.store(dst_ptr + pid_s * K * D + offs, acc, mask=mask)


@triton.jit
def _fused_backward_kernel(
    logits_ptr, table_ptr, grad_out_ptr, lse_ptr, delta_ptr, grad_logits_ptr, dst_ptr,
    N, K, D, rows_per_split,
    ATOMIC: tl.constexpr, DOT_DTYPE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # One K block of one row split, FlashAttention-2-backward style: the table tile stays on chip for
    # the whole split, each logits tile is read and exponentiated once for both gradients, and dY is
    # read once per K block rather than once per (K block, D block) as the split kernels do.
    pid_k = tl.program_id(0)
    pid_s = tl.program_id(1)
    ks = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    ds = tl.arange(0, BLOCK_D)  # BLOCK_D >= D: dP needs the whole row of dY before dS can be formed
    k_in = ks < K
    d_in = ds < D
    kd_mask = k_in[:, None] & d_in[None, :]
    t = tl.load(table_ptr + ks[:, None] * D + ds[None, :], mask=kd_mask, other=0.0).to(DOT_DTYPE)
    acc = tl.zeros([BLOCK_K, BLOCK_D], tl.float32)  # Pᵀ·dY over this split's rows
    start = pid_s * rows_per_split
    end = tl.minimum(start + rows_per_split, N)
    for r0 in range(start, end, BLOCK_M):
        rows = r0 + tl.arange(0, BLOCK_M)
        live = rows < end
        safe_rows = tl.minimum(rows, N - 1).to(tl.int64)
        s = tl.load(logits_ptr + safe_rows[:, None] * K + ks[None, :], mask=k_in[None, :], other=0.0).to(tl.float32)
        lse = tl.load(lse_ptr + safe_rows)
        delta = tl.load(delta_ptr + safe_rows)
        # zero for dead rows and padded classes, so neither reaches dtable
        p = tl.where(live[:, None] & k_in[None, :], tl.exp(s - lse[:, None]), 0.0)
        dy = tl.load(grad_out_ptr + safe_rows[:, None] * D + ds[None, :], mask=live[:, None] & d_in[None, :],
                     other=0.0).to(DOT_DTYPE)
        dp = tl.dot(dy, tl.trans(t), input_precision="tf32x3")  # dY · tableᵀ, (BLOCK_M, BLOCK_K)
        tl.store(grad_logits_ptr + rows.to(tl.int64)[:, None] * K + ks[None, :], p * (dp - delta[:, None]),
                 mask=live[:, None] & k_in[None, :])
        acc = tl.dot(tl.trans(p.to(DOT_DTYPE)), dy, acc, input_precision="tf32x3")
    offs = ks[:, None] * D + ds[None, :]
    if ATOMIC:
        tl.atomic_add(dst_ptr + offs, acc, mask=kd_mask)
    else:
        tl.store(dst_ptr + pid_s * K * D + offs, acc, mask=kd_mask)


@triton.jit
def _chunk_kernel(
    logits_ptr, lse_ptr, delta_ptr, dp_ptr, grad_logits_ptr, p_ptr,
    N, K,
    WRITE_GRAD: tl.constexpr, WRITE_P: tl.constexpr, DOT_DTYPE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
):
    # The chunked backward's one elementwise pass over a chunk of rows (all pointers at the chunk's
    # first row, rows K apart): P = exp(s − lse) recomputed once, dlogits = P ∘ (dP − delta) from the
    # product cuBLAS left in dp, and P stored for the dtable product that follows.
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    ks = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    row_in = rows < N
    mask = row_in[:, None] & (ks < K)[None, :]
    offs = rows.to(tl.int64)[:, None] * K + ks[None, :]
    s = tl.load(logits_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    lse = tl.load(lse_ptr + rows, mask=row_in, other=0.0)
    p = tl.exp(s - lse[:, None])
    if WRITE_P:
        tl.store(p_ptr + offs, p.to(DOT_DTYPE), mask=mask)
    if WRITE_GRAD:
        dp = tl.load(dp_ptr + offs, mask=mask, other=0.0)
        delta = tl.load(delta_ptr + rows, mask=row_in, other=0.0)
        tl.store(grad_logits_ptr + offs, p * (dp - delta[:, None]), mask=mask)


@triton.jit
def _chunk_probs_kernel(
    logits_ptr, uncond_ptr, lse_ptr, p_ptr,
    N, K, guidance,
    GUIDED: tl.constexpr, DOT_DTYPE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
):
    # The chunked forward's softmax over a chunk of rows (pointers at its first row): an online
    # max and sum over K, then P = exp(s − lse) stored for cuBLAS's P·table. The second sweep reads
    # the rows this program has just read, from cache.
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_in = rows < N
    row_off = tl.minimum(rows, N - 1).to(tl.int64) * K  # rows past N re-read row N-1, never stored
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        s = _score_tile(logits_ptr, uncond_ptr, row_off, ks, ks < K, guidance, GUIDED, "")
        m_i, _, _, l_i = _online_softmax_step(m_i, l_i, s)
    lse = m_i + tl.log(l_i)
    tl.store(lse_ptr + rows, lse, mask=row_in)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_in = ks < K
        p = tl.exp(_score_tile(logits_ptr, uncond_ptr, row_off, ks, k_in, guidance, GUIDED, "") - lse[:, None])
        tl.store(p_ptr + rows.to(tl.int64)[:, None] * K + ks[None, :], p.to(DOT_DTYPE),
                 mask=row_in[:, None] & k_in[None, :])


_TUNED = {
    "forward": Tuned(_forward_kernel, "forward", variants=("GUIDED",)),
    "forward_fixed_max": Tuned(_forward_fixed_max_kernel, "forward_fixed_max", variants=("GUIDED", "MAX_FIRST")),
    "grad_logits": Tuned(_grad_logits_kernel, "grad_logits",
                         variants=("STORE_P", "FUSED_DELTA", "HAS_GRAD_LSE")),
    "grad_logits_rows": Tuned(_grad_logits_rows_kernel, "grad_logits_rows", variants=("STORE_P", "HAS_GRAD_LSE")),
    "grad_table": Tuned(_grad_table_kernel, "grad_table", variants=("ATOMIC",), reset_to_zero=["dst_ptr"]),
    "fused_backward": Tuned(_fused_backward_kernel, "fused_backward", variants=("ATOMIC",),
                            reset_to_zero=["dst_ptr"]),
}
_KERNELS = {"forward": _forward_kernel, "forward_fixed_max": _forward_fixed_max_kernel, "grad_logits": _grad_logits_kernel,
            "grad_logits_rows": _grad_logits_rows_kernel, "grad_table": _grad_table_kernel,
            "fused_backward": _fused_backward_kernel, "chunk": _chunk_kernel, "chunk_probs": _chunk_probs_kernel}


def _launch(name: str, grid, N: int, K: int, D: int, args: tuple, dot, **const) -> None:
    """Fixed tiles (interpreter, small problems) or the autotuner; ``grid(meta)`` sizes the launch."""
    blk = blocks(name, N, K, D, args[0].device, dot)
    if blk is None:
        _TUNED[name](dot)[grid](*args, DOT_DTYPE=dot, **const)
    else:
        _KERNELS[name][grid(blk)](*args, DOT_DTYPE=dot, **const, **blk)


FORWARD_ENV = "VQLCMD_TRITON_FORWARD"
FORWARD_VARIANTS = ("fused", "two-pass", "first-tile", "chunked")


def _choice(variant: Optional[str], env: str, choices: tuple, default: str) -> str:
    """``variant``, else $``env``, else ``default``, checked against ``choices``; the environment is read
    per call so that a benchmark can switch variants between calls."""
    variant = variant or os.environ.get(env) or default
    if variant not in choices:
        raise ValueError(f"{env} must be one of {', '.join(choices)}, got {variant!r}")
    return variant


def forward_variant(variant: Optional[str] = None) -> str:
    """``variant``, else $VQLCMD_TRITON_FORWARD, else "fused" (the one-pass kernel).

    "two-pass" and "first-tile" run ``_forward_fixed_max_kernel``, whose products need no online
    rescaling: "two-pass" finds each row's max in a first sweep over its logits, "first-tile" takes
    the first K tile's max and sweeps again only for rows whose logits spread further than
    ``max_gap``. Neither is the default yet: no GPU has timed them.
    """
    return _choice(variant, FORWARD_ENV, FORWARD_VARIANTS, "fused")


def forward(logits: torch.Tensor, table: torch.Tensor, uncond: Optional[torch.Tensor] = None,
            guidance: float = 0.0, *, variant: Optional[str] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits (N, K), table (K, D) [, uncond (N, K), ω] -> out (N, D) in the promoted dtype, lse (N,) float32.

    ``variant`` (default $VQLCMD_TRITON_FORWARD, else "fused"): the one-pass FlashAttention-style
    kernel, "two-pass": a sweep for each row's max, then the same product without online rescaling,
    "first-tile": that product against the first K tile's max (a second sweep only where it falls
    short), or "chunked": the softmax of a chunk of rows in Triton and P_c·table through cuBLAS.
    """
    N, K = logits.shape
    D = table.shape[1]
    out_dtype = torch.promote_types(logits.dtype, table.dtype)
    if uncond is not None:
        out_dtype = torch.promote_types(out_dtype, uncond.dtype)
    out = torch.empty((N, D), device=logits.device, dtype=out_dtype)
    lse = torch.empty((N,), device=logits.device, dtype=torch.float32)
    variant = forward_variant(variant)
    if N == 0:
        return out, lse
    guided = uncond is not None
    logits, table = logits.contiguous(), table.contiguous()
    uncond = uncond.contiguous() if guided else logits  # unread when not guided
    dot = dot_dtype(logits, table)
    if variant == "chunked":
        _chunked_forward(logits, uncond, table, float(guidance), guided, out, lse, dot)
    else:
        grid = lambda meta: (triton.cdiv(N, meta["BLOCK_M"]), triton.cdiv(D, meta["BLOCK_D"]))  # noqa: E731
        args = (logits, uncond, table, out, lse, N, K, D, float(guidance))
        if variant == "fused":
            _launch("forward", grid, N, K, D, args, dot, GUIDED=guided)
        else:
            _launch("forward_fixed_max", grid, N, K, D, args, dot, GUIDED=guided, MAX_FIRST=variant == "two-pass",
                    MAX_GAP=max_gap(dot))
    return out, lse


BACKWARD_ENV = "VQLCMD_TRITON_BACKWARD"
BACKWARD_VARIANTS = ("auto", "fused", "split", "chunked", "mm")


def backward_variant(variant: Optional[str] = None, dot=None) -> str:
    """``variant``, else $VQLCMD_TRITON_BACKWARD, else "auto".

    "auto" resolves by ``dot``, the ``tl.dot`` operand dtype: "mm" for 16-bit operands (the fastest on
    an H100, module docstring), "split" for float32 and under the interpreter (where ``dot`` is float32).
    """
    variant = _choice(variant, BACKWARD_ENV, BACKWARD_VARIANTS, "auto")
    if variant == "auto" and dot is not None:
        variant = "split" if dot == tl.float32 else "mm"
    return variant


DELTA_ENV = "VQLCMD_TRITON_DELTA"
DELTA_VARIANTS = ("kernel", "fused")


def delta_variant(variant: Optional[str] = None) -> str:
    """``variant``, else $VQLCMD_TRITON_DELTA, else "kernel".

    Where the dlogits kernel of the "split" and "mm" backwards gets delta = rowsum(dY ∘ Y) − dLSE:
    "kernel", from the small delta kernel that runs first (14 µs of the 241 µs fwd+bwd on an H100 at
    N = 32768, K = 1024, D = 256, bf16), or "fused": each dlogits program sums it itself from the dY
    tiles its product loop loads anyway, plus the matching Y tiles (16-bit operands only on a GPU:
    with float32 ones the tiles spill registers, so those keep the delta kernel). That saves the launch and a
    pass over dY and Y in memory for extra (mostly L2) reads of Y in every K block of a row block.
    "kernel" stays the default until a GPU run says "fused" pays (benchmarks: ``triton-delta``).
    """
    return _choice(variant, DELTA_ENV, DELTA_VARIANTS, "kernel")


DLOGITS_ENV = "VQLCMD_TRITON_DLOGITS"
DLOGITS_VARIANTS = ("tiles", "rows")


def dlogits_variant(variant: Optional[str] = None) -> str:
    """``variant``, else $VQLCMD_TRITON_DLOGITS, else "tiles".

    Which kernel computes dlogits in the split and mm backwards: "tiles", one (rows, classes) tile per
    program (``_grad_logits_kernel``), or "rows", a block of whole rows per program sweeping all
    classes with its dY on chip (``_grad_logits_rows_kernel``; it sums delta itself, so no delta
    kernel runs). "rows" needs D <= 256, and on a GPU 16-bit operands (``rows_fit``); elsewhere the
    tiles run. "tiles" stays the default until a GPU run says "rows" pays (benchmarks: ``triton-rows``).
    """
    return _choice(variant, DLOGITS_ENV, DLOGITS_VARIANTS, "tiles")


def backward(grad_out: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, logits: torch.Tensor,
             table: torch.Tensor, grad_lse: Optional[torch.Tensor] = None, *, need_logits: bool = True,
             need_table: bool = True, deterministic: bool = False,
             variant: Optional[str] = None) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """Gradients of ``forward`` w.r.t. logits (N, K) and table (K, D), in their dtypes (None if not needed).

    ``variant`` (default $VQLCMD_TRITON_BACKWARD, else "auto": "mm" for 16-bit operands, "split" for
    float32) picks the fused kernel, the split ones, the chunked products or "mm". "fused" applies
    when both gradients are needed and the kernel fits (``fused_fits``), and so does "mm"; else a
    single gradient takes its own split kernel, which does no work for the other. "chunked" serves
    any combination and is deterministic whatever ``deterministic`` says.

    "mm": the dlogits kernel also writes P (N, K) in the operand dtype, and cuBLAS computes
    dtable = Pᵀ·dY over all rows at once (in pieces of rows where P would pass ``MM_P_BYTES``,
    ``_mm_backward``). On an H100 (N = 32768, K = 1024, D = 256, bf16) the dtable
    kernel took 113 µs where cuBLAS does a product of that size in ~36 µs, and the extra store of P
    should cost about its 64 MB of writes (~22 µs); measured, the whole fwd+bwd took 246 µs against 286
    for "split". P is a transient of the backward (freed when it returns; 64 MiB at that shape), not a
    saved activation: the saved tensors stay the log-sum-exp. Deterministic (cuBLAS).
    """
    N, K = logits.shape
    D = table.shape[1]
    logits, table = logits.contiguous(), table.contiguous()
    grad_out, out, lse = grad_out.contiguous(), out.contiguous(), lse.contiguous()
    dot = dot_dtype(logits, table)
    dev = logits.device
    variant = backward_variant(variant, dot)
    fused = variant == "fused" and need_logits and need_table and fused_fits(D, dot)
    grad_lse = grad_lse.contiguous() if grad_lse is not None else None
    # the fused and chunked backwards read delta from memory; the dlogits kernel may sum its own, with
    # 16-bit operands on a GPU (float32's tf32x3 tiles spill registers when they sum delta too: aot_check)
    own_delta = (delta_variant() == "fused" and variant != "chunked" and not fused
                 and (interpreted or dot != tl.float32))
    # the rows dlogits kernel always sums its own delta
    rows_kernel = dlogits_variant() == "rows" and variant in ("split", "mm") and rows_fit(D, dot)
    own_delta = own_delta or rows_kernel
    delta = None
    if N and need_logits and not own_delta:
        delta = torch.empty((N,), device=dev, dtype=torch.float32)
        has_glse = grad_lse is not None
        blk = blocks("delta", N, K, D, dev, dot)
        _delta_kernel[(triton.cdiv(N, blk["BLOCK_M"]),)](
            grad_out, out, grad_lse if has_glse else lse, delta, N, D,
            HAS_GRAD_LSE=has_glse, **blk)
    if variant == "chunked":
        return _chunked_backward(grad_out, lse, logits, table, delta, need_logits, need_table, dot)
    dl = _DeltaFrom(delta, out, grad_lse)
    if variant == "mm" and need_logits and need_table and N:
        return _mm_backward(grad_out, lse, logits, table, dl, dot, rows_kernel)
    grad_logits = torch.empty_like(logits) if need_logits else None
    if need_table:
        n_split = fused_splits(N) if fused else splits(N)
        atomic = not deterministic and n_split > 1
        # atomics add into one float32 (K, D) buffer; otherwise each split writes its own slice
        dst = torch.zeros((K, D) if atomic else (n_split, K, D), device=dev, dtype=torch.float32)
    if N:
        if fused:
            # whole row blocks in every split (split_rows is a multiple of every BLOCK_M), so only
            # the last split has a ragged tail
            split_rows = triton.cdiv(triton.cdiv(N, n_split), SPLIT_ALIGN) * SPLIT_ALIGN
            _launch("fused_backward", lambda meta: (triton.cdiv(K, meta["BLOCK_K"]), n_split), N, K, D,
                    (logits, table, grad_out, lse, delta, grad_logits, dst, N, K, D, split_rows), dot,
                    ATOMIC=atomic)
        else:
            if need_logits:
                _grad_logits(logits, table, grad_out, lse, dl, grad_logits, dot, rows_kernel=rows_kernel)
            if need_table:
                _launch("grad_table",
                        lambda meta: (triton.cdiv(K, meta["BLOCK_K"]), triton.cdiv(D, meta["BLOCK_D"]), n_split),
                        N, K, D, (logits, grad_out, lse, dst, N, K, D, triton.cdiv(N, n_split)), dot,
                        ATOMIC=atomic)
    grad_table = (dst if atomic else dst.sum(0)).to(table.dtype) if need_table else None
    return grad_logits, grad_table


_TORCH_DTYPE = {tl.bfloat16: torch.bfloat16, tl.float16: torch.float16, tl.float32: torch.float32}


# torch.mm(..., out_dtype=float32) for 16-bit operands (CUDA) exists from PyTorch 2.8 on
_MM_OUT_DTYPE = hasattr(torch.ops.aten.mm, "dtype_out")


def _mm_float32(a: torch.Tensor, b: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """a @ b with float32 output: 16-bit operands (CUDA only, by ``dot_dtype``) through cuBLAS's
    float32-output GEMM, so dP keeps float32 before ``dP − delta`` cancels most of it. Without that
    overload the product is rounded to the operands' dtype first, as PyTorch's own backward does."""
    if a.dtype == torch.float32:
        return torch.mm(a, b, out=out)
    if _MM_OUT_DTYPE:
        return torch.mm(a, b, out_dtype=torch.float32, out=out)
    product = torch.mm(a, b).float()
    return product if out is None else out.copy_(product)


class _DeltaFrom(NamedTuple):
    """Where the dlogits kernel takes delta from: ``values`` (the delta kernel's output), or, when that
    is None, its own sum of rowsum(dY ∘ out) − grad_lse (``delta_variant`` "fused")."""
    values: Optional[torch.Tensor]
    out: torch.Tensor
    grad_lse: Optional[torch.Tensor]

    def rows(self, piece: slice) -> "_DeltaFrom":
        return _DeltaFrom(*(None if t is None else t[piece] for t in self))


def _grad_logits(logits, table, grad_out, lse, dl: _DeltaFrom, grad_logits, dot, p=None,
                 rows_kernel=False) -> None:
    """The split dlogits kernel into ``grad_logits``, or with ``rows_kernel`` the rows kernel (which sums delta
    itself: ``dl.values`` is then None); with ``p``, it writes P there too. Pointers a constexpr switch
    leaves unread (P without STORE_P, the delta inputs) get a live tensor."""
    N, K = logits.shape
    D = table.shape[1]
    own = dl.values is None
    if rows_kernel:
        _launch("grad_logits_rows", lambda meta: (triton.cdiv(N, meta["BLOCK_M"]),), N, K, D,
                (logits, table, grad_out, dl.out, lse if dl.grad_lse is None else dl.grad_lse, lse, grad_logits,
                 logits if p is None else p, N, K, D), dot,
                STORE_P=p is not None, HAS_GRAD_LSE=dl.grad_lse is not None)
        return
    _launch("grad_logits", lambda meta: (triton.cdiv(N, meta["BLOCK_M"]), triton.cdiv(K, meta["BLOCK_K"])),
            N, K, D, (logits, table, grad_out, dl.out, lse if dl.grad_lse is None else dl.grad_lse, lse,
                      lse if own else dl.values, grad_logits, logits if p is None else p, N, K, D), dot,
            STORE_P=p is not None, FUSED_DELTA=own, HAS_GRAD_LSE=own and dl.grad_lse is not None)


def _mm_backward(grad_out, lse, logits, table, dl: _DeltaFrom, dot, rows_kernel=False):
    """Both gradients: dlogits and P from the dlogits kernel, then dtable = Pᵀ·dY by cuBLAS, over all
    rows at once or, where P would pass ``MM_P_BYTES`` (_launch.py), piece by piece of rows (one P buffer,
    float32 sums of the pieces' products)."""
    N, K = logits.shape
    p_dtype = _TORCH_DTYPE[dot]
    grad_logits = torch.empty_like(logits)
    rows = mm_rows(N, K, p_dtype.itemsize)
    p = torch.empty((rows, K), device=logits.device, dtype=p_dtype)
    dy = grad_out.to(p_dtype)
    grad_table = None
    for r0 in range(0, N, rows):
        piece = slice(r0, min(r0 + rows, N))
        n = piece.stop - r0
        _grad_logits(logits[piece], table, grad_out[piece], lse[piece], dl.rows(piece), grad_logits[piece], dot,
                     p=p[:n], rows_kernel=rows_kernel)
        product = _mm_float32(p[:n].t(), dy[piece])
        grad_table = product if grad_table is None else grad_table.add_(product)
    return grad_logits, grad_table.to(table.dtype)


def _chunked_forward(logits, uncond, table, guidance, guided, out, lse, dot):
    """out = P·table chunk by chunk: the ``chunk_probs`` kernel writes lse and the chunk's P (one
    buffer reused, so it stays in L2, see ``_chunked_backward``), cuBLAS multiplies."""
    N, K = logits.shape
    p_dtype = _TORCH_DTYPE[dot]
    table_p = table.to(p_dtype)
    rows = chunk_rows(N, K, p_dtype.itemsize)
    p_buf = torch.empty((rows, K), device=logits.device, dtype=p_dtype)
    for r0 in range(0, N, rows):
        n = min(rows, N - r0)
        _launch("chunk_probs", lambda meta, n=n: (triton.cdiv(n, meta["BLOCK_M"]),), n, K, table.shape[1],
                (logits[r0:], uncond[r0:], lse[r0:], p_buf, n, K, guidance), dot, GUIDED=guided)
        if out.dtype == p_dtype:
            torch.mm(p_buf[:n], table_p, out=out[r0:r0 + n])
        else:
            out[r0:r0 + n] = _mm_float32(p_buf[:n], table_p)


def _chunked_backward(grad_out, lse, logits, table, delta, need_logits, need_table, dot):
    """Both products through cuBLAS, the softmax part in one Triton pass per chunk of rows.

    Triton issues the backward's two products at ~200 TFLOP/s on an H200 where cuBLAS reaches ~460
    (module docstring), so this variant gives them to cuBLAS, chunk by chunk: dP = dY_c·tableᵀ
    (float32), the ``chunk`` kernel (reads the logits once, writes dlogits once and P), then
    dtable += P_cᵀ·dY_c. P and dP exist for one chunk only (``chunk_rows``: sized to stay in L2),
    and the same two buffers serve every chunk, so they are rewritten in L2 rather than streamed to
    memory; the saved activations are still only the log-sum-exp. The chunks run in order and
    cuBLAS products are deterministic, so the table gradient is too.
    """
    N, K = logits.shape
    D = table.shape[1]
    dev = logits.device
    p_dtype = _TORCH_DTYPE[dot]  # the GEMM operand dtype: 16-bit on a GPU when the inputs are
    dy, table_t = grad_out.to(p_dtype), table.to(p_dtype).t()
    rows = chunk_rows(N, K, p_dtype.itemsize)
    grad_logits = torch.empty_like(logits) if need_logits else None
    dst = torch.zeros((K, D), device=dev, dtype=torch.float32) if need_table else None
    p_buf = torch.empty((rows, K), device=dev, dtype=p_dtype) if need_table else None
    dp_buf = torch.empty((rows, K), device=dev, dtype=torch.float32) if need_logits else None
    for r0 in range(0, N, rows):
        n = min(rows, N - r0)
        dy_c = dy[r0:r0 + n]
        if need_logits:
            _mm_float32(dy_c, table_t, out=dp_buf[:n])
        # unused pointers get a live tensor of the right kind; the constexpr switches never touch them
        _launch("chunk", lambda meta, n=n: (triton.cdiv(n, meta["BLOCK_M"]), triton.cdiv(K, meta["BLOCK_K"])),
                n, K, D, (logits[r0:], lse[r0:], delta[r0:] if need_logits else lse,
                          dp_buf if need_logits else lse, grad_logits[r0:] if need_logits else logits,
                          p_buf if need_table else logits, n, K),
                dot, WRITE_GRAD=need_logits, WRITE_P=need_table)
        if need_table:
            dst += _mm_float32(p_buf[:n].t(), dy_c)
    return grad_logits, (dst.to(table.dtype) if need_table else None)


__all__ = ["forward", "forward_variant", "backward", "backward_variant", "delta_variant", "interpreted"]
