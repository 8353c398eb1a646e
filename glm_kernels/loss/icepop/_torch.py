"""The torch backend of :func:`glm_kernels.icepop_loss`: the gated PPO objective computed in
one forward without an autograd graph over the [N] tensors (the loss, each token's gradient
coefficient and the metric counts), the Triton kernel's design in torch ops. Bitwise masking
(``glm_kernels._bits``) replaces ``torch.where`` over the irregular gate mask: on the CPU a
branch per element costs 5-10x the vectorised AND.
"""
import math
from typing import Tuple

import torch

from ..._bits import and_bits, and_optional, keep_bits
from ._reference import LOG_RATIO_CLAMP

# A gate strictly inside these bounds pops every token whose gated log-ratio reaches the
# clamp (a factor 2 of margin over e^-+20 for the fp32 rounding of exp and of the bounds).
_GATE_MIN, _GATE_MAX = 2.0 * math.exp(-LOG_RATIO_CLAMP), 0.5 * math.exp(LOG_RATIO_CLAMP)


def lean_icepop(lp, rollout, adv, mask, old, *, gate_low, gate_high, eps_low, eps_high,
                dual_clip, need_grad, store_loss, need_metrics=True
                ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The torch backend of :func:`glm_kernels.icepop_loss`: the vanilla PPO objective (dual
    clip optional) under the IcePop gate, with IcePop's contract
    (``loss/icepop/_reference.py``: the readable version and the tests' oracle). Flat [N]
    inputs (``adv`` per token, ``mask`` bool / 0-1 or None, ``old`` None = coupled). Returns
    (per-token loss [N] or [0], per-token d(l m)/d lp [N] or [0], stats [8]: loss sum, masked,
    popped, clipped, gate-ratio sum / max / min / count over the masked tokens with finite
    log-probs). ``need_metrics=False``
    computes the loss sum and the masked count only (the rest NaN): the loss and the
    gradient are the same bits either way.

    Closed form, no autograd: kept tokens are masked once by a bitwise AND, so a popped,
    unmasked or non-finite token is exactly 0 (its log-ratio 0, its advantage 0) without a
    ``where`` per term; the PPO terms -rA and -clip(r)A give the loss (their max), the clip
    indicator (clipped > unclipped) and, times the decoupled weight, the gradient."""
    f32 = torch.float32
    lp, rollout, adv = lp.float(), rollout.float(), adv.float()
    old = None if old is None else old.float()
    n = lp.numel()
    device = lp.device
    empty = lp.new_empty(0)
    if n == 0:
        stats = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, -math.inf, math.inf, 0.0],
                             device=device)
        return empty, empty, stats
    masked = None if mask is None else (mask if mask.dtype == torch.bool else mask != 0)
    # A gate inside (e^-20, e^20) keeps only tokens whose gated log-ratio is finite and
    # inside the clamp, so both of its log-probs are finite: the train-side finiteness test
    # is then needed for the metrics (pop_frac counts finite tokens only) and, decoupled,
    # for lp (not in the gate), not for the loss.
    gate_finite = gate_low > _GATE_MIN and gate_high < _GATE_MAX
    # |x| < inf is isfinite(x) (NaN fails it too) in two passes instead of four; one
    # comparison of the larger |.| covers both train-side tensors.
    if need_metrics or not gate_finite:
        train_abs = lp.abs() if old is None else torch.maximum(lp.abs(), old.abs())
        train_ok = train_abs < math.inf
    else:
        train_ok = None if old is None else lp.abs() < math.inf
    masked_ok = and_optional(train_ok, masked)
    base = rollout if old is None else old
    raw_log_ratio = lp - base                          # the ratio's; coupled, the gate's too
    gate_log_ratio = raw_log_ratio if old is None else old - rollout
    if old is not None and gate_finite and not need_metrics:
        # the clamp changes no gate decision (|log k| > 20 is outside the gate either way)
        # nor a kept token's k; only the metrics read the clamped k of popped tokens
        gate_clamped = gate_log_ratio
    else:
        gate_clamped = torch.clamp(gate_log_ratio, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    gate_ratio = torch.exp(gate_clamped)
    # lo <= k <= hi as clamp(k, lo, hi) == k: one comparison (NaN fails it: popped)
    in_gate = torch.clamp(gate_ratio, gate_low, gate_high) == gate_ratio
    keep = and_optional(in_gate, masked_ok)
    bits = keep_bits(keep)
    log_ratio = and_bits(raw_log_ratio, bits)         # 0 off the kept tokens
    if old is None:
        # coupled: the ratio is the gate's ratio (the same clamp); 0 off the kept tokens,
        # where the advantage is 0 too, so every term there is still +-0
        ratio = and_bits(gate_ratio, bits)
        in_range = gate_clamped == raw_log_ratio
    else:
        kept_clamped = torch.clamp(log_ratio, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        ratio = torch.exp(kept_clamped)
        in_range = kept_clamped == log_ratio
    neg_adv = and_bits(adv, bits).neg_()               # -A on kept tokens, -0 elsewhere
    unclipped = ratio * neg_adv
    clipped_term = torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high) * neg_adv
    cut = clipped_term > unclipped                      # the clipped branch is active
    num_clipped = torch.count_nonzero(cut) if need_metrics else None   # kept tokens only
    per_token = torch.maximum(unclipped, clipped_term)
    if dual_clip is not None:
        bound = neg_adv * dual_clip
        cap = (neg_adv > 0) & (per_token > bound)       # A < 0 and the cap binds
        per_token = torch.where(cap, bound, per_token)
        cut |= cap
    weight = None if old is None else and_bits(gate_ratio, bits)
    if weight is not None:
        per_token = weight * per_token
    loss_terms = and_bits(per_token, bits) if store_loss else empty
    grad = empty
    if need_grad:
        slope = unclipped if weight is None else unclipped * weight     # -w r A
        # the clamp's gradient: 0 where the kept log-ratio lies outside [-20, 20]
        grad = and_bits(slope, keep_bits(~cut & in_range))
    f64 = torch.float64
    num_masked = (torch.tensor(n, device=device) if masked is None
                  else torch.count_nonzero(masked))
    loss_sum = per_token.sum().to(f64)          # fp32 pairwise sum, as the reference's
    if not need_metrics:
        known = torch.stack([loss_sum, num_masked.to(f64)]).to(f32)
        return loss_terms, grad, torch.cat([known, known.new_full((6,), math.nan)])
    # Ratio statistics over M: masked tokens with finite train-side and rollout log-probs.
    counted = masked_ok & (rollout.abs() < math.inf)
    num_counted = torch.count_nonzero(counted)
    counted_ratio = and_bits(gate_ratio, keep_bits(counted))    # > 0 on M, 0 elsewhere
    stats = torch.stack([
        loss_sum, num_masked.to(f64),
        (torch.count_nonzero(masked_ok) - torch.count_nonzero(keep)).to(f64),
        num_clipped.to(f64), counted_ratio.sum(dtype=f64),
        torch.where(num_counted > 0, counted_ratio.max(), -math.inf).to(f64),
        torch.where(counted, gate_ratio, math.inf).min().to(f64),
        num_counted.to(f64)]).to(f32)
    return loss_terms, grad, stats
