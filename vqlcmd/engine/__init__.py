"""Training engine. A newcomer's path through one run, in the order it happens:

1. ``config``      the experiment file: DeepSpeed's keys plus the ``vqlcmd`` section, parsed into dataclasses
                   (``load_config``); ``ds_config`` derives batch sizes and precision for the world size.
2. ``build``       the data, the method's network and its EMAs (``vqlcmd.methods`` says which), DeepSpeed.
3. ``step``        one training step (``TrainStep``): micro-steps, DeepSpeed's optimizer step, both EMAs, with
                   one flush policy for the host reads (every micro-step, or deferred with ``train.fast``).
4. ``checkpoint``  ``CheckpointManager``: what a resume must match, save, load, the settings a resume changed.

``trainer.Trainer`` strings them together: build, then loop step -> maybe log / save / preview.
"""
import importlib

__all__ = ["ConfigError", "VQLCMDConfig", "load_config", "parse_vqlcmd_section", "resolve_config_path"]


def __getattr__(name: str):
    # on first use: importing a leaf of the engine (manifest.py, which the pipeline uses) runs no config code
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(".config", __name__), name)
