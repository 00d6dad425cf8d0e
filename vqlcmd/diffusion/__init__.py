"""Diffusion math of VQ-LCMD, apart from the model: the training objective."""
from .losses import (DROP_STRATEGIES, WEIGHTINGS, LossConfig, draw_loss_randoms, drop_labels, sample_drop_mask,
                     training_losses, training_losses_drawn)

__all__ = ["DROP_STRATEGIES", "WEIGHTINGS", "LossConfig", "draw_loss_randoms", "drop_labels", "sample_drop_mask",
           "training_losses", "training_losses_drawn"]
