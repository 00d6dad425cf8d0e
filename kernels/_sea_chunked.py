"""Triton kernels of the "chunked" variants of ``softmax_embedding_average``: the softmax parts of a
chunk of rows, with the products left to cuBLAS (``_chunked_forward`` / ``_chunked_backward`` there).
"""
from __future__ import annotations

import triton
import triton.language as tl

from ._sea_forward import _online_softmax_step, _score_tile


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
        s = _score_tile(logits_ptr, uncond_ptr, row_off, ks, ks < K, guidance, GUIDED)
        m_i, _, _, l_i = _online_softmax_step(m_i, l_i, s)
    lse = m_i + tl.log(l_i)
    tl.store(lse_ptr + rows, lse, mask=row_in)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_in = ks < K
        p = tl.exp(_score_tile(logits_ptr, uncond_ptr, row_off, ks, k_in, guidance, GUIDED) - lse[:, None])
        tl.store(p_ptr + rows.to(tl.int64)[:, None] * K + ks[None, :], p.to(DOT_DTYPE),
                 mask=row_in[:, None] & k_in[None, :])
