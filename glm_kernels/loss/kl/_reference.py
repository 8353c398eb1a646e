"""Plain-PyTorch definition of the reference-KL penalty (verl's ``kl_penalty`` + ``agg_loss``).

Per-token terms, d = log_prob - ref_log_prob, x = -d = ref_log_prob - log_prob
(J. Schulman, "Approximating KL divergence", 2020)::

    k1 / kl          l = d                                    dl/dlp = 1
    abs              l = |d|                                  dl/dlp = sign(d)   (0 at d = 0)
    k2 / mse         l = d^2 / 2                              dl/dlp = d
    k3 / low_var_kl  xc = clamp(x, -20, 20)
                     l = clamp(e^xc - xc - 1, -10, 10)        dl/dlp = 1 - e^xc inside both
                                                              clamps (ends included), else 0
    <kind>+          l as <kind>                              dl/dlp = d  (straight-through:
                                                              the k2 gradient, unbiased)

``clamp=False`` drops both k3 clamps: l = e^x - x - 1, TRL's per-token KL (``beta > 0``).
The clamps' zero-gradient regions are torch.clamp's: the gradient passes where
min <= input <= max, so a term sitting exactly on an end still gets it.

Aggregation over a [rows, T] mask m (verl's ``agg_loss``; S_b = sum_t l*m, N_b = sum_t m,
v_b = 1[N_b > 0], masked-out tokens contribute exactly 0 whatever their value)::

    token-mean               dp * sum_b S_b / (batch_num_tokens or sum_b N_b)
    token-sum                dp * sum_b S_b
    seq-mean-token-sum       dp * sum_b v_b S_b / (global_batch_size or sum_b v_b)
    seq-mean-token-sum-norm  the same / (loss_scale_factor or T)
    seq-mean-token-mean      dp * sum_b v_b S_b / (N_b + 1e-8) / (global_batch_size or sum_b v_b)

The loss is linear in the per-token terms, so d loss / d lp_bt = row_scale_b * m_bt * dl_bt
with one scale per row; both backends compute (S_b, N_b) and the gradient coefficient m * dl,
then :func:`aggregate_rows` turns the row sums into the loss and the row scales.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

KINDS = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
# Kind codes the kernel takes as a constexpr (aliases share one code).
KIND_CODES = {"kl": 1, "k1": 1, "abs": 2, "mse": 3, "k2": 3, "low_var_kl": 4, "k3": 4}
K1, ABS, K2, K3 = 1, 2, 3, 4
LOSS_AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-sum-norm",
                  "seq-mean-token-mean")
LOG_RATIO_CLAMP = 20.0
K3_CLAMP = 10.0
SEQ_MEAN_EPS = 1e-8          # verl's seq-mean-token-mean: S_b / (N_b + 1e-8)


def kl_terms(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, kind_code: int,
             straight_through: bool, clamp: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """(l, dl/dlp), both fp32 of the input shape, in closed form (no autograd)."""
    lp, ref = log_prob.float(), ref_log_prob.float()
    d = lp - ref
    if kind_code == K1:
        terms, grad = d, torch.ones_like(d)
    elif kind_code == ABS:
        terms, grad = d.abs(), torch.sign(d)
    elif kind_code == K2:
        terms, grad = 0.5 * d * d, d
    elif kind_code == K3:
        x = -d
        if not clamp:
            ratio = torch.exp(x)
            terms = (ratio - x).sub_(1.0)
            grad = ratio.neg_().add_(1.0)
        else:
            x_clamped = x.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
            ratio = torch.exp(x_clamped)
            terms = (ratio - x_clamped).sub_(1.0)
            grad = ratio.neg_().add_(1.0)
            # torch.clamp's gradient passes where min <= input <= max (x == its clamp; NaN
            # fails). The term is >= 0 up to rounding, so only its upper end can bind.
            passes = (x == x_clamped).logical_and_(terms <= K3_CLAMP)
            terms.clamp_(-K3_CLAMP, K3_CLAMP)
            grad.masked_fill_(passes.logical_not_(), 0.0)
    else:
        raise ValueError(f"unknown kind code {kind_code}")
    if straight_through:
        grad = d.clone() if terms is d else d      # k1+: two outputs, two tensors
    return terms, grad


def masked_row_sums(terms: torch.Tensor, grad: Optional[torch.Tensor], mask: torch.Tensor
                    ) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """[rows, T] terms and mask -> (S_b, N_b, gradient coefficient m * dl or None), fp32.

    A masked-out token (m == 0) gives exactly 0 even when its term is inf or NaN. ``grad`` is
    overwritten (it becomes the coefficient)."""
    dropped = mask.logical_not()
    kept_terms = terms.masked_fill(dropped, 0.0)
    if mask.dtype == torch.bool:                   # weights are 1: no multiply
        row_loss, row_count = kept_terms.sum(-1), mask.sum(-1, dtype=torch.float32)
        coef = None if grad is None else grad.masked_fill_(dropped, 0.0)
        return row_loss, row_count, coef
    m = mask.float()
    row_loss = (kept_terms * m).sum(-1)
    coef = None if grad is None else grad.mul_(m).masked_fill_(dropped, 0.0)
    return row_loss, m.sum(-1), coef


def aggregate_rows(row_loss: torch.Tensor, row_count: torch.Tensor, loss_agg_mode: str,
                   dp_size: int, batch_num_tokens: Optional[float],
                   global_batch_size: Optional[float], loss_scale_factor: Optional[float],
                   seq_len: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """(loss fp32 scalar, row_scale [rows] fp32): verl's agg_loss on row sums [rows].

    As in verl, an empty denominator (no masked token for token-mean, no row with a token for
    the seq-mean modes) without batch_num_tokens / global_batch_size gives a NaN loss; the
    gradient is then 0 (no token is masked in), so row_scale is 0 where it would be inf/NaN.
    Given counts enter as Python numbers (no host-to-device copy: CUDA-graph capturable).
    """
    total = row_loss.double()
    if loss_agg_mode == "token-sum":
        return (total.sum() * dp_size).float(), torch.full_like(row_loss, float(dp_size))
    if loss_agg_mode == "token-mean":
        if batch_num_tokens is not None:
            loss = total.sum() / batch_num_tokens * dp_size
            return loss.float(), torch.full_like(row_loss, dp_size / batch_num_tokens)
        denom = row_count.double().sum()
        loss = total.sum() / denom * dp_size
        factor = torch.where(denom != 0, dp_size / denom, 0.0).float()
        return loss.float(), factor.expand(row_loss.shape).contiguous()
    valid = row_count > 0
    if loss_agg_mode == "seq-mean-token-mean":
        per_row = 1.0 / (row_count.double() + SEQ_MEAN_EPS)
    else:
        per_row = torch.ones_like(total)
        if loss_agg_mode == "seq-mean-token-sum-norm":
            per_row = per_row / float(seq_len if loss_scale_factor is None
                                      else loss_scale_factor)
    weights = torch.where(valid, per_row, 0.0)
    if global_batch_size is not None:
        loss = (total * weights).sum() / global_batch_size * dp_size
        return loss.float(), (weights * (dp_size / global_batch_size)).float()
    denom = valid.double().sum()
    loss = (total * weights).sum() / denom * dp_size
    scale = torch.where(denom != 0, weights * dp_size / denom, 0.0)
    return loss.float(), scale.float()
