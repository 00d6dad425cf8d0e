"""The ``compiled`` backend: ``torch.ops.vqlcmd.*`` from the extension ``vqlcmd._C`` (csrc/)."""
from __future__ import annotations

from typing import Optional

_IMPORT_ERROR: Optional[str] = None
try:
    from vqlcmd import _C  # noqa: F401
except ImportError as exc:  # not built: only the reference backend serves
    _IMPORT_ERROR = f"the C++/CUDA extension vqlcmd._C is not built ({exc}); run `pip install --no-build-isolation -e .`"


def unavailable() -> Optional[str]:
    return _IMPORT_ERROR
