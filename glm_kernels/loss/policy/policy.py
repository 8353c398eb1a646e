"""The fused policy-loss family: every verl / TRL policy loss, IcePop composable on each.

Per-token math: docs/policy_loss.md (one row per preset); readable version in
``loss/policy/_reference.py``. The variant is a compile-time :class:`PolicyLossSpec`
(``loss/policy/_spec.py``); its hyper-parameters are runtime floats.

Forward writes the gradient (``loss/policy/_kernels.py``). With ``u_t = m_t w_t l_t`` the
token's weighted term (w: token weights x gate weight x the row's sequence IS weight w_b,
detached; w_b is reduced in the kernel's first pass over the row) and ``c_b`` the reduction's
factor of row b (1/D for token_mean, 1/(n_b D) for seq_mean_token_mean, ...: constant within a
row), the loss is ``sum_b c_b sum_{t in b} u_t`` and the kernel writes
``g_t = d(sum_{s in row(t)} u_s) / d lp_t``; backward returns ``g_t c_row(t) dL`` (dL the
upstream gradient). Per ratio mode, with ``l(r)`` the objective:

* token: ``g_t = m_t w_t (dl/dr r_t 1[|lr_t| <= clamp] + dl/dlp_t)`` (the second term for
  objectives with ``lp`` in them: cispo, reinforce, dppo, dro, kl_cov's |lr|).
* sequence_stopgrad (GSPO): ``s_t = exp(lp_t - sg(lp_t) + sg(S_b))``, S_b = mean_m lr over the
  row: ``ds_t/dlp_t = s_t 1[S_b <= cap]``, so g_t is local once S_b is known (phase 1).
* sequence (TRL): ``s_b = exp(S_b)`` shared by the row, ``dS_b/dlp_t = m_t / n_b``:
  ``g_t = m_t w_t dl_t/dlp_t + (m_t / n_b) s_b sum_{s in b} m_s w_s dl_s/dr`` (phase 2 sums
  the row's dl/dr, the last phase writes g_t).
* geo_mean (GMPO): one term per row, ``L_b = -Abar_b exp(G_b) W_b`` with
  ``G_b = sum_t k_t h_t / (K_b + 1e-8)``, h_t = sgn(A) min(sgn(A) lr_t, sgn(A) clip(lr_t)),
  k the kept mask, K_b its count: ``g_t = L_b k_t h'_t / (K_b + 1e-8)`` with h' the
  derivative of the min (1 on the unclipped branch, the clip band's indicator on the
  clipped one, their mean at a tie, as autograd).
* sequence_sum (VESPO): phi_b is detached: ``g_t = -m_t phi_b A_t``.
"""
from typing import Dict, List, Optional, Tuple, Union

import torch

from ... import _checks, _dispatch
from .._common import checks as loss_checks
from ._reference import Rows, policy_loss_reference
from ._torch import lean_applies, lean_policy_loss, seq_row_scale
from .sequence_is import check_seq_is, seq_is_token_weights
from ._spec import (GATES, POLICY_VARIANTS, REDUCTIONS, PolicyLossSpec, resolve_params,
                    resolve_variant)

STATS_KEYS = ("pg_clipfrac", "pg_clipfrac_lower", "ppo_kl", "pop_frac")
_DEFAULT_GATE = (0.5, 2.0)
_BLOCK_GPU, _WARPS_GPU = 2048, 8
_BLOCK_SEQ_GPU = 1024            # a sequence program's chunk: registers for ~8 tile values
_BLOCK_INTERPRET = 256
_NUM_STATS = 7                  # _policy_kernels.NUM_STATS


def _layout(logprobs, cu_seqlens):
    """(num_seqs, row_length or None) of padded [B, T], packed [N] or one sequence [N]."""
    if cu_seqlens is not None:
        return cu_seqlens.numel() - 1, None
    if logprobs.dim() == 2:
        return logprobs.shape[0], logprobs.shape[1]
    return 1, logprobs.numel()


def _check_tensors(logprobs, old_logprobs, advantages, loss_mask, token_weights,
                   rollout_logprobs, cu_seqlens, selection):
    check = _checks.check_tensor
    check("logprobs", logprobs, dtypes=(torch.float32, torch.bfloat16, torch.float16),
          ndim=(1, 2))
    check("old_logprobs", old_logprobs, floating=True)
    _checks.check_same_shape("old_logprobs", old_logprobs, "logprobs", logprobs)
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
        loss_checks.check_loss_mask(loss_mask, "logprobs", logprobs)
    if token_weights is not None:
        check("token_weights", token_weights, floating=True)
        _checks.check_same_shape("token_weights", token_weights, "logprobs", logprobs)
    if rollout_logprobs is not None:
        check("rollout_logprobs", rollout_logprobs, floating=True)
        _checks.check_same_shape("rollout_logprobs", rollout_logprobs, "logprobs", logprobs)
    if selection is not None:
        check("selection", selection, dtypes=(torch.bool,))
        _checks.check_same_shape("selection", selection, "logprobs", logprobs)
    _checks.check_same_device(dict(
        logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages,
        loss_mask=loss_mask, token_weights=token_weights, rollout_logprobs=rollout_logprobs,
        cu_seqlens=cu_seqlens, selection=selection))


def _check_reduction(spec, reduction, denominator, norm_length, logprobs, cu_seqlens):
    reduction = spec.default_reduction if reduction is None else reduction
    _checks.check_choice("reduction", reduction, REDUCTIONS)
    if (reduction == "row_mean") != (spec.ratio == "geo_mean") and reduction not in (
            "sum", "none"):
        raise ValueError(f"reduction={reduction!r} does not fit ratio={spec.ratio!r}: geo_mean "
                         "(one loss per sequence) takes row_mean, sum or none; the others "
                         "take token_mean, seq_mean_*, sum or none")
    if reduction == "none" and spec.ratio == "sequence":
        raise ValueError("reduction='none' is not defined for ratio='sequence': each token's "
                         "loss depends on its whole row, so per-token losses have no per-token "
                         "gradient; use a scalar reduction")
    if denominator is not None:
        if reduction in ("sum", "none"):
            raise ValueError(f"denominator is not used by reduction={reduction!r}: pass None")
        if isinstance(denominator, torch.Tensor):
            if denominator.dim() != 0 or not denominator.is_floating_point() and \
                    denominator.dtype not in (torch.int32, torch.int64):
                raise ValueError(f"denominator must be a number or a 0-d tensor, got shape "
                                 f"{tuple(denominator.shape)}, dtype {denominator.dtype}")
        else:
            denominator = _checks.check_finite_number("denominator", denominator,
                                                        positive=True)
    if reduction == "seq_mean_token_sum_norm":
        if norm_length is None:
            if cu_seqlens is not None or logprobs.dim() != 2:
                raise ValueError("norm_length is required for reduction="
                                 "'seq_mean_token_sum_norm' on packed inputs (verl's "
                                 "loss_scale_factor; padded [B, T] defaults to T)")
            norm_length = float(logprobs.shape[-1])
        norm_length = _checks.check_finite_number("norm_length", norm_length, positive=True)
    elif norm_length is not None:
        raise ValueError(f"norm_length is only used by reduction='seq_mean_token_sum_norm', "
                         f"got reduction={reduction!r}")
    return reduction, denominator, norm_length


def _reduce(row_layout, reduction, loss_terms, partials, mask, rows, denominator, norm_length,
            loss_scale):
    """(loss, backward scale: 0-d, or [rows] for seq_mean_*) from the kernel's outputs;
    ``row_layout``: one stats row per sequence (the sequence kernel) rather than per block."""
    device = partials.device
    one = torch.ones((), device=device)
    if reduction == "none":
        return loss_terms * loss_scale, one * loss_scale
    total = partials[:, 0].double().sum().float()
    if reduction == "sum":
        return total * loss_scale, one * loss_scale
    if reduction == "row_mean":
        inv = 1.0 / (float(max(rows.num_rows, 1)) if denominator is None else denominator)
        return total * inv * loss_scale, inv * loss_scale * one
    if reduction == "token_mean":
        tokens = partials[:, 1].double().sum().float()
        inv = 1.0 / (tokens.clamp(min=1.0) if denominator is None else denominator)
        return total * inv * loss_scale, inv * loss_scale * one
    if row_layout:                                 # one stats row per sequence
        row_sums, row_tokens = partials[:, 0], partials[:, 1]
    else:
        row_sums, row_tokens = rows.sum(loss_terms), rows.sum(mask.float())
    row_scale = seq_row_scale(row_tokens, reduction, denominator, norm_length) * loss_scale
    return (row_sums * row_scale).sum(), row_scale


@torch.library.custom_op("glm_kernels::policy_loss", mutates_args=())
def _policy_op(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
               loss_mask: Optional[torch.Tensor], token_weights: Optional[torch.Tensor],
               rollout_logprobs: Optional[torch.Tensor], selection: Optional[torch.Tensor],
               cu_seqlens: Optional[torch.Tensor], denominator: Optional[torch.Tensor],
               ratio: str, objective: str, gate: str, reduction: str,
               floats: List[float], params: List[float],
               has_delta: bool, has_dual: bool, num_rows: int, row_len: int,
               need_grad: bool) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                         torch.Tensor]:
    """Flat inputs -> (loss, d unit / d lp [N] fp32 or [0], backward scale, stats [7]).

    gate '' = none; floats: log-ratio clamp
    (0 = none), sequence log-ratio cap (nan = none), gate_low, gate_high, eps_low, eps_high,
    dual_clip, norm_length, loss_scale, sequence IS mode (0 none, 1 truncate, 2 mask: the
    weight reduced from ``rollout_logprobs`` inside the sequence kernel, which then runs token
    ratios too), its low and high bounds."""
    from . import _kernels as kernels
    log_clamp, seq_max, gate_low, gate_high, eps_low, eps_high, dual, norm_length, \
        loss_scale, seq_is_code, seq_is_low, seq_is_high = floats
    spec = PolicyLossSpec(ratio, objective, log_ratio_clamp=log_clamp or None,
                          seq_log_ratio_max=None if seq_max != seq_max else seq_max)
    backend = _dispatch.select_backend("policy_loss", logprobs, old_logprobs, advantages,
                                       loss_mask, token_weights, rollout_logprobs)
    interpret = backend == "interpret"
    n = logprobs.numel()
    device = logprobs.device
    adv_per_seq = advantages.shape[0] != n
    rows = Rows(n, num_rows, row_len, cu_seqlens, device)
    ratio_code = kernels.RATIO_CODES[ratio]
    row_layout = kernels.row_programs(ratio_code, int(seq_is_code))
    row_splits = 1
    if adv_per_seq and not row_layout and cu_seqlens is not None:
        advantages, adv_per_seq = rows.spread(advantages), False
    store_loss = reduction == "none" or (reduction.startswith("seq_mean") and not row_layout)
    if ratio == "geo_mean":
        loss_terms = torch.zeros(num_rows, dtype=torch.float32, device=device)
        programs = num_rows
        block = _BLOCK_INTERPRET if interpret else _BLOCK_SEQ_GPU
    elif row_layout:
        loss_terms = torch.empty(n if store_loss else 0, dtype=torch.float32, device=device)
        block = _BLOCK_INTERPRET if interpret else _BLOCK_SEQ_GPU
        if ratio == "token":
            row_splits = kernels.row_splits(n, num_rows, block, device, interpret)
        programs = num_rows * row_splits
    else:
        loss_terms = torch.empty(n if store_loss else 0, dtype=torch.float32, device=device)
        block = _BLOCK_INTERPRET if interpret else _BLOCK_GPU
        programs = -(-n // block)
    grad = torch.empty(n if need_grad else 0, dtype=torch.float32, device=device)
    partials = torch.zeros((programs, _NUM_STATS), dtype=torch.float32, device=device)
    as_bytes = lambda t: None if t is None else (   # noqa: E731
        t.view(torch.uint8) if t.dtype == torch.bool else t)
    mask = None                    # read by the token layout's seq_mean_* reductions only
    if reduction.startswith("seq_mean") and not row_layout:
        mask = (torch.ones(n, dtype=torch.bool, device=device) if loss_mask is None
                else loss_mask != 0)
    if programs and n:            # no tokens: every sum stays 0 (rows without tokens: 0)
        kernels.policy_fwd(
            spec, (ratio_code, kernels.OBJECTIVE_CODES[objective],
                   kernels.GATE_CODES[gate or None]),
            logprobs, old_logprobs, advantages, as_bytes(loss_mask), token_weights,
            rollout_logprobs, as_bytes(selection), cu_seqlens, loss_terms, grad, partials,
            row_len=row_len, adv_per_seq=adv_per_seq, gate_low=gate_low, gate_high=gate_high,
            eps_low=eps_low, eps_high=eps_high, dual_clip=dual if has_dual else None,
            params=params, has_delta=has_delta, block=block,
            num_warps=4 if interpret or block <= 1024 else _WARPS_GPU,
            seq_is=int(seq_is_code), seq_is_low=seq_is_low, seq_is_high=seq_is_high,
            row_splits=row_splits)
    row_partials = (partials if row_splits == 1 else
                    partials.view(num_rows, row_splits, _NUM_STATS).sum(1))
    loss, scale = _reduce(row_layout, reduction, loss_terms, row_partials, mask, rows,
                          denominator, norm_length, loss_scale)
    stats = partials.double().sum(0).float()
    return loss, grad, scale, stats


@_policy_op.register_fake
def _policy_fake(logprobs, old_logprobs, advantages, loss_mask, token_weights,
                 rollout_logprobs, selection, cu_seqlens, denominator, ratio, objective, gate,
                 reduction, floats, params, has_delta, has_dual, num_rows, row_len, need_grad):
    n = logprobs.numel()
    if reduction == "none":
        loss_shape = (num_rows,) if ratio == "geo_mean" else (n,)
    else:
        loss_shape = ()
    scale_shape = (num_rows,) if reduction.startswith("seq_mean") else ()
    return (logprobs.new_empty(loss_shape, dtype=torch.float32),
            logprobs.new_empty((n if need_grad else 0,), dtype=torch.float32),
            logprobs.new_empty(scale_shape, dtype=torch.float32),
            logprobs.new_empty((_NUM_STATS,), dtype=torch.float32))


def _setup_context(ctx, inputs, output):
    logprobs, cu_seqlens = inputs[0], inputs[7]
    _, grad, scale, _ = output
    ctx.save_for_backward(grad, scale, cu_seqlens)
    ctx.ratio, ctx.reduction = inputs[9], inputs[12]
    ctx.num_rows, ctx.row_len = inputs[17], inputs[18]
    ctx.lp_dtype = logprobs.dtype


def _backward(ctx, grad_loss, _grad_grad, _grad_scale, _grad_stats):
    coef, scale, cu_seqlens = ctx.saved_tensors
    n = coef.numel()
    per_row = ctx.reduction.startswith("seq_mean") or (
        ctx.reduction == "none" and ctx.ratio == "geo_mean")
    upstream = scale * grad_loss
    if per_row:
        out = coef * Rows(n, ctx.num_rows, ctx.row_len, cu_seqlens, coef.device).spread(upstream)
    else:
        out = coef * upstream
    return (out.to(ctx.lp_dtype),) + (None,) * 19


torch.library.register_autograd("glm_kernels::policy_loss", _backward,
                                setup_context=_setup_context)


def policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                loss_mask: Optional[torch.Tensor] = None, *,
                variant: Union[str, PolicyLossSpec] = "vanilla", eps_low: float = 0.2,
                eps_high: float = 0.28, dual_clip: Optional[float] = None,
                token_weights: Optional[torch.Tensor] = None,
                rollout_logprobs: Optional[torch.Tensor] = None, gate: Optional[str] = None,
                gate_low: Optional[float] = None, gate_high: Optional[float] = None,
                cu_seqlens: Optional[torch.Tensor] = None, reduction: Optional[str] = None,
                denominator=None, norm_length: Optional[float] = None, loss_scale: float = 1.0,
                selection: Optional[torch.Tensor] = None, seq_is: Optional[str] = None,
                seq_is_high: float = 2.0, seq_is_low: Optional[float] = None,
                return_stats: bool = False,
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
        Sequence boundaries of packed 1-D inputs; must satisfy 0 = cu[0] <= ... <= cu[B] = N.
        The values are not checked (reading them would sync the device): other values give
        undefined results.
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
        ``ppo_kl`` (verl's definitions for the objective) and ``pop_frac`` (the gate's);
        vespo adds ``phi_mean`` (TRL's ``vespo/phi_seq_mean``: phi over the B rows, each with
        its first advantage; rows without tokens count with w = 1).
    seq_is, seq_is_high, seq_is_low : optional
        Sequence-level IS on ``rollout_logprobs`` (verl ``rollout_is="sequence"``, slime /
        TRL sequence TIS / MIS): every token of sequence b is weighted by
        w_b = exp(clamp(sum_m (old - rollout), -20, 20)), "truncate": min(w_b, seq_is_high);
        "mask": w_b where seq_is_low <= w_b <= seq_is_high (low default 1 / high), else 0.
        On the Triton / interpreter backends every preset reduces w_b inside the sequence
        kernel (programs per sequence; token-ratio presets run there too under seq_is),
        with no pass before it and no [N] weight tensor; the torch backend makes it a token
        weight (times ``token_weights``, :mod:`loss.sequence_is`). Not with vespo (TRL puts
        IS in its log w).
    **variant_params : float
        The objective's parameters (docs/policy_loss.md): delta; cispo_min, cispo_max; tau_pos,
        tau_neg; ratio_cap; dro_beta; ppo_kl_coef; k_pos, lambda_pos, k_neg, lambda_neg.

    Returns
    -------
    loss : fp32 0-d tensor ([*S] for reduction="none"; [B] for geo_mean "none"), optionally
    with the stats dict.
    """
    spec = resolve_variant(variant)
    _check_tensors(logprobs, old_logprobs, advantages, loss_mask, token_weights,
                   rollout_logprobs, cu_seqlens, selection)
    eps_low = _checks.check_finite_number("eps_low", eps_low, nonnegative=True)
    eps_high = _checks.check_finite_number("eps_high", eps_high, nonnegative=True)
    if spec.objective in ("ppo", "clip_cov") and spec.ratio != "geo_mean" and eps_low >= 1.0:
        raise ValueError(f"eps_low must be in [0, 1) (the clip band starts at 1 - eps_low > 0), "
                         f"got {eps_low}")
    dual = loss_checks.check_dual_clip(dual_clip)
    if dual is not None and spec.objective != "ppo":
        raise ValueError(f"dual_clip applies to objective 'ppo' only, got objective "
                         f"{spec.objective!r}")
    params = resolve_params(spec, variant_params, eps_low, eps_high)
    _checks.check_choice("gate", gate, GATES)
    if seq_is is not None:
        seq_is_high, seq_is_low = check_seq_is(seq_is, seq_is_high, seq_is_low)
        if rollout_logprobs is None:
            raise ValueError(f"seq_is={seq_is!r} needs rollout_logprobs")
        if spec.objective == "vespo":
            raise ValueError("seq_is does not apply to vespo (TRL adds the IS ratio to its "
                             "log w: pass token_weights)")
    elif seq_is_low is not None:
        raise ValueError("seq_is_low needs seq_is='mask'")
    if gate is None:
        if gate_low is not None or gate_high is not None or (
                rollout_logprobs is not None and seq_is is None):
            raise ValueError("rollout_logprobs / gate_low / gate_high need gate='coupled' or "
                             "'decoupled' (or seq_is for rollout_logprobs)")
        lo, hi = _DEFAULT_GATE
    else:
        if rollout_logprobs is None:
            raise ValueError(f"gate={gate!r} needs rollout_logprobs")
        lo, hi, _, _ = loss_checks.check_icepop_hyperparameters(
            _DEFAULT_GATE[1], gate_low if gate_low is not None else _DEFAULT_GATE[0],
            gate_high, 0.0, 0.0)
    if spec.objective in ("clip_cov", "kl_cov"):
        pass                                   # selection None = no token selected
    elif selection is not None:
        raise ValueError(f"selection is used by objectives clip_cov / kl_cov only, got "
                         f"objective {spec.objective!r}")
    loss_scale = _checks.check_finite_number("loss_scale", loss_scale)
    _checks.check_bool("return_stats", return_stats)
    reduction, denominator, norm_length = _check_reduction(spec, reduction, denominator,
                                                           norm_length, logprobs, cu_seqlens)

    num_seqs, row_len = _layout(logprobs, cu_seqlens)
    backend = _dispatch.select_backend("policy_loss", logprobs, old_logprobs, advantages,
                                       loss_mask, token_weights, rollout_logprobs)
    flat = lambda t: None if t is None else t.reshape(-1)   # noqa: E731
    mask = None
    if backend == "torch":
        mask = _bool_mask(flat(loss_mask), logprobs)
        if seq_is is not None:
            # The kernels reduce the sequence IS weight in the sequence kernel (every preset:
            # no pass before it, no [N] weights); the torch backend makes it a token weight.
            rows = Rows(logprobs.numel(), num_seqs, row_len, cu_seqlens, logprobs.device)
            seq_weights = seq_is_token_weights(flat(old_logprobs), flat(rollout_logprobs),
                                               mask, rows, seq_is, seq_is_high,
                                               seq_is_low).reshape(logprobs.shape)
            token_weights = (seq_weights if token_weights is None
                             else token_weights.float() * seq_weights)
    if gate is None and (seq_is is None or backend == "torch"):
        rollout_logprobs = None               # read by seq_is only
    if spec.objective in ("clip_cov", "kl_cov") and selection is None:
        selection = torch.zeros(logprobs.shape, dtype=torch.bool, device=logprobs.device)
    if backend == "torch":
        rows = Rows(logprobs.numel(), num_seqs, row_len, cu_seqlens, logprobs.device)
        adv = (rows.spread(advantages) if advantages.shape != logprobs.shape
               else flat(advantages))
        if lean_applies(spec, gate, params):
            loss, stats = lean_policy_loss(
                spec, flat(logprobs), flat(old_logprobs), adv, mask, rows, eps_low=eps_low,
                eps_high=eps_high, token_weights=flat(token_weights), reduction=reduction,
                denominator=denominator, norm_length=norm_length, loss_scale=loss_scale,
                params=params, need_stats=return_stats, dual_clip=dual,
                selection=flat(selection), rollout=flat(rollout_logprobs), gate=gate,
                gate_low=lo, gate_high=hi)
        else:
            loss, stats = policy_loss_reference(
                spec, flat(logprobs), flat(old_logprobs), adv, mask, rows,
                eps_low=eps_low, eps_high=eps_high, dual_clip=dual,
                token_weights=flat(token_weights), rollout=flat(rollout_logprobs), gate=gate,
                gate_low=lo, gate_high=hi, selection=flat(selection), reduction=reduction,
                denominator=denominator, norm_length=norm_length, loss_scale=loss_scale,
                params=params, need_stats=return_stats)
    else:
        contiguous = lambda t: None if t is None else t.contiguous().reshape(-1)  # noqa: E731
        if denominator is not None and not isinstance(denominator, torch.Tensor):
            denominator = torch.tensor(denominator, dtype=torch.float32,
                                       device=logprobs.device)
        elif denominator is not None:
            denominator = denominator.to(device=logprobs.device, dtype=torch.float32)
        values = [v for v in params.values()] + [0.0] * 4
        delta = params.get("delta")
        op_params = [0.0 if v is None else float(v) for v in values[:4]]
        floats = [spec.log_ratio_clamp or 0.0,
                  float("nan") if spec.seq_log_ratio_max is None else spec.seq_log_ratio_max,
                  lo, hi, eps_low, eps_high, 1.0 if dual is None else dual,
                  1.0 if norm_length is None else norm_length, loss_scale,
                  {None: 0.0, "truncate": 1.0, "mask": 2.0}[seq_is],
                  0.0 if seq_is_low is None else seq_is_low, seq_is_high]
        loss, _, _, sums = _policy_op(
            contiguous(logprobs), contiguous(old_logprobs), contiguous(advantages),
            contiguous(loss_mask), contiguous(token_weights), contiguous(rollout_logprobs),
            contiguous(selection), None if cu_seqlens is None else cu_seqlens.contiguous(),
            denominator, spec.ratio, spec.objective, gate or "", reduction, floats,
            op_params, delta is not None, dual is not None, num_seqs,
            0 if row_len is None else row_len,
            bool(logprobs.requires_grad and torch.is_grad_enabled()))
        stats = _stats_from_sums(sums)
        if spec.objective == "vespo":
            stats["phi_mean"] = sums[6] / max(num_seqs, 1)
    if reduction == "none" and spec.ratio != "geo_mean":
        loss = loss.reshape(logprobs.shape)
    return (loss, stats) if return_stats else loss


def _bool_mask(flat_mask: Optional[torch.Tensor], logprobs: torch.Tensor) -> torch.Tensor:
    """The flat loss mask as bool [N] (a bool mask as it is: no pass over it)."""
    if flat_mask is None:
        return torch.ones(logprobs.numel(), dtype=torch.bool, device=logprobs.device)
    return flat_mask if flat_mask.dtype == torch.bool else flat_mask != 0


def _stats_from_sums(sums: torch.Tensor) -> Dict[str, torch.Tensor]:
    """The kernel's stats [7] -> verl's masked means (sum / (masked + 1e-8)) and pop_frac."""
    masked = sums[1]
    return {"pg_clipfrac": sums[3] / (masked + 1e-8),
            "pg_clipfrac_lower": sums[4] / (masked + 1e-8),
            "ppo_kl": sums[5] / (masked + 1e-8),
            "pop_frac": sums[2] / masked.clamp(min=1.0)}
