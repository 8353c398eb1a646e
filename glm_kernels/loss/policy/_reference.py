"""Readable torch reference of every policy-loss variant (the test oracle; autograd gives its
gradient). Also the ``torch`` backend of :func:`glm_kernels.policy_loss` for TRL's
``delta``, grpo_sequence / luspo, geo_mean and vespo; every other preset (gated or not) takes
the lean path of ``loss/policy/_torch.py`` (held equal to this one by tests/loss/
test_policy_lean.py).

Everything runs on a flat token layout: ``[N]`` tensors plus :class:`Rows`, the token ->
sequence map (a padded ``[B, T]`` batch: a reshape; packed ``cu_seqlens``: ``index_add`` over
each token's row found by ``searchsorted``). No host sync either way.
Formulas: docs/policy_loss.md.
"""
import math
from typing import Dict, Optional, Tuple

import torch

from ..._bits import and_bits, keep_bits
from ._spec import PolicyLossSpec

_GATE_LOG_CLAMP = 20.0                 # the IcePop gate's log-ratio clamp (loss/icepop/icepop.py)
_VESPO_LOG_MIN = math.log(1e-8)        # TRL get_gamma_weights' lower clamp


class Rows:
    """Token -> sequence map of the flat layout: padded rows of ``row_len`` tokens (reshape
    and broadcast) or packed rows bounded by ``cu_seqlens`` (index_add and gather)."""

    def __init__(self, num_tokens: int, num_rows: int, row_len: Optional[int],
                 cu_seqlens: Optional[torch.Tensor], device):
        self.num_tokens, self.num_rows, self.row_len = num_tokens, num_rows, row_len
        self.cu_seqlens, self.device = cu_seqlens, device
        self._seg_id = None

    @property
    def seg_id(self) -> torch.Tensor:
        """[N] int64: each token's row (built on first use, on the device)."""
        if self._seg_id is None:
            if self.cu_seqlens is None:
                self._seg_id = (torch.arange(self.num_tokens, device=self.device)
                                // max(self.row_len, 1))
            else:
                positions = torch.arange(self.num_tokens, device=self.device,
                                         dtype=self.cu_seqlens.dtype)
                self._seg_id = torch.searchsorted(self.cu_seqlens[1:].contiguous(), positions,
                                                  right=True)
        return self._seg_id

    def sum(self, values: torch.Tensor) -> torch.Tensor:
        """[rows] sums of per-token ``values`` [N] (differentiable)."""
        if self.cu_seqlens is None:
            return values.reshape(self.num_rows, self.row_len).sum(-1)
        return values.new_zeros(self.num_rows).index_add(0, self.seg_id, values)

    def first(self, values: torch.Tensor) -> torch.Tensor:
        """[rows]: each row's first token's value (0 for a row without tokens)."""
        if self.cu_seqlens is None:
            if self.row_len == 0:
                return values.new_zeros(self.num_rows)
            return values.reshape(self.num_rows, self.row_len)[:, 0]
        if self.num_tokens == 0:
            return values.new_zeros(self.num_rows)
        starts = self.cu_seqlens[:-1]
        first = values[starts.clamp(max=self.num_tokens - 1)]
        return torch.where(self.cu_seqlens[1:] > starts, first, 0.0)

    def spread(self, per_row: torch.Tensor) -> torch.Tensor:
        """[N]: each token's row value."""
        if self.cu_seqlens is None:
            return per_row[:, None].expand(self.num_rows, self.row_len).reshape(-1)
        return per_row[self.seg_id]


class _Keep(torch.autograd.Function):
    """fp32 ``torch.where(mask, x, 0.0)``, forward and backward, as a bitwise AND with
    :func:`keep_bits`: all ones keeps the value (NaN and inf included), 0 gives +0.0 whatever
    the value was. On the CPU a ``where`` over an irregular mask (popped tokens, zero IS
    weights) mispredicts a branch per element and costs 5-10x this vectorised AND."""

    @staticmethod
    def forward(ctx, x, bits):
        ctx.save_for_backward(bits)
        return and_bits(x, bits)

    @staticmethod
    def backward(ctx, grad):
        (bits,) = ctx.saved_tensors
        return and_bits(grad.float(), bits), None


class _KeepGrad(torch.autograd.Function):
    """Identity forward; backward zeroes the gradient outside the mask exactly (a NaN or inf
    local derivative of a dropped token never reaches the input)."""

    @staticmethod
    def forward(ctx, x, bits):
        ctx.save_for_backward(bits)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        (bits,) = ctx.saved_tensors
        return and_bits(grad.float(), bits), None


def keep(x: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """fp32 [N] ``x`` where ``bits`` are all ones, +0.0 elsewhere (differentiable)."""
    return _Keep.apply(x, bits) if x.requires_grad else and_bits(x, bits)


def gate_weights(lp, old, rollout, mask, gate: Optional[str], gate_low: float,
                 gate_high: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """(weight [N] detached, popped [N] bool): the IcePop gate as a per-token factor.

    coupled: 1[lo <= exp(lp - rollout) <= hi]; decoupled: k 1[lo <= k <= hi], k = exp(old -
    rollout). A NaN ratio is popped (fails both comparisons)."""
    if gate is None:
        return None, None
    log_ratio = (lp.detach() if gate == "coupled" else old) - rollout
    ratio = torch.exp(torch.clamp(log_ratio, -_GATE_LOG_CLAMP, _GATE_LOG_CLAMP))
    in_gate = (ratio >= gate_low) & (ratio <= gate_high)
    weight = in_gate.float() if gate == "coupled" else torch.where(in_gate, ratio, 0.0)
    return weight, mask & ~in_gate


def _clamp(x, bound):
    return x if bound is None else torch.clamp(x, -bound, bound)


def token_objective(spec: PolicyLossSpec, lp, old, adv, ratio, log_ratio, selection, eps_low,
                    eps_high, dual_clip, p, need_stats=True
                    ) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """(per-token loss l_t, per-token metric indicators) for every objective but geo_mean.
    The indicators (clip, clip_lower: bool; kl: float; absent = 0) are built only with
    ``need_stats``. ``log_ratio`` may be None for reinforce without stats (unused)."""
    obj = spec.objective
    ind = {"kl": -log_ratio.detach()} if need_stats else {}
    if obj in ("ppo", "clip_cov") and p.get("delta") is None:
        # max(-A r, -A clip(r)) is -A min(r, 1 + eps_high) for A > 0 and -A max(r, 1 - eps_low)
        # for A < 0; the dual clip min(., -A c) caps the latter at c: one clamp of r between
        # per-token bounds (its gradient: r' inside the bounds, 0 outside, as autograd's
        # maximum / minimum give it off ties), in a third of the passes of the literal form.
        negative = adv < 0
        cap = 1.0 + eps_high
        upper = torch.where(negative, math.inf if dual_clip is None or obj == "clip_cov"
                            else dual_clip, cap)
        lower = torch.where(negative, 1.0 - eps_low, -math.inf)
        loss = -adv * torch.clamp(ratio, lower, upper)
        if need_stats:       # verl: pg2 > pg1, i.e. r above the cap (A > 0) or below the floor
            ratio_d = ratio.detach()
            ind["clip"] = torch.where(negative, ratio_d < 1.0 - eps_low,
                                      (ratio_d > cap) & (adv > 0))
            if obj == "ppo" and dual_clip is not None:
                ind["clip_lower"] = negative & (ratio_d > dual_clip)
        if obj == "clip_cov":
            loss = torch.where(selection, 0.0, loss)
            if need_stats:
                ind["clip"] = selection
        return loss, ind
    if obj in ("ppo", "clip_cov"):                   # TRL's delta: the ratio capped first
        capped = ratio if p.get("delta") is None else torch.clamp(ratio, max=p["delta"])
        pg1 = -adv * capped
        pg2 = -adv * torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high)
        loss = torch.maximum(pg1, pg2)
        if need_stats:
            ind["clip"] = pg2 > (pg1 if capped is ratio else -adv * ratio)
        if obj == "clip_cov":
            loss = torch.where(selection, 0.0, loss)
            if need_stats:
                ind["clip"] = selection
        elif dual_clip is not None:
            bound = -adv * dual_clip
            if need_stats:
                ind["clip_lower"] = (loss > bound) & (adv < 0)
            loss = torch.where(adv < 0, torch.minimum(loss, bound), loss)
        return loss, ind
    if obj == "cispo":
        clipped = torch.clamp(ratio, p["cispo_min"], p["cispo_max"])
        if need_stats:
            ind["clip"] = ratio != clipped
        return -clipped.detach() * adv * lp, ind
    if obj == "sapo":
        tau = torch.where(adv > 0, p["tau_pos"], p["tau_neg"])
        return -torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau) * adv, ind
    if obj == "reinforce":
        return -adv * lp, ind
    if obj in ("dppo_tv", "dppo_kl"):
        truncated = torch.clamp(ratio, max=p["ratio_cap"]).detach()
        prob, old_prob = torch.exp(lp.detach()), torch.exp(old)
        if obj == "dppo_tv":
            valid_pos = (prob - old_prob) <= eps_high
            valid_neg = (prob - old_prob) >= -eps_low
        else:
            binary_kl = old_prob * (old - lp.detach()) + (1 - old_prob) * torch.log(
                (1.0 - old_prob + 1e-8) / (1.0 - prob + 1e-8))
            valid_pos = (binary_kl <= eps_high) | (prob <= old_prob)
            valid_neg = (binary_kl <= eps_low) | (prob >= old_prob)
        valid = torch.where(adv > 0, valid_pos, valid_neg)
        if need_stats:
            ind["clip"] = ~valid
            ind["clip_lower"] = (ratio > p["ratio_cap"]) & valid
        return torch.where(valid, -adv * truncated * lp, 0.0), ind
    if obj == "dro":
        return -(lp * adv - 0.5 * p["dro_beta"] * log_ratio.square()), ind
    if obj == "kl_cov":
        if need_stats:
            ind["kl"] = log_ratio.detach().abs()
        return torch.where(selection, -adv * ratio + p["ppo_kl_coef"] * log_ratio.abs(),
                           -adv * ratio), ind
    raise AssertionError(obj)


def _gamma_weight(adv, log_w, p):
    """TRL's phi(w) = e^lam w^k e^(-lam w) in log space; (k, lam) by the advantage's sign."""
    nonneg = adv >= 0
    k = torch.where(nonneg, p["k_pos"], p["k_neg"])
    lam = torch.clamp(torch.where(nonneg, p["lambda_pos"], p["lambda_neg"]), min=1e-4)
    log_phi = lam + k * log_w - lam * torch.exp(log_w)
    return torch.exp(log_phi).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def vespo_phi(adv, log_ratio, token_weights, rows, p):
    """(phi per token [N] detached, mean of phi over the rows): TRL's gamma weight of the
    token's sequence, w = exp(clamp(sum of clamped log-ratios [+ sum of clamped log token
    weights], log 1e-8, 20)). The row mean (TRL's ``vespo/phi_seq_mean``) takes each row's
    first advantage (rows without tokens: A = 0, w = 1)."""
    seq_log = log_ratio  # already clamped to [-20, 20] by the spec and masked by the caller
    if token_weights is not None:
        seq_log = seq_log + torch.clamp(torch.log(token_weights), _VESPO_LOG_MIN, 20.0)
    row_log_w = torch.clamp(rows.sum(seq_log), _VESPO_LOG_MIN, 20.0)
    phi = _gamma_weight(adv, rows.spread(row_log_w), p).detach()
    phi_rows = _gamma_weight(rows.first(adv), row_log_w, p)
    return phi, phi_rows.sum().detach() / max(rows.num_rows, 1)


def reduce_tokens(terms, mask, rows, reduction, denominator, norm_length, num_masked=None):
    """verl's agg_loss over per-token terms already multiplied by the mask (bool [N]);
    ``num_masked``: ``mask.sum()`` when the caller has it."""
    if reduction == "none":
        return terms
    if reduction == "sum":
        return terms.sum()
    if reduction == "token_mean":
        if denominator is not None:
            return terms.sum() / denominator
        num_masked = mask.sum() if num_masked is None else num_masked
        return terms.sum() / num_masked.clamp(min=1).float()
    seq_tokens = rows.sum(mask.float())
    seq_sums = rows.sum(terms)
    has_tokens = (seq_tokens > 0).float()
    if reduction == "seq_mean_token_mean":
        seq_sums = seq_sums / seq_tokens.clamp(min=1.0)
    denom = has_tokens.sum().clamp(min=1.0) if denominator is None else denominator
    loss = (seq_sums * has_tokens).sum() / denom
    if reduction == "seq_mean_token_sum_norm":
        loss = loss / norm_length
    return loss


def policy_loss_reference(spec: PolicyLossSpec, lp, old, adv, mask, rows: Rows, *,
                          eps_low, eps_high, dual_clip, token_weights, rollout, gate, gate_low,
                          gate_high, selection, reduction, denominator, norm_length,
                          loss_scale, params, need_stats=True
                          ) -> Tuple[torch.Tensor, Optional[Dict[str, torch.Tensor]]]:
    """(loss, stats or None) on the flat layout; ``lp`` keeps its autograd graph. ``mask`` is
    bool [N], ``adv`` per token [N]; the others as :func:`glm_kernels.policy_loss` documents them.
    Work a variant does not need (the gate, the ratio, the stats) is skipped, so that this
    torch path costs about what the trainers' own functions cost."""
    lp32, old = lp.float(), old.float()
    adv = adv.float()
    weight, popped = gate_weights(lp32, old, None if rollout is None else rollout.float(), mask,
                                  gate, gate_low, gate_high)
    needs_log_ratio = (need_stats or spec.ratio != "token" or spec.objective != "reinforce")
    raw_log_ratio = lp32 - old if needs_log_ratio else None
    log_ratio = None if raw_log_ratio is None else _clamp(raw_log_ratio, spec.log_ratio_clamp)
    tw = None if token_weights is None else token_weights.float()
    stats = None
    num_masked = None

    if spec.ratio == "geo_mean":
        mask_f = mask.float()
        # popped tokens leave the sequence; decoupled weights join the token weights.
        kept = mask_f * (weight > 0).float() if gate is not None else mask_f
        if gate == "decoupled":
            tw = weight if tw is None else weight * tw
        sgn = torch.sign(adv)
        clipped = torch.clamp(log_ratio, -eps_low, eps_high)
        log_min = sgn * torch.minimum(sgn * log_ratio, sgn * clipped)
        n = rows.sum(kept)
        seq_ratio = torch.exp(rows.sum(log_min * kept) / (n + 1e-8))
        seq_adv = rows.sum(adv * kept) / (n + 1e-8)
        losses = -seq_adv * seq_ratio
        if tw is not None:
            losses = losses * torch.exp(
                rows.sum(torch.log(tw + 1e-10) * kept) / (n + 1e-8))
        if reduction == "none":
            loss = losses
        elif reduction == "sum":
            loss = losses.sum()
        else:
            loss = losses.sum() / (max(rows.num_rows, 1) if denominator is None else denominator)
        if need_stats:                  # verl's masked means; counts of bools are exact
            num_masked = mask.sum()
            denom = num_masked + 1e-8
            clipped_tokens = (log_ratio.detach() != clipped.detach()) & mask
            stats = {"pg_clipfrac": (clipped_tokens & (adv > 0)).sum() / denom,
                     "pg_clipfrac_lower": (clipped_tokens & (adv < 0)).sum() / denom,
                     "ppo_kl": -and_bits(raw_log_ratio.detach(), keep_bits(mask)).sum() / denom}
    else:
        factor = weight if (tw is None or spec.objective == "vespo") else (
            tw if weight is None else weight * tw)
        live = mask if factor is None else mask & factor.bool()     # bool(w): w != 0
        live_bits = keep_bits(live)
        if factor is not None and spec.ratio != "sequence" and lp32.requires_grad:
            # A token of factor 0 (popped, zero IS weight) adds exactly 0 to the loss and the
            # gradient whatever its inputs (inf / NaN): no gradient path through it at all.
            # (TRL's sequence ratio keeps it: the token still moves its row's mean.)
            lp32 = _KeepGrad.apply(lp32, live_bits)
            if raw_log_ratio is not None:
                raw_log_ratio = lp32 - old
                log_ratio = _clamp(raw_log_ratio, spec.log_ratio_clamp)
        ratio = None
        if spec.ratio in ("token", "sequence_sum"):
            if spec.objective not in ("reinforce", "dro", "vespo"):
                ratio = torch.exp(log_ratio)
        else:
            n = rows.sum(mask.float()).clamp(min=1.0)
            seq_log = rows.spread(rows.sum(torch.where(mask, raw_log_ratio, 0.0)) / n)
            if spec.ratio == "sequence_stopgrad":
                seq_log = lp32 - lp32.detach() + seq_log.detach()
            if spec.seq_log_ratio_max is not None:
                seq_log = torch.clamp(seq_log, max=spec.seq_log_ratio_max)
            ratio = torch.exp(seq_log)
        if spec.objective == "vespo":
            phi, phi_mean = vespo_phi(adv, torch.where(mask, log_ratio, 0.0).detach(), tw, rows,
                                      params)
            loss_t = -phi * adv * lp32
            ind = {"kl": -log_ratio.detach()} if need_stats else {}
        else:
            loss_t, ind = token_objective(spec, lp32, old, adv, ratio, log_ratio, selection,
                                          eps_low, eps_high, dual_clip, params, need_stats)
        terms = keep(loss_t if factor is None else loss_t * factor, live_bits)
        if reduction == "token_mean" or need_stats:
            num_masked = mask.sum()
        loss = reduce_tokens(terms, mask, rows, reduction, denominator, norm_length,
                             num_masked)
        if need_stats:
            if spec.ratio != "token" and spec.objective == "ppo":
                ind["kl"] = -raw_log_ratio.detach()
            mask_bits = live_bits if factor is None else keep_bits(mask)
            zero = torch.zeros((), device=lp.device)
            denom = num_masked + 1e-8                     # verl's masked_mean denominator

            def mean(key):
                if key not in ind:
                    return zero
                if ind[key].dtype == torch.bool:          # indicators: finite by construction
                    return (ind[key] & mask).sum() / denom
                return and_bits(ind[key], mask_bits).sum() / denom
            stats = {"pg_clipfrac": mean("clip"), "pg_clipfrac_lower": mean("clip_lower"),
                     "ppo_kl": mean("kl")}
            if spec.objective == "vespo":
                stats["phi_mean"] = phi_mean
    if need_stats:
        if num_masked is None:
            num_masked = mask.sum()
        stats["pop_frac"] = (torch.zeros((), device=lp.device) if popped is None else
                             popped.sum() / num_masked.clamp(min=1).float())
        stats = {k: v.detach().float() for k, v in stats.items()}
    return (loss if loss_scale == 1.0 else loss * loss_scale), stats
