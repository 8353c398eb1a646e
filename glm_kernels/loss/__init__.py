"""Policy losses and advantages for GRPO + IcePop and on-policy distillation."""
from .advantages import group_advantages, opd_advantages
from .icepop import icepop_loss

__all__ = ["icepop_loss", "group_advantages", "opd_advantages"]
