"""VQ-LCMD: latent consistency-matching diffusion over vector-quantized image tokens.

The names below load on first use, so that ``import vqlcmd`` does not import torch: the commands
(``vqlcmd.cli``) set OpenMP's wait policy before torch loads it (see ``vqlcmd/threads.py``), and a console
entry point imports this package before its own module.
"""
import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "ops": None,  # a sub-package
    "LossConfig": ".diffusion", "training_losses": ".diffusion",
    "EMA": ".ema",
    "TokenEmbedding": ".embedding", "collapse_indicator": ".embedding",
    "Denoiser": ".model", "DenoiserConfig": ".model", "build_denoiser": ".model", "preset_config": ".model",
    "VQLCMDNetwork": ".network",
    "VQLCMDPipeline": ".pipeline",
    "MaskGITPipeline": ".baselines",
    "sample_tokens": ".samplers",
    "ShiftedCosineSchedule": ".schedule",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module = _EXPORTS[name]
    if module is None:
        return importlib.import_module(f".{name}", __name__)
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
