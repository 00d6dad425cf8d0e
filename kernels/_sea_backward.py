"""Triton backward kernels of ``softmax_embedding_average``.

    dlogits = P ∘ (dY·tableᵀ − delta),  delta = rowsum(dY ∘ Y)  (minus dLSE when LSE has a gradient)
    dtable  = Pᵀ·dY, summed over row splits (atomics, or per-split partials when deterministic)

with P = exp(logits − lse) recomputed from the forward's log-sum-exp. The delta kernel, the split
dlogits kernels (a tile per program, or a block of whole rows), the dtable kernel and the fused
FlashAttention-2-style kernel; ``softmax_embedding_average.backward`` picks among them.
"""
from __future__ import annotations

import triton
import triton.language as tl

from ._sea_forward import LOG2E


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
    logits_ptr, table_ptr, grad_out_ptr, lse_ptr, delta_ptr, grad_logits_ptr, p_ptr,
    N, K, D,
    STORE_P: tl.constexpr, DOT_DTYPE: tl.constexpr, EVEN_K: tl.constexpr, EVEN_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # STORE_P: also write P (the "mm" backward hands Pᵀ·dY to cuBLAS). delta comes from the delta kernel.
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
    delta = tl.load(delta_ptr + safe_rows)
    dy_t = tl.zeros([BLOCK_M, BLOCK_K], tl.float32)  # dY · tableᵀ for this tile
    for d0 in range(0, D, BLOCK_D):
        ds = d0 + tl.arange(0, BLOCK_D)
        d_in = (ds < D) | EVEN_D
        dy = tl.load(grad_out_ptr + safe_rows[:, None] * D + ds[None, :], mask=d_in[None, :], other=0.0)
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
    # fills and drains its load pipeline around a short product and re-reads its dY block from L2 once
    # per K block. Here the loads of the next K tiles are in flight during this one's product and
    # epilogue, dY is read once, and delta = rowsum(dY ∘ Y) − dLSE is summed once per row block, so no
    # delta kernel runs before it.
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
        tl.store(dst_ptr + pid_s.to(tl.int64) * K * D + offs, acc, mask=mask)


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
        tl.store(dst_ptr + pid_s.to(tl.int64) * K * D + offs, acc, mask=kd_mask)
