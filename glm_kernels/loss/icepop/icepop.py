"""IcePop policy loss: training/rollout mismatch gate + asymmetric PPO clip, fused.

Math (docs/design.md 3.1; readable version in ``loss/icepop/_reference.py``)::

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
through ``torch.compile`` (a fake kernel gives output shapes) and CUDA graphs; eager calls
run the op's body directly under a plain autograd node (the same backward formula) and skip
the dispatcher's fixed cost.

Why IcePop keeps its own kernel beside the policy family (``glm_kernels.policy_loss``, whose
``gate=`` composes the same gate with every variant): the two contracts differ where trainers
observe them. Here a token whose train-side log-prob (``logprobs``, or ``old_logprobs`` when
decoupled) is NaN / inf contributes exactly 0 to the loss and the gradient and is left out of
``pop_frac``; the family follows verl, which lets such a value reach the loss and counts the
token as popped. Here ``return_metrics`` reports the gate ratio's mean / max / min over the
masked tokens with finite log-probs, statistics the family's kernel does not carry; and
``clip_frac`` counts clipped tokens among the kept ones, where verl's ``pg_clipfrac`` (the
family's) counts over all masked tokens. Folding these rules into the family would add
constexpr branches and a second statistics layout to every variant's kernel for one preset, so
the gated PPO stays this small single-pass kernel (``_kernels.py``); its torch backend is
``_torch.lean_icepop`` (closed form, kept tokens masked by one bitwise AND).
benchmarks/NOTES.md (icepop_loss) has the measurements.

``return_metrics`` adds the train/rollout mismatch metrics (verl's names and values,
``loss/mismatch/mismatch.py``), computed from the same per-token inputs after the kernel:
turning them on never changes the loss or the gradient by a bit. :func:`mismatch_metrics`
computes them alone for trainers with their own loss.
"""

from typing import Dict, Optional, Tuple, Union

import torch

from ... import _checks, _dispatch
from .._common import checks as loss_checks
from ._torch import lean_icepop
from ..mismatch import mismatch_from_tokens, raise_if_nonfinite, train_side_nonfinite_count

REDUCTIONS = ("token_mean", "seq_mean_token_mean", "sum", "none")
_BLOCK_GPU, _WARPS_GPU = 4096, 8
# With dual clip at most 1024 tokens a program: at 2048 triton 3.6 gives the decoupled variant
# an 8 B stack frame (sm_90 AOT); at 1024 every variant stays at 43-88 registers, no spill.
_BLOCK_GPU_DUAL = 1024
_BLOCK_INTERPRET = 1024
_NUM_STATS = 8                 # loss, masked, popped, clipped, ratio sum / max / min / count
_NONFINITE_KEY = "icepop_loss: non-finite train-side log-probs"   # warned once per process


def _token_stats_torch(logprobs, rollout, adv, mask, old, gate_low, gate_high, eps_low,
                       eps_high, dual_clip, need_grad, store_loss, need_metrics):
    """The torch backend: the policy-loss family's lean torch path for the gated PPO
    objective (``loss/icepop/_torch.lean_icepop``; closed-form gradient: autograd is off
    inside a custom op's implementation)."""
    flat = lambda t: None if t is None else t.reshape(-1)   # noqa: E731
    return lean_icepop(flat(logprobs), flat(rollout), flat(adv), flat(mask), flat(old),
                       gate_low=gate_low, gate_high=gate_high, eps_low=eps_low,
                       eps_high=eps_high, dual_clip=dual_clip, need_grad=need_grad,
                       store_loss=store_loss, need_metrics=need_metrics)


def _token_stats_triton(logprobs, rollout, adv, mask, old, gate_low, gate_high, eps_low,
                        eps_high, dual_clip, need_grad, store_loss, seq_len, adv_per_seq,
                        interpret):
    from . import _kernels
    n = logprobs.numel()
    block = _BLOCK_INTERPRET if interpret else (
        _BLOCK_GPU if dual_clip is None else _BLOCK_GPU_DUAL)
    warps = _WARPS_GPU if block >= 2048 else 4
    device = logprobs.device
    programs = -(-n // block)
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
            num_warps=warps, dual_clip=dual_clip)
    return loss_terms, grad, _stats_from_partials(partials)


def _stats_from_partials(partials: torch.Tensor) -> torch.Tensor:
    """[rows, 8] per-program (or per-token) statistics -> the stats vector [8].

    Every reduction runs in a fixed order on the device: deterministic, no atomics, no sync.
    """
    sums = partials.double().sum(0).float()
    has_rows = partials.shape[0] > 0
    return torch.stack([sums[0], sums[1], sums[2], sums[3], sums[4],
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


def _icepop_impl(logprobs: torch.Tensor, rollout_logprobs: torch.Tensor,
               advantages: torch.Tensor, loss_mask: Optional[torch.Tensor],
               old_logprobs: Optional[torch.Tensor], gate_low: float, gate_high: float,
               eps_low: float, eps_high: float, dual_clip: Optional[float], reduction: str,
               need_grad: bool, need_metrics: bool = True
               ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (loss, grad coefficient [N] fp32 or [0], backward scale, stats fp32 [8]).
    ``need_metrics=False``: stats[2:] may be NaN (the torch backend skips the metric-only
    statistics; the loss and the gradient are the same bits)."""
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
            gate_high, eps_low, eps_high, dual_clip, need_grad, store_loss, need_metrics)
    else:
        flat = lambda t: None if t is None else t.reshape(-1)   # noqa: E731 (inputs contiguous)
        loss_terms, grad, stats = _token_stats_triton(
            flat(logprobs), flat(rollout_logprobs), flat(advantages), flat(loss_mask),
            flat(old_logprobs), gate_low, gate_high, eps_low, eps_high, dual_clip, need_grad,
            store_loss, seq_len, adv_per_seq, interpret=backend == "interpret")
    loss, scale = _reduce(loss_terms, loss_mask, stats, reduction, shape)
    return loss, grad, scale, stats


_icepop_op = torch.library.custom_op("glm_kernels::icepop_loss", mutates_args=())(_icepop_impl)


@_icepop_op.register_fake
def _icepop_fake(logprobs, rollout_logprobs, advantages, loss_mask, old_logprobs, gate_low,
                 gate_high, eps_low, eps_high, dual_clip, reduction, need_grad,
                 need_metrics=True):
    loss_shape = logprobs.shape if reduction == "none" else ()
    scale_shape = logprobs.shape[:-1] if reduction == "seq_mean_token_mean" else ()
    return (logprobs.new_empty(loss_shape, dtype=torch.float32),
            logprobs.new_empty((logprobs.numel() if need_grad else 0,), dtype=torch.float32),
            logprobs.new_empty(scale_shape, dtype=torch.float32),
            logprobs.new_empty((_NUM_STATS,), dtype=torch.float32))


def _setup_context(ctx, inputs, output):
    logprobs, reduction = inputs[0], inputs[10]
    _, grad, scale, _ = output
    ctx.save_for_backward(grad, scale)
    ctx.reduction = reduction
    ctx.lp_shape = logprobs.shape
    ctx.lp_dtype = logprobs.dtype


def _scaled_gradient(ctx, grad_loss):
    """d loss / d logprobs: the forward's per-token coefficient times the reduction's scale
    and the upstream gradient (one multiply)."""
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
    return out.to(ctx.lp_dtype)


def _backward(ctx, grad_loss, _grad_grad, _grad_scale, _grad_stats):
    return (_scaled_gradient(ctx, grad_loss),) + (None,) * 12


torch.library.register_autograd("glm_kernels::icepop_loss", _backward,
                                setup_context=_setup_context)


class _EagerGradient(torch.autograd.Function):
    """Eager mode's autograd node for the op's outputs: the registered formula
    (:func:`_scaled_gradient`) on a plain ``autograd.Function``. In eager mode
    :func:`icepop_loss` calls the op's body directly: the custom op's dispatch and
    torch.library's autograd wrapper cost ~0.1 ms a call forward and as much backward on the
    CPU (argument normalisation, pytree, its generated node), a tenth of a 32K-token loss.
    Traced code (``torch.compile``) calls the registered custom op and its autograd."""

    @staticmethod
    def forward(ctx, logprobs, loss, grad, scale, reduction):
        ctx.save_for_backward(grad, scale)
        ctx.reduction, ctx.lp_shape, ctx.lp_dtype = reduction, logprobs.shape, logprobs.dtype
        return loss.clone()

    @staticmethod
    def backward(ctx, grad_loss):
        return _scaled_gradient(ctx, grad_loss), None, None, None, None


def icepop_metrics(stats: torch.Tensor, train, rollout, loss_mask, also_finite, gate_low,
                   gate_high) -> Dict[str, torch.Tensor]:
    """The metrics dict: IcePop's from the kernel's stats [8] (pop_frac, clip_frac and the
    gate ratio's mean / max / min over M, the masked tokens with finite log-probs) and the
    mismatch metrics of ``loss/mismatch/mismatch.py`` from the per-token tensors. Device ops
    only."""
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
    out.update(mismatch_from_tokens(train, rollout, loss_mask, gate_low=gate_low,
                                    gate_high=gate_high, also_finite=also_finite))
    return {k: v.detach() for k, v in out.items()}


def _check_inputs(logprobs, rollout_logprobs, advantages, loss_mask, old_logprobs,
                  reduction):
    check = _checks.check_tensor
    check("logprobs", logprobs, dtypes=(torch.float32, torch.bfloat16, torch.float16))
    check("rollout_logprobs", rollout_logprobs, floating=True)
    _checks.check_same_shape("rollout_logprobs", rollout_logprobs, "logprobs", logprobs)
    check("advantages", advantages, floating=True)
    if advantages.shape != logprobs.shape:
        per_seq_ok = logprobs.dim() == 2 and advantages.shape == logprobs.shape[:1]
        if not per_seq_ok:
            raise ValueError(
                f"advantages must have the shape of logprobs {tuple(logprobs.shape)} or, for "
                f"2-D logprobs [B, T], shape [B]; got shape {tuple(advantages.shape)}")
    if loss_mask is not None:
        loss_checks.check_loss_mask(loss_mask, "logprobs", logprobs)
    if old_logprobs is not None:
        check("old_logprobs", old_logprobs, floating=True)
        _checks.check_same_shape("old_logprobs", old_logprobs, "logprobs", logprobs)
    _checks.check_choice("reduction", reduction, REDUCTIONS)
    if reduction == "seq_mean_token_mean" and logprobs.dim() != 2:
        raise ValueError("reduction='seq_mean_token_mean' needs 2-D logprobs [B, T], got shape "
                         f"{tuple(logprobs.shape)}")
    _checks.check_same_device(dict(logprobs=logprobs, rollout_logprobs=rollout_logprobs,
                                     advantages=advantages, loss_mask=loss_mask,
                                     old_logprobs=old_logprobs))


def _warn_if_nonfinite(train, loss_mask, also_finite) -> None:
    """warn_on_nonfinite: one host read of the count; the warning once per process."""
    bad = train_side_nonfinite_count(train, loss_mask, also_finite)
    if bad:
        masked = train.numel() if loss_mask is None else int((loss_mask != 0).sum().item())
        _dispatch.warn_once(
            _NONFINITE_KEY,
            f"icepop_loss: {bad} of {masked} masked tokens have a non-finite (NaN/inf) "
            f"train-side log-prob; they contribute 0 to the loss and the gradient (has the "
            f"policy diverged?). Logged once per process: raise_on_nonfinite=True raises "
            f"instead, warn_on_nonfinite=False silences it; return_metrics=True counts them "
            f"in nonfinite_frac")


def _check_hyperparameters(beta, gate_low, gate_high, eps_low, eps_high):
    """(gate_low, gate_high, eps_low, eps_high) as validated floats (``_checks``)."""
    return loss_checks.check_icepop_hyperparameters(beta, gate_low, gate_high, eps_low, eps_high)


def icepop_loss(logprobs: torch.Tensor, rollout_logprobs: torch.Tensor,
                advantages: torch.Tensor, loss_mask: Optional[torch.Tensor] = None, *,
                old_logprobs: Optional[torch.Tensor] = None, beta: float = 2.0,
                gate_low: Optional[float] = None, gate_high: Optional[float] = None,
                eps_low: float = 0.2, eps_high: float = 0.28, reduction: str = "token_mean",
                return_metrics: bool = False, raise_on_nonfinite: bool = False,
                dual_clip: Optional[float] = None, warn_on_nonfinite: bool = True
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
        the gated ratio (rho coupled, k decoupled) over the masked tokens whose log-probs are
        all finite (NaN if none), and the train/rollout mismatch metrics of
        :func:`glm_kernels.mismatch_metrics` (verl's names and values: training_ppl, kl,
        k3_kl, log_ppl_diff, chi2_token, chi2_seq, rollout_is_*, ...; nonfinite_frac,
        rollout_nonfinite_count), train = old_logprobs when given. Turning them on changes
        neither the loss nor the gradient by a bit.
    raise_on_nonfinite : bool
        Raise ValueError, before anything is computed, when a masked token has a NaN/inf
        train-side log-prob (logprobs, or old_logprobs); costs one host read of a count (a
        device sync on a GPU). Default: such tokens contribute 0 and are counted in
        nonfinite_frac.
    warn_on_nonfinite : bool, default True
        Log a warning (logger ``glm_kernels``, once per process, naming the count) the first
        time a masked token has a NaN/inf train-side log-prob: it contributes 0 to the loss and
        the gradient, so a diverged policy would otherwise go unnoticed. Until that warning the
        check costs one host read of a count per eager call (a device sync on a GPU); after it,
        or with False, none. Skipped inside ``torch.compile`` (no graph break: read
        ``nonfinite_frac`` from the metrics there) and when ``raise_on_nonfinite`` is set.

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
    dual = loss_checks.check_dual_clip(dual_clip)
    _checks.check_bool("return_metrics", return_metrics)
    _checks.check_bool("raise_on_nonfinite", raise_on_nonfinite)
    _checks.check_bool("warn_on_nonfinite", warn_on_nonfinite)
    contiguous = lambda t: None if t is None else t.contiguous()   # noqa: E731
    train, also_finite = ((logprobs, None) if old_logprobs is None
                          else (old_logprobs, logprobs))
    if raise_on_nonfinite:
        raise_if_nonfinite("icepop_loss", train, loss_mask, also_finite)
    elif warn_on_nonfinite and not torch.compiler.is_compiling() and \
            _NONFINITE_KEY not in _dispatch.fallbacks_logged():
        _warn_if_nonfinite(train, loss_mask, also_finite)
    need_grad = bool(logprobs.requires_grad and torch.is_grad_enabled())
    args = (contiguous(logprobs), contiguous(rollout_logprobs), contiguous(advantages),
            contiguous(loss_mask), contiguous(old_logprobs), lo, hi, eps_low, eps_high, dual,
            reduction, need_grad, return_metrics)
    if torch.compiler.is_compiling():
        loss, _, _, stats = _icepop_op(*args)
    else:
        with torch.no_grad():
            loss, grad, scale, stats = _icepop_impl(*args)
        if need_grad:
            loss = _EagerGradient.apply(logprobs, loss, grad, scale, reduction)
    if not return_metrics:
        return loss
    return loss, icepop_metrics(stats, train, rollout_logprobs, loss_mask, also_finite, lo, hi)
