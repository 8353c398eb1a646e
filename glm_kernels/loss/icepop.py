"""IcePop policy loss: training/rollout mismatch gate + asymmetric PPO clip, fused.

Math (DESIGN.md 3.1; readable version in ``loss/_reference.py``)::

    coupled   (old_logprobs is None):
        rho = exp(lp - lp_rollout);  g = 1[lo <= sg(rho) <= hi]
        l   = g * max(-rho * A, -clip(rho, 1 - eps_low, 1 + eps_high) * A)
    decoupled (old_logprobs given):
        k = exp(lp_old - lp_rollout);  w = k * 1[lo <= k <= hi];  r = exp(lp - lp_old)
        l = w * max(-r * A, -clip(r, 1 - eps_low, 1 + eps_high) * A)
    dual clip (dual_clip = c > 1): where A < 0 the max(...) is capped at -c * A

One Triton pass reads each token once, writes the per-token gradient coefficient
dl/dlp (and the per-token loss when the reduction needs it) plus per-program sums for the
loss and the metrics; backward only scales the coefficient by the reduction's factor and
``grad_output``. Registered as the ``glm_kernels::icepop_loss`` custom op, so it traces
through ``torch.compile`` (a fake kernel gives output shapes) and CUDA graphs.

With ``return_metrics`` the kernel's METRICS variant also sums the train/rollout mismatch
terms (k1, k3, chi2, log-ppl gaps, gate_out, non-finite; ``loss/_reference.py`` writes them
out), its programs following the rows of the last dim so the per-sequence gap is a sum of
whole programs. :func:`mismatch_metrics` runs the same kernel for trainers with their own
loss.
"""

from typing import Dict, Optional, Tuple, Union

import torch

from .. import _dispatch
from . import _checks, _reference

REDUCTIONS = ("token_mean", "seq_mean_token_mean", "sum", "none")
_BLOCK_GPU, _WARPS_GPU = 4096, 8
_BLOCK_GPU_METRICS = 2048
# With dual clip at most 1024 tokens a program: at 2048 triton 3.6 gives the decoupled variant
# an 8 B stack frame (sm_90 AOT); at 1024 every variant stays at 43-88 registers, no spill.
_BLOCK_GPU_DUAL = 1024
_BLOCK_INTERPRET = 1024
_NUM_STATS = 8                 # loss, masked, popped, clipped, ratio sum / max / min / count
_NUM_STATS_METRICS = 14        # + nonfinite, |M|, sums over M of d, k3, chi2, gate_out
_NUM_STATS_OUT = 16            # + sum over rows of the row's log-ppl gap, rows with |M_b| > 0
MISMATCH_KEYS = _reference.MISMATCH_KEYS


def _row_len(shape) -> int:
    """Tokens per sequence: the last dim (a 1-D or 0-D input is one sequence)."""
    return shape[-1] if len(shape) >= 2 else shape.numel()


def _n_seqs(shape) -> int:
    """Sequences (rows of the last dim) holding at least one token."""
    row_len = _row_len(shape)
    return shape.numel() // row_len if row_len else 0


def _token_stats_torch(logprobs, rollout, adv, mask, old, gate_low, gate_high, eps_low,
                       eps_high, dual_clip, need_grad, metrics):
    """The torch backend: reference terms, their written-out gradient, and the stats."""
    # Autograd is off inside a custom op's implementation, hence the closed-form gradient.
    kwargs = dict(old_logprobs=old, gate_low=gate_low, gate_high=gate_high, eps_low=eps_low,
                  eps_high=eps_high, dual_clip=dual_clip)
    loss_terms, popped, clipped, gate_ratio, masked = _reference.icepop_token_terms(
        logprobs, rollout, adv, mask, **kwargs)
    grad = (_reference.icepop_token_grad(logprobs, rollout, adv, mask, **kwargs)
            if need_grad else logprobs.new_empty(0, dtype=torch.float32))
    mismatch = None
    if metrics:
        train = logprobs if old is None else old
        mismatch = _reference.mismatch_token_terms(
            train, rollout, mask, gate_low=gate_low, gate_high=gate_high,
            also_finite=None if old is None else logprobs)
    rows = _reference.icepop_stats_rows(loss_terms.detach(), popped, clipped, gate_ratio,
                                        masked, mismatch)
    stats = _stats_from_partials(rows, _n_seqs(logprobs.shape))
    return loss_terms.detach().reshape(-1), grad.reshape(-1), stats


def _token_stats_triton(logprobs, rollout, adv, mask, old, gate_low, gate_high, eps_low,
                        eps_high, dual_clip, need_grad, store_loss, seq_len, adv_per_seq,
                        interpret, metrics, row_len):
    from . import _kernels
    n = logprobs.numel()
    block = _BLOCK_INTERPRET if interpret else (
        _BLOCK_GPU if dual_clip is None else _BLOCK_GPU_DUAL)
    if metrics:
        # Rows of row_len tokens, each covered by its own programs (per-sequence sums). On
        # the GPU at most 2048 tokens per program: with the metric sums a 4096-token program
        # needs 146-186 registers a thread at 8 warps (one program per SM, sm_90 AOT).
        cap = block if interpret else min(block, _BLOCK_GPU_METRICS)
        block = min(cap, max(16, 1 << max(row_len - 1, 0).bit_length()))
    else:
        row_len = max(n, 1)                   # one flat row
    warps = _WARPS_GPU if block >= 2048 else 4
    device = logprobs.device
    programs = -(-row_len // block) * (n // row_len) if n and row_len else 0
    loss_terms = torch.empty(n if store_loss else 0, dtype=torch.float32, device=device)
    grad = torch.empty(n if need_grad else 0, dtype=torch.float32, device=device)
    cols = _NUM_STATS_METRICS if metrics else _NUM_STATS
    partials = torch.empty((programs, cols), dtype=torch.float32, device=device)
    if mask is not None and mask.dtype == torch.bool:
        mask = mask.view(torch.uint8)
    if programs:
        _kernels.icepop_fwd(
            logprobs, rollout, old, adv, mask, loss_terms, grad, partials, seq_len=seq_len,
            gate_low=gate_low, gate_high=gate_high, clip_low=1.0 - eps_low,
            clip_high=1.0 + eps_high, adv_per_seq=adv_per_seq, block=block,
            num_warps=warps, row_len=row_len, metrics=metrics, dual_clip=dual_clip)
    return loss_terms, grad, _stats_from_partials(partials, n // row_len if row_len else 0)


def _stats_from_partials(partials: torch.Tensor, n_seqs: int = 0) -> torch.Tensor:
    """[rows, 8 or 14] per-program (or per-token) statistics -> the stats vector: [8], or
    [16] for 14 columns, the last two from the per-sequence grouping of the rows.

    With metrics, the rows must come in sequence order, ``n_seqs`` sequences with the same
    number of rows each (one row per token, or cdiv(row_len, block) programs per sequence).
    Every reduction runs in a fixed order on the device: deterministic, no atomics, no sync.
    """
    sums = partials.double().sum(0).float()
    has_rows = partials.shape[0] > 0
    stats = [sums[0], sums[1], sums[2], sums[3], sums[4],
             partials[:, 5].max() if has_rows else sums.new_tensor(float("-inf")),
             partials[:, 6].min() if has_rows else sums.new_tensor(float("inf")),
             sums[7]]
    if partials.shape[1] == _NUM_STATS:
        return torch.stack(stats)
    stats += [sums[k] for k in range(_NUM_STATS, _NUM_STATS_METRICS)]
    if has_rows and n_seqs:
        per_seq = partials[:, 9:11].double().reshape(n_seqs, -1, 2).sum(1)
        valid = per_seq[:, 0] > 0
        gap = torch.where(valid, -per_seq[:, 1] / per_seq[:, 0].clamp(min=1.0), 0.0)
        stats += [gap.sum().float(), valid.sum().float()]
    else:
        stats += [sums.new_zeros(()), sums.new_zeros(())]
    return torch.stack(stats)


def _reduce(loss_terms, loss_mask, stats, reduction, shape):
    """(loss, scale): scale is what backward multiplies the per-token coefficient by."""
    device = stats.device
    if reduction == "none":
        return loss_terms.reshape(shape), torch.ones((), device=device)
    if reduction == "sum":
        return stats[0].clone(), torch.ones((), device=device)
    if reduction == "token_mean":
        inv = 1.0 / stats[1].clamp(min=1.0)
        return stats[0] * inv, inv
    # seq_mean_token_mean on [B, T]: per-row scale 1 / (tokens_b * valid_rows).
    if loss_mask is None:
        row_tokens = torch.full(shape[:-1], float(shape[-1]), device=device)
    else:
        row_tokens = (loss_mask != 0).sum(-1).float()
    valid = row_tokens > 0
    row_sums = loss_terms.reshape(shape).sum(-1)
    n_valid = valid.sum().float().clamp(min=1.0)
    row_scale = torch.where(valid, 1.0 / (row_tokens.clamp(min=1.0) * n_valid), 0.0)
    return (row_sums * row_scale).sum(), row_scale


@torch.library.custom_op("glm_kernels::icepop_loss", mutates_args=())
def _icepop_op(logprobs: torch.Tensor, rollout_logprobs: torch.Tensor,
               advantages: torch.Tensor, loss_mask: Optional[torch.Tensor],
               old_logprobs: Optional[torch.Tensor], gate_low: float, gate_high: float,
               eps_low: float, eps_high: float, dual_clip: Optional[float], reduction: str,
               need_grad: bool, metrics: bool
               ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (loss, grad coefficient [N] fp32 or [0], backward scale, stats fp32: [8], or
    [16] with ``metrics``)."""
    shape = logprobs.shape
    adv_per_seq = advantages.shape != shape
    seq_len = shape[-1] if adv_per_seq else 1
    backend = _dispatch.select_backend("icepop_loss", logprobs, rollout_logprobs,
                                       advantages, loss_mask, old_logprobs)
    store_loss = reduction in ("none", "seq_mean_token_mean")
    if backend == "torch":
        adv_full = advantages.unsqueeze(-1).expand(shape) if adv_per_seq else advantages
        loss_terms, grad, stats = _token_stats_torch(
            logprobs, rollout_logprobs, adv_full, loss_mask, old_logprobs, gate_low,
            gate_high, eps_low, eps_high, dual_clip, need_grad, metrics)
    else:
        flat = lambda t: None if t is None else t.reshape(-1)   # noqa: E731 (inputs contiguous)
        loss_terms, grad, stats = _token_stats_triton(
            flat(logprobs), flat(rollout_logprobs), flat(advantages), flat(loss_mask),
            flat(old_logprobs), gate_low, gate_high, eps_low, eps_high, dual_clip, need_grad,
            store_loss, seq_len, adv_per_seq, interpret=backend == "interpret", metrics=metrics,
            row_len=_row_len(shape))
    loss, scale = _reduce(loss_terms, loss_mask, stats, reduction, shape)
    return loss, grad, scale, stats


@_icepop_op.register_fake
def _icepop_fake(logprobs, rollout_logprobs, advantages, loss_mask, old_logprobs, gate_low,
                 gate_high, eps_low, eps_high, dual_clip, reduction, need_grad, metrics):
    loss_shape = logprobs.shape if reduction == "none" else ()
    scale_shape = logprobs.shape[:-1] if reduction == "seq_mean_token_mean" else ()
    return (logprobs.new_empty(loss_shape, dtype=torch.float32),
            logprobs.new_empty((logprobs.numel() if need_grad else 0,), dtype=torch.float32),
            logprobs.new_empty(scale_shape, dtype=torch.float32),
            logprobs.new_empty((_NUM_STATS_OUT if metrics else _NUM_STATS,),
                               dtype=torch.float32))


def _setup_context(ctx, inputs, output):
    logprobs, reduction = inputs[0], inputs[10]
    _, grad, scale, _ = output
    ctx.save_for_backward(grad, scale)
    ctx.reduction = reduction
    ctx.lp_shape = logprobs.shape
    ctx.lp_dtype = logprobs.dtype


def _backward(ctx, grad_loss, _grad_grad, _grad_scale, _grad_stats):
    grad, scale = ctx.saved_tensors
    shape = ctx.lp_shape
    if grad.numel() != shape.numel():
        raise RuntimeError("icepop_loss: backward called but forward ran without need_grad")
    coef = grad.reshape(shape)
    if ctx.reduction == "none":
        out = coef * grad_loss
    elif ctx.reduction == "seq_mean_token_mean":
        out = coef * (scale * grad_loss).unsqueeze(-1)
    else:
        out = coef * (scale * grad_loss)
    return (out.to(ctx.lp_dtype),) + (None,) * 12


torch.library.register_autograd("glm_kernels::icepop_loss", _backward,
                                setup_context=_setup_context)


def _metrics_from_stats(stats: torch.Tensor) -> Dict[str, torch.Tensor]:
    """The metrics dict from a stats vector ([8]: the IcePop metrics; [16]: also the mismatch
    metrics of ``loss/_reference.py``). Device ops only: no host sync."""
    masked = stats[1]
    denom = masked.clamp(min=1.0)
    counted = stats[7]
    nan = torch.full_like(masked, float("nan"))
    has_ratio = counted > 0
    out = {
        "pop_frac": stats[2] / denom,
        "clip_frac": stats[3] / denom,
        "ratio_mean": torch.where(has_ratio, stats[4] / counted.clamp(min=1.0), nan),
        "ratio_max": torch.where(has_ratio, stats[5], nan),
        "ratio_min": torch.where(has_ratio, stats[6], nan),
    }
    if stats.shape[0] == _NUM_STATS_OUT:
        out.update(_mismatch_from_stats(stats))
    return {k: v.detach() for k, v in out.items()}


def _mismatch_from_stats(stats: torch.Tensor) -> Dict[str, torch.Tensor]:
    n_m = stats[9]
    nan = torch.full_like(n_m, float("nan"))
    per_m = lambda x: torch.where(n_m > 0, x / n_m.clamp(min=1.0), nan)   # noqa: E731
    k1 = per_m(-stats[10])
    seqs = stats[15]
    return {
        "mismatch_k1": k1,
        "mismatch_k3": per_m(stats[11]),
        "mismatch_chi2": per_m(stats[12]),
        "log_ppl_gap": k1.clone(),
        "log_ppl_gap_seq": torch.where(seqs > 0, stats[14] / seqs.clamp(min=1.0), nan),
        "gate_out_frac": per_m(stats[13]),
        "nonfinite_frac": stats[8] / stats[1].clamp(min=1.0),
    }


def _raise_if_nonfinite(stats: torch.Tensor, what: str) -> None:
    """raise_on_nonfinite=True: one host read of the count (a device sync on a GPU)."""
    bad = int(stats[8].item())
    if bad:
        raise ValueError(f"{what}: {bad} of {int(stats[1].item())} masked tokens have a "
                         f"non-finite (NaN/inf) train-side log-prob (raise_on_nonfinite=True)")


def _check_loss_mask(loss_mask, ref_name: str, ref: torch.Tensor) -> None:
    """loss_mask: bool or 0/1 numbers of ``ref``'s shape."""
    _dispatch.check_tensor("loss_mask", loss_mask)
    if not (loss_mask.dtype == torch.bool or loss_mask.is_floating_point()
            or loss_mask.dtype in (torch.uint8, torch.int8, torch.int32, torch.int64)):
        raise TypeError(f"loss_mask must be bool or 0/1 numbers, got dtype {loss_mask.dtype}")
    _dispatch.check_same_shape("loss_mask", loss_mask, ref_name, ref)


def _check_inputs(logprobs, rollout_logprobs, advantages, loss_mask, old_logprobs,
                  reduction):
    check = _dispatch.check_tensor
    check("logprobs", logprobs, dtypes=(torch.float32, torch.bfloat16, torch.float16))
    check("rollout_logprobs", rollout_logprobs, floating=True)
    _dispatch.check_same_shape("rollout_logprobs", rollout_logprobs, "logprobs", logprobs)
    check("advantages", advantages, floating=True)
    if advantages.shape != logprobs.shape:
        per_seq_ok = logprobs.dim() == 2 and advantages.shape == logprobs.shape[:1]
        if not per_seq_ok:
            raise ValueError(
                f"advantages must have the shape of logprobs {tuple(logprobs.shape)} or, for "
                f"2-D logprobs [B, T], shape [B]; got shape {tuple(advantages.shape)}")
    if loss_mask is not None:
        _check_loss_mask(loss_mask, "logprobs", logprobs)
    if old_logprobs is not None:
        check("old_logprobs", old_logprobs, floating=True)
        _dispatch.check_same_shape("old_logprobs", old_logprobs, "logprobs", logprobs)
    _dispatch.check_choice("reduction", reduction, REDUCTIONS)
    if reduction == "seq_mean_token_mean" and logprobs.dim() != 2:
        raise ValueError("reduction='seq_mean_token_mean' needs 2-D logprobs [B, T], got shape "
                         f"{tuple(logprobs.shape)}")
    _dispatch.check_same_device(dict(logprobs=logprobs, rollout_logprobs=rollout_logprobs,
                                     advantages=advantages, loss_mask=loss_mask,
                                     old_logprobs=old_logprobs))


def _check_hyperparameters(beta, gate_low, gate_high, eps_low, eps_high):
    """(gate_low, gate_high, eps_low, eps_high) as validated floats (``_checks``)."""
    return _checks.check_icepop_hyperparameters(beta, gate_low, gate_high, eps_low, eps_high)


def icepop_loss(logprobs: torch.Tensor, rollout_logprobs: torch.Tensor,
                advantages: torch.Tensor, loss_mask: Optional[torch.Tensor] = None, *,
                old_logprobs: Optional[torch.Tensor] = None, beta: float = 2.0,
                gate_low: Optional[float] = None, gate_high: Optional[float] = None,
                eps_low: float = 0.2, eps_high: float = 0.28, reduction: str = "token_mean",
                return_metrics: bool = False, raise_on_nonfinite: bool = False,
                dual_clip: Optional[float] = None
                ) -> Union[torch.Tensor, Tuple[torch.Tensor, Dict[str, torch.Tensor]]]:
    """IcePop policy loss (GLM-5 RL; Ring-1T "IcePop"), fused forward and gradient.

    Parameters
    ----------
    logprobs : Tensor [*S], float32 / bfloat16 / float16
        log pi_theta of the sampled tokens; the only input that receives a gradient.
    rollout_logprobs : Tensor [*S], any float dtype
        log pi_rollout recorded by the inference engine at sampling time.
    advantages : Tensor [*S], or [B] when ``logprobs`` is [B, T] (one per sequence)
    loss_mask : Tensor [*S], bool or 0/1, optional
        Tokens that count (nonzero). None = all tokens.
    old_logprobs : Tensor [*S], optional
        Recomputed log pi_old: switches to the decoupled mode (gate on exp(old - rollout)).
    beta : float > 1, default 2.0
        Gate interval is [gate_low or 1/beta, gate_high or beta], both ends inclusive;
        0 <= gate_low < gate_high is required.
    eps_low, eps_high : float, default 0.2, 0.28
        Asymmetric clip of the ratio to [1 - eps_low, 1 + eps_high]; 0 <= eps_low < 1,
        eps_high >= 0.
    dual_clip : float > 1, optional
        Dual-clip PPO (verl's ``clip_ratio_c``, slime's ``--eps-clip-c``; TRL's ``delta`` when
        delta >= 1 + eps_high): for A < 0 the token's max(...) term is capped at
        -dual_clip * A, a constant where the cap binds (no gradient; clip_frac does not count
        it). None: off.
    reduction : {"token_mean", "seq_mean_token_mean", "sum", "none"}
        token_mean: sum(l*m) / max(sum(m), 1) (popped tokens stay in the denominator);
        seq_mean_token_mean: mean over rows with tokens of the row's token mean ([B, T] only);
        sum: sum(l*m); none: l*m with the input shape.
    return_metrics : bool
        Also return detached fp32 scalars: pop_frac (popped / masked), clip_frac (masked kept
        tokens whose clipped branch is strictly active), ratio_mean / ratio_max / ratio_min of
        the gated ratio (rho coupled, k decoupled) over masked tokens (NaN if none), and the
        train/rollout mismatch metrics, computed in the same kernel pass: mismatch_k1,
        mismatch_k3, mismatch_chi2, log_ppl_gap, log_ppl_gap_seq (per row of the last dim),
        gate_out_frac, nonfinite_frac (formulas: docs/icepop.md, loss/_reference.py).
    raise_on_nonfinite : bool
        Raise ValueError when a masked token has a NaN/inf train-side log-prob (logprobs, or
        old_logprobs); costs one host read of a count (a device sync on a GPU). Default: such
        tokens contribute 0 and are counted in nonfinite_frac.

    Returns
    -------
    loss : fp32 scalar, or [*S] for reduction="none"; optionally (loss, metrics dict).

    Notes
    -----
    Log-ratios are clamped to [-20, 20] before exp. A popped or unmasked token contributes
    exactly 0 to the loss and the gradient even when its inputs are inf or NaN. A masked token
    with a NaN/inf train-side log-prob contributes 0 too and counts in nonfinite_frac (not in
    pop_frac); a NaN/inf rollout log-prob pops the token. A NaN/inf advantage of a kept token
    propagates to the loss and to that token's gradient.
    Non-contiguous inputs are copied to contiguous ones (one extra read and write).

    Example
    -------
    >>> import torch, glm_kernels
    >>> lp = torch.tensor([-1.0, -2.0, -0.5], requires_grad=True)
    >>> rollout = torch.tensor([-1.1, -0.5, -0.5])   # token 1: ratio e^-1.5 < 1/2, popped
    >>> adv = torch.tensor([1.0, 1.0, -1.0])
    >>> loss, m = glm_kernels.icepop_loss(lp, rollout, adv, return_metrics=True)
    >>> round(m["pop_frac"].item(), 4)
    0.3333
    >>> loss.backward(); bool(lp.grad[1] == 0)
    True
    """
    _check_inputs(logprobs, rollout_logprobs, advantages, loss_mask, old_logprobs, reduction)
    lo, hi, eps_low, eps_high = _check_hyperparameters(beta, gate_low, gate_high, eps_low,
                                                       eps_high)
    dual = _checks.check_dual_clip(dual_clip)
    _checks.check_bool("return_metrics", return_metrics)
    _checks.check_bool("raise_on_nonfinite", raise_on_nonfinite)
    contiguous = lambda t: None if t is None else t.contiguous()   # noqa: E731
    loss, _, _, stats = _icepop_op(
        contiguous(logprobs), contiguous(rollout_logprobs), contiguous(advantages),
        contiguous(loss_mask), contiguous(old_logprobs), lo, hi, eps_low, eps_high, dual,
        reduction, bool(logprobs.requires_grad and torch.is_grad_enabled()),
        return_metrics or raise_on_nonfinite)
    if raise_on_nonfinite:
        _raise_if_nonfinite(stats, "icepop_loss")
    if not return_metrics:
        return loss
    return loss, _metrics_from_stats(stats)


def mismatch_metrics(train_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor,
                     loss_mask: Optional[torch.Tensor] = None, *, beta: float = 2.0,
                     gate_low: Optional[float] = None, gate_high: Optional[float] = None
                     ) -> Dict[str, torch.Tensor]:
    """Train/rollout mismatch metrics for trainers that keep their own loss.

    The same numbers ``icepop_loss(..., return_metrics=True)`` reports, from the same kernel
    (one read of each input, per-program partial sums reduced in a fixed order: deterministic,
    no host sync).

    Parameters
    ----------
    train_logprobs : Tensor [*S], float32 / bfloat16 / float16
        log pi_train of the sampled tokens (the trainer's recompute). Not differentiated.
    rollout_logprobs : Tensor [*S], any float dtype
        log pi_rollout recorded by the inference engine.
    loss_mask : Tensor [*S], bool or 0/1, optional
        Tokens that count. None = all.
    beta, gate_low, gate_high
        The gate [gate_low or 1/beta, gate_high or beta] that gate_out_frac measures.

    Returns
    -------
    dict of detached fp32 scalars; with M the masked tokens whose two log-probs are finite,
    d = clamp(train - rollout, -20, 20), r = e^d:
    mismatch_k1 = mean_M(-d); mismatch_k3 = mean_M(r - 1 - d); mismatch_chi2 = mean_M(r^2 - 1);
    log_ppl_gap = mean_M(-d) (log PPL_train - log PPL_rollout); log_ppl_gap_seq = the mean
    over rows of the last dim (sequences) with tokens in M of each row's gap; gate_out_frac =
    share of M outside the gate; nonfinite_frac = masked tokens with a NaN/inf train log-prob
    / masked tokens. Means over an empty set are NaN.

    Example
    -------
    >>> import torch, glm_kernels
    >>> train = torch.tensor([[-1.0, -2.0], [-0.5, -0.5]])
    >>> m = glm_kernels.loss.mismatch_metrics(train, train - 0.1)   # rollout 0.1 nats lower
    >>> round(m["mismatch_k1"].item(), 4), round(m["log_ppl_gap_seq"].item(), 4)
    (-0.1, -0.1)
    >>> round(m["mismatch_k3"].item(), 6)                          # e^0.1 - 1 - 0.1
    0.005171
    """
    check = _dispatch.check_tensor
    check("train_logprobs", train_logprobs, dtypes=(torch.float32, torch.bfloat16,
                                                    torch.float16))
    check("rollout_logprobs", rollout_logprobs, floating=True)
    _dispatch.check_same_shape("rollout_logprobs", rollout_logprobs, "train_logprobs",
                               train_logprobs)
    if loss_mask is not None:
        _check_loss_mask(loss_mask, "train_logprobs", train_logprobs)
    _dispatch.check_same_device(dict(train_logprobs=train_logprobs,
                                     rollout_logprobs=rollout_logprobs, loss_mask=loss_mask))
    lo, hi, _, _ = _check_hyperparameters(beta, gate_low, gate_high, 0.2, 0.28)
    # As [rows, row_len] (same sequences) with zero per-sequence advantages: the loss terms
    # vanish and the kernel reports the metrics; nothing per token is read besides the inputs.
    shape = train_logprobs.shape
    rows = shape[:-1].numel() if len(shape) >= 2 else 1
    as_2d = lambda t: t.detach().reshape(rows, _row_len(shape)).contiguous()   # noqa: E731
    zeros = torch.zeros(rows, dtype=torch.float32, device=train_logprobs.device)
    _, _, _, stats = _icepop_op(
        as_2d(train_logprobs), as_2d(rollout_logprobs), zeros,
        None if loss_mask is None else as_2d(loss_mask), None, lo, hi, 0.2, 0.28,
        None, "sum", False, True)
    metrics = _metrics_from_stats(stats)
    return {k: metrics[k] for k in MISMATCH_KEYS}
