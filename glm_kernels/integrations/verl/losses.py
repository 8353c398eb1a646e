"""verl plug-in, every policy loss: ``glm_<name>`` for each name in verl's policy-loss registry.

verl 0.9.1 registers twelve policy losses in ``verl.trainer.ppo.core_algos.POLICY_LOSS_REGISTRY``
(:data:`VERL_LOSS_NAMES`). Importing :mod:`glm_kernels.integrations.verl` registers, beside
each, ``glm_<name>`` (:data:`POLICY_LOSSES`): the same loss computed by
:func:`glm_kernels.policy_loss` -- one fused pass for the per-token objective, the reduction and
verl's metrics -- selected with ``actor_rollout_ref.actor.policy_loss.loss_mode=glm_<name>``.

Each ``glm_<name>`` has verl's policy-loss signature and is called by verl's actor
(``verl/workers/utils/losses.py::ppo_loss``) exactly as verl's own function::

    pg_loss, pg_metrics = fn(old_log_prob=..., log_prob=..., advantages=..., response_mask=...,
                             loss_agg_mode=..., config=..., rollout_is_weights=...)

and returns verl's loss, gradient and metric keys with equal values (tests/integrations/
test_verl_losses.py compares them with verl's own function on the same inputs). How verl's
config maps onto the core op:

==============  =====================================  ==========================================
verl name       core variant and parameters            verl config read
==============  =====================================  ==========================================
vanilla         ``vanilla``, ``dual_clip``             clip_ratio(_low/_high), clip_ratio_c
gspo            ``gspo`` (sequence ratio, stop-grad)   clip_ratio(_low/_high)
gpg             ``gpg`` (REINFORCE)                    --
clip_cov        ``clip_cov`` + ``clip_cov_selection``  clip ratios, policy_loss.clip_cov_*
kl_cov          ``kl_cov`` + ``kl_cov_selection``      policy_loss.kl_cov_ratio, ppo_kl_coef
geo_mean        ``geo_mean`` (``row_mean``)            clip ratios (log-space band)
cispo           ``cispo``                              clip ratios
sapo            ``sapo`` (seq-mean-token-mean)         tau_pos, tau_neg
dro             ``dro``                                policy_loss.dro_beta
dppo_tv/_kl     ``dppo_tv`` / ``dppo_kl``              clip ratios (thresholds), clip_ratio_c
bypass_mode     ``bypass_mode`` / ``_reinforce``       policy_loss.rollout_correction
==============  =====================================  ==========================================

``loss_agg_mode`` and ``config.global_batch_info`` (``dp_size``, ``batch_num_tokens``,
``global_batch_size``, ``loss_scale_factor``, as verl's ``ppo_loss`` writes them) become the
core's ``reduction`` / ``denominator`` / ``norm_length`` / ``loss_scale`` (verl's ``agg_loss``
arithmetic). As in verl, ``geo_mean`` ignores both (mean over all rows) and ``sapo`` always
aggregates ``seq-mean-token-mean``. ``rollout_is_weights`` are the core's ``token_weights``.
``clip_cov`` draws its tokens from torch's global generator with verl's calls, so a seed picks
the same tokens as verl's. ``bypass_mode`` computes the IS weights, rejection mask and
metrics of verl's rollout-correction helper itself (:mod:`.verl_rollout_correction`, held
equal to verl's helper by a test; rejection sampling is verl's own
``compute_rollout_rejection_mask``), then the loss with the core op.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Tuple

import torch

from ...loss import clip_cov_selection, kl_cov_selection, policy_loss
from .rollout_correction import field, rollout_correction

__all__ = ["VERL_LOSS_NAMES", "POLICY_LOSSES", "PREFIX", "register_all", "AGG_MODES"]

PREFIX = "glm_"
VERL_LOSS_NAMES = ("vanilla", "dppo_tv", "dppo_kl", "gspo", "sapo", "gpg", "clip_cov", "kl_cov",
                   "geo_mean", "dro", "cispo", "bypass_mode")
AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean",
             "seq-mean-token-sum-norm")
# verl's metric keys per loss (the "actor/" prefix added on return); gpg reports none.
_PPO_KEYS = ("pg_clipfrac", "ppo_kl", "pg_clipfrac_lower")
METRIC_KEYS = {"vanilla": _PPO_KEYS, "dppo_tv": _PPO_KEYS, "dppo_kl": _PPO_KEYS,
               "gspo": _PPO_KEYS, "sapo": _PPO_KEYS, "gpg": (),
               "clip_cov": ("pg_clipfrac", "ppo_kl"), "kl_cov": ("ppo_kl",),
               "geo_mean": _PPO_KEYS, "dro": ("ppo_kl",), "cispo": _PPO_KEYS,
               "bypass_mode": _PPO_KEYS, "bypass_mode_reinforce": ("ppo_kl",)}
_BYPASS_LOSS_TYPES = ("ppo_clip", "reinforce")
# What a clean venv with torch needs for the loss path and verl's actor-side loss module
# (docs/verl.md; checked in one by .ci/check_verl_install.py).
INSTALL_HINT = ("pip install --no-deps 'verl==0.9.1' && pip install 'ray==2.60.0' "
                "'tensordict==0.10.0' 'transformers==5.10.4' datasets pillow omegaconf "
                "codetiming")


def verl_core():
    """verl's ``core_algos`` module, or an ImportError naming the pip line."""
    try:
        from verl.trainer.ppo import core_algos
    except ImportError as exc:
        raise ImportError(f"glm_kernels.integrations.verl needs verl ({exc}); install it with: "
                          f"{INSTALL_HINT}") from exc
    return core_algos


def clip_ranges(config) -> Tuple[float, float]:
    """verl's ``clip_ratio_low`` / ``clip_ratio_high``, each defaulting to ``clip_ratio``."""
    clip = field(config, "clip_ratio", 0.2)
    low, high = field(config, "clip_ratio_low"), field(config, "clip_ratio_high")
    return float(clip if low is None else low), float(clip if high is None else high)


def dual_clip(config) -> float:
    """verl's ``clip_ratio_c`` (dual-clip PPO's ratio cap for negative advantages)."""
    value = float(field(config, "clip_ratio_c", 3.0))
    if not value > 1.0:
        raise ValueError(f"config.clip_ratio_c must be > 1 (dual-clip PPO lower bound of the "
                         f"ratio), got {value}")
    return value


def check_inputs(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode,
                 rollout_is_weights, config) -> None:
    """verl's padded [batch, response_length] layout, a known ``loss_agg_mode``, a config."""
    if config is None:
        raise ValueError("config must be verl's ActorConfig (clip ratios, global_batch_info), "
                         "got None")
    named = (("log_prob", log_prob), ("old_log_prob", old_log_prob),
             ("advantages", advantages), ("response_mask", response_mask),
             ("rollout_is_weights", rollout_is_weights))
    shape = None
    for key, value in named:                 # one pass: type, then the shape of log_prob
        if not isinstance(value, torch.Tensor):
            if value is None and key == "rollout_is_weights":
                continue
            raise TypeError(f"{key} must be a torch.Tensor, got {type(value).__name__}")
        if shape is None:
            shape = value.shape
            if len(shape) != 2:
                raise ValueError(f"log_prob must be [batch, response_length], got shape "
                                 f"{tuple(shape)}")
        elif value.shape != shape:
            raise ValueError(f"{key} must have the shape of log_prob {tuple(shape)}, "
                             f"got {tuple(value.shape)}")
    if loss_agg_mode not in AGG_MODES:
        raise ValueError(f"loss_agg_mode={loss_agg_mode!r}: expected one of {list(AGG_MODES)}")


def reduction_kwargs(loss_agg_mode: str, config) -> Dict[str, Any]:
    """verl's ``agg_loss(..., **config.global_batch_info)`` as the core op's reduction
    arguments: token-mean = sum / batch_num_tokens * dp_size, token-sum = sum * dp_size,
    seq-mean-* = sum over rows / global_batch_size * dp_size (/ loss_scale_factor, default the
    response length, for -norm); a missing global count means the local one, as in verl."""
    info = field(config, "global_batch_info", None) or {}
    dp_size = info.get("dp_size", 1)
    dp_size = 1 if dp_size is None else dp_size
    kwargs: Dict[str, Any] = {"reduction": loss_agg_mode.replace("-", "_"),
                              "loss_scale": float(dp_size)}
    if loss_agg_mode == "token-sum":
        kwargs["reduction"] = "sum"
        return kwargs
    count_key = "batch_num_tokens" if loss_agg_mode == "token-mean" else "global_batch_size"
    count = info.get(count_key)
    if count is None and dp_size > 1:
        raise ValueError(f"config.global_batch_info[{count_key!r}] is required when "
                         f"dp_size > 1 (loss_agg_mode={loss_agg_mode!r})")
    if count is not None:
        kwargs["denominator"] = count
    if loss_agg_mode == "seq-mean-token-sum-norm" and info.get("loss_scale_factor") is not None:
        kwargs["norm_length"] = info["loss_scale_factor"]
    return kwargs


def metrics_dict(stats: Dict[str, torch.Tensor], keys) -> Dict[str, float]:
    """verl's ``actor/<key>`` python floats, moved to the host in one transfer."""
    if not keys:
        return {}
    values = torch.stack([stats[key].float() for key in keys]).tolist()
    return {f"actor/{key}": value for key, value in zip(keys, values)}


def _variant_params(name: str, config) -> Dict[str, Any]:
    """The core op's variant parameters read from verl's config as verl's function reads them."""
    if name in ("gpg", "bypass_mode_reinforce"):    # no parameter: no config read
        return {}
    policy = field(config, "policy_loss")
    eps_low, eps_high = clip_ranges(config)
    clip_band = {"eps_low": eps_low, "eps_high": eps_high}
    if name in ("vanilla", "bypass_mode"):
        return {**clip_band, "dual_clip": dual_clip(config)}
    if name in ("gspo", "geo_mean", "cispo", "clip_cov"):
        return clip_band
    if name in ("dppo_tv", "dppo_kl"):
        # verl: config.get("clip_ratio_c", 20.0) truncates the detached ratio.
        return {**clip_band, "ratio_cap": float(field(config, "clip_ratio_c", 20.0))}
    if name == "sapo":
        return {"tau_pos": float(field(config, "tau_pos", 1.0)),        # ActorConfig defaults
                "tau_neg": float(field(config, "tau_neg", 1.05))}
    if name == "dro":
        beta = field(policy, "dro_beta")
        if beta is None or not beta > 0:
            raise ValueError(f"config.policy_loss.dro_beta must be a positive value when using "
                             f"DRO, got {beta!r}")
        return {"dro_beta": float(beta)}
    if name == "kl_cov":
        coef = field(policy, "ppo_kl_coef")
        return {"ppo_kl_coef": 1.0 if coef is None else float(coef)}
    return {}                                                        # gpg, bypass reinforce


def _selection(name: str, log_prob, old_log_prob, advantages, mask, config):
    """Clip-Cov / KL-Cov's token choice (verl's defaults for unset ratios)."""
    policy = field(config, "policy_loss")
    if policy is None:
        raise ValueError(f"config.policy_loss is required by {name}")
    if name == "clip_cov":
        eps_low, eps_high = clip_ranges(config)
        ratio = field(policy, "clip_cov_ratio")
        lb, ub = field(policy, "clip_cov_lb"), field(policy, "clip_cov_ub")
        return clip_cov_selection(
            log_prob.detach(), old_log_prob, advantages, mask, eps_low=eps_low,
            eps_high=eps_high, clip_cov_ratio=0.0002 if ratio is None else float(ratio),
            clip_cov_lb=1.0 if lb is None else float(lb),
            clip_cov_ub=5.0 if ub is None else float(ub))
    ratio = field(policy, "kl_cov_ratio")
    return kl_cov_selection(log_prob.detach(), advantages, mask,
                            kl_cov_ratio=0.0002 if ratio is None else float(ratio))


def _token_loss(name, old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config,
                rollout_is_weights):
    check_inputs(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode,
                 rollout_is_weights, config)
    mask = response_mask.bool()
    params = _variant_params(name, config)
    if name == "geo_mean":          # verl: torch.mean over all rows, agg mode unused
        reduce = {"reduction": "row_mean"}
    elif name == "sapo":            # verl aggregates SAPO seq-mean-token-mean whatever the mode
        reduce = reduction_kwargs("seq-mean-token-mean", config)
    else:
        reduce = reduction_kwargs(loss_agg_mode, config)
    if name in ("clip_cov", "kl_cov"):
        params["selection"] = _selection(name, log_prob, old_log_prob, advantages, mask, config)
    weights = None if rollout_is_weights is None else rollout_is_weights.detach()
    keys = METRIC_KEYS[name]
    out = policy_loss(log_prob, old_log_prob.detach(), advantages.detach(), mask, variant=name,
                      token_weights=weights, return_stats=bool(keys), **reduce, **params)
    if not keys:                    # gpg reports no metric: no statistics computed either
        return out, {}
    loss, stats = out
    return loss, metrics_dict(stats, keys)


def _bypass_loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config,
                 rollout_is_weights):
    """verl's bypass_mode: ``old_log_prob`` holds the rollout log-probs; IS weights, the
    rejection mask and the rollout metrics are verl's helper's on (current policy, rollout)
    (:func:`.verl_rollout_correction.rollout_correction`); the passed ``rollout_is_weights``
    are ignored, as in verl."""
    check_inputs(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, None, config)
    policy = field(config, "policy_loss")
    correction = field(policy, "rollout_correction")
    if correction is None:
        raise ValueError("config.policy_loss.rollout_correction is required by bypass_mode "
                         "(verl's trainer passes algorithm.rollout_correction there)")
    loss_type = field(correction, "loss_type", "ppo_clip")
    if loss_type not in _BYPASS_LOSS_TYPES:
        raise ValueError(f"config.policy_loss.rollout_correction.loss_type={loss_type!r}: "
                         f"expected one of {list(_BYPASS_LOSS_TYPES)}")
    with torch.no_grad():
        weights, kept_mask, rollout_metrics = rollout_correction(
            log_prob.detach(), old_log_prob, response_mask, correction)
    if loss_type == "reinforce":
        variant = "bypass_mode_reinforce"
        params = {}
    else:                      # PPO-clip: the ratio already is pi / pi_rollout, no IS weights
        variant, weights, params = "bypass_mode", None, _variant_params("bypass_mode", config)
    loss, stats = policy_loss(log_prob, old_log_prob.detach(), advantages.detach(),
                              kept_mask.bool(), variant=variant, token_weights=weights,
                              return_stats=True, **reduction_kwargs(loss_agg_mode, config),
                              **params)
    metrics = metrics_dict(stats, METRIC_KEYS[variant])
    metrics.update(rollout_metrics)
    return loss, metrics


def _make(name: str) -> Callable:
    default_mode = "seq-mean-token-mean" if name in ("gspo", "sapo") else "token-mean"

    def loss_fn(old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor,
                response_mask: torch.Tensor, loss_agg_mode: str = default_mode,
                config: Any = None, rollout_is_weights: Optional[torch.Tensor] = None
                ) -> Tuple[torch.Tensor, Dict[str, float]]:
        if name == "bypass_mode":
            return _bypass_loss(old_log_prob, log_prob, advantages, response_mask,
                                loss_agg_mode, config, rollout_is_weights)
        return _token_loss(name, old_log_prob, log_prob, advantages, response_mask,
                           loss_agg_mode, config, rollout_is_weights)

    weights_doc = ("ignored, as by verl's bypass_mode: the IS weights and the rejection mask "
                   "come from\n        policy_loss.rollout_correction (verl's rollout-correction math)"
                   if name == "bypass_mode" else
                   "verl's rollout-correction IS weights (detached), multiplied into each "
                   "token's loss")
    loss_fn.__name__ = loss_fn.__qualname__ = f"glm_{name}_policy_loss"
    loss_fn.__doc__ = f"""verl's ``{name}`` policy loss through :func:`glm_kernels.policy_loss`.

    Registered in verl as ``glm_{name}``; equal to
    ``verl.trainer.ppo.core_algos.POLICY_LOSS_REGISTRY["{name}"]`` on the same inputs (loss,
    gradient, metrics). Module docstring: which config fields are read.

    Parameters
    ----------
    old_log_prob : Tensor [B, T] float (detached)
        verl's ``old_log_probs`` (the rollout log-probs in bypass mode).
    log_prob : Tensor [B, T] fp32 / bf16 / fp16
        log pi_theta of the response tokens; the only input that gets a gradient.
    advantages : Tensor [B, T] float
    response_mask : Tensor [B, T] bool or 0/1
    loss_agg_mode : str
        verl's "token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean" or
        "seq-mean-token-sum-norm", with ``config.global_batch_info``.
    config : verl ``ActorConfig`` (or a DictConfig with its fields)
    rollout_is_weights : Tensor [B, T] float, optional
        {weights_doc}.

    Returns
    -------
    (pg_loss, metrics): fp32 0-d tensor; python floats under verl's keys for ``{name}``.
    """
    return loss_fn


POLICY_LOSSES: Dict[str, Callable] = {name: _make(name) for name in VERL_LOSS_NAMES}


def register_all(prefix: str = PREFIX) -> None:
    """Register every :data:`POLICY_LOSSES` entry in verl's registry as ``prefix + name``."""
    if not isinstance(prefix, str) or not prefix:
        raise ValueError(f"prefix must be a non-empty string, got {prefix!r}")
    core = verl_core()
    for name, fn in POLICY_LOSSES.items():
        core.register_policy_loss(prefix + name)(fn)
