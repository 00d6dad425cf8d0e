from .attention import attention, attention_backend_for
from .denoiser import Denoiser, DenoiserConfig, num_parameters
from .presets import PAPER_PARAMETERS, PRESETS, build_denoiser, preset_config

__all__ = ["attention", "attention_backend_for", "Denoiser", "DenoiserConfig", "num_parameters",
           "PAPER_PARAMETERS", "PRESETS", "build_denoiser", "preset_config"]
