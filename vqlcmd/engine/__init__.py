"""Training engine. A newcomer's path through one run, in the order it happens:

1. ``config``      the experiment file: DeepSpeed's keys plus the ``vqlcmd`` section, parsed into dataclasses
                   (``load_config``); ``ds_config`` derives batch sizes and precision for the world size.
2. ``build``       the data, the method's network and its EMAs (``vqlcmd.methods`` says which), DeepSpeed.
3. ``step``        one training step (``TrainStep``): micro-steps, DeepSpeed's optimizer step, both EMAs, with
                   one flush policy for the host reads (every micro-step, or deferred with ``train.fast``).
4. ``checkpoint``  ``CheckpointManager``: what a resume must match, save, load, the settings a resume changed.

``trainer.Trainer`` strings them together: build, then loop step -> maybe log / save / preview.
"""
from .config import ConfigError, VQLCMDConfig, load_config, parse_vqlcmd_section, resolve_config_path

__all__ = ["ConfigError", "VQLCMDConfig", "load_config", "parse_vqlcmd_section", "resolve_config_path"]
