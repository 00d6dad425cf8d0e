"""Input validation shared by every backend: errors name the argument and the problem."""
from __future__ import annotations

import contextlib
import math
import numbers
import operator
import os
from typing import Sequence

import torch

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def check_float(name: str, x: torch.Tensor, *, min_dim: int = 1) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be a float tensor (float32, bfloat16, float16 or float64), got {x.dtype}")
    if x.dim() < min_dim:
        raise ValueError(f"{name} must have at least {min_dim} dims, got shape {tuple(x.shape)}")


def check_shape(name: str, x: torch.Tensor, shape: Sequence[int]) -> None:
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(x.shape)}")


def check_same_device(**tensors: torch.Tensor) -> None:
    devices = {name: t.device for name, t in tensors.items() if t is not None}
    if len(set(devices.values())) > 1:
        listing = ", ".join(f"{n} on {d}" for n, d in devices.items())
        raise ValueError(f"all inputs must be on one device, got {listing}")


def ids_checked(tokens: torch.Tensor) -> bool:
    """Whether token ids are range-checked here (``check_token_range``, for the backends whose
    kernels do not check each id as they read it: all but the compiled ones). Reading the range back
    syncs a GPU, which a CUDA graph capture forbids and a tuned training loop may not want
    (VQLCMD_CHECK_IDS=0, after the loader has checked the shards); it turns off the compiled CUDA
    kernels' check, whose read-back is the same sync, too. Unchecked ids are still never read out of
    bounds: the compiled kernels write NaN for them (the engine then stops on a non-finite loss, by
    name), and the reference ops' indexing stops with a device-side assert. Under ``torch.compile``
    the read-back is a data-dependent branch the graph cannot hold, so there the kernels' own checks
    (the CPU kernels raise the same error) are the check."""
    if torch.compiler.is_compiling() or _checked_upstream:
        return False
    if tokens.device.type != "cuda":
        return True
    return id_checks_switch() and not torch.cuda.is_current_stream_capturing()


_checked_upstream = False


@contextlib.contextmanager
def checked_upstream():
    """Inside it the ids and class labels are trusted, on every device: the training engine's fast step,
    whose loader opened shards whose id and label ranges were verified, so that a range check's read-back
    (a host sync per op call) is not paid again at every step. It also sets ``VQLCMD_CHECK_IDS`` to 0 for
    its span, the switch the compiled CUDA kernels read at each call for their own check's read-back."""
    global _checked_upstream
    before, env = _checked_upstream, os.environ.get("VQLCMD_CHECK_IDS")
    _checked_upstream = True
    os.environ["VQLCMD_CHECK_IDS"] = "0"
    try:
        yield
    finally:
        _checked_upstream = before
        if env is None:
            del os.environ["VQLCMD_CHECK_IDS"]
        else:
            os.environ["VQLCMD_CHECK_IDS"] = env


def inputs_checked_upstream() -> bool:
    return _checked_upstream


def id_checks_switch() -> bool:
    """``VQLCMD_CHECK_IDS``, read at every call as the CUDA kernels read it: unset or 1/true/yes/on is on,
    0/false/no/off is off (any case); anything else is an error, so a misspelt switch never passes."""
    value = os.environ.get("VQLCMD_CHECK_IDS", "").lower()
    if value in ("", "1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"VQLCMD_CHECK_IDS must be a yes/no value (1/true/yes/on or 0/false/no/off), "
                     f"got {os.environ['VQLCMD_CHECK_IDS']!r}")


def check_tokens(name: str, tokens: torch.Tensor, *, ndim: int = 2) -> None:
    """Token ids: an integer tensor of ``ndim`` dims. Their range is ``check_token_range``'s, called only
    for backends that do not check it themselves: the compiled kernels check each id as they read it
    and raise the same IndexError, so a pass here would only add a read-back (a GPU sync)."""
    if not isinstance(tokens, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tokens).__name__}")
    if tokens.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"{name} must be int64 (or int32) token ids, got {tokens.dtype}")
    if tokens.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims (B, M), got shape {tuple(tokens.shape)}")


def check_token_range(name: str, tokens: torch.Tensor, num_rows: int) -> None:
    """Token ids index a table of ``num_rows`` rows; out-of-range ids are errors, not crashes: an
    IndexError naming an id outside [0, num_rows), where ``ids_checked``."""
    if tokens.numel() and ids_checked(tokens):
        lo, hi = torch.stack(torch.aminmax(tokens)).tolist()  # one read-back for both ends, not two
        if lo < 0 or hi >= num_rows:
            bad = lo if lo < 0 else hi
            raise IndexError(f"{name} holds id {bad}, outside the table's rows [0, {num_rows})")


def check_per_batch(name: str, x: torch.Tensor, batch: int) -> None:
    check_float(name, x)
    check_shape(name, x, (batch,))


def check_logits_pair(first: torch.Tensor, second: torch.Tensor,
                      names: tuple[str, str] = ("teacher_logits", "student_logits")) -> None:
    """Two logit tensors of one shape on one device; ``names``: the caller's names for them."""
    check_float(names[0], first)
    check_float(names[1], second)
    if first.shape != second.shape:
        raise ValueError(f"{names[0]} {tuple(first.shape)} and {names[1]} {tuple(second.shape)} must have one shape")
    check_same_device(**{names[0]: first, names[1]: second})


def check_average_inputs(logits: torch.Tensor, table: torch.Tensor) -> None:
    check_float("logits", logits)
    check_float("table", table, min_dim=2)
    if table.dim() != 2:
        raise ValueError(f"table must be (K, D), got shape {tuple(table.shape)}")
    if logits.shape[-1] != table.shape[0]:
        raise ValueError(
            f"logits have K={logits.shape[-1]} classes in the last dim but table has {table.shape[0]} rows"
        )
    check_same_device(logits=logits, table=table)


def check_noise_inputs(tokens, table, alpha, sigma, noise, drop_mask, mask_index) -> None:
    """Everything but the range of the ids (``check_token_range``)."""
    check_float("table", table, min_dim=2)
    if table.dim() != 2:
        raise ValueError(f"table must be (V, D), got shape {tuple(table.shape)}")
    check_tokens("tokens", tokens)
    B, M = tokens.shape
    check_per_batch("alpha", alpha, B)
    check_per_batch("sigma", sigma, B)
    if noise is not None:
        check_float("noise", noise)
        check_shape("noise", noise, (B, M, table.shape[1]))
    if drop_mask is not None:
        if drop_mask.dtype != torch.bool:
            raise TypeError(f"drop_mask must be bool, got {drop_mask.dtype}")
        check_shape("drop_mask", drop_mask, (B, M))
        if mask_index is None:
            raise ValueError("drop_mask given without mask_index (the table row of the [mask] embedding)")
        if isinstance(mask_index, bool) or not hasattr(mask_index, "__index__"):  # int(2.7) would be row 2
            raise TypeError(f"mask_index must be an integer (a table row), got {mask_index!r}")
        if not 0 <= operator.index(mask_index) < table.shape[0]:
            raise IndexError(f"mask_index {mask_index} outside the table's rows [0, {table.shape[0]})")
    check_same_device(tokens=tokens, table=table, alpha=alpha, sigma=sigma, noise=noise, drop_mask=drop_mask)


def check_ddim_inputs(tokens, table, z_t, alpha_t, sigma_t, alpha_s, sigma_s) -> None:
    """Everything but the range of the ids (``check_token_range``)."""
    check_float("table", table, min_dim=2)
    if table.dim() != 2:
        raise ValueError(f"table must be (V, D), got shape {tuple(table.shape)}")
    check_tokens("tokens", tokens)
    B, M = tokens.shape
    check_float("z_t", z_t)
    check_shape("z_t", z_t, (B, M, table.shape[1]))
    for name, x in (("alpha_t", alpha_t), ("sigma_t", sigma_t), ("alpha_s", alpha_s), ("sigma_s", sigma_s)):
        check_per_batch(name, x, B)
    check_same_device(tokens=tokens, table=table, z_t=z_t, alpha_t=alpha_t, sigma_t=sigma_t,
                      alpha_s=alpha_s, sigma_s=sigma_s)


def check_ada_layer_norm_inputs(h, scale, shift, eps) -> None:
    check_float("h", h)
    if h.dim() != 3:
        raise ValueError(f"h must be (B, M, W), got shape {tuple(h.shape)}")
    B, _, W = h.shape
    for name, x in (("scale", scale), ("shift", shift)):
        check_float(name, x)
        check_shape(name, x, (B, W))
    if not eps > 0:
        raise ValueError(f"eps must be > 0, got {eps}")
    check_same_device(h=h, scale=scale, shift=shift)


def check_attention_inputs(q, k, v) -> None:
    for name, x in (("q", q), ("k", k), ("v", v)):
        check_float(name, x)
    if q.dim() != 4:
        raise ValueError(f"q must be (B, H, M, hd), got shape {tuple(q.shape)}")
    check_shape("k", k, tuple(q.shape))
    check_shape("v", v, tuple(q.shape))
    if not q.dtype == k.dtype == v.dtype:
        raise ValueError(f"q, k, v must have one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    check_same_device(q=q, k=k, v=v)


def check_ema_update_inputs(shadows, source, weights, copies, copy_of) -> None:
    check_float("source", source)
    if not source.is_contiguous():
        raise ValueError("source must be contiguous (a flat buffer)")
    if len(weights) != len(shadows):
        raise ValueError(f"one weight per shadow: got {len(weights)} weights for {len(shadows)} shadows")
    if len(copy_of) != len(copies):
        raise ValueError(f"copy_of must name one shadow per copy: got {len(copy_of)} for {len(copies)} copies")
    for i, (x, w) in enumerate(zip(shadows, weights)):
        check_float(f"shadows[{i}]", x)
        if x.dtype != torch.float32 or not x.is_contiguous() or x.numel() != source.numel():
            raise ValueError(f"shadows[{i}] must be a contiguous float32 tensor of the source's {source.numel()} "
                             f"elements, got {x.dtype} {tuple(x.shape)}")
        if not 0.0 <= w <= 1.0:
            raise ValueError(f"weights[{i}] (1 - decay) must be in [0, 1], got {w}")
    for j, (c, k) in enumerate(zip(copies, copy_of)):
        check_float(f"copies[{j}]", c)
        if not c.is_contiguous() or c.numel() != source.numel():
            raise ValueError(f"copies[{j}] must be contiguous with the source's {source.numel()} elements, got "
                             f"{tuple(c.shape)}")
        if not 0 <= k < len(shadows):
            raise ValueError(f"copy_of[{j}] = {k} names no shadow (there are {len(shadows)})")
    check_same_device(source=source, **{f"shadows[{i}]": x for i, x in enumerate(shadows)},
                      **{f"copies[{j}]": c for j, c in enumerate(copies)})


def checked_guidance(value) -> float:
    """ω as a float, for the guided op and the samplers alike: a real number (numpy scalars and one-element
    tensors too), finite and >= 0. A negative ω would silently mean no guidance (guided = ω > 0), a NaN or
    infinite one an all-NaN average."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        raise TypeError(f"guidance_scale must be a real number, got {type(value).__name__}")
    value = float(value)
    if not (value >= 0 and math.isfinite(value)):  # "not >= 0" also refuses NaN
        raise ValueError(f"guidance_scale must be a finite number >= 0 (0: no guidance), got {value}")
    return value

