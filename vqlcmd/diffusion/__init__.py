"""Diffusion math of VQ-LCMD, apart from the model: the training objective."""
from .losses import DROP_STRATEGIES, WEIGHTINGS, LossConfig, drop_labels, sample_drop_mask, training_losses

__all__ = ["DROP_STRATEGIES", "WEIGHTINGS", "LossConfig", "drop_labels", "sample_drop_mask", "training_losses"]
