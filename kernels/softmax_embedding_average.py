"""Triton implementation of Ψ̂ = softmax(logits) @ table (docs/method.md eq. 9: training and sampling).

``softmax(logits) @ table`` is attention with precomputed scores, so it is computed the way
FlashAttention computes attention: the forward streams K in tiles with an online softmax
(running max and sum) and ``tl.dot`` against table tiles, so the (N, K) probabilities never
exist in memory; it saves only the per-row log-sum-exp. The backward recomputes P from it:

    dlogits = P ∘ (dY·tableᵀ − delta),  delta = rowsum(dY ∘ Y)  (minus dLSE when LSE has a gradient)
    dtable  = Pᵀ·dY

This module is the op as launched: which variant runs (each has an environment variable, read per
call), the launches, and the parts given to cuBLAS. The kernels are in ``_sea_forward.py``,
``_sea_backward.py`` and ``_sea_chunked.py``; README.md in this folder has every variant and the
GPU measurements that made the defaults: for 16-bit inputs the "first-tile" fixed-max forward and
the "mm" backward (cuBLAS computes Pᵀ·dY) with the "rows" dlogits kernel; for float32 the one-pass
("fused") forward and the "split" backward with the "tiles" dlogits kernel.

Shapes: logits (N, K), table (K, D), out (N, D), lse (N,). Math is float32 throughout.
Under TRITON_INTERPRET=1 (the CPU tests) the interpreter keeps bfloat16 as raw 16-bit
patterns, so every tile is converted to float32 right after loading and DOT_DTYPE, the
``tl.dot`` operand dtype, is float32 there; on a GPU it is the inputs' 16-bit dtype so that
bf16/fp16 run on tensor cores (fp32 inputs use tf32x3, which keeps fp32 accuracy).
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import os
from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from ._launch import (SPLIT_ALIGN, Tuned, blocks, chunk_rows, dot_dtype, fixed_max_fits, fused_fits, fused_splits,
                      interpreted, mm_rows, rows_fit, splits)
from ._sea_backward import (_delta_kernel, _fused_backward_kernel, _grad_logits_kernel, _grad_logits_rows_kernel,
                            _grad_table_kernel)
from ._sea_chunked import _chunk_kernel, _chunk_probs_kernel
from ._sea_forward import _forward_fixed_max_kernel, _forward_kernel, max_gap


_TUNED = {
    "forward": Tuned(_forward_kernel, "forward", variants=("GUIDED",)),
    "forward_fixed_max": Tuned(_forward_fixed_max_kernel, "forward_fixed_max", variants=("GUIDED",)),
    "grad_logits": Tuned(_grad_logits_kernel, "grad_logits", variants=("STORE_P",)),
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
FORWARD_VARIANTS = ("auto", "fused", "first-tile", "chunked")


def _choice(variant: Optional[str], env: str, choices: tuple, default: str) -> str:
    """``variant``, else $``env``, else ``default``, checked against ``choices``; the environment is read
    per call so that a benchmark can switch variants between calls."""
    variant = variant or os.environ.get(env) or default
    if variant not in choices:
        raise ValueError(f"{env} must be one of {', '.join(choices)}, got {variant!r}")
    return variant


def sixteen_bit(*tensors: torch.Tensor) -> bool:
    """Whether the inputs promote to bfloat16 or float16: what the "auto" variants choose by. A GPU's
    ``tl.dot`` operands are then 16-bit too (``dot_dtype``); choosing by the inputs rather than by the
    operands, which the interpreter makes float32, lets the CPU tests run what a GPU runs for bf16."""
    promoted = tensors[0].dtype
    for t in tensors[1:]:
        promoted = torch.promote_types(promoted, t.dtype)
    return promoted in (torch.bfloat16, torch.float16)


def forward_variant(variant: Optional[str] = None, is_16_bit: Optional[bool] = None) -> str:
    """``variant``, else $VQLCMD_TRITON_FORWARD, else "auto", which resolves by ``is_16_bit`` (``sixteen_bit``
    of the inputs, when given): "first-tile" for 16-bit inputs, "fused" for float32.

    "first-tile" runs ``_forward_fixed_max_kernel``, whose products need no online rescaling: it
    takes the first K tile's max and sweeps again only for rows whose logits spread further than
    ``max_gap``. On an H200 (N = 32768, K = 1024, D = 256, bf16; benchmarks/results/h200-2026-11-28.jsonl)
    it took 0.0579 ms against 0.0662 for the one-pass "fused" kernel (0.205 against 0.215 fwd+bwd).
    float32 stays with "fused": Triton 3.6 failed to compile the fixed-max kernel with float32
    operands there (a TritonGPUOptimizeThreadLocality pass error on its tf32x3 products;
    h200-2026-11-28-gpu-tests.txt), so ``forward`` runs "fused" for them whatever is asked
    (``fixed_max_fits``).
    """
    variant = _choice(variant, FORWARD_ENV, FORWARD_VARIANTS, "auto")
    if variant == "auto" and is_16_bit is not None:
        variant = "first-tile" if is_16_bit else "fused"
    return variant


def on_tensor_device(fn):
    """Runs ``fn`` with its first tensor's GPU as the current device. Triton launches on the current device,
    not the tensors' (triton-lang/triton#2441): on a machine of several GPUs, tensors on cuda:1 with
    cuda:0 current stopped with "Pointer argument cannot be accessed from Triton", or, with peer access
    on, ran on cuda:0's stream unordered against cuda:1's work. The compiled kernels' CUDAGuard does the
    same for them."""
    first = next(iter(inspect.signature(fn).parameters))

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        x = args[0] if args else kwargs[first]  # (by keyword too: logits=..., grad_out=...)
        guard = torch.cuda.device(x.device) if x.device.type == "cuda" else contextlib.nullcontext()
        with guard:
            return fn(*args, **kwargs)
    return wrapped


@on_tensor_device
def forward(logits: torch.Tensor, table: torch.Tensor, uncond: Optional[torch.Tensor] = None,
            guidance: float = 0.0, *, variant: Optional[str] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits (N, K), table (K, D) [, uncond (N, K), ω] -> out (N, D) in the promoted dtype, lse (N,) float32.

    ``variant`` (default $VQLCMD_TRITON_FORWARD, else "auto": "first-tile" for 16-bit inputs, "fused"
    for float32): "fused", the one-pass FlashAttention-style kernel, "first-tile": the product
    against the first K tile's max without online rescaling (a second sweep only where it falls
    short; float32 operands on a GPU take "fused" instead, ``forward_variant``), or "chunked": the
    softmax of a chunk of rows in Triton and P_c·table through cuBLAS.
    """
    N, K = logits.shape
    D = table.shape[1]
    out_dtype = torch.promote_types(logits.dtype, table.dtype)
    if uncond is not None:
        out_dtype = torch.promote_types(out_dtype, uncond.dtype)
    out = torch.empty((N, D), device=logits.device, dtype=out_dtype)
    lse = torch.empty((N,), device=logits.device, dtype=torch.float32)
    variant = forward_variant(variant, sixteen_bit(logits, table))
    if N == 0:
        return out, lse
    guided = uncond is not None
    logits, table = logits.contiguous(), table.contiguous()
    uncond = uncond.contiguous() if guided else logits  # unread when not guided
    dot = dot_dtype(logits, table)
    if variant == "first-tile" and not fixed_max_fits(dot):
        variant = "fused"
    if variant == "chunked":
        _chunked_forward(logits, uncond, table, float(guidance), guided, out, lse, dot)
    else:
        grid = lambda meta: (triton.cdiv(N, meta["BLOCK_M"]), triton.cdiv(D, meta["BLOCK_D"]))  # noqa: E731
        args = (logits, uncond, table, out, lse, N, K, D, float(guidance))
        if variant == "fused":
            _launch("forward", grid, N, K, D, args, dot, GUIDED=guided)
        else:
            _launch("forward_fixed_max", grid, N, K, D, args, dot, GUIDED=guided, MAX_GAP=max_gap(dot))
    return out, lse


BACKWARD_ENV = "VQLCMD_TRITON_BACKWARD"
BACKWARD_VARIANTS = ("auto", "fused", "split", "chunked", "mm")


def backward_variant(variant: Optional[str] = None, is_16_bit: Optional[bool] = None) -> str:
    """``variant``, else $VQLCMD_TRITON_BACKWARD, else "auto".

    "auto" resolves by ``is_16_bit`` (``sixteen_bit`` of the inputs, when given): "mm" for 16-bit inputs
    (the fastest on an H100, README.md), "split" for float32 (cuBLAS would run Pᵀ·dY as an SGEMM).
    """
    variant = _choice(variant, BACKWARD_ENV, BACKWARD_VARIANTS, "auto")
    if variant == "auto" and is_16_bit is not None:
        variant = "mm" if is_16_bit else "split"
    return variant


DLOGITS_ENV = "VQLCMD_TRITON_DLOGITS"
DLOGITS_VARIANTS = ("auto", "tiles", "rows")


def dlogits_variant(variant: Optional[str] = None, is_16_bit: Optional[bool] = None) -> str:
    """``variant``, else $VQLCMD_TRITON_DLOGITS, else "auto", which resolves by ``is_16_bit`` (``sixteen_bit``
    of the inputs, when given): "rows" for 16-bit inputs, "tiles" for float32.

    Which kernel computes dlogits in the split and mm backwards: "tiles", one (rows, classes) tile per
    program (``_grad_logits_kernel``), or "rows", a block of whole rows per program sweeping all
    classes with its dY on chip (``_grad_logits_rows_kernel``; it sums delta itself, so no delta
    kernel runs). On an H200 (N = 32768, K = 1024, D = 256, bf16, mm backward) fwd+bwd took 0.205 ms
    with "rows" against 0.215 with "tiles" (benchmarks/results/h200-2026-11-28.jsonl). "rows" needs
    D <= 256, and on a GPU 16-bit operands (``rows_fit``: it has no float32 configurations);
    elsewhere the tiles run, whatever is asked.
    """
    variant = _choice(variant, DLOGITS_ENV, DLOGITS_VARIANTS, "auto")
    if variant == "auto" and is_16_bit is not None:
        variant = "rows" if is_16_bit else "tiles"
    return variant


@on_tensor_device
def backward(grad_out: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, logits: torch.Tensor,
             table: torch.Tensor, grad_lse: Optional[torch.Tensor] = None, *, need_logits: bool = True,
             need_table: bool = True, deterministic: bool = False,
             variant: Optional[str] = None) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """Gradients of ``forward`` w.r.t. logits (N, K) and table (K, D), in their dtypes (None if not needed).

    ``variant`` (default $VQLCMD_TRITON_BACKWARD, else "auto": "mm" for 16-bit inputs, "split" for
    float32) picks the fused kernel, the split ones, the chunked products or "mm"; the split and mm
    backwards take their dlogits kernel from ``dlogits_variant``. "fused" applies
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
    is_16_bit = sixteen_bit(logits, table)
    variant = backward_variant(variant, is_16_bit)
    fused = variant == "fused" and need_logits and need_table and fused_fits(D, dot)
    grad_lse = grad_lse.contiguous() if grad_lse is not None else None
    # the rows dlogits kernel sums its own delta; the other backwards read it from the delta kernel
    rows_kernel = dlogits_variant(None, is_16_bit) == "rows" and variant in ("split", "mm") and rows_fit(D, dot)
    delta = None
    if N and need_logits and not rows_kernel:
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
    is None, its own sum of rowsum(dY ∘ out) − grad_lse (the rows kernel)."""
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
    if rows_kernel:
        _launch("grad_logits_rows", lambda meta: (triton.cdiv(N, meta["BLOCK_M"]),), N, K, D,
                (logits, table, grad_out, dl.out, lse if dl.grad_lse is None else dl.grad_lse, lse, grad_logits,
                 logits if p is None else p, N, K, D), dot,
                STORE_P=p is not None, HAS_GRAD_LSE=dl.grad_lse is not None)
        return
    _launch("grad_logits", lambda meta: (triton.cdiv(N, meta["BLOCK_M"]), triton.cdiv(K, meta["BLOCK_K"])),
            N, K, D, (logits, table, grad_out, lse, dl.values, grad_logits, logits if p is None else p, N, K, D), dot,
            STORE_P=p is not None)


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
    (README.md), so this variant gives them to cuBLAS, chunk by chunk: dP = dY_c·tableᵀ
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


__all__ = ["forward", "forward_variant", "backward", "backward_variant", "dlogits_variant", "sixteen_bit",
           "interpreted"]
