"""Backend registry for the fused ops (docs/building.md, "Ops and backends").

Each op has one public function in ``vqlcmd.ops``; each backend registers an
implementation plus two questions it can answer:

- ``unavailable()``: why the backend cannot run at all on this install
  (extension not built, Triton missing), or ``None``;
- ``unsupported(*tensors)``: why it cannot serve these particular inputs
  (wrong device, dtype), or ``None``.

It also says whether it checks its token ids itself (``checks_ids``): the
compiled kernels raise the same IndexError as they read each id, so the public
function skips its own range check (a read-back to the host) for them.

``auto`` walks the backends in priority order and takes the first that can
serve; an explicit backend that cannot serve raises with the reason, as
xformers' dispatcher does.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from ..engine.config import BACKENDS  # the names a config's train.backend takes


@dataclass
class _Impl:
    fn: Callable
    unavailable: Callable[[], Optional[str]]
    unsupported: Callable[..., Optional[str]]
    # higher runs first under backend="auto"; per device type
    priority: Callable[[torch.device], int]
    # raises IndexError on a token id outside the table by itself (vqlcmd.ops then does not check first)
    checks_ids: bool = False


_REGISTRY: dict[str, dict[str, _Impl]] = {}


def _never(*_args) -> Optional[str]:
    return None


def register(
    op: str,
    backend: str,
    fn: Callable,
    *,
    unavailable: Callable[[], Optional[str]] = _never,
    unsupported: Callable[..., Optional[str]] = _never,
    priority: Callable[[torch.device], int] = lambda device: 0,
    checks_ids: bool = False,
) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; expected one of {BACKENDS}")
    _REGISTRY.setdefault(op, {})[backend] = _Impl(fn, unavailable, unsupported, priority, checks_ids)


def _impls(op: str) -> dict[str, _Impl]:
    if op not in _REGISTRY:
        raise ValueError(f"unknown op {op!r}; known ops: {sorted(_REGISTRY)}")
    return _REGISTRY[op]


def available_backends(op: str) -> list[str]:
    """Backends of ``op`` that can run on this install (built and importable)."""
    return [name for name, impl in _impls(op).items() if impl.unavailable() is None]


def why_not(op: str, backend: str, *tensors: torch.Tensor) -> Optional[str]:
    """Why ``backend`` cannot serve ``op`` for these inputs (none given: for any input, on this install), or
    ``None`` if it can."""
    impls = _impls(op)
    if backend not in impls:
        return f"{op} has no {backend!r} backend (it has: {', '.join(impls)})"
    impl = impls[backend]
    reason = impl.unavailable()
    if reason is None and tensors:
        reason = impl.unsupported(*tensors)
    return reason


def resolve_impl(op: str, backend: str, *tensors: torch.Tensor) -> _Impl:
    """The registered implementation of ``op`` to run for ``backend`` on these inputs."""
    impls = _impls(op)
    if backend != "auto":
        if backend not in BACKENDS:
            raise ValueError(f"backend must be 'auto' or one of {BACKENDS}, got {backend!r}")
        reason = why_not(op, backend, *tensors)
        if reason is not None:
            raise RuntimeError(f"{op}: backend {backend!r} cannot serve these inputs: {reason}")
        return impls[backend]
    device = tensors[0].device
    ranked = sorted(impls.items(), key=lambda kv: -kv[1].priority(device))
    for name, impl in ranked:
        if why_not(op, name, *tensors) is None:
            return impl
    raise RuntimeError(f"{op}: no backend can serve these inputs")  # reference always can


def resolve(op: str, backend: str, *tensors: torch.Tensor) -> Callable:
    """The implementation of ``op`` to run for ``backend`` on these inputs."""
    return resolve_impl(op, backend, *tensors).fn
