"""glm_kernels: fused kernels for GLM-5-style RL post-training.

Public API (see README.md and DESIGN contracts):
    icepop_loss, group_advantages, opd_advantages
Backends: ``glm_kernels.force_backend("torch"|"triton"|"interpret")`` or the environment
variable ``GLM_KERNELS_BACKEND``.
"""
from . import _dispatch  # first: sets TRITON_INTERPRET before any kernel module is imported
from . import delta
from ._dispatch import force_backend, select_backend
from .loss import (group_advantages, icepop_loss, icepop_loss_from_logits, opd_advantages,
                   selective_logprobs)

__version__ = "0.1.0"
__all__ = ["icepop_loss", "group_advantages", "opd_advantages", "selective_logprobs",
           "icepop_loss_from_logits", "force_backend",
           "select_backend", "__version__"]
