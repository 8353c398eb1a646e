"""TRL plug-in: ``FusedGRPOTrainer`` / ``IcePopGRPOTrainer`` / ``IcePopGRPOConfig``, TRL
``GRPOTrainer`` subclasses whose loss is fused (``trainer.py``), and the loss itself with every
``loss_type`` stock TRL accepts (``loss.py``).

``import glm_kernels.integrations.trl`` works without TRL; the trainer classes are built from
TRL's on first access (an ImportError naming what to install if TRL is missing).
"""
from . import trainer as _trainer
from .trainer import (INSTALL_HINT, LOSS_TYPES, SUPPORTED_LOSS_TYPES, generate_with_logprobs)

__all__ = ["FusedGRPOTrainer", "IcePopGRPOTrainer", "IcePopGRPOConfig", "generate_with_logprobs",
           "INSTALL_HINT", "LOSS_TYPES", "SUPPORTED_LOSS_TYPES"]


def __getattr__(name: str):
    return getattr(_trainer, name)
