"""verl's rollout correction (IS weights, rejection mask, metrics) for ``glm_bypass_mode``.

verl 0.9.1's bypass-mode loss calls
``verl.trainer.ppo.rollout_corr_helper.compute_rollout_correction_and_rejection_mask`` on
(current policy, rollout) for every micro-batch: IS weights (token or sequence level, TIS
truncation or the IcePop band, optional batch normalisation), an optional rejection mask,
and ~40 metrics. On the CPU that helper was ~75% of verl's whole bypass-mode call: each of
its ~20 masked means is a ``torch.where`` over the mask (a branch per element on the CPU),
a multiply and a sum, and each metric is its own ``.item()`` host read.
:func:`rollout_correction` returns the same weights, mask and metrics (keys and values; held
equal to verl's helper by tests/integrations/test_verl_rollout_correction.py) with the mask
applied once as a bitwise AND (``glm_kernels/_bits.keep_bits``: exactly
``where(mask, x, 0)``, NaN and inf included), the per-row sums shared between metrics and
one host transfer for all of them. Rejection sampling (``rollout_rs``) is verl's own
``compute_rollout_rejection_mask`` (a rollout-correction helper, called as verl calls it).

With lr = log_prob - rollout, m the response mask, n_b / n its row / total counts and
verl's masked mean mm(x) = sum_m x / (count + 1e-8)::

    token IS:     raw_t = exp(clamp(lr_t, +-20)) m_t
    sequence IS:  raw_t = exp(clamp(sum_{m, row} lr, +-20)) m_t
    TIS (threshold u):          w = min(raw, u)
    IcePop ("l_u" threshold):   w = raw where l <= raw <= u, else 0
    batch normalisation:        w / mm(w) (sequence level: over the rows' mm_b(w))

The metric formulas are verl's (``compute_is_metrics``, ``compute_offpolicy_metrics``), in
the input dtypes as verl computes them.
"""
from __future__ import annotations

import math
from typing import Dict, List, Optional, Tuple

import torch

from ..._bits import and_bits, keep_bits

__all__ = ["rollout_correction"]

SAFETY_BOUND = 20.0                 # verl's rollout_corr_helper.SAFETY_BOUND
_EPS = 1e-8                         # verl's masked_mean guard


class _Masked:
    """verl's ``masked_sum`` / ``masked_mean`` over one response mask, the mask converted
    once: fp32 values by a bitwise AND with the mask's bits, other dtypes by ``where``."""

    def __init__(self, mask: torch.Tensor):
        self.mask = mask.bool()
        self.bits = keep_bits(self.mask)
        self.row_count = mask.sum(-1)                    # verl: mask.sum(axis)
        self.count = self.row_count.sum()

    def keep(self, values: torch.Tensor) -> torch.Tensor:
        if values.dtype == torch.float32:
            return and_bits(values.contiguous(), self.bits)
        return torch.where(self.mask, values, 0.0)

    def sum(self, values, axis=None):
        kept = self.keep(values)
        return kept.sum() if axis is None else kept.sum(axis)

    def mean(self, values, axis=None):
        if axis is None:
            return self.sum(values) / (self.count + _EPS)
        return self.sum(values, axis) / (self.row_count + _EPS)


def field(config, key, default=None):
    """``config.key`` from verl's dataclass configs and from DictConfig / dict alike."""
    if config is None:
        return default
    if hasattr(type(config), "__dataclass_fields__"):
        # verl's BaseConfig.get is this getattr behind a method call (~10x its time; the
        # plug-in reads ~5 fields per loss call)
        return getattr(config, key, default)
    getter = getattr(config, "get", None)
    if callable(getter):
        return getter(key, default)
    return getattr(config, key, default)


def _threshold(spec) -> Tuple[float, Optional[float]]:
    """verl's parse of ``rollout_is_threshold`` (upper, lower or None), its errors included."""
    from verl.trainer.ppo.rollout_corr_helper import _parse_rollout_is_threshold
    return _parse_rollout_is_threshold(spec)


def _is_weights(log_ratio, row_log_ratio, m: _Masked, level: str, upper: float,
                lower: Optional[float], batch_normalize: bool,
                out: List[Tuple[str, torch.Tensor]]):
    """verl's ``compute_rollout_correction_weights`` + ``compute_is_metrics``: the weights;
    the metrics appended to ``out`` as (key, 0-d tensor or float). ``row_log_ratio``: the
    rows' masked sums of ``log_ratio``."""
    if level == "token":
        log_for_metrics = log_ratio
        raw = torch.exp(torch.clamp(log_ratio, -SAFETY_BOUND, SAFETY_BOUND))
    elif level == "sequence":
        log_for_metrics = row_log_ratio.unsqueeze(-1)
        raw = torch.exp(torch.clamp(log_for_metrics, -SAFETY_BOUND,
                                    SAFETY_BOUND)).expand_as(log_ratio)
    else:
        raise ValueError(f"Invalid rollout_is: {level}. Must be one of {{'token', 'sequence'}}.")
    raw = raw * m.mask                       # verl: raw * response_mask (0 off the mask)
    if lower is None:
        weights = raw.clamp(max=upper)
    else:
        weights = torch.where((raw >= lower) & (raw <= upper), raw, 0.0)
    low_bound = 1.0 / upper if lower is None else lower
    if level == "sequence":
        out += [("rollout_is_max", torch.exp(torch.clamp(log_for_metrics.max(),
                                                         max=SAFETY_BOUND))),
                ("rollout_is_min", torch.exp(log_for_metrics.min())),
                ("rollout_is_mean", m.mean(weights)),
                ("rollout_is_ratio_fraction_high",
                 (log_for_metrics > math.log(upper)).float().mean()),
                ("rollout_is_ratio_fraction_low",
                 (log_for_metrics < math.log(low_bound)).float().mean())]
    else:
        out += [("rollout_is_mean", m.mean(weights)),
                ("rollout_is_ratio_fraction_high", m.mean((raw > upper).float())),
                ("rollout_is_ratio_fraction_low", m.mean((raw < low_bound).float())),
                ("rollout_is_max", weights.masked_fill(~m.mask, float("-inf")).max()),
                ("rollout_is_min", weights.masked_fill(~m.mask, float("inf")).min())]
    clamped = weights.clamp(min=0.0, max=upper)          # the std's and the ESS's weights
    clamped_mean = m.mean(clamped)
    variance = m.mean(clamped.square()) - clamped_mean.square()
    out.append(("rollout_is_std", torch.where(m.count > 1,
                                              torch.sqrt(torch.clamp(variance, min=0.0)), 0.0)))
    normalized = clamped / (clamped_mean + 1e-8)
    # verl: 1.0 / (a masked mean).item(), a python (fp64) division.
    out.append(("rollout_is_eff_sample_size", 1.0 / m.mean(normalized.square()).double()))
    seq_mean = m.mean(weights, -1)
    many_rows = seq_mean.numel() > 1
    out += [("rollout_is_seq_mean", seq_mean.mean()),
            ("rollout_is_seq_std", seq_mean.std() if many_rows else 0.0),
            ("rollout_is_seq_max", seq_mean.max()),
            ("rollout_is_seq_min", seq_mean.min()),
            ("rollout_is_seq_max_deviation", (seq_mean - 1.0).abs().max())]
    raw_seq_mean = m.mean(raw, -1)
    out += [("rollout_is_seq_fraction_high", (raw_seq_mean > upper).float().mean()),
            ("rollout_is_seq_fraction_low", (raw_seq_mean < low_bound).float().mean())]
    if lower is not None:
        out.append(("rollout_is_oob_ratio", m.mean(((raw < lower) | (raw > upper)).float())))
    weights = weights.detach()
    if batch_normalize:
        weights = _batch_normalize(weights, m, level, out)
    return weights


def _batch_normalize(weights, m: _Masked, level, out):
    """verl's ``rollout_is_batch_normalize``: divide by the (data-parallel) mean weight."""
    import verl.utils.torch_functional as verl_F
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    if level == "token":
        mean = (verl_F.distributed_masked_mean(weights, m.mask.to(weights.dtype))
                if distributed else m.mean(weights))
    else:
        seq_weights = m.mean(weights, -1)
        seq_mask = (m.row_count > 0).to(weights.dtype)
        mean = (verl_F.distributed_masked_mean(seq_weights, seq_mask) if distributed
                else (seq_weights * seq_mask).sum() / seq_mask.sum().clamp_min(1e-8))
    if mean > 1e-8:                          # a host read, as in verl
        out.append(("rollout_is_batch_norm_factor", mean))
        return weights / mean
    out.append(("rollout_is_batch_norm_factor", 1.0))
    return weights


def _offpolicy(log_prob, rollout, log_ratio, row_log_ratio, m: _Masked, out):
    """verl's ``compute_offpolicy_metrics`` (train = the current policy in bypass mode)."""
    mean_train = m.mean(log_prob, -1)
    out += [("training_ppl", torch.exp(-mean_train).mean()),
            ("training_log_ppl", (-mean_train).mean())]
    # kl = mm(rollout - train) = -mm(lr): the negation is exact.
    out += [("kl", -m.mean(log_ratio)),
            ("k3_kl", m.mean(torch.exp(log_ratio) - log_ratio - 1))]
    mean_rollout = m.mean(rollout, -1)
    log_ppl_diff = mean_rollout - mean_train
    out += [("rollout_ppl", torch.exp(-mean_rollout).mean()),
            ("rollout_log_ppl", (-mean_rollout).mean()),
            ("log_ppl_diff", log_ppl_diff.mean()),
            ("log_ppl_abs_diff", log_ppl_diff.abs().mean()),
            ("log_ppl_diff_max", log_ppl_diff.max()),
            ("log_ppl_diff_min", log_ppl_diff.min()),
            ("ppl_ratio", torch.exp(log_ppl_diff).mean())]
    rho = torch.exp(torch.clamp(log_ratio, -SAFETY_BOUND, SAFETY_BOUND))
    out.append(("chi2_token", m.mean(rho.square()) - 1.0))
    row_log_ratio = torch.clamp(row_log_ratio, -SAFETY_BOUND, SAFETY_BOUND)
    out.append(("chi2_seq", torch.exp(2.0 * row_log_ratio).mean() - 1.0))


def rollout_correction(log_prob: torch.Tensor, rollout_log_prob: torch.Tensor,
                       response_mask: torch.Tensor, correction
                       ) -> Tuple[Optional[torch.Tensor], torch.Tensor, Dict[str, float]]:
    """verl's ``compute_rollout_correction_and_rejection_mask(old_log_prob=log_prob,
    rollout_log_prob=..., response_mask=..., **correction's fields)`` as bypass mode calls it.

    Parameters
    ----------
    log_prob : Tensor [B, T] float (detached: the current policy's log-probs)
    rollout_log_prob : Tensor [B, T] float
    response_mask : Tensor [B, T] bool or 0/1
    correction : verl ``RolloutCorrectionConfig`` (or a mapping with its fields)
        Read: ``rollout_is``, ``rollout_is_threshold``, ``rollout_is_batch_normalize``,
        ``rollout_rs``, ``rollout_rs_threshold``.

    Returns
    -------
    (weights [B, T] or None, the response mask after rejection (response_mask's dtype),
    verl's metrics under ``rollout_corr/<key>`` as python floats). Raises verl's errors
    (no valid token, a bad IS level or threshold).
    """
    rollout_is = field(correction, "rollout_is", None)
    threshold = field(correction, "rollout_is_threshold", 2.0)
    batch_normalize = field(correction, "rollout_is_batch_normalize", False)
    rollout_rs = field(correction, "rollout_rs", None)
    rs_threshold = field(correction, "rollout_rs_threshold", None)
    if log_prob.shape != rollout_log_prob.shape:
        raise ValueError(f"old_log_prob shape {log_prob.shape} does not match rollout_log_prob "
                         f"shape {rollout_log_prob.shape}.")
    if log_prob.shape != response_mask.shape:
        raise ValueError(f"log_prob shape {log_prob.shape} does not match response_mask shape "
                         f"{response_mask.shape}.")
    if response_mask.numel() == 0:
        raise ValueError("response_mask must contain at least one valid token (1).")
    m = _Masked(response_mask)
    # verl raises on an empty mask first; the count is read with the metrics below (one host
    # read) unless rejection sampling or batch normalisation read the device anyway.
    log_ratio = log_prob - rollout_log_prob
    row_log_ratio = m.sum(log_ratio, -1)
    out: List[Tuple[str, torch.Tensor]] = []
    weights = None
    if rollout_is is not None and threshold is not None:
        upper, lower = _threshold(threshold)
        if batch_normalize or rollout_rs is not None:
            _require_tokens(m)
        weights = _is_weights(log_ratio, row_log_ratio, m, rollout_is, upper, lower, batch_normalize, out)
    kept_mask = response_mask.clone()
    rs_metrics: Dict[str, float] = {}
    if rollout_rs is not None:
        if rs_threshold is None:
            raise ValueError("rollout_rs_threshold must be explicitly provided when rollout_rs "
                             "is enabled. Set rollout_rs_threshold to the desired threshold "
                             "value.")
        _require_tokens(m)
        from verl.trainer.ppo.rollout_corr_helper import compute_rollout_rejection_mask
        kept_mask, rs_metrics = compute_rollout_rejection_mask(
            log_ratio=log_ratio, response_mask=response_mask, rollout_rs=rollout_rs,
            rollout_rs_threshold=rs_threshold)
    is_keys = [key for key, _ in out]
    _offpolicy(log_prob, rollout_log_prob, log_ratio, row_log_ratio, m, out)
    tensors = [value for _, value in out if isinstance(value, torch.Tensor)]
    values = iter(torch.stack([t.detach().double() for t in tensors] + [
        m.count.double()]).tolist())
    floats = {key: next(values) if isinstance(value, torch.Tensor) else float(value)
              for key, value in out}
    if next(values) == 0:
        raise ValueError("response_mask must contain at least one valid token (1).")
    metrics = {f"rollout_corr/{key}": floats[key] for key in is_keys}
    metrics.update({f"rollout_corr/{key}": value for key, value in rs_metrics.items()})
    metrics.update({f"rollout_corr/{key}": floats[key] for key, _ in out
                    if key not in is_keys})
    return weights, kept_mask, metrics


def _require_tokens(m: _Masked) -> None:
    if not bool(m.count > 0):
        raise ValueError("response_mask must contain at least one valid token (1).")
