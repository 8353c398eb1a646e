"""Comparison of metric dicts (loss functions' return_metrics, mismatch_metrics) with the
reference's, for tests/loss.

Fractions, ratio statistics, perplexities and IS weights are compared with the fp32 relative
tolerance. Means of signed terms (kl, the log-ppl differences, chi2 of e^2d - 1) can be near 0
while their terms are not: like the loss sums, they get an absolute budget of tol times the
mean |term| over the same tokens.
"""
import math

import torch

from tests._compare import assert_close

SIGNED = {"kl": "d", "log_ppl_diff": "d", "log_ppl_diff_max": "d", "log_ppl_diff_min": "d",
          "log_ppl_abs_diff": "d", "chi2_token": "chi2", "chi2_seq": "chi2",
          "rollout_is_seq_max_deviation": "d", "rollout_is_std": "d",
          "rollout_is_seq_std": "d", "k3_kl": "d"}


def metric_scales(train, rollout, loss_mask=None, also_finite=None):
    """Mean |d| and mean |e^(2d) - 1| over M, d = train - rollout (the budgets' scales)."""
    train, rollout = train.detach().double().cpu(), rollout.detach().double().cpu()
    in_m = torch.isfinite(train) & torch.isfinite(rollout)
    if also_finite is not None:
        in_m &= torch.isfinite(also_finite.detach().cpu())
    if loss_mask is not None:
        in_m &= loss_mask.cpu() != 0
    d = torch.where(in_m, train - rollout, 0.0).clamp(-20, 20)
    n = in_m.sum().clamp(min=1).double()
    return {"d": float(d.abs().sum() / n),
            "chi2": float(torch.expm1(2 * d).abs().sum() / n)}


def assert_metrics_close(got, ref, scales=None, *, tol=1e-5):
    assert set(got) == set(ref), sorted(set(got) ^ set(ref))
    for key in ref:
        g = got[key].detach().reshape(()).double().cpu()
        r = ref[key].detach().reshape(()).double().cpu()
        if key in SIGNED and scales is not None and bool(torch.isfinite(r)):
            budget = tol * max(scales[SIGNED[key]], abs(float(r))) + 1e-7
            assert abs(float(g - r)) <= budget, (
                f"{key}: {float(g)} vs {float(r)} (budget {budget:.2e})")
        elif math.isnan(float(r)):
            assert math.isnan(float(g)), f"{key}: {float(g)} vs NaN"
        else:
            assert_close(g, r, tol=tol, name=key)
