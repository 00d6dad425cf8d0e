"""VQ-LCMD: latent consistency-matching diffusion over vector-quantized image tokens."""
from . import ops
from .diffusion import LossConfig, training_losses
from .ema import EMA
from .embedding import TokenEmbedding, collapse_indicator
from .model import Denoiser, DenoiserConfig, build_denoiser, preset_config
from .network import VQLCMDNetwork
from .pipeline import VQLCMDPipeline
from .baselines import MaskGITPipeline  # noqa: E402  (imports .pipeline)
from . import methods  # noqa: E402,F401  (registers every method and its pipeline class)
from .samplers import sample_tokens
from .schedule import ShiftedCosineSchedule

__version__ = "0.1.0"

__all__ = ["ops", "LossConfig", "training_losses", "EMA", "TokenEmbedding", "collapse_indicator", "Denoiser",
           "DenoiserConfig", "build_denoiser", "preset_config", "VQLCMDNetwork", "VQLCMDPipeline", "MaskGITPipeline", "sample_tokens",
           "ShiftedCosineSchedule"]
