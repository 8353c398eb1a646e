"""Comparison of metric dicts (loss functions' return_metrics, mismatch_metrics) with the
reference's, for tests/loss.

Fractions, ratio statistics and k3 (a mean of non-negative terms) are compared with the fp32
relative tolerance. The means of signed terms (k1 and the log-ppl gaps of d, chi2 of r^2 - 1)
can be near 0 while their terms are not: like the loss sums, they get an absolute budget of
tol times the mean |term| over the same tokens.
"""
import torch

from glm_kernels.loss import _reference
from tests._compare import assert_close

SIGNED = {"mismatch_k1": "d", "log_ppl_gap": "d", "log_ppl_gap_seq": "d",
          "mismatch_chi2": "chi2"}


def metric_scales(train, rollout, loss_mask=None, also_finite=None):
    """Mean |d| and mean |r^2 - 1| over the mismatch set M (the budgets' scales)."""
    in_m, _, d, _, chi2, _ = _reference.mismatch_token_terms(
        train.cpu(), rollout.cpu(), None if loss_mask is None else loss_mask.cpu(),
        gate_low=0.5, gate_high=2.0,
        also_finite=None if also_finite is None else also_finite.cpu())
    n = in_m.sum().clamp(min=1).double()
    return {"d": float(d.abs().sum() / n), "chi2": float(chi2.abs().sum() / n)}


def assert_metrics_close(got, ref, scales=None, *, tol=1e-5):
    assert set(got) == set(ref), sorted(set(got) ^ set(ref))
    for key in ref:
        g = got[key].detach().reshape(()).double().cpu()
        r = ref[key].detach().reshape(()).double().cpu()
        assert g.dtype == r.dtype
        if key in SIGNED and scales is not None and bool(torch.isfinite(r)):
            budget = tol * scales[SIGNED[key]] + 1e-7
            assert abs(float(g - r)) <= budget, (
                f"{key}: {float(g)} vs {float(r)} (budget {budget:.2e})")
        else:
            assert_close(g, r, tol=tol, name=key)
