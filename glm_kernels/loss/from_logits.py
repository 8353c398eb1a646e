"""IcePop loss starting from logits: selective_logprobs followed by the fused icepop_loss.

The per-token IcePop coefficient comes from the existing O(tokens) icepop op; the logits
gradient is dlogits = coef / T * (onehot - softmax), recomputed from the saved lse.
"""
from __future__ import annotations

import torch

from .icepop import icepop_loss
from .logprobs import selective_logprobs


def icepop_loss_from_logits(logits: torch.Tensor, token_ids: torch.Tensor,
                            rollout_logprobs: torch.Tensor, advantages: torch.Tensor,
                            loss_mask=None, *, temperature: float = 1.0, **icepop_kwargs):
    """``icepop_loss(selective_logprobs(logits, token_ids), ...)``; same kwargs as icepop_loss."""
    logprobs = selective_logprobs(logits, token_ids, temperature=temperature)
    return icepop_loss(logprobs, rollout_logprobs, advantages, loss_mask, **icepop_kwargs)
