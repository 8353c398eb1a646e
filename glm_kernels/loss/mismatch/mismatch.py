"""Train/rollout mismatch metrics, under verl's names and with verl's values.

With train = the trainer's log-probs of the sampled tokens (``old_logprobs`` when the loss is
decoupled), rollout = the engine's, b the rows of the last dim (sequences), M the masked
tokens whose log-probs are all finite, n = |M|, n_b = |M_b|, lr = train - rollout on M, and
verl's masked mean mm(x) = sum_M x / (n + 1e-8) (per row: / (n_b + 1e-8), so a row without
tokens has mean 0 and still counts, as in verl and slime)::

    training_log_ppl  = mean_b(-mm_b(train))          training_ppl = mean_b exp(-mm_b(train))
    rollout_log_ppl   = mean_b(-mm_b(rollout))        rollout_ppl  = mean_b exp(-mm_b(rollout))
    kl                = mm(rollout - train)           k3_kl        = mm(e^lr - lr - 1)
    log_ppl_diff_b    = mm_b(rollout) - mm_b(train)   -> log_ppl_diff (mean), log_ppl_abs_diff
                        (mean |.|), log_ppl_diff_max, log_ppl_diff_min;  ppl_ratio = mean_b e^(.)
    chi2_token        = mm(e^(2 clamp(lr, +-20))) - 1
    chi2_seq          = mean_b e^(2 clamp(sum_{M_b} lr, +-20)) - 1

    IS weights of the IcePop gate [lo, hi] (verl's token-level ``rollout_is`` with the
    threshold "lo_hi"): raw = e^clamp(lr, +-20) (the gate's fp32 ratio), w = raw on tokens the
    gate keeps, else 0:
    rollout_is_mean = mm(w); rollout_is_max / _min = max / min of w over M;
    rollout_is_std = sqrt(max(mm(w^2) - mm(w)^2, 0)) (0 when n <= 1);
    rollout_is_eff_sample_size = 1 / mm((w / (mm(w) + 1e-8))^2);
    rollout_is_ratio_fraction_high / _low = mm(raw > hi) / mm(raw < lo);
    rollout_is_oob_ratio = mm(raw outside [lo, hi]);
    rollout_is_seq_mean / _std (unbiased; 0 for one row) / _max / _min of mm_b(w),
    rollout_is_seq_max_deviation = max_b |mm_b(w) - 1|,
    rollout_is_seq_fraction_high / _low = mean_b(mm_b(raw) > hi) / mean_b(mm_b(raw) < lo).

    nonfinite_frac          = masked tokens with a NaN/inf train-side log-prob / masked tokens
    rollout_nonfinite_count = masked tokens with a NaN/inf rollout log-prob

verl's formulas are computed in fp64 from the fp32 inputs (verl computes in the input dtype).
Where verl would divide by nothing (no token in M; verl raises) the means are NaN. Non-finite
tokens are left out of M and counted instead (verl has no such policy: they would make its
metrics NaN). Everything is device ops, no host sync; the per-row sums use a fixed-order
reduction under ``glm_kernels.batch_invariant()``.
"""
from __future__ import annotations

from typing import Dict, Optional

import torch

from ... import _checks, _dispatch
from ... import _row_invariant as _invariant
from .._common import checks as loss_checks

LOG_RATIO_CLAMP = 20.0
_EPS = 1e-8                           # verl's masked_mean denominator guard

MISMATCH_KEYS = (
    "training_ppl", "training_log_ppl", "rollout_ppl", "rollout_log_ppl", "kl", "k3_kl",
    "log_ppl_diff", "log_ppl_abs_diff", "log_ppl_diff_max", "log_ppl_diff_min", "ppl_ratio",
    "chi2_token", "chi2_seq",
    "rollout_is_mean", "rollout_is_std", "rollout_is_min", "rollout_is_max",
    "rollout_is_eff_sample_size", "rollout_is_ratio_fraction_high",
    "rollout_is_ratio_fraction_low", "rollout_is_oob_ratio",
    "rollout_is_seq_mean", "rollout_is_seq_std", "rollout_is_seq_max", "rollout_is_seq_min",
    "rollout_is_seq_max_deviation", "rollout_is_seq_fraction_high",
    "rollout_is_seq_fraction_low",
    "nonfinite_frac", "rollout_nonfinite_count",
)


def _as_rows(x: torch.Tensor) -> torch.Tensor:
    """[*S] -> [rows, row_len]: the last dim is the sequence (a 0-D or 1-D input is one)."""
    if x.dim() < 2:
        return x.reshape(1, -1)
    return x.reshape(x.shape[:-1].numel(), x.shape[-1])


def mismatch_from_tokens(train: torch.Tensor, rollout: torch.Tensor,
                         loss_mask: Optional[torch.Tensor] = None, *, gate_low: float,
                         gate_high: float, also_finite: Optional[torch.Tensor] = None
                         ) -> Dict[str, torch.Tensor]:
    """The metrics of the module docstring from per-token tensors of one shape (detached).

    ``also_finite``: another train-side tensor that must be finite for a token to be in M
    (the policy's log-probs in the decoupled mode, where train = old_logprobs).
    """
    train, rollout = _as_rows(train.detach()), _as_rows(rollout.detach())
    masked = (torch.ones_like(train, dtype=torch.bool) if loss_mask is None
              else _as_rows(loss_mask.detach()) != 0)
    train_ok = torch.isfinite(train)
    if also_finite is not None:
        train_ok = train_ok & torch.isfinite(_as_rows(also_finite.detach()))
    rollout_ok = torch.isfinite(rollout)
    in_m = masked & train_ok & rollout_ok
    row_sum = _invariant.tree_sum if _dispatch.batch_invariant_enabled() else (
        lambda x: x.sum(-1))
    on_m = lambda x: torch.where(in_m, x, 0.0)                         # noqa: E731
    f64 = torch.float64

    n_b = row_sum(in_m.to(f64))
    n = n_b.sum()
    nan = torch.full_like(n, float("nan"))
    # Nothing measured (no token in M): every mean is NaN, the per-row ones too.
    has_m = n > 0
    mean_m = lambda total: torch.where(has_m, total / (n + _EPS), nan)           # noqa: E731
    mean_b = lambda per_row: _over(per_row, torch.mean, has_m, nan)               # noqa: E731

    train64, rollout64 = on_m(train.to(f64)), on_m(rollout.to(f64))
    log_ratio = train64 - rollout64
    mean_train_b = row_sum(train64) / (n_b + _EPS)
    mean_rollout_b = row_sum(rollout64) / (n_b + _EPS)
    sum_log_ratio_b = row_sum(log_ratio)
    log_ppl_diff_b = -sum_log_ratio_b / (n_b + _EPS)

    # The gate's fp32 ratio, as the loss tests it; IS weights on the tokens it keeps.
    raw32 = torch.exp((train.float() - rollout.float()).clamp(-LOG_RATIO_CLAMP,
                                                              LOG_RATIO_CLAMP))
    raw = on_m(raw32.to(f64))
    kept = in_m & (raw32 >= gate_low) & (raw32 <= gate_high)
    high, low = in_m & (raw32 > gate_high), in_m & (raw32 < gate_low)
    weights = torch.where(kept, raw, 0.0)
    w_mean = weights.sum() / (n + _EPS)
    w_sq_mean = weights.square().sum() / (n + _EPS)
    seq_w = row_sum(weights) / (n_b + _EPS)
    seq_raw = row_sum(raw) / (n_b + _EPS)
    inf = float("inf")
    multi_rows = train.shape[0] > 1

    out = {
        "training_ppl": mean_b(torch.exp(-mean_train_b)),
        "training_log_ppl": mean_b(-mean_train_b),
        "rollout_ppl": mean_b(torch.exp(-mean_rollout_b)),
        "rollout_log_ppl": mean_b(-mean_rollout_b),
        "kl": mean_m(-log_ratio.sum()),
        "k3_kl": mean_m(on_m(torch.expm1(log_ratio) - log_ratio).sum()),
        "log_ppl_diff": mean_b(log_ppl_diff_b),
        "log_ppl_abs_diff": mean_b(log_ppl_diff_b.abs()),
        "log_ppl_diff_max": _over(log_ppl_diff_b, torch.amax, has_m, nan),
        "log_ppl_diff_min": _over(log_ppl_diff_b, torch.amin, has_m, nan),
        "ppl_ratio": mean_b(torch.exp(log_ppl_diff_b)),
        "chi2_token": mean_m(on_m(torch.expm1(2.0 * log_ratio.clamp(
            -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))).sum()),
        "chi2_seq": mean_b(torch.expm1(2.0 * sum_log_ratio_b.clamp(-LOG_RATIO_CLAMP,
                                                                   LOG_RATIO_CLAMP))),
        "rollout_is_mean": mean_m(weights.sum()),
        "rollout_is_std": torch.where(
            n > 1, (w_sq_mean - w_mean.square()).clamp(min=0.0).sqrt(),
            torch.where(has_m, torch.zeros_like(n), nan)),
        "rollout_is_min": _over(torch.where(in_m, weights, inf), torch.amin, has_m, nan),
        "rollout_is_max": _over(torch.where(in_m, weights, -inf), torch.amax, has_m, nan),
        "rollout_is_eff_sample_size": torch.where(
            has_m, 1.0 / (w_sq_mean / (w_mean + _EPS).square()), nan),
        "rollout_is_ratio_fraction_high": mean_m(high.to(f64).sum()),
        "rollout_is_ratio_fraction_low": mean_m(low.to(f64).sum()),
        "rollout_is_oob_ratio": mean_m((high | low).to(f64).sum()),
        "rollout_is_seq_mean": mean_b(seq_w),
        "rollout_is_seq_std": _over(seq_w, torch.std if multi_rows else torch.zeros_like,
                                    has_m, nan),
        "rollout_is_seq_max": _over(seq_w, torch.amax, has_m, nan),
        "rollout_is_seq_min": _over(seq_w, torch.amin, has_m, nan),
        "rollout_is_seq_max_deviation": _over((seq_w - 1.0).abs(), torch.amax, has_m, nan),
        "rollout_is_seq_fraction_high": mean_b((seq_raw > gate_high).to(f64)),
        "rollout_is_seq_fraction_low": mean_b((seq_raw < gate_low).to(f64)),
        "nonfinite_frac": (masked & ~train_ok).to(f64).sum() / masked.to(f64).sum().clamp(
            min=1.0),
        "rollout_nonfinite_count": (masked & ~rollout_ok).to(f64).sum(),
    }
    return {key: out[key].to(torch.float32) for key in MISMATCH_KEYS}


def _over(values, reduce, has_m, nan):
    """reduce(values) (a scalar) where anything was measured, else NaN (also for no values,
    where torch's reductions raise or warn)."""
    if values.numel() == 0:
        return nan
    return torch.where(has_m, reduce(values).reshape(()), nan)


def train_side_nonfinite_count(train: torch.Tensor, loss_mask: Optional[torch.Tensor],
                               also_finite: Optional[torch.Tensor] = None) -> int:
    """Masked tokens whose train-side log-probs are NaN/inf (one host read)."""
    bad = ~torch.isfinite(train.detach())
    if also_finite is not None:
        bad = bad | ~torch.isfinite(also_finite.detach())
    if loss_mask is not None:
        bad = bad & (loss_mask != 0)
    return int(bad.sum().item())


def raise_if_nonfinite(what: str, train, loss_mask, also_finite=None) -> None:
    """raise_on_nonfinite=True: one host read of the count (a device sync on a GPU)."""
    bad = train_side_nonfinite_count(train, loss_mask, also_finite)
    if bad:
        masked = train.numel() if loss_mask is None else int((loss_mask != 0).sum().item())
        raise ValueError(f"{what}: {bad} of {masked} masked tokens have a non-finite (NaN/inf) "
                         f"train-side log-prob (raise_on_nonfinite=True)")


def mismatch_metrics(train_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor,
                     loss_mask: Optional[torch.Tensor] = None, *, beta: float = 2.0,
                     gate_low: Optional[float] = None, gate_high: Optional[float] = None
                     ) -> Dict[str, torch.Tensor]:
    """Train/rollout mismatch metrics for trainers that keep their own loss (verl's keys).

    Parameters
    ----------
    train_logprobs : Tensor [*S], float32 / bfloat16 / float16
        log pi_train of the sampled tokens (the trainer's recompute). Not differentiated.
    rollout_logprobs : Tensor [*S], any float dtype
        log pi_rollout recorded by the inference engine.
    loss_mask : Tensor [*S], bool or 0/1, optional
        Tokens that count. None = all. Rows of the last dim are the sequences.
    beta, gate_low, gate_high
        The IcePop gate [gate_low or 1/beta, gate_high or beta]: the ``rollout_is_*`` metrics
        describe its importance weights (verl's ``rollout_is_threshold="lo_hi"``).

    Returns
    -------
    dict of detached fp32 scalars, the keys of ``MISMATCH_KEYS``: verl 0.9.1's
    ``compute_offpolicy_metrics`` and token-level ``compute_rollout_correction_weights``
    metrics without the ``rollout_corr/`` prefix, equal to verl's on the same inputs, plus
    ``nonfinite_frac`` and ``rollout_nonfinite_count`` (formulas: the module docstring).

    Example
    -------
    >>> import torch, glm_kernels
    >>> train = torch.tensor([[-1.0, -2.0], [-0.5, -0.5]])
    >>> m = glm_kernels.mismatch_metrics(train, train - 0.1)   # rollout 0.1 nats lower
    >>> round(m["kl"].item(), 4), round(m["log_ppl_diff"].item(), 4)
    (-0.1, -0.1)
    >>> round(m["k3_kl"].item(), 6)                             # e^0.1 - 1 - 0.1
    0.005171
    """
    check = _checks.check_tensor
    check("train_logprobs", train_logprobs, dtypes=(torch.float32, torch.bfloat16,
                                                    torch.float16))
    check("rollout_logprobs", rollout_logprobs, floating=True)
    _checks.check_same_shape("rollout_logprobs", rollout_logprobs, "train_logprobs",
                               train_logprobs)
    if loss_mask is not None:
        loss_checks.check_loss_mask(loss_mask, "train_logprobs", train_logprobs)
    _checks.check_same_device(dict(train_logprobs=train_logprobs,
                                     rollout_logprobs=rollout_logprobs, loss_mask=loss_mask))
    lo, hi, _, _ = loss_checks.check_icepop_hyperparameters(beta, gate_low, gate_high, 0.2, 0.28)
    return mismatch_from_tokens(train_logprobs, rollout_logprobs, loss_mask, gate_low=lo,
                                gate_high=hi)
