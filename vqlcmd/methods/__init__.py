"""Training methods, registered by name: VQ-LCMD and the paper's baselines in one engine.

A method says what ``vqlcmd.method: NAME`` trains and exports: the config switches it forces, the network
it builds, its loss, its pipeline class, and the config keys a resume must match (``registry.Method``). The
engine asks the registry (``get_method(cfg.method)``) and branches on no method name itself. One file per
method; importing this package registers them all, in the order users see in errors and docs.
"""
from . import vqlcmd as _vqlcmd  # noqa: F401  (first: the default)
from . import maskgit as _maskgit  # noqa: F401
from . import csdm as _csdm  # noqa: F401
from .registry import Method, apply_method, build_network, get_method, method_names, register

METHODS = method_names()

__all__ = ["METHODS", "Method", "apply_method", "build_network", "get_method", "method_names", "register"]
