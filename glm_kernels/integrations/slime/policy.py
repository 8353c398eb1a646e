"""slime plug-in: every policy-loss option of slime 624b824, computed by glm_kernels.

:func:`policy_loss_function` is slime's ``policy_loss_function`` (THUDM/slime 624b824,
slime/backends/megatron_utils/loss.py) with its per-token pieces replaced: log-probs and
entropy by ``selective_logprobs`` (one fused pass over the logits), the policy objective by
``glm_kernels.policy_loss`` in one reduction (the IS / OPSM factors and the reducer's
per-token coefficients as its ``token_weights``, ``reduction="sum"``), the reference-KL
term by ``kl_penalty_terms``. Use it with every flag slime already takes::

    --loss-type custom_loss
    --custom-loss-function-path glm_kernels.integrations.slime_policy.policy_loss_function

and it reads the same options slime's own loss reads:

==============================  =========================================================
slime flag                      glm_kernels.policy_loss / op
==============================  =========================================================
--advantage-estimator grpo,     variant token / ppo (no log-ratio clamp, as slime)
  ppo, reinforce_plus_plus(_baseline)
--advantage-estimator gspo      variant sequence / ppo: s = exp(mean_m(lp - old)), the
                                gradient through the mean (slime's compute_gspo_kl)
--advantage-estimator cispo     variant token / cispo: -sg(clip(r, 1-eps, 1+eps_hi)) A lp
--eps-clip, --eps-clip-high     eps_low, eps_high
--eps-clip-c                    dual_clip (ppo and gspo; slime ignores it for cispo)
--use-opsm, --opsm-delta        token_weights *= 1 - 1[A < 0 and mean_m(old - lp) > delta]
--use-tis (no custom path)      token_weights *= clamp(exp(old - rollout), tis_clip_low,
                                tis_clip)
--custom-tis-function-path      token_weights *= the IcePop gate (slime's icepop_function or
  ...icepop_function            glm_kernels.integrations.slime.icepop_tis_function)
--custom-tis-function-path      token_weights *= mis.py's weights; its rejection mask
  ...compute_mis_weights_with_cp  replaces the loss masks' numerators (slime's reducer
  (mis.yaml: tis/rs level, mode,  rebuilt, denominators unchanged); or this module's
  veto, batch normalisation)    mis_tis_function
--custom-tis-function-path      token_weights *= a user's hook's weights (called as slime
  my.module.my_tis              calls it, ``pg_loss`` a probe of ones: the hook must return
                                pg_loss times detached weights); its masks rebuild slime's
                                reducer, its metrics are reported (_custom_tis)
--get-mismatch-metrics          the TIS hook's metrics without --use-tis's weights
--rollout-top-p < 1             log-probs renormalised over the rollout's nucleus
                                (selective_logprobs' keep_token_ids / keep_offsets, from the
                                batch's rollout_top_p_token_ids / _offsets)
--use-kl-loss, --kl-loss-coef,  + coef * kl_penalty_terms(lp, ref, k1 / k2 / k3), low_var_kl
  --kl-loss-type,               clamped to [-10, 10]; --use-unbiased-kl multiplies by
  --use-unbiased-kl             exp(lp - old) before that clamp (with its gradient)
--entropy-coef                  - coef * entropy (selective_logprobs' entropy, differentiable)
--calculate-per-token-loss,     slime's own reducer (``sum_of_sample_mean``), as slime
  rollout_mask_sums denominators
--use-rollout-logprobs          old = rollout log-probs
--custom-pg-loss-reducer-       called as slime calls it (the user's own code; it must be
  function-path                 linear in the per-token loss, as slime's reducers are)
==============================  =========================================================

Refused with a ValueError naming the flag (nothing computed): ``--rollout-top-p`` != 1
without the replay keys, and a ``--custom-tis-function-path`` hook
that does not return ``pg_loss`` times weights (keep slime's ``--loss-type policy_loss`` for
it).

:func:`mis_tis_function` is mis.py's ``compute_mis_weights_with_cp`` for slime's own
``--loss-type policy_loss`` (``--custom-tis-function-path
glm_kernels.integrations.slime_policy.mis_tis_function``), vectorised over the samples.
"""
from __future__ import annotations

import importlib
from typing import Callable, Dict, List, Optional, Tuple

import torch

from ...loss import PolicyLossSpec, kl_penalty_terms, policy_loss
from . import _is as _slime_is
from .icepop import (_cat, _clip_eps, _context_parallel, _gate_bounds, _response_logprobs,
                     icepop_gate_weights, icepop_tis_function)

__all__ = ["policy_loss_function", "mis_tis_function", "SLIME_VARIANTS"]

# slime computes exp(-(old - lp)) with no clamp: every spec keeps the raw log-ratio.
SLIME_VARIANTS = {
    "ppo": PolicyLossSpec("token", "ppo", log_ratio_clamp=None),
    "gspo": PolicyLossSpec("sequence", "ppo", log_ratio_clamp=None),
    "cispo": PolicyLossSpec("token", "cispo", log_ratio_clamp=None),
}
ESTIMATORS = {"grpo": "ppo", "ppo": "ppo", "reinforce_plus_plus": "ppo",
              "reinforce_plus_plus_baseline": "ppo", "gspo": "gspo", "cispo": "cispo"}
KL_KINDS = {"k1": "k1", "k2": "k2", "k3": "k3", "low_var_kl": "k3"}
LOW_VAR_KL_CLAMP = 10.0
ICEPOP_HOOKS = ("slime.backends.megatron_utils.loss.icepop_function",
                "glm_kernels.integrations.slime.icepop_tis_function")
MIS_HOOK_NAMES = ("compute_mis_weights_with_cp", "mis_tis_function")


def _load(path: str):
    module, _, attr = path.rpartition(".")        # slime's load_function: "pkg.module.attr"
    return getattr(importlib.import_module(module), attr)


def _tis_kind(args) -> Optional[str]:
    """None (no TIS hook runs), "vanilla", "icepop" or "mis"."""
    if not (getattr(args, "use_tis", False) or getattr(args, "get_mismatch_metrics", False)):
        return None
    path = getattr(args, "custom_tis_function_path", None)
    if path is None:
        return "vanilla"
    if path in ICEPOP_HOOKS:
        return "icepop"
    if path.rpartition(".")[2] in MIS_HOOK_NAMES:
        return "mis"
    return "custom"


def _check_args(args) -> str:
    """The policy_loss spec name; every flag this loss cannot honour refused up front."""
    estimator = getattr(args, "advantage_estimator", "grpo")
    if estimator not in ESTIMATORS:
        raise ValueError(f"--advantage-estimator must be one of {sorted(ESTIMATORS)}, got "
                         f"{estimator!r}")
    if getattr(args, "use_kl_loss", False):
        kind = getattr(args, "kl_loss_type", "k1")
        if kind not in KL_KINDS:
            raise ValueError(f"--kl-loss-type must be one of {sorted(KL_KINDS)}, got {kind!r}")
    _tis_kind(args)
    return ESTIMATORS[estimator]


class _Layout:
    """Whole responses of the micro-batch, packed. At CP = 1 these are the local tensors;
    under context parallelism each rank gathers the whole responses with slime's own
    ``all_gather_with_cp`` (differentiable: slime's GSPO, OPSM and MIS do the same) and
    :meth:`local` cuts a whole-response tensor back to this rank's zigzag part."""

    def __init__(self, args, batch, device):
        self.cp = _context_parallel(args)
        self.totals = [int(t) for t in batch["total_lengths"]]
        self.sizes = [int(r) for r in batch["response_lengths"]]
        self.device = device
        sizes = torch.tensor(self.sizes, device=device)
        self.seg = torch.repeat_interleave(torch.arange(len(self.sizes), device=device), sizes)
        self.cu_seqlens = torch.nn.functional.pad(sizes.cumsum(0), (1, 0))

    def whole(self, local_list: List[torch.Tensor]) -> torch.Tensor:
        xs = [torch.as_tensor(x, device=self.device) for x in local_list]
        if self.cp:
            from slime.backends.megatron_utils.cp_utils import all_gather_with_cp
            xs = [all_gather_with_cp(x, t, r) for x, t, r in zip(xs, self.totals, self.sizes)]
        return torch.cat([x.float().reshape(-1) for x in xs]) if xs else \
            torch.zeros(0, device=self.device)

    def local_list(self, whole: torch.Tensor) -> List[torch.Tensor]:
        parts = list(whole.split(self.sizes))
        if self.cp:
            from slime.backends.megatron_utils.cp_utils import slice_log_prob_with_cp
            parts = [slice_log_prob_with_cp(p, t, r) for p, t, r in zip(parts, self.totals,
                                                                         self.sizes)]
        return parts

    def local(self, whole: torch.Tensor) -> torch.Tensor:
        parts = self.local_list(whole)
        return torch.cat(parts) if parts else whole[:0]

    def scatter_local(self, local: torch.Tensor) -> torch.Tensor:
        """A [N local] tensor put at its whole-response positions, 0 elsewhere."""
        if not self.cp:
            return local
        n = int(self.cu_seqlens[-1])
        where = self.local(torch.arange(n, device=self.device))
        return torch.zeros(n, dtype=local.dtype, device=self.device).index_put_((where,), local)


def _reducer_coefficients(reduce, n_local: int, device) -> torch.Tensor:
    """d reduce(x) / d x [n_local] for slime's (linear) reducer: the weight it gives each token."""
    x = torch.zeros(n_local, device=device, requires_grad=True)
    with torch.enable_grad():
        out = reduce(x)
        if not (torch.is_tensor(out) and out.requires_grad):   # no samples: sum([]) == 0
            return torch.zeros(n_local, device=device)
        (grad,) = torch.autograd.grad(out, x, allow_unused=True)
    return torch.zeros(n_local, device=device) if grad is None else grad.detach()


def _importance_weights(args, kind, train, rollout, mask, layout
                        ) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor],
                                   Dict[str, torch.Tensor]]:
    """(token weights or None, rejection mask or None, per-token metrics), whole responses."""
    if kind == "vanilla":
        weights, metrics = _slime_is.vanilla_tis(args, train, rollout)
        return weights, None, metrics
    if kind == "icepop" and args.custom_tis_function_path == ICEPOP_HOOKS[1]:
        # glm_kernels' own hook: its weights and its metric names (tis = w, tis_pop, tis_abs).
        weights, _, metrics = icepop_tis_function(
            args, pg_loss=torch.ones_like(train), train_log_probs=[train],
            rollout_log_probs=[rollout], loss_masks=[mask])
        return weights, None, metrics
    if kind == "icepop":
        low, high = _gate_bounds(args)
        weights = icepop_gate_weights(train, rollout, None, low, high)
        ratio = torch.exp(train - rollout)
        metrics = {"tis": ratio, "tis_clipfrac": (weights != ratio).float(),
                   "tis_abs": (ratio - 1.0).abs()}
        return weights, None, metrics
    weights, kept, metrics = _slime_is.mis_weights(args, train, rollout, mask, layout.seg,
                                                   len(layout.sizes))
    return weights, kept, {f"mis_{k}": v for k, v in metrics.items()}


def _custom_tis(args, batch, train_list, layout, n_local, device, sum_of_sample_mean):
    """A user's ``--custom-tis-function-path`` hook, called with slime's keyword arguments.

    Its ``pg_loss`` is a probe of ones [N local] (this loss never forms slime's per-token
    loss): the hook must return ``pg_loss`` times detached per-token weights, as slime's own
    hooks do, so the returned values are the weights; checked through the probe's gradient
    (on CPU a ValueError, on CUDA an asynchronous assert). Returns (whole-response weights,
    the reducer rebuilt on the hook's masks as slime rebuilds it, the hook's metrics).
    """
    probe = torch.ones(n_local, device=device, requires_grad=True)
    with torch.enable_grad():
        weighted, masks, metrics = _load(args.custom_tis_function_path)(
            args=args, pg_loss=probe, train_log_probs=train_list,
            rollout_log_probs=batch["rollout_log_probs"], loss_masks=batch["loss_masks"],
            total_lengths=batch["total_lengths"], response_lengths=batch["response_lengths"])
        if not (torch.is_tensor(weighted) and weighted.shape == probe.shape):
            raise ValueError(f"--custom-tis-function-path {args.custom_tis_function_path!r} "
                             f"must return pg_loss of shape {tuple(probe.shape)} first")
        slope = torch.autograd.grad(weighted.sum(), probe, allow_unused=True)[0] \
            if weighted.requires_grad else None
    weights = weighted.detach().float()
    slope = torch.zeros_like(weights) if slope is None else slope
    # pg_loss * w1 * w2 ...: the slope's products may round in another order (1 ulp).
    linear = (slope == weights) | ((slope - weights).abs() <= 1e-6 * weights.abs()) | \
        (weights != weights)                           # NaN weights pass through as slime's
    message = (f"--custom-tis-function-path {args.custom_tis_function_path!r} must return "
               f"pg_loss times detached weights (policy_loss_function never forms slime's "
               f"per-token pg_loss); use --loss-type policy_loss for this hook")
    if weights.is_cuda:
        torch._assert_async(linear.all(), message)
    elif not bool(linear.all()):
        raise ValueError(message)
    if masks is batch["loss_masks"]:
        reduce = sum_of_sample_mean
    else:   # slime rebuilds its reducer on the hook's masks, denominators unchanged
        from slime.backends.megatron_utils.cp_utils import get_sum_of_sample_mean
        reduce = get_sum_of_sample_mean(batch["total_lengths"], batch["response_lengths"], masks,
                                        batch["rollout_mask_sums"],
                                        bool(args.calculate_per_token_loss))
    # At whole-response positions; under CP the other ranks' tokens get 0 (their reducer
    # coefficient on this rank is 0 too).
    return layout.scatter_local(weights), masks, reduce, metrics


def _kl_terms(args, logprobs, ref, old) -> torch.Tensor:
    """slime's compute_approx_kl(lp, ref, kl_loss_type, importance_ratio) per token."""
    kind = args.kl_loss_type
    terms = kl_penalty_terms(logprobs, ref, kl_penalty=KL_KINDS[kind], clamp=False)
    if getattr(args, "use_unbiased_kl", False):
        terms = torch.exp(logprobs - old) * terms
    if kind == "low_var_kl":
        terms = terms.clamp(-LOW_VAR_KL_CLAMP, LOW_VAR_KL_CLAMP)
    return terms


def policy_loss_function(args, batch: Dict, logits: torch.Tensor,
                         sum_of_sample_mean: Callable[[torch.Tensor], torch.Tensor]
                         ) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """slime's policy loss for every option of slime 624b824, through glm_kernels.

    Parameters (as slime's ``loss_function`` passes them to a custom loss)
    ----------
    args : slime's namespace (the flags in the module docstring).
    batch : per-sample lists of one micro-batch: ``unconcat_tokens`` [total_i] int64,
        ``total_lengths`` / ``response_lengths`` ints, ``loss_masks`` [R_i] 0/1 (whole
        responses), ``advantages`` [R_i] fp32, optionally ``log_probs`` (recomputed old
        policy), ``rollout_log_probs``, ``ref_log_probs`` (``--use-kl-loss``),
        ``teacher_log_probs``; under CP every per-token list is this rank's zigzag part.
    logits : [1, T, V] fp32 (or this rank's vocab shard [1, T, V / tp]).
    sum_of_sample_mean : slime's reducer (per-sample masked means summed, or the token sum
        with ``--calculate-per-token-loss``; denominators from ``rollout_mask_sums``).

    Returns
    -------
    (loss, metrics): the scalar ``pg_loss - entropy_coef * entropy_loss [+ kl_loss_coef *
    kl_loss]`` with its gradient to ``logits``, and slime's metric keys with slime's values:
    loss, pg_loss, entropy_loss, pg_clipfrac, ppo_kl, train_rollout_logprob_abs_diff (with
    rollout log-probs), kl_loss (``--use-kl-loss``), ois and the TIS hook's metrics (TIS or
    ``--get-mismatch-metrics``), opsm_clipfrac (``--use-opsm``), opd_reverse_kl (with teacher
    log-probs).
    """
    variant = _check_args(args)
    for key in ("unconcat_tokens", "total_lengths", "response_lengths", "loss_masks",
                "advantages"):
        if not batch.get(key):
            raise ValueError(f"policy_loss_function: batch[{key!r}] is missing or empty")
    device = logits.device
    lp_list, entropy_list = _response_logprobs(args, batch, logits)
    logprobs = torch.cat(lp_list)
    use_rollout = bool(getattr(args, "use_rollout_logprobs", False))
    if use_rollout:
        if not batch.get("rollout_log_probs"):
            raise ValueError("--use-rollout-logprobs needs batch['rollout_log_probs']")
        old_list = batch["rollout_log_probs"]
    else:
        old_list = batch.get("log_probs") or [lp.detach() for lp in lp_list]
    train_list = batch.get("log_probs") or [lp.detach() for lp in lp_list]

    layout = _Layout(args, batch, device)
    lp_w = layout.whole(lp_list)
    old_w = layout.whole(old_list).detach()
    adv_w = layout.whole(batch["advantages"]).detach()
    mask_w = _cat(batch["loss_masks"], device)
    if lp_w.shape != old_w.shape or lp_w.shape != adv_w.shape or lp_w.shape != mask_w.shape:
        raise ValueError(f"per-token lengths disagree: log-probs {tuple(lp_w.shape)}, old "
                         f"{tuple(old_w.shape)}, advantages {tuple(adv_w.shape)}, loss_masks "
                         f"{tuple(mask_w.shape)}")

    # The detached per-token factors: importance weights, OPSM's sequence mask.
    kind = _tis_kind(args)
    weights, kept, tis_metrics = None, None, {}
    if kind is not None:
        if not batch.get("rollout_log_probs"):
            raise ValueError("--use-tis / --get-mismatch-metrics need batch['rollout_log_probs']")
        rollout_w = layout.whole(batch["rollout_log_probs"]).detach()
        train_w = layout.whole(train_list).detach()
        if kind == "custom":
            weights, custom_masks, custom_reduce, tis_metrics = _custom_tis(
                args, batch, train_list, layout, logprobs.numel(), device, sum_of_sample_mean)
        else:
            weights, kept, tis_metrics = _importance_weights(args, kind, train_w, rollout_w,
                                                             mask_w, layout)
    segs = _slime_is.Segments(layout.seg, len(layout.sizes), mask_w)
    seq_kl = segs.expand(segs.masked_mean(old_w - lp_w.detach()))
    opsm = None
    if getattr(args, "use_opsm", False):
        opsm = ((adv_w < 0) & (seq_kl > float(args.opsm_delta))).float()
        weights = (1.0 - opsm) if weights is None else weights * (1.0 - opsm)

    eps_low, eps_high, dual_clip = _clip_eps(args)
    # slime's per-token metrics (detached): the PPO log-ratio and its clip indicator.
    ppo_kl = seq_kl if variant == "gspo" else old_w - lp_w.detach()
    ratio = torch.exp(-ppo_kl)
    if variant == "cispo":
        clipfrac = (ratio.clamp(1.0 - eps_low, 1.0 + eps_high) != ratio).float()
    else:
        clipfrac = (-ratio.clamp(1.0 - eps_low, 1.0 + eps_high) * adv_w > -ratio * adv_w).float()

    # Reducers. A TIS hook's rejection mask replaces the loss masks' numerators everywhere
    # below, as slime rebuilds its reducer (denominators unchanged); the hook's metrics keep
    # the original one. kept is 0/1 and never above the loss mask, so x * kept under the
    # original mask is x under the rebuilt one.
    reduce_mismatch = sum_of_sample_mean
    if kind == "custom":
        reduce = custom_reduce
    elif kept is not None:
        kept_local = layout.local(kept)
        reduce = lambda x: sum_of_sample_mean(x * kept_local)  # noqa: E731
    else:
        reduce = sum_of_sample_mean
    pg_reducer = reduce
    custom_reducer = getattr(args, "custom_pg_loss_reducer_function_path", None)
    if custom_reducer is not None:
        masks = custom_masks if kind == "custom" else \
            batch["loss_masks"] if kept is None else list(kept.split(layout.sizes))
        pg_reducer = _load(custom_reducer)(batch["total_lengths"], batch["response_lengths"],
                                           masks, bool(args.calculate_per_token_loss))

    # The policy term in one fused pass: the reducer is linear in the per-token loss, so its
    # per-token coefficients (m_t / max(D_i, 1), or m_t per token; 0 for tokens another CP rank
    # reduces) join the importance / OPSM factors in token_weights and policy_loss sums.
    coef = layout.scatter_local(_reducer_coefficients(pg_reducer, logprobs.numel(), device))
    pg_loss = policy_loss(
        lp_w, old_w, adv_w, mask_w, variant=SLIME_VARIANTS[variant], eps_low=eps_low,
        eps_high=eps_high, dual_clip=None if variant == "cispo" else dual_clip,
        token_weights=coef if weights is None else weights * coef,
        cu_seqlens=layout.cu_seqlens, reduction="sum")
    entropy = torch.cat(entropy_list)
    entropy_coef = float(getattr(args, "entropy_coef", 0.0))
    # Without the coefficient the entropy is a metric: no backward through it (slime's
    # log-prob function also drops its entropy gradient then).
    entropy_loss = reduce(entropy if entropy_coef else entropy.detach())
    loss = pg_loss - entropy_coef * entropy_loss if entropy_coef else pg_loss
    metrics = {"pg_clipfrac": reduce(layout.local(clipfrac)),
               "ppo_kl": reduce(layout.local(ppo_kl))}
    if getattr(args, "use_kl_loss", False):
        if not batch.get("ref_log_probs"):
            raise ValueError("--use-kl-loss needs batch['ref_log_probs']")
        kl = _kl_terms(args, logprobs, _cat(batch["ref_log_probs"], device),
                       _cat(old_list, device))
        kl_loss = reduce(kl)
        loss = loss + float(args.kl_loss_coef) * kl_loss
        metrics["kl_loss"] = kl_loss
    if logprobs.numel() == 0:            # keep every rank's graph connected (as slime does)
        loss = loss + 0.0 * logits.sum()

    if batch.get("rollout_log_probs"):
        compared = logprobs.detach() if use_rollout else _cat(old_list, device)
        metrics["train_rollout_logprob_abs_diff"] = reduce(
            (compared - _cat(batch["rollout_log_probs"], device)).abs())
    if kind is not None:
        metrics["ois"] = reduce_mismatch(layout.local(ratio))
        for key, value in tis_metrics.items():     # a user's hook gives this rank's part
            metrics[key] = reduce_mismatch(value if kind == "custom" else layout.local(value))
    if opsm is not None:
        # slime: per sample, OPSM-masked tokens of this rank over the whole response's count.
        local_opsm = layout.local_list(opsm)
        metrics["opsm_clipfrac"] = sum(
            m.sum() / torch.clamp_min(full.sum(), 1)
            for m, full in zip(local_opsm, batch["loss_masks"]))
    if batch.get("opd_reverse_kl"):       # set by slime's OPD advantage step
        metrics["opd_reverse_kl"] = reduce(_cat(batch["opd_reverse_kl"], device))
    reported = {"loss": loss, "pg_loss": pg_loss, "entropy_loss": entropy_loss}
    reported.update(metrics)
    return loss, {k: torch.as_tensor(v).detach().clone() for k, v in reported.items()}


def mis_tis_function(args, *, pg_loss: torch.Tensor, train_log_probs: List[torch.Tensor],
                     rollout_log_probs: List[torch.Tensor], loss_masks: List[torch.Tensor],
                     total_lengths: List[int], response_lengths: List[int], **kwargs
                     ) -> Tuple[torch.Tensor, List[torch.Tensor], Dict[str, torch.Tensor]]:
    """mis.py's ``compute_mis_weights_with_cp`` for slime's own policy loss.

    Same call and return as slime's hook: ``pg_loss`` [N local] times the MIS weights (none
    without ``--use-tis``), the whole-response rejection masks (one [R_i] per sample), and the
    per-token metrics under ``mis_*`` names (this rank's part), for slime to reduce.
    """
    device = pg_loss.device
    layout = _Layout(args, {"total_lengths": total_lengths,
                            "response_lengths": response_lengths}, device)
    mask_w = _cat(loss_masks, device)
    train_w = layout.whole(train_log_probs).detach()
    rollout_w = layout.whole(rollout_log_probs).detach()
    if not (train_w.shape == rollout_w.shape == mask_w.shape):
        raise ValueError(f"per-token lengths disagree: train_log_probs {tuple(train_w.shape)}, "
                         f"rollout_log_probs {tuple(rollout_w.shape)}, loss_masks "
                         f"{tuple(mask_w.shape)}")
    weights, kept, metrics = _slime_is.mis_weights(args, train_w, rollout_w, mask_w, layout.seg,
                                                   len(layout.sizes))
    if weights is not None:
        pg_loss = pg_loss * layout.local(weights).to(pg_loss.dtype)
    masks = list(kept.split(layout.sizes))
    return pg_loss, masks, {f"mis_{k}": layout.local(v) for k, v in metrics.items()}
