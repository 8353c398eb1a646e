"""The fused policy-loss family: every verl / TRL policy loss, IcePop composable on each.

Math: docs/policy_loss.md (one row per preset); readable version in
``loss/_policy_reference.py``. The variant is a compile-time :class:`PolicyLossSpec`
(``loss/_policy_spec.py``); its hyper-parameters are runtime floats.
"""
from typing import Dict, Optional, Tuple, Union

import torch

from .. import _dispatch
from . import _checks
from ._policy_reference import policy_loss_reference
from ._policy_spec import (GATES, POLICY_VARIANTS, REDUCTIONS, PolicyLossSpec,  # noqa: F401
                           resolve_params, resolve_variant)

STATS_KEYS = ("pg_clipfrac", "pg_clipfrac_lower", "ppo_kl", "pop_frac")
_DEFAULT_GATE = (0.5, 2.0)


def _layout(logprobs, cu_seqlens):
    """(seg_id [N] int64, num_seqs, row_length or None) of padded [B, T] or packed [N]."""
    device = logprobs.device
    n = logprobs.numel()
    if cu_seqlens is None:
        if logprobs.dim() == 2:
            rows, length = logprobs.shape
            return torch.arange(n, device=device) // max(length, 1), rows, length
        return torch.zeros(n, dtype=torch.long, device=device), 1, n
    # Token t belongs to sequence b when cu[b] <= t < cu[b + 1]: a device-side search.
    positions = torch.arange(n, device=device, dtype=cu_seqlens.dtype)
    seg_id = torch.searchsorted(cu_seqlens[1:].contiguous(), positions, right=True)
    return seg_id, cu_seqlens.numel() - 1, None


def _check_tensors(logprobs, old_logprobs, advantages, loss_mask, token_weights,
                   rollout_logprobs, cu_seqlens, selection):
    check = _dispatch.check_tensor
    check("logprobs", logprobs, dtypes=(torch.float32, torch.bfloat16, torch.float16),
          ndim=(1, 2))
    check("old_logprobs", old_logprobs, floating=True)
    _dispatch.check_same_shape("old_logprobs", old_logprobs, "logprobs", logprobs)
    check("advantages", advantages, floating=True)
    if cu_seqlens is not None:
        check("cu_seqlens", cu_seqlens, dtypes=(torch.int32, torch.int64), ndim=(1,))
        if logprobs.dim() != 1:
            raise ValueError(f"cu_seqlens needs packed 1-D logprobs [N], got shape "
                             f"{tuple(logprobs.shape)}")
        if cu_seqlens.numel() < 2:
            raise ValueError(f"cu_seqlens must have B + 1 >= 2 entries, got "
                             f"{cu_seqlens.numel()}")
    rows = (logprobs.shape[0] if logprobs.dim() == 2 else
            None if cu_seqlens is None else cu_seqlens.numel() - 1)
    if advantages.shape != logprobs.shape and not (
            rows is not None and advantages.shape == (rows,)):
        raise ValueError(f"advantages must have the shape of logprobs {tuple(logprobs.shape)} "
                         f"or one value per sequence [B]; got shape {tuple(advantages.shape)}")
    if loss_mask is not None:
        _checks.check_loss_mask(loss_mask, "logprobs", logprobs)
    if token_weights is not None:
        check("token_weights", token_weights, floating=True)
        _dispatch.check_same_shape("token_weights", token_weights, "logprobs", logprobs)
    if rollout_logprobs is not None:
        check("rollout_logprobs", rollout_logprobs, floating=True)
        _dispatch.check_same_shape("rollout_logprobs", rollout_logprobs, "logprobs", logprobs)
    if selection is not None:
        check("selection", selection, dtypes=(torch.bool,))
        _dispatch.check_same_shape("selection", selection, "logprobs", logprobs)
    _dispatch.check_same_device(dict(
        logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages,
        loss_mask=loss_mask, token_weights=token_weights, rollout_logprobs=rollout_logprobs,
        cu_seqlens=cu_seqlens, selection=selection))


def _check_reduction(spec, reduction, denominator, norm_length, logprobs, cu_seqlens):
    reduction = spec.default_reduction if reduction is None else reduction
    _dispatch.check_choice("reduction", reduction, REDUCTIONS)
    if (reduction == "row_mean") != (spec.ratio == "geo_mean") and reduction not in (
            "sum", "none"):
        raise ValueError(f"reduction={reduction!r} does not fit ratio={spec.ratio!r}: geo_mean "
                         "(one loss per sequence) takes row_mean, sum or none; the others "
                         "take token_mean, seq_mean_*, sum or none")
    if denominator is not None:
        if reduction in ("sum", "none"):
            raise ValueError(f"denominator is not used by reduction={reduction!r}: pass None")
        if isinstance(denominator, torch.Tensor):
            if denominator.dim() != 0 or not denominator.is_floating_point() and \
                    denominator.dtype not in (torch.int32, torch.int64):
                raise ValueError(f"denominator must be a number or a 0-d tensor, got shape "
                                 f"{tuple(denominator.shape)}, dtype {denominator.dtype}")
        else:
            denominator = _dispatch.check_finite_number("denominator", denominator,
                                                        positive=True)
    if reduction == "seq_mean_token_sum_norm":
        if norm_length is None:
            if cu_seqlens is not None or logprobs.dim() != 2:
                raise ValueError("norm_length is required for reduction="
                                 "'seq_mean_token_sum_norm' on packed inputs (verl's "
                                 "loss_scale_factor; padded [B, T] defaults to T)")
            norm_length = float(logprobs.shape[-1])
        norm_length = _dispatch.check_finite_number("norm_length", norm_length, positive=True)
    elif norm_length is not None:
        raise ValueError(f"norm_length is only used by reduction='seq_mean_token_sum_norm', "
                         f"got reduction={reduction!r}")
    return reduction, denominator, norm_length


def policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                loss_mask: Optional[torch.Tensor] = None, *,
                variant: Union[str, PolicyLossSpec] = "vanilla", eps_low: float = 0.2,
                eps_high: float = 0.28, dual_clip: Optional[float] = None,
                token_weights: Optional[torch.Tensor] = None,
                rollout_logprobs: Optional[torch.Tensor] = None, gate: Optional[str] = None,
                gate_low: Optional[float] = None, gate_high: Optional[float] = None,
                cu_seqlens: Optional[torch.Tensor] = None, reduction: Optional[str] = None,
                denominator=None, norm_length: Optional[float] = None, loss_scale: float = 1.0,
                selection: Optional[torch.Tensor] = None, return_stats: bool = False,
                **variant_params
                ) -> Union[torch.Tensor, Tuple[torch.Tensor, Dict[str, torch.Tensor]]]:
    """One policy loss of the family (verl POLICY_LOSS_REGISTRY, TRL loss types), fused.

    Parameters
    ----------
    logprobs : Tensor [B, T] (padded) or [N] (packed with ``cu_seqlens``; without it, one
        sequence), float32 / bfloat16 / float16. log pi_theta; the only input with a gradient.
    old_logprobs : Tensor, same shape, any float dtype. log pi_old (detached). Bypass mode and
        coupled IcePop pass the rollout log-probs here.
    advantages : Tensor, same shape, or [B] (one per sequence).
    loss_mask : Tensor, same shape, bool or 0/1, optional. None = every token.
    variant : str or PolicyLossSpec
        A :data:`POLICY_VARIANTS` name (verl: vanilla, gspo, gpg, clip_cov, kl_cov, geo_mean,
        cispo, sapo, dro, dppo_kl, dppo_tv, bypass_mode, bypass_mode_reinforce; TRL: trl_cispo,
        trl_sapo, luspo, grpo_sequence, vespo) or a spec.
    eps_low, eps_high : float
        PPO clip band [1 - eps_low, 1 + eps_high] (geo_mean: the log-space band
        [-eps_low, eps_high]; dppo_*: the divergence thresholds).
    dual_clip : float > 1, optional
        Dual-clip PPO cap for A < 0 (verl ``clip_ratio_c``; verl's vanilla always applies it).
    token_weights : Tensor, same shape, optional
        Detached per-token weights (verl ``rollout_is_weights``, TRL importance-sampling
        ratio): loss_t *= w_t. geo_mean aggregates them per sequence by verl's geometric mean;
        vespo adds their clamped logs to the sequence log-weight (as TRL).
    rollout_logprobs, gate, gate_low, gate_high
        The IcePop gate on any variant: ``gate="coupled"`` keeps token t iff
        gate_low <= exp(lp_t - rollout_t) <= gate_high (no gradient through the gate);
        ``"decoupled"`` weights it by k 1[gate_low <= k <= gate_high], k = exp(old - rollout).
        Defaults 0.5 / 2.0. Popped tokens contribute 0 but stay in every denominator
        (geo_mean drops them from their sequence's mean).
    cu_seqlens : Tensor [B + 1] int32 / int64, optional
        Sequence boundaries of packed 1-D inputs (0 = cu[0] <= ... <= cu[B] = N).
    reduction : str, optional (default: the preset's)
        token_mean | seq_mean_token_mean | seq_mean_token_sum | seq_mean_token_sum_norm | sum |
        none (verl's loss_agg_mode names with '_'); row_mean for geo_mean (mean over all B
        sequences, verl's torch.mean). verl's token-sum is "sum" with loss_scale=dp_size.
    denominator : float or 0-d tensor, optional
        Replaces the local normaliser: token_mean divides the token sum by it (verl
        batch_num_tokens / dp_size), seq_mean_* and row_mean divide the sequence sum by it
        (verl global_batch_size / dp_size).
    norm_length : float, optional
        seq_mean_token_sum_norm's divisor (verl loss_scale_factor); default T of [B, T].
    loss_scale : float
        Final multiplier (e.g. 1 / gradient-accumulation steps).
    selection : bool Tensor, same shape, optional
        clip_cov: the tokens whose loss is zeroed; kl_cov: the tokens given the |log-ratio|
        penalty. See :func:`clip_cov_selection`, :func:`kl_cov_selection`.
    return_stats : bool
        Also return detached fp32 0-d tensors ``pg_clipfrac``, ``pg_clipfrac_lower``,
        ``ppo_kl`` (verl's definitions for the objective) and ``pop_frac`` (the gate's).
    **variant_params : float
        The objective's parameters (CORE_API.md): delta; cispo_min, cispo_max; tau_pos,
        tau_neg; ratio_cap; dro_beta; ppo_kl_coef; k_pos, lambda_pos, k_neg, lambda_neg.

    Returns
    -------
    loss : fp32 0-d tensor ([*S] for reduction="none"; [B] for geo_mean "none"), optionally
    with the stats dict.
    """
    spec = resolve_variant(variant)
    _check_tensors(logprobs, old_logprobs, advantages, loss_mask, token_weights,
                   rollout_logprobs, cu_seqlens, selection)
    eps_low = _dispatch.check_finite_number("eps_low", eps_low, nonnegative=True)
    eps_high = _dispatch.check_finite_number("eps_high", eps_high, nonnegative=True)
    if spec.objective in ("ppo", "clip_cov") and spec.ratio != "geo_mean" and eps_low >= 1.0:
        raise ValueError(f"eps_low must be in [0, 1) (the clip band starts at 1 - eps_low > 0), "
                         f"got {eps_low}")
    dual = _checks.check_dual_clip(dual_clip)
    if dual is not None and spec.objective != "ppo":
        raise ValueError(f"dual_clip applies to objective 'ppo' only, got objective "
                         f"{spec.objective!r}")
    params = resolve_params(spec, variant_params, eps_low, eps_high)
    _dispatch.check_choice("gate", gate, GATES)
    if gate is None:
        if rollout_logprobs is not None or gate_low is not None or gate_high is not None:
            raise ValueError("rollout_logprobs / gate_low / gate_high need gate='coupled' or "
                             "'decoupled'")
        lo, hi = _DEFAULT_GATE
    else:
        if rollout_logprobs is None:
            raise ValueError(f"gate={gate!r} needs rollout_logprobs")
        lo, hi, _, _ = _checks.check_icepop_hyperparameters(
            _DEFAULT_GATE[1], gate_low if gate_low is not None else _DEFAULT_GATE[0],
            gate_high, 0.0, 0.0)
    if spec.objective in ("clip_cov", "kl_cov"):
        pass                                   # selection None = no token selected
    elif selection is not None:
        raise ValueError(f"selection is used by objectives clip_cov / kl_cov only, got "
                         f"objective {spec.objective!r}")
    loss_scale = _dispatch.check_finite_number("loss_scale", loss_scale)
    _checks.check_bool("return_stats", return_stats)
    reduction, denominator, norm_length = _check_reduction(spec, reduction, denominator,
                                                           norm_length, logprobs, cu_seqlens)

    seg_id, num_seqs, _ = _layout(logprobs, cu_seqlens)
    flat = lambda t: None if t is None else t.reshape(-1)   # noqa: E731
    adv = advantages[seg_id] if advantages.shape != logprobs.shape else flat(advantages)
    mask = (torch.ones(logprobs.numel(), dtype=torch.bool, device=logprobs.device)
            if loss_mask is None else flat(loss_mask) != 0)
    sel = flat(selection)
    if sel is None and spec.objective in ("clip_cov", "kl_cov"):
        sel = torch.zeros_like(mask)
    loss, stats = policy_loss_reference(
        spec, flat(logprobs), flat(old_logprobs), adv, mask, seg_id, num_seqs,
        eps_low=eps_low, eps_high=eps_high, dual_clip=dual,
        token_weights=flat(token_weights), rollout=flat(rollout_logprobs), gate=gate,
        gate_low=lo, gate_high=hi, selection=sel, reduction=reduction,
        denominator=denominator, norm_length=norm_length, loss_scale=loss_scale,
        params=params)
    if reduction == "none" and spec.ratio != "geo_mean":
        loss = loss.reshape(logprobs.shape)
    return (loss, stats) if return_stats else loss
