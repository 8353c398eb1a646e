"""Plain-PyTorch definitions of the loss-side ops: the oracle, the CPU path, the spec.

IcePop (GLM-5 / Ring-1T): drop tokens whose training/rollout probability ratio leaves a
trust interval, then apply the asymmetric PPO clip to what is left.

Coupled mode (no recompute of old log-probs; asynchronous TITO):
    rho  = exp(clamp(logprobs - rollout_logprobs, -20, 20))
    g    = 1[lo <= sg(rho) <= hi]
    l    = g * max(-rho * A, -clip(rho, 1 - eps_low, 1 + eps_high) * A)

Decoupled mode (old_logprobs recomputed by the trainer):
    k    = exp(clamp(old - rollout, -20, 20))            (no gradient)
    w    = k * 1[lo <= k <= hi]
    r    = exp(clamp(logprobs - old, -20, 20))
    l    = w * max(-r * A, -clip(r, 1 - eps_low, 1 + eps_high) * A)

Dual clip (optional, c = dual_clip > 1; verl's clip_ratio_c, slime's --eps-clip-c): for A < 0
the PPO term max(...) is capped at -c * A, a constant (no gradient) where the cap binds.

A popped (g = 0 or w = 0) or unmasked token contributes exactly 0 to the loss and to the
gradient, whatever its inputs (inf, NaN): its values are replaced by 0 before any arithmetic.

Non-finite policy: a masked token whose train-side log-prob is NaN or +-inf (``logprobs``, and
``old_logprobs`` in the decoupled mode) is *non-finite*: it contributes exactly 0 to the loss
and the gradient (both modes: loss and gradient agree) and is counted in the ``nonfinite_frac``
metric, not in ``pop_frac``. A non-finite rollout log-prob is rollout-side: the token is
popped (its ratio is NaN or clamped out of the gate). A NaN/inf advantage of a kept token
propagates (NaN/inf loss, and that token's gradient NaN/inf); masked-out or popped tokens
never read theirs.

IcePop's metrics (``token_metrics``): pop_frac and clip_frac over masked tokens; the gate
ratio's mean / max / min over M, the masked tokens whose log-probs (logprobs, old_logprobs,
rollout) are all finite. The train/rollout mismatch metrics are defined in
``loss/mismatch/mismatch.py`` (plain torch on every backend: they read O(tokens) inputs, never
the logits).
"""
from __future__ import annotations

from typing import Dict

import torch

from ..._row_invariant import row_logsumexp
from .._common.softmax import scaled_fp32, selective_logprobs_reference, softmax_grad_of_z
from ..mismatch import mismatch_from_tokens

LOG_RATIO_CLAMP = 20.0


def icepop_token_terms(logprobs, rollout_logprobs, advantages, loss_mask=None, *,
                       old_logprobs=None, gate_low, gate_high, eps_low, eps_high,
                       dual_clip=None):
    """Per-token IcePop terms, all of the input shape.

    Returns (loss l*m fp32, popped bool, clipped bool, gate_ratio fp32, masked bool), where
    ``gate_ratio`` is the ratio the gate tests (rho coupled, k decoupled) and ``clipped`` marks
    masked, kept tokens whose clipped branch is strictly active (their gradient is cut).
    ``advantages`` must already have the shape of ``logprobs``. Differentiable in logprobs.
    """
    lp = logprobs.float()
    rollout = rollout_logprobs.detach().float()
    adv = advantages.detach().float()
    masked = torch.ones_like(lp, dtype=torch.bool) if loss_mask is None else loss_mask != 0
    train_ok = train_side_finite(lp.detach(), old_logprobs)

    if old_logprobs is None:
        gate_log_ratio = (lp.detach() - rollout).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    else:
        old = old_logprobs.detach().float()
        gate_log_ratio = (old - rollout).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    gate_ratio = torch.exp(gate_log_ratio)
    in_gate = (gate_ratio >= gate_low) & (gate_ratio <= gate_high)   # NaN -> False: popped
    keep = in_gate & masked & train_ok

    zero = torch.zeros_like(lp)
    base = rollout if old_logprobs is None else old
    # Select before subtracting so popped inf/NaN never meet the gradient path.
    log_ratio = torch.where(keep, lp, zero) - torch.where(keep, base, zero)
    ratio = torch.exp(log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    adv_kept = torch.where(keep, adv, zero)
    unclipped = -ratio * adv_kept
    clipped_term = -ratio.clamp(1.0 - eps_low, 1.0 + eps_high) * adv_kept
    per_token = torch.maximum(unclipped, clipped_term)
    if dual_clip is not None:
        dual_bound = -dual_clip * adv_kept
        per_token = torch.where((adv_kept < 0) & (per_token > dual_bound), dual_bound,
                                per_token)
    if old_logprobs is not None:
        per_token = torch.where(keep, gate_ratio, zero) * per_token
    loss = torch.where(keep, per_token, zero)
    clipped = keep & (clipped_term > unclipped)
    popped = masked & train_ok & ~in_gate
    return loss, popped, clipped, gate_ratio, masked


def train_side_finite(logprobs, old_logprobs=None):
    """True where the train-side log-probs (logprobs, and old_logprobs if given) are finite."""
    ok = torch.isfinite(logprobs)
    if old_logprobs is not None:
        ok = ok & torch.isfinite(old_logprobs)
    return ok


def icepop_token_grad(logprobs, rollout_logprobs, advantages, loss_mask=None, *,
                      old_logprobs=None, gate_low, gate_high, eps_low, eps_high,
                      dual_clip=None):
    """d(l*m)/d logprobs per token, written out (tests check it equals autograd of the above).

    dl/dlp = -w * r * A where the unclipped branch is active (ties included), the dual-clip
    cap does not bind and the log-ratio lies inside the clamp range, else 0; w = 1 (coupled)
    or k (decoupled), r the ratio.
    """
    with torch.no_grad():
        lp = logprobs.float()
        rollout = rollout_logprobs.float()
        base = rollout if old_logprobs is None else old_logprobs.float()
        masked = torch.ones_like(lp, dtype=torch.bool) if loss_mask is None else loss_mask != 0
        gate_ratio = torch.exp(((lp if old_logprobs is None else base) - rollout)
                               .clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
        keep = (masked & (gate_ratio >= gate_low) & (gate_ratio <= gate_high)
                & train_side_finite(lp, old_logprobs))
        zero = torch.zeros_like(lp)
        log_ratio = torch.where(keep, lp, zero) - torch.where(keep, base, zero)
        ratio = torch.exp(log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
        adv = torch.where(keep, advantages.float(), zero)
        clipped_term = -ratio.clamp(1.0 - eps_low, 1.0 + eps_high) * adv
        cut = clipped_term > -ratio * adv                     # the clipped branch is active
        if dual_clip is not None:
            ppo_term = torch.maximum(-ratio * adv, clipped_term)
            cut |= (adv < 0) & (ppo_term > -dual_clip * adv)  # the cap binds
        in_range = (log_ratio >= -LOG_RATIO_CLAMP) & (log_ratio <= LOG_RATIO_CLAMP)
        weight = keep.float() if old_logprobs is None else torch.where(keep, gate_ratio, zero)
        return torch.where(cut | ~in_range, zero, -weight * ratio * adv)


def reduce_terms(loss_terms: torch.Tensor, masked: torch.Tensor, reduction: str) -> torch.Tensor:
    """Apply one of the four reductions to per-token terms that are already l*m."""
    if reduction == "none":
        return loss_terms
    if reduction == "sum":
        return loss_terms.sum()
    if reduction == "token_mean":
        return loss_terms.sum() / masked.sum().clamp(min=1)
    if reduction == "seq_mean_token_mean":
        row_tokens = masked.sum(-1)
        valid = row_tokens > 0
        row_means = loss_terms.sum(-1) / row_tokens.clamp(min=1)
        return torch.where(valid, row_means, 0.0).sum() / valid.sum().clamp(min=1)
    raise ValueError(f"reduction={reduction!r}")


def ratio_counted(masked, logprobs, rollout_logprobs, old_logprobs=None):
    """M: masked tokens whose log-probs are all finite (what the ratio statistics describe)."""
    return (masked & train_side_finite(logprobs.detach(), old_logprobs)
            & torch.isfinite(rollout_logprobs.detach()))


def token_metrics(popped, clipped, gate_ratio, masked, counted) -> Dict[str, torch.Tensor]:
    """pop_frac, clip_frac over masked tokens; ratio_mean/max/min over ``counted`` (M)."""
    n_masked = masked.sum().float()
    denom = n_masked.clamp(min=1)
    ratios = gate_ratio.float()[counted]
    nan = torch.tensor(float("nan"))
    return {
        "pop_frac": popped.sum().float() / denom,
        "clip_frac": clipped.sum().float() / denom,
        "ratio_mean": ratios.mean() if ratios.numel() else nan,
        "ratio_max": ratios.max() if ratios.numel() else nan,
        "ratio_min": ratios.min() if ratios.numel() else nan,
    }


def icepop_stats_rows(loss, popped, clipped, gate_ratio, masked, counted):
    """Per-token statistics rows [N, 8] in the layout of the kernels' per-program rows: loss,
    masked, popped, clipped, ratio sum / max / min / count over ``counted`` (M) (the torch
    backend's input to the same fixed-order reduction the kernels' rows go through)."""
    inf = float("inf")
    cols = [loss.float(), masked.float(), popped.float(), clipped.float(),
            torch.where(counted, gate_ratio, 0.0), torch.where(counted, gate_ratio, -inf),
            torch.where(counted, gate_ratio, inf), counted.float()]
    return torch.stack([c.reshape(-1).float() for c in cols], -1)


def icepop_loss_reference(logprobs, rollout_logprobs, advantages, loss_mask=None, *,
                          old_logprobs=None, beta=2.0, gate_low=None, gate_high=None,
                          eps_low=0.2, eps_high=0.28, reduction="token_mean",
                          return_metrics=False, dual_clip=None):
    """The whole docs/design.md 3.1 contract in readable torch (autograd gives the gradient)."""
    lo = 1.0 / beta if gate_low is None else gate_low
    hi = beta if gate_high is None else gate_high
    if advantages.shape != logprobs.shape:
        advantages = advantages.unsqueeze(-1).expand_as(logprobs)
    loss_terms, popped, clipped, gate_ratio, masked = icepop_token_terms(
        logprobs, rollout_logprobs, advantages, loss_mask, old_logprobs=old_logprobs,
        gate_low=lo, gate_high=hi, eps_low=eps_low, eps_high=eps_high, dual_clip=dual_clip)
    loss = reduce_terms(loss_terms, masked, reduction)
    if not return_metrics:
        return loss
    counted = ratio_counted(masked, logprobs, rollout_logprobs, old_logprobs)
    metrics = token_metrics(popped, clipped, gate_ratio, masked, counted)
    train = logprobs if old_logprobs is None else old_logprobs
    metrics.update(mismatch_from_tokens(
        train, rollout_logprobs, loss_mask, gate_low=lo, gate_high=hi,
        also_finite=None if old_logprobs is None else logprobs))
    return loss, metrics


def icepop_loss_from_logits_reference(logits, token_ids, rollout_logprobs, advantages,
                                      loss_mask=None, *, temperature=1.0, **icepop_kwargs):
    """icepop_loss_reference of the reference log-probs (fp32 log_softmax + gather)."""
    lp = selective_logprobs_reference(logits, token_ids, temperature)
    return icepop_loss_reference(lp, rollout_logprobs, advantages, loss_mask, **icepop_kwargs)


def fused_linear_icepop_loss_reference(hidden, weight, token_ids, rollout_logprobs, advantages,
                                       loss_mask=None, *, temperature=1.0, **icepop_kwargs):
    """The same loss from the last hidden states: logits = hidden @ weight^T in fp32."""
    logits = hidden.float() @ weight.float().t()
    return icepop_loss_from_logits_reference(logits, token_ids, rollout_logprobs, advantages,
                                             loss_mask, temperature=temperature,
                                             **icepop_kwargs)


def icepop_logits_rows(logits, token_ids, rollout, old, adv, mask, scale, *, inv_temp, gate_low,
                       gate_high, eps_low, eps_high, need_grad, dual_clip=None):
    """The fused op in torch: (dL/dlogits [N, V] fp32 or None, IcePop stats rows [N, 8],
    log-probs [N] fp32).

    ``scale`` [N] is the reduction's factor per token; rows follow the layout of the IcePop
    kernel's per-program statistics (loss, masked, popped, clipped, ratio sum/max/min, count).
    """
    z = scaled_fp32(logits, inv_temp)
    lse = row_logsumexp(z)
    lp = z.gather(-1, token_ids.long().unsqueeze(-1)).squeeze(-1) - lse
    kwargs = dict(old_logprobs=old, gate_low=gate_low, gate_high=gate_high, eps_low=eps_low,
                  eps_high=eps_high, dual_clip=dual_clip)
    loss, popped, clipped, gate_ratio, masked = icepop_token_terms(lp, rollout, adv, mask,
                                                                   **kwargs)
    rows = icepop_stats_rows(loss, popped, clipped, gate_ratio, masked,
                             ratio_counted(masked, lp, rollout, old))
    if not need_grad:
        return None, rows, lp
    coef = icepop_token_grad(lp, rollout, adv, mask, **kwargs) * scale
    return softmax_grad_of_z(z, token_ids, lse, None, coef, None, inv_temp, 0), rows, lp
