"""Training engine. A newcomer's path through one run, in the order it happens:

1. ``config``      the experiment file's ``vqlcmd`` section as dataclasses (the whole schema, standard library
                   only); ``config_file.load_config`` reads a file into them, ``ds_config`` checks DeepSpeed's
                   keys and derives batch sizes and precision for the world size.
2. ``build``       the data, the method's network and its EMAs (``vqlcmd.methods`` says which), DeepSpeed.
3. ``step``        one training step (``TrainStep``): micro-steps, DeepSpeed's optimizer step, both EMAs, with
                   one flush policy for the host reads (every micro-step, or deferred with ``train.fast``).
4. ``checkpoint``  ``CheckpointManager``: what a resume must match, save, load, the settings a resume changed.

``trainer.Trainer`` strings them together: build, then loop step -> maybe log / save / preview.
"""
import importlib

from .config import ConfigError, VQLCMDConfig

# loaded on first use: the package's lower layers import their names from .config, which runs this file
# first, and config_file imports those layers
_LAZY = {name: ".config_file" for name in ("load_config", "parse_vqlcmd_section", "resolve_config_path")}

__all__ = ["ConfigError", "VQLCMDConfig", *_LAZY]


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_LAZY[name], __name__), name)
