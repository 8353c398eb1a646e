"""GRPO group advantages and on-policy-distillation advantages (plain torch, ``advantages.py``)."""
from .advantages import group_advantages, opd_advantages

__all__ = ["group_advantages", "opd_advantages"]
