"""IcePop policy loss: training/rollout mismatch gate + asymmetric PPO clip, fused.

Math (DESIGN.md 3.1; readable version in ``loss/_reference.py``)::

    coupled   (old_logprobs is None):
        rho = exp(lp - lp_rollout);  g = 1[lo <= sg(rho) <= hi]
        l   = g * max(-rho * A, -clip(rho, 1 - eps_low, 1 + eps_high) * A)
    decoupled (old_logprobs given):
        k = exp(lp_old - lp_rollout);  w = k * 1[lo <= k <= hi];  r = exp(lp - lp_old)
        l = w * max(-r * A, -clip(r, 1 - eps_low, 1 + eps_high) * A)

One Triton pass reads each token once, writes the per-token gradient coefficient
dl/dlp (and the per-token loss when the reduction needs it) plus per-program sums for the
loss and the metrics; backward only scales the coefficient by the reduction's factor and
``grad_output``. Registered as the ``glm_kernels::icepop_loss`` custom op, so it traces
through ``torch.compile`` (a fake kernel gives output shapes) and CUDA graphs.
"""

from typing import Dict, Optional, Tuple, Union

import torch

from .. import _dispatch
from . import _reference

REDUCTIONS = ("token_mean", "seq_mean_token_mean", "sum", "none")
_BLOCK_GPU, _WARPS_GPU = 4096, 8
_BLOCK_INTERPRET = 1024
_NUM_STATS = 8


def _token_stats_torch(logprobs, rollout, adv, mask, old, gate_low, gate_high, eps_low,
                       eps_high, need_grad):
    """The torch backend: reference terms, their written-out gradient, and the stats row."""
    # Autograd is off inside a custom op's implementation, hence the closed-form gradient.
    kwargs = dict(old_logprobs=old, gate_low=gate_low, gate_high=gate_high, eps_low=eps_low,
                  eps_high=eps_high)
    loss_terms, popped, clipped, gate_ratio, masked = _reference.icepop_token_terms(
        logprobs, rollout, adv, mask, **kwargs)
    grad = (_reference.icepop_token_grad(logprobs, rollout, adv, mask, **kwargs)
            if need_grad else logprobs.new_empty(0, dtype=torch.float32))
    counted = masked & ~torch.isnan(gate_ratio)
    inf = torch.tensor(float("inf"), dtype=torch.float32, device=loss_terms.device)
    stats = torch.stack([
        loss_terms.detach().sum(), masked.sum().float(), popped.sum().float(),
        clipped.sum().float(), torch.where(counted, gate_ratio, 0.0).sum(),
        torch.where(counted, gate_ratio, -inf).max() if loss_terms.numel() else -inf,
        torch.where(counted, gate_ratio, inf).min() if loss_terms.numel() else inf,
        counted.sum().float()]).to(torch.float32)
    return loss_terms.detach().reshape(-1), grad.reshape(-1), stats


def _token_stats_triton(logprobs, rollout, adv, mask, old, gate_low, gate_high, eps_low,
                        eps_high, need_grad, store_loss, seq_len, adv_per_seq, interpret):
    from . import _kernels
    block = _BLOCK_INTERPRET if interpret else _BLOCK_GPU
    n = logprobs.numel()
    device = logprobs.device
    programs = max(-(-n // block), 0)
    loss_terms = torch.empty(n if store_loss else 0, dtype=torch.float32, device=device)
    grad = torch.empty(n if need_grad else 0, dtype=torch.float32, device=device)
    partials = torch.empty((programs, _NUM_STATS), dtype=torch.float32, device=device)
    if mask is not None and mask.dtype == torch.bool:
        mask = mask.view(torch.uint8)
    if programs:
        _kernels.icepop_fwd(
            logprobs, rollout, old, adv, mask, loss_terms, grad, partials, seq_len=seq_len,
            gate_low=gate_low, gate_high=gate_high, clip_low=1.0 - eps_low,
            clip_high=1.0 + eps_high, adv_per_seq=adv_per_seq, block=block,
            num_warps=_WARPS_GPU)
    return loss_terms, grad, _stats_from_partials(partials)


def _stats_from_partials(partials: torch.Tensor) -> torch.Tensor:
    """[rows, 8] per-program (or per-token) statistics -> the [8] stats vector."""
    # Fixed-order reduction of the rows: deterministic, no atomics.
    sums = partials.double().sum(0).float()
    has_rows = partials.shape[0] > 0
    return torch.stack([
        sums[0], sums[1], sums[2], sums[3], sums[4],
        partials[:, 5].max() if has_rows else sums.new_tensor(float("-inf")),
        partials[:, 6].min() if has_rows else sums.new_tensor(float("inf")),
        sums[7]])


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
               eps_low: float, eps_high: float, reduction: str, need_grad: bool
               ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (loss, grad coefficient [N] fp32 or [0], backward scale, stats [8] fp32)."""
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
            gate_high, eps_low, eps_high, need_grad)
    else:
        flat = lambda t: None if t is None else t.reshape(-1)   # noqa: E731 (inputs contiguous)
        loss_terms, grad, stats = _token_stats_triton(
            flat(logprobs), flat(rollout_logprobs), flat(advantages), flat(loss_mask),
            flat(old_logprobs), gate_low, gate_high, eps_low, eps_high, need_grad, store_loss,
            seq_len, adv_per_seq, interpret=backend == "interpret")
    loss, scale = _reduce(loss_terms, loss_mask, stats, reduction, shape)
    return loss, grad, scale, stats


@_icepop_op.register_fake
def _icepop_fake(logprobs, rollout_logprobs, advantages, loss_mask, old_logprobs, gate_low,
                 gate_high, eps_low, eps_high, reduction, need_grad):
    loss_shape = logprobs.shape if reduction == "none" else ()
    scale_shape = logprobs.shape[:-1] if reduction == "seq_mean_token_mean" else ()
    return (logprobs.new_empty(loss_shape, dtype=torch.float32),
            logprobs.new_empty((logprobs.numel() if need_grad else 0,), dtype=torch.float32),
            logprobs.new_empty(scale_shape, dtype=torch.float32),
            logprobs.new_empty((_NUM_STATS,), dtype=torch.float32))


def _setup_context(ctx, inputs, output):
    logprobs, reduction = inputs[0], inputs[9]
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
    return (out.to(ctx.lp_dtype),) + (None,) * 10


torch.library.register_autograd("glm_kernels::icepop_loss", _backward,
                                setup_context=_setup_context)


def _metrics_from_stats(stats: torch.Tensor) -> Dict[str, torch.Tensor]:
    masked = stats[1]
    denom = masked.clamp(min=1.0)
    counted = stats[7]
    nan = torch.full_like(masked, float("nan"))
    has_ratio = counted > 0
    return {
        "pop_frac": (stats[2] / denom).detach(),
        "clip_frac": (stats[3] / denom).detach(),
        "ratio_mean": torch.where(has_ratio, stats[4] / counted.clamp(min=1.0), nan).detach(),
        "ratio_max": torch.where(has_ratio, stats[5], nan).detach(),
        "ratio_min": torch.where(has_ratio, stats[6], nan).detach(),
    }


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
        check("loss_mask", loss_mask)
        if not (loss_mask.dtype == torch.bool or loss_mask.is_floating_point()
                or loss_mask.dtype in (torch.uint8, torch.int8, torch.int32, torch.int64)):
            raise TypeError(f"loss_mask must be bool or 0/1 numbers, got dtype {loss_mask.dtype}")
        _dispatch.check_same_shape("loss_mask", loss_mask, "logprobs", logprobs)
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
    """(gate_low, gate_high, eps_low, eps_high) as validated floats."""
    beta = _dispatch.check_finite_number("beta", beta, positive=True)
    lo = 1.0 / beta if gate_low is None else _dispatch.check_finite_number("gate_low", gate_low)
    hi = beta if gate_high is None else _dispatch.check_finite_number("gate_high", gate_high)
    if lo > hi:
        raise ValueError(f"gate interval is empty: gate_low {lo} > gate_high {hi}")
    eps_low = _dispatch.check_finite_number("eps_low", eps_low, nonnegative=True)
    eps_high = _dispatch.check_finite_number("eps_high", eps_high, nonnegative=True)
    return lo, hi, eps_low, eps_high


def icepop_loss(logprobs: torch.Tensor, rollout_logprobs: torch.Tensor,
                advantages: torch.Tensor, loss_mask: Optional[torch.Tensor] = None, *,
                old_logprobs: Optional[torch.Tensor] = None, beta: float = 2.0,
                gate_low: Optional[float] = None, gate_high: Optional[float] = None,
                eps_low: float = 0.2, eps_high: float = 0.28, reduction: str = "token_mean",
                return_metrics: bool = False
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
    beta : float, default 2.0
        Gate interval is [gate_low or 1/beta, gate_high or beta], both ends inclusive.
    eps_low, eps_high : float, default 0.2, 0.28
        Asymmetric clip of the ratio to [1 - eps_low, 1 + eps_high].
    reduction : {"token_mean", "seq_mean_token_mean", "sum", "none"}
        token_mean: sum(l*m) / max(sum(m), 1) (popped tokens stay in the denominator);
        seq_mean_token_mean: mean over rows with tokens of the row's token mean ([B, T] only);
        sum: sum(l*m); none: l*m with the input shape.
    return_metrics : bool
        Also return detached fp32 scalars: pop_frac (popped / masked), clip_frac (masked kept
        tokens whose clipped branch is strictly active), ratio_mean / ratio_max / ratio_min of
        the gated ratio (rho coupled, k decoupled) over masked tokens (NaN if none).

    Returns
    -------
    loss : fp32 scalar, or [*S] for reduction="none"; optionally (loss, metrics dict).

    Notes
    -----
    Log-ratios are clamped to [-20, 20] before exp. A popped or unmasked token contributes
    exactly 0 to the loss and the gradient even when its inputs are inf or NaN.
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
    contiguous = lambda t: None if t is None else t.contiguous()   # noqa: E731
    loss, _, _, stats = _icepop_op(
        contiguous(logprobs), contiguous(rollout_logprobs), contiguous(advantages),
        contiguous(loss_mask), contiguous(old_logprobs), lo, hi, eps_low, eps_high,
        reduction, bool(logprobs.requires_grad and torch.is_grad_enabled()))
    if not return_metrics:
        return loss
    return loss, _metrics_from_stats(stats)
