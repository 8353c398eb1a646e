"""IcePop: the training/rollout mismatch gate + asymmetric PPO clip (GLM-5 / Ring-1T).

``icepop_loss`` (``icepop.py``) on log-probs, ``icepop_loss_from_logits`` (``from_logits.py``)
on logits in one fused pass, ``fused_linear_icepop_loss`` (``fused_linear.py``) on hidden
states + the output layer. Kernels in ``_kernels.py``, the math in ``_reference.py``.
"""
from .icepop import icepop_loss
from .from_logits import icepop_loss_from_logits
from .fused_linear import fused_linear_icepop_loss

__all__ = ["icepop_loss", "icepop_loss_from_logits", "fused_linear_icepop_loss"]
