"""Exact full-vocab reverse KL(student || teacher) from logits, for on-policy distillation.

The op in ``reverse_kl.py``, its kernels in ``_kernels.py``; the math is
``glm_kernels.loss.logprobs``' reference (``reverse_kl_reference``).
"""
from .reverse_kl import reverse_kl_from_logits

__all__ = ["reverse_kl_from_logits"]
