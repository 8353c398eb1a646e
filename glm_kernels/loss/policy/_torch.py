"""The torch backend's lean path for the token objectives (verl gpg / REINFORCE, DRO, SAPO,
CISPO, DPPO-TV / -KL, PPO-clip with or without the dual clip, Clip-Cov and KL-Cov with their
selection) and GSPO's stop-gradient sequence ratio, with or without the IcePop gate (a detached
token factor), and for ``icepop_loss``'s gated PPO (:func:`lean_icepop`): the Triton kernel's
design in torch ops.

The loss and each token's gradient coefficient ``g_t = d(loss)/d lp_t`` are computed in one
forward without an autograd graph over the [N] tensors; one autograd node's backward is the
multiply ``g * dL``. With ``u_t = w_t l_t`` (w: token weights, detached) and r = exp(clamp(lr)):

* reinforce ``l = -A lp``: ``dl/dlp = -A``;
* dro ``l = -(A lp - beta/2 lr^2)``: ``dl/dlp = beta lr - A``;
* sapo ``l = -(4/tau) A sigmoid(tau (r - 1))``: ``dl/dlp = -4 A s (1 - s) r``;
* cispo ``l = -sg(clip(r)) A lp``: ``dl/dlp = -clip(r) A``;
* dppo ``l = -sg(min(r, cap)) A lp`` on tokens inside the divergence band, else 0:
  ``dl/dlp = -min(r, cap) A`` there;
* ppo ``l = -A clamp(r, lo, hi)`` (lo, hi: 1 - eps_low and the dual clip c or inf for A < 0,
  -inf and 1 + eps_high for A >= 0): ``dl/dlp = -A r 1[lo <= r <= hi]``; clip_cov the same
  without c and 0 on selected tokens; kl_cov ``l = -A r + sel coef |lr|``:
  ``dl/dlp = -A r + sel coef sign(lr)``; gspo: ppo on the row's ratio (its derivative in lp_t
  is the ratio, through the stop-gradient);

each times 1[|lr| <= clamp] on the terms through r or lr (the clamp's gradient), and zeroed
exactly (whatever the inputs) outside the mask and where w = 0, as the reference's
``where``. The readable autograd version of every variant is ``policy/_reference.py`` (the
tests' oracle); these objectives cost ~0.3-1 ms in verl, so the reference's fixed cost of
an autograd graph (~10 nodes) and its masking passes showed against them.
"""
import math
from typing import Dict, Optional, Tuple

import torch

from ..._bits import and_bits, keep_bits
from ._reference import Rows, gate_weights
from ._spec import PolicyLossSpec

LEAN_OBJECTIVES = ("reinforce", "dro", "sapo", "cispo", "dppo_tv", "dppo_kl", "ppo", "clip_cov",
                   "kl_cov")


def seq_row_scale(row_tokens: torch.Tensor, reduction: str, denominator, norm_length):
    """The per-sequence factor of the ``seq_mean_*`` reductions (shared by the kernels' and
    this path's reductions): 1[row has tokens] / (the number of such rows, or
    ``denominator``), then / the row's tokens (token mean) or / ``norm_length`` (sum norm)."""
    has_tokens = (row_tokens > 0).float()
    denom = has_tokens.sum().clamp(min=1.0) if denominator is None else denominator
    row_scale = has_tokens / denom
    if reduction == "seq_mean_token_mean":
        row_scale = row_scale / row_tokens.clamp(min=1.0)
    elif reduction == "seq_mean_token_sum_norm":
        row_scale = row_scale / norm_length
    return row_scale


def lean_applies(spec: PolicyLossSpec, gate: Optional[str], params: Optional[dict] = None
                 ) -> bool:
    """Whether :func:`lean_policy_loss` computes this variant: token ratios and GSPO's, with
    or without the IcePop gate (``gate``: None, "coupled", "decoupled"); PPO / Clip-Cov only
    without TRL's ``delta`` (``params``: the resolved parameters)."""
    if spec.objective not in LEAN_OBJECTIVES:
        return False
    if spec.ratio != "token" and not (spec.ratio == "sequence_stopgrad"
                                      and spec.objective == "ppo"):
        return False
    return spec.objective not in ("ppo", "clip_cov") or (params or {}).get("delta") is None


class _LossWithCoefficients(torch.autograd.Function):
    """``value`` in forward; backward: ``coef * dL`` (coef already holds the reduction's
    per-token factor), in log-probs' dtype."""

    @staticmethod
    def forward(ctx, lp, value, coef):
        ctx.save_for_backward(coef)
        ctx.lp_dtype = lp.dtype
        return value.clone()

    @staticmethod
    def backward(ctx, grad):
        (coef,) = ctx.saved_tensors
        return (coef * grad).to(ctx.lp_dtype), None, None


def _and_bits_(x: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """``and_bits`` in place, on a tensor this path made (no [N] allocation: ~40 % of the
    AND's time at 32K tokens on the CPU)."""
    x.view(torch.int32).bitwise_and_(bits)
    return x


def _f32(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.float32 else t.float()


def _objective(spec, lp, old, adv, tw, p, need_log_ratio, band, selection):
    """(s_t, g_t, log-ratio or None, ratio or None, sign, gradient keep or None): the lean
    objectives with ``sign * s_t`` the token's weighted loss w_t l_t and ``sign * g_t`` its
    w_t dl_t/dlp_t (``tw``: token weights or None); s_t None for the objectives linear in lp
    (s_t = g_t lp_t: REINFORCE, CISPO), whose sum is then one dot product. The sign (a scalar:
    -4 for SAPO's 4/tau) is folded into the reduction's scalar factor, saving a pass over the
    tokens. The gradient keep (bool [N]):
    where a clamp passes the gradient, applied after the factor so that the others are +0.0
    as in autograd."""
    obj = spec.objective
    if obj == "reinforce":           # -w A lp: linear in lp, the slope w A times lp
        log_ratio = (lp - old) if need_log_ratio else None
        slope = adv if tw is None else adv * tw
        return None, slope, log_ratio, None, -1.0, None
    raw = lp - old
    bound = spec.log_ratio_clamp
    log_ratio = raw if bound is None else torch.clamp(raw, -bound, bound)
    inside = None if bound is None else (raw.abs() <= bound)
    if obj == "dro":
        beta = p["dro_beta"]
        loss = 0.5 * beta * log_ratio.square() - adv * lp
        slope = beta * log_ratio if inside is None else beta * log_ratio * inside
        slope = slope - adv
        return (loss, slope, log_ratio, None, 1.0, None) if tw is None else (
            loss * tw, slope * tw, log_ratio, None, 1.0, None)
    ratio = torch.exp(log_ratio)
    if obj == "sapo":
        tau = torch.where(adv > 0, p["tau_pos"], p["tau_neg"])
        gate = torch.sigmoid(tau * (ratio - 1.0))
        loss = gate * adv / tau                # the factor 4 joins the sign: one pass less
        grad = adv * gate * (1.0 - gate) * ratio
        grad = grad if inside is None else grad * inside
        return (loss, grad, log_ratio, ratio, -4.0, None) if tw is None else (
            loss * tw, grad * tw, log_ratio, ratio, -4.0, None)
    if obj in ("dppo_tv", "dppo_kl"):  # -A sg(min(r, cap)) lp where the divergence is in band
        truncated = torch.clamp(ratio, max=p["ratio_cap"])
        slope = truncated * adv if tw is None else truncated * adv * tw
        return None, slope, log_ratio, ratio, -1.0, None
    if obj in ("ppo", "clip_cov"):
        loss, grad, grad_keep = _ppo_terms(adv, ratio, band, dual=obj == "ppo")
        grad_keep = grad_keep if inside is None else grad_keep & inside
        return (loss, grad, log_ratio, ratio, -1.0, grad_keep) if tw is None else (
            loss * tw, grad * tw, log_ratio, ratio, -1.0, grad_keep)
    if obj == "kl_cov":              # -A r + coef |lr| on the selected tokens
        picked = selection.float() * p["ppo_kl_coef"]
        unpenalised = adv * ratio
        loss = unpenalised - picked * log_ratio.abs()
        grad = unpenalised - picked * torch.sign(log_ratio)      # both terms through lr
        return (loss, grad, log_ratio, ratio, -1.0, inside) if tw is None else (
            loss * tw, grad * tw, log_ratio, ratio, -1.0, inside)
    clipped = torch.clamp(ratio, p["cispo_min"], p["cispo_max"])          # cispo
    slope = clipped * adv if tw is None else clipped * adv * tw
    return None, slope, log_ratio, ratio, -1.0, None


def _ppo_terms(adv, ratio, band, dual):
    """(A clamp(r, lo, hi), A r, 1[lo <= r <= hi]): PPO's max(-A r, -A clip(r)) (with the
    dual clip's cap c for A < 0 when ``dual``) is -A clamp(r, lo, hi) with per-token bounds
    lo, hi = 1 - eps_low, c (A < 0) or -inf, 1 + eps_high (A >= 0), as the reference's
    ``token_objective`` writes it; the clamp's gradient passes where r lies in [lo, hi]
    (``clamp(r) == r``: one comparison)."""
    eps_low, eps_high, dual_clip = band
    negative = adv < 0
    upper = torch.where(negative, math.inf if dual_clip is None or not dual else dual_clip,
                        1.0 + eps_high)
    lower = torch.where(negative, 1.0 - eps_low, -math.inf)
    held = torch.clamp(ratio, lower, upper)
    slope = adv * ratio
    return adv * held, slope, held == ratio


def _gspo_objective(spec, lp, old, adv, tw, mask, rows: Rows, band):
    """GSPO's (s_t, g_t, token log-ratio, ratio, sign, gradient keep): PPO-clip on the
    sequence ratio r_t = exp(min(sg(m_row) + lp_t - sg(lp_t), smax)), m_row the row's mean
    log-ratio over its masked tokens. Its value is the row's, its derivative in lp_t is r_t
    itself (1[m_row <= smax]: the clamp's gradient), so the token objective is PPO's with
    that ratio."""
    raw = lp - old
    row_tokens = rows.sum(mask.float()).clamp(min=1.0)
    seq_log = rows.spread(rows.sum(and_bits(raw, keep_bits(mask))) / row_tokens)
    smax = spec.seq_log_ratio_max
    inside = None
    if smax is not None:
        inside = seq_log <= smax
        seq_log = torch.clamp(seq_log, max=smax)
    ratio = torch.exp(seq_log)
    loss, grad, grad_keep = _ppo_terms(adv, ratio, band, dual=True)
    grad_keep = grad_keep if inside is None else grad_keep & inside
    return (loss, grad, raw, ratio, -1.0, grad_keep) if tw is None else (
        loss * tw, grad * tw, raw, ratio, -1.0, grad_keep)


def _ppo_clip_counts(spec, adv, ratio, mask, band):
    """verl's PPO clip indicators over the masked tokens (counts): pg2 > pg1 (r above the cap
    for A > 0, below the floor for A < 0) and, with a dual clip, A < 0 with r above c."""
    eps_low, eps_high, dual_clip = band
    negative = adv < 0
    clip = ((negative & (ratio < 1.0 - eps_low)) | ((adv > 0) & (ratio > 1.0 + eps_high)))
    clip_lower = None
    if spec.objective == "ppo" and dual_clip is not None:
        clip_lower = torch.count_nonzero(negative & (ratio > dual_clip) & mask)
    return torch.count_nonzero(clip & mask), clip_lower


def _dppo_valid(spec, lp, old, adv, eps_low, eps_high):
    """DPPO's trust region (``_policy_reference.token_objective``): the tokens whose total
    variation (dppo_tv) or binary KL (dppo_kl) between pi and pi_old stays in the band on the
    side the advantage pushes; the others get no loss. The advantage's sign picks the side by
    two bool operations instead of a ``where``."""
    prob, old_prob = torch.exp(lp), torch.exp(old)
    if spec.objective == "dppo_tv":
        diff = prob - old_prob
        valid_pos, valid_neg = diff <= eps_high, diff >= -eps_low
    else:
        binary_kl = old_prob * (old - lp) + (1 - old_prob) * torch.log(
            (1.0 - old_prob + 1e-8) / (1.0 - prob + 1e-8))
        valid_pos = (binary_kl <= eps_high) | (prob <= old_prob)
        valid_neg = (binary_kl <= eps_low) | (prob >= old_prob)
    positive = adv > 0
    return (positive & valid_pos) | (~positive & valid_neg)


def lean_policy_loss(spec: PolicyLossSpec, lp, old, adv, mask, rows: Rows, *, eps_low,
                     eps_high, token_weights, reduction, denominator, norm_length, loss_scale,
                     params, need_stats, dual_clip=None, selection=None, rollout=None,
                     gate=None, gate_low=None, gate_high=None
                     ) -> Tuple[torch.Tensor, Optional[Dict[str, torch.Tensor]]]:
    """The reference's (loss, stats) for the variants :func:`lean_applies` accepts; arguments
    as :func:`_policy_reference.policy_loss_reference` (flat [N], ``mask`` bool,
    ``selection`` bool [N] for clip_cov / kl_cov, ``rollout`` [N] with a gate)."""
    lp_in = lp
    lp, old, adv = _f32(lp.detach()), _f32(old), _f32(adv)
    tw = None if token_weights is None else _f32(token_weights)
    # The IcePop gate is a detached token factor (the reference's own gate_weights): popped
    # tokens get weight 0, so the weighted path drops them exactly (NaN / inf included).
    gate_weight, popped = gate_weights(lp, old, None if rollout is None else _f32(rollout),
                                       mask, gate, gate_low, gate_high)
    if gate_weight is not None:
        tw = gate_weight if tw is None else gate_weight * tw
    band = (eps_low, eps_high, dual_clip)
    if spec.objective in ("clip_cov", "kl_cov") and selection is None:
        selection = torch.zeros_like(mask)
    if spec.ratio == "sequence_stopgrad":
        loss_t, dl, log_ratio, ratio, sign, grad_keep = _gspo_objective(
            spec, lp, old, adv, tw, mask, rows, band)
    else:
        loss_t, dl, log_ratio, ratio, sign, grad_keep = _objective(
            spec, lp, old, adv, tw, params, need_stats, band, selection)
    live = mask if tw is None else mask & tw.bool()      # bool(w) is w != 0, in 1/4 the time
    if spec.objective == "clip_cov":                     # selected tokens get no loss
        live = live & ~selection
    valid = None
    if spec.objective in ("dppo_tv", "dppo_kl"):
        valid = _dppo_valid(spec, lp, old, adv, eps_low, eps_high)
        live = live & valid
    bits = keep_bits(live)
    linear = loss_t is None          # linear in lp: the loss is sum_t coef_t lp_t
    num_masked = None
    if (reduction == "token_mean" and denominator is None) or need_stats:
        num_masked = torch.count_nonzero(mask)          # 2/3 of a bool sum's time on the CPU
    # Each token's gradient coefficient is the reduction's factor (token_mean, sum: a python
    # float or a 0-d tensor) or its row's (seq_mean_*) times its g_t, masked after the
    # multiply so that a dropped token's is +0.0 whatever the factor's sign.
    factor = sign * loss_scale
    token_scale = None
    if reduction == "token_mean":
        if denominator is None:   # factor / count as Tensor.__rdiv__ computes it, without
            factor = torch.reciprocal(num_masked.clamp(min=1)).mul_(factor)   # its Python
        else:
            factor = factor / denominator
    elif reduction not in ("none", "sum"):
        row_scale = seq_row_scale(rows.sum(mask.float()), reduction, denominator,
                                  norm_length) * factor
        token_scale = rows.spread(row_scale)
    need_grad = lp_in.requires_grad and torch.is_grad_enabled()
    coef = None
    if need_grad or linear:
        # a clamp's zero gradient (PPO's band) applied last as well: +0.0, as autograd's
        grad_bits = bits if grad_keep is None else keep_bits(live & grad_keep)
        coef = _and_bits_(dl * (factor if token_scale is None else token_scale), grad_bits)
    if linear:                       # one dot product, no per-token loss tensor
        lp_live = and_bits(lp, bits)
        value = coef * lp_live if reduction == "none" else torch.dot(coef, lp_live)
    elif reduction == "none":                           # +0.0 where dropped, as the grad
        value = _and_bits_(loss_t if factor == 1.0 else loss_t * factor, bits)
    elif token_scale is None:                           # sum, token_mean
        value = _and_bits_(loss_t, bits).sum() * factor
    else:
        value = (rows.sum(_and_bits_(loss_t, bits)) * row_scale).sum()
    loss = _LossWithCoefficients.apply(lp_in, value, coef) if need_grad else value
    stats = None
    if need_stats:
        denom = num_masked + 1e-8                      # verl's masked_mean denominator
        zero = torch.zeros((), device=lp.device)
        masked_log_ratio = and_bits(log_ratio, keep_bits(mask))
        kl = (masked_log_ratio.abs().sum() if spec.objective == "kl_cov"
              else -masked_log_ratio.sum()) / denom
        clip_lower = zero
        if spec.objective == "ppo":      # token or sequence ratio: the same indicators
            clip, lower_count = _ppo_clip_counts(spec, adv, ratio, mask, band)
            clip = clip / denom
            clip_lower = zero if lower_count is None else lower_count / denom
        elif spec.objective == "clip_cov":               # verl: the selected fraction
            clip = torch.count_nonzero(selection & mask) / denom
        elif spec.objective == "cispo":
            clip = ((ratio != torch.clamp(ratio, params["cispo_min"], params["cispo_max"]))
                    & mask).sum() / denom
        elif valid is not None:          # DPPO: outside the band; truncated inside it
            clip = (mask & ~valid).sum() / denom
            clip_lower = (mask & valid & (ratio > params["ratio_cap"])).sum() / denom
        else:
            clip = zero
        pop_frac = zero if popped is None else (
            torch.count_nonzero(popped) / num_masked.clamp(min=1).float())
        stats = {"pg_clipfrac": clip.float(), "pg_clipfrac_lower": clip_lower.float(),
                 "ppo_kl": kl.float(), "pop_frac": pop_frac}
    return loss, stats


