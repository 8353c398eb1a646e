"""Readable torch references for the from-logits ops (fp32 throughout)."""
from __future__ import annotations

import torch


def selective_logprobs_reference(logits, token_ids, temperature=1.0, return_entropy=False):
    """log_softmax(logits / T)[token] in fp32; optionally the entropy -sum p log p."""
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    lp = logp.gather(-1, token_ids.long().unsqueeze(-1)).squeeze(-1)
    if not return_entropy:
        return lp
    p = logp.exp()
    entropy = -(torch.where(p > 0, p * logp, torch.zeros_like(p))).sum(-1)
    return lp, entropy
