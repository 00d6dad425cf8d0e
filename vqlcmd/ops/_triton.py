"""The ``triton`` backend: kernels from ``vqlcmd.kernels`` (top-level folder kernels/)."""
from __future__ import annotations

import os
from typing import Optional

import torch

try:
    import triton  # noqa: F401

    _IMPORT_ERROR: Optional[str] = None
except ImportError as exc:
    _IMPORT_ERROR = f"triton is not installed ({exc})"


def unavailable() -> Optional[str]:
    return _IMPORT_ERROR


def unsupported_device(*tensors: torch.Tensor) -> Optional[str]:
    """Triton runs CUDA tensors, or CPU tensors under TRITON_INTERPRET=1."""
    device = tensors[0].device
    if device.type == "cuda":
        return None
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1":
        return None
    return f"triton needs CUDA tensors (or TRITON_INTERPRET=1 for CPU tensors), got device {device}"
