"""Training engine: configuration, DeepSpeed trainer, crash-safe checkpoints."""
from .config import ConfigError, VQLCMDConfig, load_config, parse_vqlcmd_section, resolve_config_path

__all__ = ["ConfigError", "VQLCMDConfig", "load_config", "parse_vqlcmd_section", "resolve_config_path"]
