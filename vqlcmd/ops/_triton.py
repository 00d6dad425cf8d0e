"""The ``triton`` backend: kernels from ``vqlcmd.kernels`` (top-level folder kernels/).

The kernels are wrapped as ``torch.library`` custom ops (namespace ``vqlcmd_triton``) with fake
impls and autograd, so ``torch.compile`` treats them as opaque nodes and ``opcheck`` can test them.
``auto`` picks this backend for CUDA tensors only; CPU tensors run in Triton's interpreter, which
is for tests, so there the backend must be asked for by name (and TRITON_INTERPRET=1 must be set
before the kernels are first imported). dtable's cross-block sum uses atomics unless
``torch.use_deterministic_algorithms(True)`` is on, which selects a fixed-order sum.
"""
from __future__ import annotations

import os
import sys
from typing import Optional

import torch
from torch.autograd.function import once_differentiable

from ._dispatch import register

try:
    import triton  # noqa: F401

    _IMPORT_ERROR: Optional[str] = None
except ImportError as exc:
    _IMPORT_ERROR = f"triton is not installed ({exc})"

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def unavailable() -> Optional[str]:
    return _IMPORT_ERROR


def unsupported_device(*tensors: torch.Tensor) -> Optional[str]:
    """Triton runs CUDA tensors, or CPU tensors under TRITON_INTERPRET=1."""
    device = tensors[0].device
    if device.type == "cuda":
        return None
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1":
        loaded = sys.modules.get("vqlcmd.kernels._launch")
        if loaded is not None and not loaded.interpreted:
            return ("the Triton kernels were imported before TRITON_INTERPRET=1 was set, so they are "
                    "compiled for a GPU; set it before the first use of the triton backend")
        return None
    return f"triton needs CUDA tensors (or TRITON_INTERPRET=1 for CPU tensors), got device {device}"


def unsupported_average(logits: torch.Tensor, table: torch.Tensor) -> Optional[str]:
    reason = unsupported_device(logits, table)
    if reason is not None:
        return reason
    for name, t in (("logits", logits), ("table", table)):
        if t.dtype not in _DTYPES:
            return f"the triton kernels take float32, bfloat16 or float16 {name}, got {t.dtype}"
    if logits.shape[-1] == 0 or table.shape[1] == 0:
        return f"empty class or embedding dimension (K={logits.shape[-1]}, D={table.shape[1]})"
    return None


def _kernels():
    from vqlcmd.kernels import guided_embedding_average, softmax_embedding_average

    return softmax_embedding_average, guided_embedding_average


# ---- softmax_embedding_average: forward op returns (out, lse); lse is what the backward keeps ----

@torch.library.custom_op("vqlcmd_triton::softmax_embedding_average", mutates_args=())
def _average_forward(logits: torch.Tensor, table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    K = logits.shape[-1]
    out, lse = _kernels()[0].forward(logits.reshape(-1, K), table)
    return out.view(*logits.shape[:-1], table.shape[1]), lse.view(logits.shape[:-1])


@_average_forward.register_fake
def _(logits, table):
    out_dtype = torch.promote_types(logits.dtype, table.dtype)
    out = logits.new_empty((*logits.shape[:-1], table.shape[1]), dtype=out_dtype)
    return out, logits.new_empty(logits.shape[:-1], dtype=torch.float32)


@torch.library.custom_op("vqlcmd_triton::softmax_embedding_average_backward", mutates_args=())
def _average_backward(grad_out: torch.Tensor, grad_lse: Optional[torch.Tensor], out: torch.Tensor,
                      lse: torch.Tensor, logits: torch.Tensor, table: torch.Tensor, need_logits: bool,
                      need_table: bool, deterministic: bool) -> tuple[torch.Tensor, torch.Tensor]:
    K, D = table.shape
    grad_logits, grad_table = _kernels()[0].backward(
        grad_out.reshape(-1, D), out.reshape(-1, D), lse.reshape(-1), logits.reshape(-1, K), table,
        None if grad_lse is None else grad_lse.reshape(-1),
        need_logits=need_logits, need_table=need_table, deterministic=deterministic)
    # an op must return tensors: unneeded gradients come back empty and are dropped by _backward
    grad_logits = grad_logits.view(logits.shape) if need_logits else logits.new_empty(0)
    grad_table = grad_table if need_table else table.new_empty(0)
    return grad_logits, grad_table


@_average_backward.register_fake
def _(grad_out, grad_lse, out, lse, logits, table, need_logits, need_table, deterministic):
    return (logits.new_empty(logits.shape) if need_logits else logits.new_empty(0),
            table.new_empty(table.shape) if need_table else table.new_empty(0))


def _setup_context(ctx, inputs, output):
    logits, table = inputs
    out, lse = output
    ctx.save_for_backward(logits, table, out, lse)


def _backward(ctx, grad_out, grad_lse):
    logits, table, out, lse = ctx.saved_tensors
    need_logits, need_table = ctx.needs_input_grad
    if grad_out is None:  # only lse was used (not by the public op, which returns out)
        grad_out = torch.zeros_like(out)
    grad_logits, grad_table = torch.ops.vqlcmd_triton.softmax_embedding_average_backward(
        grad_out, grad_lse, out, lse, logits, table, need_logits, need_table,
        torch.are_deterministic_algorithms_enabled())
    return (grad_logits if need_logits else None), (grad_table if need_table else None)


_average_forward.register_autograd(_backward, setup_context=_setup_context)


class _EagerAverage(torch.autograd.Function):
    """The same kernels as the custom op, for eager mode.

    A ``torch.library.custom_op`` call goes through the Python dispatcher (tens of microseconds
    per call, forward and backward each), which on a GPU costs more than the kernels themselves at
    the sizes sampling and small models use; outside ``torch.compile`` nothing needs the op's
    opacity, so eager calls take this thinner path.
    """

    @staticmethod
    def forward(ctx, logits, table):
        K = logits.shape[-1]
        out, lse = _kernels()[0].forward(logits.reshape(-1, K), table)
        ctx.save_for_backward(logits, table, out, lse)
        return out.view(*logits.shape[:-1], table.shape[1])

    @staticmethod
    @once_differentiable  # no second derivative: create_graph=True used to take the kernels as constants
    def backward(ctx, grad_out):
        logits, table, out, lse = ctx.saved_tensors
        need_logits, need_table = ctx.needs_input_grad
        K, D = table.shape
        grad_logits, grad_table = _kernels()[0].backward(
            grad_out.reshape(-1, D), out, lse, logits.reshape(-1, K), table, None, need_logits=need_logits,
            need_table=need_table, deterministic=torch.are_deterministic_algorithms_enabled())
        return (grad_logits.view(logits.shape) if need_logits else None), grad_table


def softmax_embedding_average(logits: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    if torch.compiler.is_compiling():
        return _average_forward(logits, table)[0]
    return _EagerAverage.apply(logits, table)


# ---- guided_embedding_average (samplers; no gradient) ----------------------------------------

def _guided_impl(cond_logits: torch.Tensor, uncond_logits: torch.Tensor, table: torch.Tensor,
                 guidance_scale: float) -> torch.Tensor:
    K = cond_logits.shape[-1]
    out = _kernels()[1].guided_embedding_average(cond_logits.reshape(-1, K), uncond_logits.reshape(-1, K),
                                                 table, guidance_scale)
    return out.view(*cond_logits.shape[:-1], table.shape[1])


_guided = torch.library.custom_op("vqlcmd_triton::guided_embedding_average", _guided_impl, mutates_args=())


@_guided.register_fake
def _(cond_logits, uncond_logits, table, guidance_scale):
    out_dtype = torch.promote_types(cond_logits.dtype, table.dtype)
    return cond_logits.new_empty((*cond_logits.shape[:-1], table.shape[1]), dtype=out_dtype)


def guided_embedding_average(cond_logits, uncond_logits, table, guidance_scale: float) -> torch.Tensor:
    if torch.compiler.is_compiling():
        return _guided(cond_logits, uncond_logits, table, float(guidance_scale))
    return _guided_impl(cond_logits, uncond_logits, table, float(guidance_scale))  # eager: see _EagerAverage


def _unsupported_guided(cond_logits: torch.Tensor, table: torch.Tensor) -> Optional[str]:
    return unsupported_average(cond_logits, table)


def _priority(device: torch.device) -> int:
    # above reference (-1) on CUDA; below it elsewhere, so auto never picks the interpreter
    return 10 if device.type == "cuda" else -10


def _average_priority(device: torch.device) -> int:
    """Inside torch.compile, below the reference op on CUDA too: inductor then compiles the reference's
    softmax and matmul, which the last GPU run measured faster than these kernels with a gradient at the
    goal size (N=32768 K=1024 D=256 bf16, fwd+bwd: torch.compile of the eager op 0.180 ms, the best Triton
    kernels 0.205, eager 0.269; benchmarks/results/h200-2026-11-28.jsonl). Outside torch.compile the
    kernels beat the eager reference and stay first. Forward-only, the guided sampling step, Triton wins
    (0.0808 ms against compile's 0.109), so ``guided_embedding_average`` keeps ``_priority`` there.
    (scripts/gpu_check.sh times both again on each lease.)"""
    if torch.compiler.is_compiling():
        return -5
    return _priority(device)


register("softmax_embedding_average", "triton", softmax_embedding_average, unavailable=unavailable,
         unsupported=unsupported_average, priority=_average_priority)
register("guided_embedding_average", "triton", guided_embedding_average, unavailable=unavailable,
         unsupported=_unsupported_guided, priority=_priority)
