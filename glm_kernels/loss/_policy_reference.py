"""Readable torch reference of every policy-loss variant (the test oracle; autograd gives its
gradient). Also the ``torch`` backend of :func:`glm_kernels.policy_loss`.

Everything runs on a flat token layout: ``[N]`` tensors plus ``seg_id`` (the sequence of each
token, ``[N]`` int64) and ``num_seqs``; a padded ``[B, T]`` batch is the flat layout with
``seg_id = t // T``. Per-sequence sums are ``index_add`` over ``seg_id``: no host sync.
Formulas: docs/policy_loss.md.
"""
import math
from typing import Dict, Optional, Tuple

import torch

from ._policy_spec import PolicyLossSpec

_GATE_LOG_CLAMP = 20.0                 # the IcePop gate's log-ratio clamp (loss/icepop.py)
_VESPO_LOG_MIN = math.log(1e-8)        # TRL get_gamma_weights' lower clamp


def seg_sum(values: torch.Tensor, seg_id: torch.Tensor, num_seqs: int) -> torch.Tensor:
    """[num_seqs] sums of ``values`` [N] per sequence (differentiable)."""
    return values.new_zeros(num_seqs).index_add(0, seg_id, values)


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """verl's masked mean: sum(v * m) / (sum(m) + 1e-8)."""
    return (torch.where(mask.bool(), values, 0.0) * mask).sum() / (mask.sum() + 1e-8)


def gate_weights(lp, old, rollout, mask, gate: Optional[str], gate_low: float,
                 gate_high: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """(weight [N] detached, popped [N] bool): the IcePop gate as a per-token factor.

    coupled: 1[lo <= exp(lp - rollout) <= hi]; decoupled: k 1[lo <= k <= hi], k = exp(old -
    rollout). A NaN ratio is popped (fails both comparisons)."""
    if gate is None:
        return torch.ones_like(lp), torch.zeros_like(mask)
    log_ratio = (lp.detach() if gate == "coupled" else old) - rollout
    ratio = torch.exp(torch.clamp(log_ratio, -_GATE_LOG_CLAMP, _GATE_LOG_CLAMP))
    in_gate = (ratio >= gate_low) & (ratio <= gate_high)
    weight = in_gate.float() if gate == "coupled" else torch.where(in_gate, ratio, 0.0)
    return weight, mask & ~in_gate


def _clamp(x, bound):
    return x if bound is None else torch.clamp(x, -bound, bound)


def token_objective(spec: PolicyLossSpec, lp, old, adv, ratio, log_ratio, selection, eps_low,
                    eps_high, dual_clip, p) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """(per-token loss l_t, per-token metric indicators) for every objective but geo_mean."""
    obj = spec.objective
    zero = torch.zeros_like(lp)
    ind = {"clip": zero, "clip_lower": zero, "kl": -log_ratio}
    if obj in ("ppo", "clip_cov"):
        capped = ratio if p.get("delta") is None else torch.clamp(ratio, max=p["delta"])
        pg1 = -adv * capped
        pg2 = -adv * torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high)
        loss = torch.maximum(pg1, pg2)
        ind["clip"] = (pg2 > (-adv * ratio)).float()
        if obj == "clip_cov":
            loss = loss * (~selection).float()
            ind["clip"] = selection.float()
        elif dual_clip is not None:
            bound = -adv * dual_clip
            ind["clip_lower"] = ((loss > bound) & (adv < 0)).float()
            loss = torch.where(adv < 0, torch.minimum(loss, bound), loss)
        return loss, ind
    if obj == "cispo":
        clipped = torch.clamp(ratio, p["cispo_min"], p["cispo_max"])
        ind["clip"] = (ratio != clipped).float()
        return -clipped.detach() * adv * lp, ind
    if obj == "sapo":
        tau = torch.where(adv > 0, p["tau_pos"], p["tau_neg"])
        return -torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau) * adv, ind
    if obj == "reinforce":
        return -adv * lp, ind
    if obj in ("dppo_tv", "dppo_kl"):
        truncated = torch.clamp(ratio, max=p["ratio_cap"]).detach()
        prob, old_prob = torch.exp(lp), torch.exp(old)
        if obj == "dppo_tv":
            valid_pos = (prob - old_prob) <= eps_high
            valid_neg = (prob - old_prob) >= -eps_low
        else:
            binary_kl = old_prob * (old - lp) + (1 - old_prob) * torch.log(
                (1.0 - old_prob + 1e-8) / (1.0 - prob + 1e-8))
            valid_pos = (binary_kl <= eps_high) | (prob <= old_prob)
            valid_neg = (binary_kl <= eps_low) | (prob >= old_prob)
        valid = torch.where(adv > 0, valid_pos, valid_neg).detach().float()
        ind["clip"] = 1.0 - valid
        ind["clip_lower"] = (ratio > p["ratio_cap"]).float() * valid
        return -adv * truncated * lp * valid, ind
    if obj == "dro":
        return -(lp * adv - 0.5 * p["dro_beta"] * log_ratio.square()), ind
    if obj == "kl_cov":
        ind["kl"] = log_ratio.abs()
        return -adv * ratio + selection.float() * p["ppo_kl_coef"] * log_ratio.abs(), ind
    raise AssertionError(obj)


def vespo_phi(adv, log_ratio, token_weights, seg_id, num_seqs, p):
    """TRL's gamma weight phi(w) per token (detached): w = exp(clamp(sum of clamped log-ratios
    [+ sum of clamped log token weights], log 1e-8, 20)) of the token's sequence."""
    seq_log = log_ratio  # already clamped to [-20, 20] by the spec and masked by the caller
    if token_weights is not None:
        seq_log = seq_log + torch.clamp(torch.log(token_weights), _VESPO_LOG_MIN, 20.0)
    log_w = torch.clamp(seg_sum(seq_log, seg_id, num_seqs), _VESPO_LOG_MIN, 20.0)[seg_id]
    nonneg = adv >= 0
    k = torch.where(nonneg, p["k_pos"], p["k_neg"])
    lam = torch.clamp(torch.where(nonneg, p["lambda_pos"], p["lambda_neg"]), min=1e-4)
    log_phi = lam + k * log_w - lam * torch.exp(log_w)
    return torch.exp(log_phi).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0).detach()


def reduce_tokens(terms, mask_f, seg_id, num_seqs, reduction, denominator, norm_length):
    """verl's agg_loss over per-token terms already multiplied by the mask."""
    if reduction == "none":
        return terms
    if reduction == "sum":
        return terms.sum()
    if reduction == "token_mean":
        denom = mask_f.sum().clamp(min=1.0) if denominator is None else denominator
        return terms.sum() / denom
    seq_tokens = seg_sum(mask_f, seg_id, num_seqs)
    seq_sums = seg_sum(terms, seg_id, num_seqs)
    has_tokens = (seq_tokens > 0).float()
    if reduction == "seq_mean_token_mean":
        seq_sums = seq_sums / seq_tokens.clamp(min=1.0)
    denom = has_tokens.sum().clamp(min=1.0) if denominator is None else denominator
    loss = (seq_sums * has_tokens).sum() / denom
    if reduction == "seq_mean_token_sum_norm":
        loss = loss / norm_length
    return loss


def policy_loss_reference(spec: PolicyLossSpec, lp, old, adv, mask, seg_id, num_seqs, *,
                          eps_low, eps_high, dual_clip, token_weights, rollout, gate, gate_low,
                          gate_high, selection, reduction, denominator, norm_length,
                          loss_scale, params) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """(loss, stats) on the flat layout; ``lp`` keeps its autograd graph. ``mask`` is bool [N],
    ``adv`` per token [N]; the others as :func:`glm_kernels.policy_loss` documents them."""
    lp32, old = lp.float(), old.float()
    adv = adv.float()
    mask_f = mask.float()
    weight, popped = gate_weights(lp32, old, None if rollout is None else rollout.float(), mask,
                                  gate, gate_low, gate_high)
    stats_mask = mask_f
    raw_log_ratio = lp32 - old
    log_ratio = _clamp(raw_log_ratio, spec.log_ratio_clamp)

    if spec.ratio == "geo_mean":
        # popped tokens leave the sequence; decoupled weights join the token weights.
        kept = mask_f * (weight > 0).float() if gate is not None else mask_f
        tw = weight if gate == "decoupled" else None
        if token_weights is not None:
            tw = token_weights.float() if tw is None else tw * token_weights.float()
        sgn = torch.sign(adv)
        clipped = torch.clamp(log_ratio, -eps_low, eps_high)
        log_min = sgn * torch.minimum(sgn * log_ratio, sgn * clipped)
        n = seg_sum(kept, seg_id, num_seqs)
        seq_ratio = torch.exp(seg_sum(log_min * kept, seg_id, num_seqs) / (n + 1e-8))
        seq_adv = seg_sum(adv * kept, seg_id, num_seqs) / (n + 1e-8)
        losses = -seq_adv * seq_ratio
        if tw is not None:
            losses = losses * torch.exp(
                seg_sum(torch.log(tw + 1e-10) * kept, seg_id, num_seqs) / (n + 1e-8))
        if reduction == "none":
            loss = losses
        elif reduction == "sum":
            loss = losses.sum()
        else:
            loss = losses.sum() / (num_seqs if denominator is None else denominator)
        is_clipped = (log_ratio != clipped).float()
        stats = {"pg_clipfrac": masked_mean(is_clipped * (adv > 0).float(), stats_mask),
                 "pg_clipfrac_lower": masked_mean(is_clipped * (adv < 0).float(), stats_mask),
                 "ppo_kl": masked_mean(-raw_log_ratio, stats_mask)}
    else:
        if spec.ratio == "token":
            ratio = torch.exp(log_ratio)
        elif spec.ratio == "sequence_sum":
            ratio = torch.exp(log_ratio)        # unused by vespo's loss; metrics only
        else:
            n = seg_sum(mask_f, seg_id, num_seqs).clamp(min=1.0)
            seq_log = (seg_sum(raw_log_ratio * mask_f, seg_id, num_seqs) / n)[seg_id]
            if spec.ratio == "sequence_stopgrad":
                seq_log = lp32 - lp32.detach() + seq_log.detach()
            if spec.seq_log_ratio_max is not None:
                seq_log = torch.clamp(seq_log, max=spec.seq_log_ratio_max)
            ratio = torch.exp(seq_log)
        if spec.objective == "vespo":
            phi = vespo_phi(adv, torch.where(mask, log_ratio, 0.0).detach(), token_weights,
                            seg_id, num_seqs, params)
            loss_t = -phi * adv * lp32
            ind = {"clip": torch.zeros_like(lp32), "clip_lower": torch.zeros_like(lp32),
                   "kl": -log_ratio}
            factor = weight
        else:
            loss_t, ind = token_objective(spec, lp32, old, adv, ratio, log_ratio, selection,
                                          eps_low, eps_high, dual_clip, params)
            factor = weight if token_weights is None else weight * token_weights.float()
        terms = torch.where(mask, loss_t * factor, 0.0)
        loss = reduce_tokens(terms, mask_f, seg_id, num_seqs, reduction, denominator,
                             norm_length)
        if spec.ratio != "token" and spec.objective == "ppo":
            ind["kl"] = -raw_log_ratio
        stats = {"pg_clipfrac": masked_mean(ind["clip"], stats_mask),
                 "pg_clipfrac_lower": masked_mean(ind["clip_lower"], stats_mask),
                 "ppo_kl": masked_mean(ind["kl"], stats_mask)}
    stats["pop_frac"] = popped.float().sum() / mask_f.sum().clamp(min=1.0)
    stats = {k: v.detach().float() for k, v in stats.items()}
    return loss * loss_scale, stats
