"""Triton forward kernels of ``softmax_embedding_average``: Ψ̂ = softmax(logits) @ table, log-sum-exp.

The one-pass kernel (``_forward_kernel``) streams K in tiles with an online softmax, as
FlashAttention does; the fixed-max kernel (``_forward_fixed_max_kernel``) takes a per-row reference
in place of the running max so that its accumulator is never rescaled. ``softmax_embedding_average``
launches them; README.md in this folder has the measurements behind each.
"""
from __future__ import annotations

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)  # exp(x) = exp2(x · log2 e)


@triton.jit
def _score_tile(logits_ptr, uncond_ptr, row_off, ks, k_in, guidance, GUIDED: tl.constexpr):
    """The float32 scores of a (rows, BLOCK_K) tile, -inf past K."""
    s = tl.load(logits_ptr + row_off[:, None] + ks[None, :], mask=k_in[None, :], other=0.0).to(tl.float32)
    keep = k_in[None, :]
    if GUIDED:
        # (1+ω) log P(·|y) − ω log P(·|∅) differs from (1+ω) c − ω u by a per-row constant,
        # which the renormalising softmax removes (docs/method.md eq. 17).
        u = tl.load(uncond_ptr + row_off[:, None] + ks[None, :], mask=k_in[None, :], other=0.0)
        # A class cond rules out (-inf) stays out: c + ω (c − u) is NaN there (at ω = 0 too, and wherever u
        # is -inf as well), so that ω = 0 is the plain op. One select with the K mask: a second one spilled.
        keep = keep & (s != float("-inf"))
        s = s + guidance * (s - u.to(tl.float32))  # c − u first: exact where c and u share an offset
    return tl.where(keep, s, float("-inf"))


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
        s = _score_tile(logits_ptr, uncond_ptr, row_off, ks, k_in, guidance, GUIDED)
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
                     BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr):
    """One sweep over K with a fixed per-row reference m_ref in place of the running max:
    P = exp2(s·log2e − m_ref·log2e), so the accumulator only feeds the products and is never
    rescaled. Returns (the row maxima seen, updated when TRACK, the sum of P, P·table)."""
    m2 = m_ref * LOG2E
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_in = (ks < K) | EVEN_K
        s = _score_tile(logits_ptr, uncond_ptr, row_off, ks, k_in, guidance, GUIDED)
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
    GUIDED: tl.constexpr, DOT_DTYPE: tl.constexpr, MAX_GAP: tl.constexpr,
    EVEN_K: tl.constexpr, EVEN_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # The one-pass kernel rescales its (BLOCK_M, BLOCK_D) accumulator by exp(m_old − m_new) after
    # every K tile; that read of the accumulator makes the compiler wait for each product before the
    # next tile's softmax (sm_90 SASS: WARPGROUP.DEPBAR gsb0 0x0), and the rescale is a third of the
    # loop's instructions. Any per-row reference m with every s − m below MAX_GAP gives the same
    # softmax without rescaling (exp(s − m) stays finite, and l, P·table are scaled alike), and the
    # products stay in flight while the next tile's exponentials run. m is the first K tile's max
    # ("first-tile"), and the sweep tracks the true max as it goes; only if some row's max passes its
    # reference by MAX_GAP (trained logits rarely spread that far beyond their first 32-128 classes)
    # does the program sweep again from the true maxima. (Finding each row's max in a first sweep
    # instead, "two-pass", read the logits twice and lost on an H200: README.md.)
    rows, row_off, cols, d_in = _forward_block(N, K, D, EVEN_D, BLOCK_M, BLOCK_D)
    m_seen = tl.full([BLOCK_M], float("-inf"), tl.float32)
    ks = tl.arange(0, BLOCK_K)
    k_in = (ks < K) | EVEN_K
    s = _score_tile(logits_ptr, uncond_ptr, row_off, ks, k_in, guidance, GUIDED)
    m_ref = _finite_reference(tl.max(s, 1))
    m_seen, l_i, acc = _fixed_max_sweep(logits_ptr, uncond_ptr, table_ptr, row_off, cols, d_in, K, D, guidance,
                                        m_ref, m_seen, GUIDED, DOT_DTYPE, EVEN_K, True, BLOCK_M, BLOCK_K, BLOCK_D)
    # also sweep again where the reference sits far above the row (a first tile of -inf logits took 0)
    gap = tl.where(m_seen == float("-inf"), 0.0, tl.abs(m_seen - m_ref))
    if tl.max(gap, 0) > MAX_GAP:  # exp(s − m_ref) may have overflowed: sweep from the maxima
        m_ref = _finite_reference(m_seen)
        m_seen, l_i, acc = _fixed_max_sweep(logits_ptr, uncond_ptr, table_ptr, row_off, cols, d_in, K, D,
                                            guidance, m_ref, m_seen, GUIDED, DOT_DTYPE, EVEN_K, False,
                                            BLOCK_M, BLOCK_K, BLOCK_D)
    _store_average(out_ptr, lse_ptr, acc, l_i, m_ref, rows, cols, d_in, N, D)


def max_gap(dot) -> float:
    """How far (in logits) the fixed-max forward lets a row's max pass its reference: exp(gap) must stay
    finite in the ``tl.dot`` operand dtype and leave the float32 sums room (K · e^40 · |table| for
    bf16 and float32 operands; float16 stops at 65504, so e^10)."""
    return 10.0 if dot == tl.float16 else 40.0
