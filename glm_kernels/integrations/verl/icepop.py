"""verl plug-in: IcePop and every verl policy loss, registered through verl's own registry.

verl (checked against verl 0.9.1) looks a policy loss up by name in
``verl.trainer.ppo.core_algos.POLICY_LOSS_REGISTRY`` (``register_policy_loss``) and calls it
from its actor's ``ppo_loss`` (verl/workers/utils/losses.py) as::

    pg_loss, pg_metrics = policy_loss_fn(old_log_prob=..., log_prob=..., advantages=...,
                                         response_mask=..., loss_agg_mode=..., config=...,
                                         rollout_is_weights=...)

Importing this module, when verl is installed, registers :func:`icepop_policy_loss` under
``"icepop"`` (:func:`register` does it explicitly, and raises if verl is missing) and
``glm_<name>`` for every loss in verl's registry (:func:`register_all`; the losses live in
:mod:`glm_kernels.integrations.verl.losses`). Select one with
``actor_rollout_ref.actor.policy_loss.loss_mode=icepop`` (or ``=glm_gspo``, ...);
docs/verl.md has the config lines, including how verl's Ray workers import this module
(``VERL_USE_EXTERNAL_MODULES``).

IcePop has two modes, chosen by what verl hands the loss:

* **decoupled** (``rollout_is_weights`` given): verl recomputed ``old_log_prob`` and its
  rollout-correction step turned the rollout log-probs into per-token IS weights -- with
  ``algorithm.rollout_correction.rollout_is=token`` and ``rollout_is_threshold="lo_hi"``
  those are IcePop's ``w = k * 1[lo <= k <= hi]``, k = exp(old - rollout)
  (``RolloutCorrectionConfig.decoupled_token_icepop``). verl never passes the rollout
  log-probs themselves to a policy loss, so the gate is verl's; the core op computes
  ``w * max(-r A, -clip(r) A)`` (dual-clipped) with r = exp(log_prob - old) as its token
  weights. Any other IS weights (TIS, sequence level) are honoured the same way.
* **coupled** (no ``rollout_is_weights``): ``old_log_prob`` is the ratio's base and the gate
  is on rho = exp(log_prob - old) itself (the core op's ``gate="coupled"``). With
  ``algorithm.rollout_correction.bypass_mode=true`` verl's trainer puts the rollout
  log-probs in ``old_log_prob`` and skips the old-log-prob forward: that is GLM-5's coupled
  (TITO) IcePop. The gate interval is read from
  ``actor_rollout_ref.actor.policy_loss.rollout_correction.rollout_is_threshold`` when it is a
  ``"lo_hi"`` string (verl's IcePop spelling), else [1/2, 2] (beta = 2).

Both modes keep verl's PPO details: the clip [1 - clip_ratio_low, 1 + clip_ratio_high], the
dual clip ``clip_ratio_c`` for negative advantages, every ``loss_agg_mode`` with
``config.global_batch_info`` (verl's ``agg_loss`` arithmetic, done by the core op), and verl's
metric names ``actor/pg_clipfrac``, ``actor/ppo_kl``, ``actor/pg_clipfrac_lower`` (from the
core op's statistics, the same pass) plus ``actor/pop_frac`` (masked tokens whose weight is
0) and ``actor/icepop_ratio_mean``.

Log-probs from hidden states: verl's actor computes ``log_prob`` itself (its
``use_fused_kernels`` option already avoids [tokens, V] logits); verl 0.9.1 has no plug point
for a policy loss to take hidden states and the LM head instead, so this plug-in takes the
log-probs verl gives it.
"""
from __future__ import annotations

import importlib.util
from typing import Any, Dict, Optional, Tuple

import torch

from ...loss import MISMATCH_KEYS, mismatch_metrics, policy_loss
from .losses import (AGG_MODES, INSTALL_HINT, POLICY_LOSSES, VERL_LOSS_NAMES, check_inputs,
                     clip_ranges, dual_clip, field, reduction_kwargs, register_all, verl_core)

__all__ = ["icepop_policy_loss", "register", "register_all", "gate_bounds", "LOSS_NAME",
           "INSTALL_HINT", "POLICY_LOSSES", "VERL_LOSS_NAMES", "AGG_MODES"]

LOSS_NAME = "icepop"
DEFAULT_GATE = (0.5, 2.0)          # IcePop beta = 2
_LOG_RATIO_CLAMP = 20.0            # verl's vanilla clamp of log_prob - old_log_prob


def register(name: str = LOSS_NAME) -> None:
    """Register :func:`icepop_policy_loss` in verl's policy-loss registry under ``name``."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"name must be a non-empty string, got {name!r}")
    verl_core().register_policy_loss(name)(icepop_policy_loss)


def gate_bounds(config) -> Tuple[float, float]:
    """The coupled-mode gate [lo, hi]: ``config.policy_loss.rollout_correction.
    rollout_is_threshold`` when it is a ``"lo_hi"`` string, else (0.5, 2.0)."""
    correction = field(field(config, "policy_loss"), "rollout_correction")
    spec = field(correction, "rollout_is_threshold")
    if not isinstance(spec, str) or "_" not in spec:
        return DEFAULT_GATE
    low_text, high_text = spec.split("_", 1)
    try:
        low, high = float(low_text), float(high_text)
    except ValueError:
        raise ValueError(f"policy_loss.rollout_correction.rollout_is_threshold={spec!r}: expected "
                         f"'lo_hi' with two numbers, e.g. '0.5_2.0'") from None
    if not 0.0 <= low <= high:
        raise ValueError(f"policy_loss.rollout_correction.rollout_is_threshold={spec!r}: need "
                         f"0 <= lo <= hi")
    return low, high


def icepop_policy_loss(old_log_prob: torch.Tensor, log_prob: torch.Tensor,
                       advantages: torch.Tensor, response_mask: torch.Tensor,
                       loss_agg_mode: str = "token-mean", config: Any = None,
                       rollout_is_weights: Optional[torch.Tensor] = None
                       ) -> Tuple[torch.Tensor, Dict[str, float]]:
    """IcePop policy loss with verl's policy-loss signature.

    Parameters
    ----------
    old_log_prob : Tensor [B, T] fp32
        verl's ``old_log_probs``: the recomputed pi_old (decoupled), or the rollout
        log-probs in bypass mode (coupled, TITO).
    log_prob : Tensor [B, T]
        log pi_theta of the response tokens; the only input that gets a gradient.
    advantages : Tensor [B, T] fp32
    response_mask : Tensor [B, T] bool or 0/1
    loss_agg_mode : str
        One of verl's "token-mean", "token-sum", "seq-mean-token-sum",
        "seq-mean-token-mean", "seq-mean-token-sum-norm"; verl's ``agg_loss`` arithmetic with
        ``config.global_batch_info`` (the core op's reduction).
    config : verl ``ActorConfig`` (or a mapping with the same fields)
        Read: ``clip_ratio``, ``clip_ratio_low``, ``clip_ratio_high``, ``clip_ratio_c``,
        ``global_batch_info``, ``policy_loss.rollout_correction.rollout_is_threshold``.
    rollout_is_weights : Tensor [B, T], optional
        verl's rollout-correction IS weights (detached). Given: decoupled mode, each token's
        PPO term is multiplied by its weight. None: coupled mode, gate on exp(log_prob - old).

    Returns
    -------
    (pg_loss, metrics): fp32 scalar; python floats keyed ``actor/pg_clipfrac``,
    ``actor/ppo_kl``, ``actor/pg_clipfrac_lower`` (verl's vanilla definitions, from the core
    op's stats), ``actor/pop_frac``, ``actor/icepop_ratio_mean`` and, coupled, the
    train-inference mismatch metrics ``actor/<MISMATCH_KEYS>``.
    """
    check_inputs(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode,
                 rollout_is_weights, config)
    eps_low, eps_high = clip_ranges(config)
    mask = response_mask.bool()
    old, adv = old_log_prob.detach(), advantages.detach()
    common = dict(variant="vanilla", eps_low=eps_low, eps_high=eps_high,
                  dual_clip=dual_clip(config), **reduction_kwargs(loss_agg_mode, config))
    keys = ("pg_clipfrac", "ppo_kl", "pg_clipfrac_lower", "pop_frac", "icepop_ratio_mean")
    if rollout_is_weights is None:
        # Coupled: base = old_log_prob (the rollout's in bypass mode), gate on rho itself.
        lo, hi = gate_bounds(config)
        gate = dict(rollout_logprobs=old, gate="coupled", gate_low=lo, gate_high=hi, **common)
        pg_loss, stats = policy_loss(log_prob, old, adv, mask, return_stats=True, **gate)
        with torch.no_grad():
            # old_log_prob is the rollout's, so the mismatch metrics are the engine drift;
            # decoupled, verl's rollout-correction step reports its own.
            stats.update(mismatch_metrics(log_prob.detach(), old, mask, gate_low=lo,
                                          gate_high=hi))
            rho = torch.exp((log_prob.detach().float() - old.float()).clamp(
                -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP))
            stats["icepop_ratio_mean"] = (torch.where(mask, rho, 0.0).sum()
                                          / mask.sum().clamp(min=1))
        keys += MISMATCH_KEYS
    else:
        # Decoupled: verl's weights are the core op's token weights (0 = popped by verl's gate).
        weights = rollout_is_weights.detach()
        gate = dict(token_weights=weights, **common)
        pg_loss, stats = policy_loss(log_prob, old, adv, mask, return_stats=True, **gate)
        with torch.no_grad():
            # Popped tokens have w = 0, so the sum over masked tokens is the sum over kept ones.
            n_masked = mask.sum()
            n_kept = (mask & (weights != 0)).sum()
            stats["pop_frac"] = (n_masked - n_kept) / n_masked.clamp(min=1)
            stats["icepop_ratio_mean"] = (torch.where(mask, weights.float(), 0.0).sum()
                                          / n_kept.clamp(min=1))
    # One host transfer for the metrics (verl's .item()s sync too). A popped token (weight 0,
    # or outside the coupled gate) adds exactly 0 even with inf / NaN inputs: policy_loss
    # guarantees it.
    metric_values = torch.stack([stats[key].float() for key in keys]).tolist()
    return pg_loss, {f"actor/{key}": value for key, value in zip(keys, metric_values)}


if importlib.util.find_spec("verl") is not None:
    register()
    register_all()
