"""Importance weights for slime's off-policy correction, on whole packed sequences.

The three TIS hooks slime 624b824 ships or documents, as per-token weights and masks that the
policy loss (``slime_policy.policy_loss_function``) folds into ``glm_kernels.policy_loss``'s
``token_weights``, vectorised over every sample at once (slime loops over samples):

* vanilla TIS (``--use-tis``, no ``--custom-tis-function-path``)::

      k = exp(lp_train - lp_rollout);  w = clamp(k, tis_clip_low, tis_clip)

* slime's IcePop hook (``slime...loss.icepop_function``): ``w = k * 1[lo <= k <= hi]``
  (the ``icepop_loss`` kernel's gate, ``slime.icepop_gate_weights``);
* MIS (slime's ``examples/train_infer_mismatch_helper/mis.py``,
  ``compute_mis_weights_with_cp``, configured by ``--custom-config-path mis.yaml``): with
  d = lp_train - lp_rollout and L the sequence's masked tokens::

      level  token: x_t = d_t;  sequence: x_t = sum_L d;  geometric: x_t = mean_L d
      w = exp(clamp(x, -20, 20))
      tis_mode  truncate: w = min(w, U) * m;   clip: w = clamp(w, lo, U) * m;
                mask:     w = w * m,  m' = m * 1[lo <= w <= U]
      use_rs:   m' *= 1[rs_lo <= exp(clamp(x_rs)) <= rs_hi]   (x_rs at rs_level)
                veto: m' = 0 on every token of a sequence with a masked d_t < log(veto)
      tis_batch_normalize: w /= mean(w) (token level: over masked tokens; sequence level:
                mean over samples of the per-sample masked mean), when that mean > 1e-8

  lo defaults to 1 / U, the RS bounds to the TIS ones. The per-token metrics are mis.py's
  (``add_ppl_metrics`` and the weight statistics), under the same names without the ``mis_``
  prefix its CP wrapper adds.

Inputs are fp32 [N] over the packed responses of a micro-batch (whole responses: under
context parallelism the caller gathers them first, as slime's hooks do), ``mask`` fp32 0/1,
``seg`` int64 [N] the sample index of every token, ``samples`` the sample count.
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch

LOG_RATIO_BOUND = 20.0          # mis.py's SAFETY_BOUND on every log-ratio before exp
LEVELS = ("token", "sequence", "geometric")
MODES = ("truncate", "clip", "mask")


class Segments:
    """Per-sample sums and means over packed tokens, broadcast back to the tokens."""

    def __init__(self, seg: torch.Tensor, samples: int, mask: torch.Tensor):
        self.seg, self.samples, self.mask = seg, samples, mask
        self.count = self.sum(mask)

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        """[samples]: sum of x * 1 over each sample's tokens (callers pass x * mask)."""
        return torch.zeros(self.samples, dtype=x.dtype, device=x.device).index_add_(
            0, self.seg, x)

    def masked_sum(self, x: torch.Tensor) -> torch.Tensor:
        return self.sum(x * self.mask)

    def masked_mean(self, x: torch.Tensor) -> torch.Tensor:
        return self.masked_sum(x) / self.count.clamp(min=1)

    def expand(self, per_sample: torch.Tensor) -> torch.Tensor:
        return per_sample[self.seg]

    def masked_extreme(self, x: torch.Tensor, reduce: str) -> torch.Tensor:
        """[samples] masked min or max (0 for a sample without masked tokens, as mis.py)."""
        keep = self.mask != 0
        out = torch.zeros(self.samples, dtype=x.dtype, device=x.device)
        out = out.scatter_reduce(0, self.seg[keep], x[keep], reduce=reduce, include_self=False)
        return out


def level_log_ratio(d: torch.Tensor, segs: Segments, level: str) -> torch.Tensor:
    if level == "token":
        return d
    if level == "sequence":
        return segs.expand(segs.masked_sum(d))
    if level == "geometric":
        return segs.expand(segs.masked_mean(d))
    raise ValueError(f"tis_level / rs_level must be one of {LEVELS}, got {level!r}")


def vanilla_tis(args, train: torch.Tensor, rollout: torch.Tensor
                ) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """slime's built-in TIS: (weights, per-token metrics tis / tis_clipfrac / tis_abs)."""
    low, high = float(getattr(args, "tis_clip_low", 0.0)), float(getattr(args, "tis_clip", 2.0))
    if not low <= high:
        raise ValueError(f"--tis-clip-low must be <= --tis-clip, got {low} and {high}")
    ratio = torch.exp(train - rollout)
    weights = ratio.clamp(min=low, max=high)
    return weights, {"tis": ratio, "tis_clipfrac": (weights != ratio).float(),
                     "tis_abs": (ratio - 1.0).abs()}


def _ppl_metrics(d: torch.Tensor, train: torch.Tensor, rollout: torch.Tensor, segs: Segments,
                 metrics: Dict[str, torch.Tensor]) -> None:
    """mis.py's ``add_ppl_metrics``: train/rollout perplexities, KL estimates, chi^2."""
    mean_train = segs.expand(segs.masked_mean(train))
    mean_rollout = segs.expand(segs.masked_mean(rollout))
    metrics["training_log_ppl"] = -mean_train
    metrics["training_ppl"] = torch.exp(-mean_train)
    metrics["rollout_log_ppl"] = -mean_rollout
    metrics["rollout_ppl"] = torch.exp(-mean_rollout)
    metrics["kl"] = rollout - train
    metrics["k3_kl"] = torch.exp(d) - d - 1.0
    log_ppl_diff = mean_rollout - mean_train
    metrics["log_ppl_diff"] = log_ppl_diff
    metrics["log_ppl_abs_diff"] = log_ppl_diff.abs()
    metrics["ppl_ratio"] = torch.exp(log_ppl_diff)
    rho = torch.exp(d.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND))
    metrics["chi2_token"] = segs.expand(segs.masked_mean(rho.square()) - 1.0)
    seq_sum = segs.expand(segs.masked_sum(d)).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    metrics["chi2_seq"] = torch.exp(2.0 * seq_sum) - 1.0


def _bounds(args) -> Tuple[float, float, float, float]:
    upper = float(args.tis_upper_bound)
    low = getattr(args, "tis_lower_bound", None)
    low = 1.0 / upper if low is None else float(low)
    rs_low = getattr(args, "rs_lower_bound", None)
    rs_high = getattr(args, "rs_upper_bound", None)
    return (low, upper, low if rs_low is None else float(rs_low),
            upper if rs_high is None else float(rs_high))


def _in_band(name: str, w: torch.Tensor, low: float, high: float,
             metrics: Dict[str, torch.Tensor]) -> torch.Tensor:
    if not low < high:
        raise ValueError(f"MIS {name} bounds need lower < upper, got {low} and {high}")
    metrics[f"{name}_fraction_low"] = (w < low).float()
    metrics[f"{name}_fraction_high"] = (w > high).float()
    return ((w >= low) & (w <= high)).float()


def mis_weights(args, train: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor,
                seg: torch.Tensor, samples: int
                ) -> Tuple[Optional[torch.Tensor], torch.Tensor, Dict[str, torch.Tensor]]:
    """mis.py's ``compute_mis_weights`` on packed whole responses.

    Returns (weights [N] or None without ``use_tis``, the rejection mask m' [N] (0/1, never
    above ``mask``), per-token metrics [N] each, reduced by slime's ``sum_of_sample_mean``
    over the original loss masks). All detached.
    """
    train, rollout, mask = train.detach().float(), rollout.detach().float(), mask.float()
    segs = Segments(seg, samples, mask)
    d = train - rollout
    metrics: Dict[str, torch.Tensor] = {}
    _ppl_metrics(d, train, rollout, segs, metrics)
    if not getattr(args, "use_tis", False):
        return None, mask, metrics
    tis_level, mode = args.tis_level, args.tis_mode
    low, upper, rs_low, rs_high = _bounds(args)
    x_tis = level_log_ratio(d, segs, tis_level)
    weights = torch.exp(x_tis.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND))
    metrics["tis_weight_before_bound"] = weights
    kept = mask
    if mode == "truncate":
        metrics["tis_truncate_fraction"] = (weights > upper).float()
        weights = weights.clamp(0, upper) * mask
    elif mode == "clip":
        _in_band("tis_clip", weights, low, upper, metrics)
        weights = weights.clamp(low, upper) * mask
    elif mode == "mask":
        kept = mask * _in_band("tis_mask", weights, low, upper, metrics)
        weights = weights * mask
    else:
        raise ValueError(f"tis_mode must be one of {MODES}, got {mode!r}")
    metrics["tis_weight_after_bound"] = weights
    if getattr(args, "use_rs", False):
        rs_level = args.rs_level
        x_rs = x_tis if rs_level == tis_level else level_log_ratio(d, segs, rs_level)
        rs_weights = torch.exp(x_rs.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND))
        kept = kept * _in_band("rs_mask", rs_weights, rs_low, rs_high, metrics)
        veto = getattr(args, "rs_veto_threshold", None)
        if veto is not None:
            # mis.py compares with log(threshold) taken in fp32.
            log_veto = torch.log(torch.tensor(float(veto), device=d.device))
            catastrophic = ((d < log_veto) & (mask != 0)).float()
            vetoed = segs.expand(segs.sum(catastrophic) > 0).float()
            metrics["rs_catastrophic_token_fraction"] = catastrophic
            metrics["rs_catastrophic_seq_fraction"] = vetoed
            kept = kept * (1.0 - vetoed)
    metrics["is_ratio_mean_after_tis_rs"] = weights
    if getattr(args, "tis_batch_normalize", False):
        if tis_level == "token":
            mean = (weights * mask).sum() / mask.sum().clamp(min=1)
        elif tis_level == "sequence":
            mean = segs.masked_mean(weights).sum() / samples
        else:
            raise ValueError(f"tis_batch_normalize supports tis_level token or sequence (as "
                             f"mis.py), got {tis_level!r}")
        if mean > 1e-8:
            weights = weights / mean
            metrics["batch_norm_factor"] = mean.expand_as(weights)
        else:
            metrics["batch_norm_factor"] = torch.ones_like(weights)
    metrics["is_ratio_mean_final"] = segs.expand(segs.masked_mean(weights))
    metrics["is_ratio_min_final"] = segs.expand(segs.masked_extreme(weights, "amin"))
    metrics["is_ratio_max_final"] = segs.expand(segs.masked_extreme(weights, "amax"))
    return weights, kept, metrics
