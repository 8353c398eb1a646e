"""verl plug-in: IcePop as a verl policy loss, registered through verl's own registry.

verl (checked against verl 0.9.1) looks a policy loss up by name in
``verl.trainer.ppo.core_algos.POLICY_LOSS_REGISTRY`` (``register_policy_loss``) and calls it
from its actor's ``ppo_loss`` (verl/workers/utils/losses.py) as::

    pg_loss, pg_metrics = policy_loss_fn(old_log_prob=..., log_prob=..., advantages=...,
                                         response_mask=..., loss_agg_mode=..., config=...,
                                         rollout_is_weights=...)

Importing this module registers :func:`icepop_policy_loss` under ``"icepop"`` when verl is
installed (:func:`register` does it explicitly, and raises if verl is missing). Select it with
``actor_rollout_ref.actor.policy_loss.loss_mode=icepop``; docs/verl.md has the config lines,
including how verl's Ray workers import this module (``VERL_USE_EXTERNAL_MODULES``).

Two modes, chosen by what verl hands the loss:

* **decoupled** (``rollout_is_weights`` given): verl recomputed ``old_log_prob`` and its
  rollout-correction step turned the rollout log-probs into per-token IS weights -- with
  ``algorithm.rollout_correction.rollout_is=token`` and ``rollout_is_threshold="lo_hi"``
  those are IcePop's ``w = k * 1[lo <= k <= hi]``, k = exp(old - rollout)
  (``RolloutCorrectionConfig.decoupled_token_icepop``). verl never passes the rollout
  log-probs themselves to a policy loss, so the gate is verl's; the kernel computes
  ``w * max(-r A, -clip(r) A)`` with r = exp(log_prob - old). Any other IS weights (TIS,
  sequence level) are honoured the same way. A token whose weight is 0 contributes exactly 0
  to the loss and the gradient, even when its log-probs are inf or NaN.
* **coupled** (no ``rollout_is_weights``): ``old_log_prob`` is the ratio's base and the gate
  is on rho = exp(log_prob - old) itself (DESIGN 3.1 coupled mode). With
  ``algorithm.rollout_correction.bypass_mode=true`` verl's trainer puts the rollout
  log-probs in ``old_log_prob`` and skips the old-log-prob forward: that is GLM-5's coupled
  (TITO) IcePop. The gate interval is read from
  ``actor_rollout_ref.actor.policy_loss.rollout_correction.rollout_is_threshold`` when it is a
  ``"lo_hi"`` string (verl's IcePop spelling), else [1/2, 2] (beta = 2).

Both modes keep verl's PPO details: the clip [1 - clip_ratio_low, 1 + clip_ratio_high], the
dual clip ``clip_ratio_c`` for negative advantages, every ``loss_agg_mode`` through verl's own
``agg_loss`` with ``config.global_batch_info`` (so data-parallel normalisation is verl's), and
verl's metric names ``actor/pg_clipfrac``, ``actor/ppo_kl``, ``actor/pg_clipfrac_lower`` plus
``actor/pop_frac`` (masked tokens whose weight is 0) and ``actor/icepop_ratio_mean``.

Log-probs from hidden states: verl's actor computes ``log_prob`` itself (its
``use_fused_kernels`` option already avoids [tokens, V] logits); verl 0.9.1 has no plug point
for a policy loss to take hidden states and the LM head instead, so this plug-in takes the
log-probs verl gives it.
"""
from __future__ import annotations

import importlib.util
from typing import Any, Dict, Optional, Tuple

import torch

from ..loss import icepop_loss
from ..loss.mismatch import MISMATCH_KEYS

__all__ = ["icepop_policy_loss", "register", "gate_bounds", "LOSS_NAME", "INSTALL_HINT"]

LOSS_NAME = "icepop"
# What a clean venv with torch needs for the loss path and verl's actor-side loss module
# (docs/verl.md; checked in one by .ci/check_verl_install.py).
INSTALL_HINT = ("pip install --no-deps 'verl==0.9.1' && pip install 'ray==2.60.0' "
                "'tensordict==0.10.0' 'transformers==5.10.4' datasets pillow omegaconf "
                "codetiming")
AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean",
             "seq-mean-token-sum-norm")
DEFAULT_GATE = (0.5, 2.0)          # IcePop beta = 2


def _verl_core():
    try:
        from verl.trainer.ppo import core_algos
    except ImportError as exc:
        raise ImportError(f"glm_kernels.integrations.verl needs verl ({exc}); install it with: "
                          f"{INSTALL_HINT}") from exc
    return core_algos


def register(name: str = LOSS_NAME) -> None:
    """Register :func:`icepop_policy_loss` in verl's policy-loss registry under ``name``."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"name must be a non-empty string, got {name!r}")
    _verl_core().register_policy_loss(name)(icepop_policy_loss)


def _field(config, key, default=None):
    if config is None:
        return default
    getter = getattr(config, "get", None)
    if callable(getter):
        return getter(key, default)
    return getattr(config, key, default)


def gate_bounds(config) -> Tuple[float, float]:
    """The coupled-mode gate [lo, hi]: ``config.policy_loss.rollout_correction.
    rollout_is_threshold`` when it is a ``"lo_hi"`` string, else (0.5, 2.0)."""
    correction = _field(_field(config, "policy_loss"), "rollout_correction")
    spec = _field(correction, "rollout_is_threshold")
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


def _clip_ranges(config) -> Tuple[float, float, float]:
    clip = _field(config, "clip_ratio", 0.2)
    low = _field(config, "clip_ratio_low")
    high = _field(config, "clip_ratio_high")
    low = float(clip if low is None else low)
    high = float(clip if high is None else high)
    dual = float(_field(config, "clip_ratio_c", 3.0))
    if not dual > 1.0:
        raise ValueError(f"config.clip_ratio_c must be > 1 (dual-clip PPO lower bound of the "
                         f"ratio), got {dual}")
    return low, high, dual


def _check_inputs(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode,
                  rollout_is_weights) -> None:
    named = {"old_log_prob": old_log_prob, "log_prob": log_prob, "advantages": advantages,
             "response_mask": response_mask}
    if rollout_is_weights is not None:
        named["rollout_is_weights"] = rollout_is_weights
    for key, value in named.items():
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{key} must be a torch.Tensor, got {type(value).__name__}")
    if log_prob.dim() != 2:
        raise ValueError(f"log_prob must be [batch, response_length], got shape "
                         f"{tuple(log_prob.shape)}")
    for key, value in named.items():
        if value.shape != log_prob.shape:
            raise ValueError(f"{key} must have the shape of log_prob {tuple(log_prob.shape)}, "
                             f"got {tuple(value.shape)}")
    if loss_agg_mode not in AGG_MODES:
        raise ValueError(f"loss_agg_mode={loss_agg_mode!r}: expected one of {list(AGG_MODES)}")


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
        "seq-mean-token-mean", "seq-mean-token-sum-norm"; aggregated by verl's ``agg_loss``
        with ``config.global_batch_info``.
    config : verl ``ActorConfig`` (or a mapping with the same fields)
        Read: ``clip_ratio``, ``clip_ratio_low``, ``clip_ratio_high``, ``clip_ratio_c``,
        ``global_batch_info``, ``policy_loss.rollout_correction.rollout_is_threshold``.
    rollout_is_weights : Tensor [B, T], optional
        verl's rollout-correction IS weights (detached). Given: decoupled mode, each token's
        PPO term is multiplied by its weight. None: coupled mode, gate on exp(log_prob - old).

    Returns
    -------
    (pg_loss, metrics): fp32 scalar; python floats keyed ``actor/pg_clipfrac``,
    ``actor/ppo_kl``, ``actor/pg_clipfrac_lower``, ``actor/pop_frac``,
    ``actor/icepop_ratio_mean``.
    """
    if config is None:
        raise ValueError("config must be verl's ActorConfig (clip ratios, global_batch_info), "
                         "got None")
    _check_inputs(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode,
                  rollout_is_weights)
    core = _verl_core()
    eps_low, eps_high, dual = _clip_ranges(config)
    mask = response_mask.bool()
    old = old_log_prob.detach().float()
    adv = advantages.detach().float()

    if rollout_is_weights is None:
        # Coupled: the kernel's coupled mode, base = old_log_prob, gate on rho itself.
        lo, hi = gate_bounds(config)
        per_token, kernel_metrics = icepop_loss(
            log_prob, old, adv, mask, gate_low=lo, gate_high=hi, eps_low=eps_low,
            eps_high=eps_high, dual_clip=dual, reduction="none", return_metrics=True)
        scaled_adv = adv
        pop_frac = kernel_metrics["pop_frac"]
        ratio_mean = kernel_metrics["ratio_mean"]
    else:
        # Decoupled: verl's weights w fold into the advantages, w * max(-rA, -clip(r)A) =
        # max(-r(wA), -clip(r)(wA)) for w >= 0; tokens with w = 0 leave the kernel's mask, so
        # they contribute exactly 0 whatever their values, and stay in verl's denominators.
        weights = rollout_is_weights.detach().float()
        kept = mask & (weights != 0)
        scaled_adv = torch.where(kept, adv * weights, torch.zeros_like(adv))
        # old as the "rollout" too: k = 1 always passes the kernel's gate; r = exp(lp - old).
        # verl's dual clip caps w max(...) at -c (wA) = w (-cA): the kernel's cap on wA.
        per_token, kernel_metrics = icepop_loss(
            log_prob, old, scaled_adv, kept, old_logprobs=old, gate_low=0.0,
            gate_high=1.0, eps_low=eps_low, eps_high=eps_high, dual_clip=dual,
            reduction="none", return_metrics=True)
        n_masked = mask.sum().clamp(min=1).float()
        pop_frac = (mask & (weights == 0)).sum().float() / n_masked
        ratio_mean = torch.where(kept, weights, 0.0).sum() / kept.sum().clamp(min=1).float()

    global_batch_info = _field(config, "global_batch_info", None) or {}
    pg_loss = core.agg_loss(loss_mat=per_token, loss_mask=mask, loss_agg_mode=loss_agg_mode,
                            **global_batch_info)

    with torch.no_grad():      # verl's own metric definitions (compute_policy_loss_vanilla)
        log_ratio = (log_prob.detach().float() - old).clamp(-20.0, 20.0)
        ratio = torch.exp(log_ratio)
        loss1 = -adv * ratio
        loss2 = -adv * ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
        clipped_max = torch.maximum(loss1, loss2)
        n = mask.sum().clamp(min=1).float()
        masked_mean = lambda x: torch.where(mask, x.float(), 0.0).sum() / n   # noqa: E731
        metrics = {
            "actor/pg_clipfrac": masked_mean(loss2 > loss1).item(),
            "actor/ppo_kl": masked_mean(-log_ratio).item(),
            "actor/pg_clipfrac_lower": masked_mean((clipped_max > -adv * dual) & (adv < 0)).item(),
            "actor/pop_frac": float(pop_frac),
            "actor/icepop_ratio_mean": float(ratio_mean),
        }
        if rollout_is_weights is None:
            # Coupled: old_log_prob is the rollout's, so the kernel's train-inference mismatch
            # metrics (same pass) are the engine drift. Decoupled: verl's rollout-correction
            # step holds the rollout log-probs and reports its own mismatch metrics.
            metrics.update({f"actor/{key}": float(kernel_metrics[key])
                            for key in MISMATCH_KEYS})
    return pg_loss, metrics


if importlib.util.find_spec("verl") is not None:
    register()
