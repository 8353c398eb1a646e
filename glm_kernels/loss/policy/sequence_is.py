"""Sequence-level importance-sampling weights (sequence TIS / MIS) without a host sync.

verl's ``rollout_is="sequence"`` (and slime's / TRL's sequence modes) weight every token of
sequence b by w_b = exp(clamp(sum_{t in b} m_t (old_t - rollout_t), -20, 20)), truncated
(TIS: min(w_b, high)) or masked (MIS: w_b 1[low <= w_b <= high]). :func:`policy_loss` takes
them through ``seq_is=``: on the Triton / interpreter backends the sequence kernel reduces
them for every preset (``loss/policy/_kernels.py``; token-ratio presets run its per-sequence
layout under ``seq_is``), with no [N] tensor; the torch backend makes them token weights
here (one row reduction in torch, no sync). :func:`sequence_is_weights` gives them alone.
"""
from typing import Optional

import torch

from ... import _checks
from ._reference import Rows

SEQ_IS_MODES = ("truncate", "mask")
_SAFETY_BOUND = 20.0          # verl rollout_corr_helper.SAFETY_BOUND


def check_seq_is(mode, high, low):
    """(high, low) as validated floats for ``mode`` (low: 1 / high unless given, mask only)."""
    _checks.check_choice("seq_is", mode, SEQ_IS_MODES)
    high = _checks.check_finite_number("seq_is_high", high, positive=True)
    if mode == "truncate":
        if low is not None:
            raise ValueError("seq_is_low is used by seq_is='mask' only")
        return high, None
    low = 1.0 / high if low is None else _checks.check_finite_number("seq_is_low", low,
                                                                       nonnegative=True)
    if not low < high:
        raise ValueError(f"seq_is_low must be < seq_is_high, got {low} >= {high}")
    return high, low


def seq_is_token_weights(old, rollout, mask, rows: Rows, mode: str, high: float,
                         low: Optional[float]) -> torch.Tensor:
    """[N] fp32 detached: each token's sequence weight (flat layout, bool mask)."""
    log_sum = rows.sum(torch.where(mask, old.float() - rollout.float(), 0.0))
    weight = torch.exp(torch.clamp(log_sum, -_SAFETY_BOUND, _SAFETY_BOUND))
    if mode == "truncate":
        weight = torch.clamp(weight, max=high)
    else:
        weight = torch.where((weight >= low) & (weight <= high), weight, 0.0)
    return rows.spread(weight).detach()


def sequence_is_weights(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor,
                        loss_mask: Optional[torch.Tensor] = None, *,
                        cu_seqlens: Optional[torch.Tensor] = None, mode: str = "truncate",
                        high: float = 2.0, low: Optional[float] = None) -> torch.Tensor:
    """Per-token sequence IS weights, as verl's ``compute_rollout_correction_weights(
    rollout_is="sequence")`` computes them before its padding mask.

    old_logprobs, rollout_logprobs : [B, T] (padded) or [N] (packed with ``cu_seqlens``
        [B + 1]); any float dtype. loss_mask: same shape, bool or 0/1 (None: every token).
    mode : "truncate" (TIS: min(w, high)) or "mask" (MIS / sequence IcePop: w where
        low <= w <= high, else 0; low defaults to 1 / high).
    Returns fp32 weights of the input shape (detached), constant within each sequence.
    """
    _checks.check_tensor("old_logprobs", old_logprobs, floating=True, ndim=(1, 2))
    _checks.check_tensor("rollout_logprobs", rollout_logprobs, floating=True)
    _checks.check_same_shape("rollout_logprobs", rollout_logprobs, "old_logprobs",
                               old_logprobs)
    if loss_mask is not None:
        _checks.check_tensor("loss_mask", loss_mask)
        _checks.check_same_shape("loss_mask", loss_mask, "old_logprobs", old_logprobs)
    high, low = check_seq_is(mode, high, low)
    n = old_logprobs.numel()
    if cu_seqlens is not None:
        _checks.check_tensor("cu_seqlens", cu_seqlens, dtypes=(torch.int32, torch.int64),
                               ndim=(1,))
        if old_logprobs.dim() != 1:
            raise ValueError("cu_seqlens needs packed 1-D inputs [N]")
        rows = Rows(n, cu_seqlens.numel() - 1, None, cu_seqlens, old_logprobs.device)
    elif old_logprobs.dim() == 2:
        rows = Rows(n, old_logprobs.shape[0], old_logprobs.shape[1], None, old_logprobs.device)
    else:
        rows = Rows(n, 1, n, None, old_logprobs.device)
    mask = (torch.ones(n, dtype=torch.bool, device=old_logprobs.device) if loss_mask is None
            else loss_mask.reshape(-1) != 0)
    weights = seq_is_token_weights(old_logprobs.reshape(-1), rollout_logprobs.reshape(-1), mask,
                                   rows, mode, high, low)
    return weights.reshape(old_logprobs.shape)
