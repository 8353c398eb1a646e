"""Reference-model KL penalty: verl's ``agg_loss(kl_penalty(...))`` fused, TRL's per-token KL.

The op in ``kl_penalty.py``, its kernel in ``_kernels.py``, the math in ``_reference.py``.
"""
from .kl_penalty import kl_penalty_loss, kl_penalty_terms

__all__ = ["kl_penalty_loss", "kl_penalty_terms"]
