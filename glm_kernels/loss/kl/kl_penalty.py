"""Reference-model KL penalty: verl's ``agg_loss(kl_penalty(...))``, fused; TRL's per-token KL.

Math (readable version: ``loss/kl/_reference.py``), d = lp - ref::

    k1 / kl: d      abs: |d|      k2 / mse: d^2 / 2
    k3 / low_var_kl: clamp(e^xc - xc - 1, -10, 10), xc = clamp(ref - lp, -20, 20)
    <kind>+: the value of <kind>, the gradient of k2 (straight-through)

then verl's ``agg_loss`` (token-mean, token-sum, seq-mean-token-sum[-norm],
seq-mean-token-mean, with dp_size / batch_num_tokens / global_batch_size /
loss_scale_factor). One pass over the tokens (Triton; the torch backend mirrors it) writes the
per-token gradient coefficient m * dl/dlp and per-program, per-row partial sums of l * m and
m; a few [rows] operations turn them into the loss and one scale per row, and backward is one
multiply. Registered as the custom ops ``glm_kernels::kl_penalty_loss`` and
``glm_kernels::kl_penalty_terms`` (fake kernels give the real shapes), so both trace through
``torch.compile(fullgraph=True)``.
"""
import numbers
from typing import Optional, Tuple

import numpy
import torch

from ... import _checks, _dispatch
from .._common import checks as loss_checks
from . import _reference as ref


# --------------------------------------------------------------------------- argument checks
def parse_kl_penalty(kl_penalty) -> Tuple[int, bool]:
    """verl's kind string -> (kind code, straight_through). Refuses what verl refuses."""
    if not isinstance(kl_penalty, str):
        raise TypeError(f"kl_penalty must be a str, got {type(kl_penalty).__name__}")
    straight_through = kl_penalty.endswith("+")
    base = kl_penalty[:-1] if straight_through else kl_penalty
    if base == "full":
        raise ValueError("kl_penalty='full' is not implemented in verl 0.9.1 either (it needs "
                         "every vocab entry's log-prob); for the exact full-vocab KL from logits "
                         "use glm_kernels.reverse_kl_from_logits")
    if base not in ref.KINDS:
        accepted = [k + plus for k in ref.KINDS for plus in ("", "+")]
        raise ValueError(f"kl_penalty={kl_penalty!r}: expected one of {accepted}")
    return ref.KIND_CODES[base], straight_through


def _check_log_probs(log_prob, ref_log_prob) -> None:
    _checks.check_tensor("log_prob", log_prob,
                           dtypes=(torch.float32, torch.bfloat16, torch.float16))
    _checks.check_tensor("ref_log_prob", ref_log_prob, floating=True)
    _checks.check_same_shape("ref_log_prob", ref_log_prob, "log_prob", log_prob)
    if log_prob.dim() < 1:
        raise ValueError("log_prob must have at least 1 dim ([*B, T], the last one the "
                         f"response), got shape {tuple(log_prob.shape)}")


def _optional_positive(name: str, value) -> Optional[float]:
    """None, or a finite number > 0 as a float (numpy scalars too: verl's counts may be)."""
    if value is None:
        return None
    if isinstance(value, numbers.Real) and not isinstance(value, (bool, numpy.bool_)):
        value = float(value)
    return _checks.check_finite_number(name, value, positive=True)


def _check_dp_size(dp_size) -> int:
    if isinstance(dp_size, (bool, numpy.bool_)) or not isinstance(dp_size, numbers.Integral):
        raise TypeError(f"dp_size must be an int, got {dp_size!r} ({type(dp_size).__name__})")
    dp_size = int(dp_size)
    if dp_size < 1:
        raise ValueError(f"dp_size must be >= 1, got {dp_size}")
    return dp_size


# --------------------------------------------------------------------------- one pass
def _rows(t: torch.Tensor) -> torch.Tensor:
    """[*B, T] -> contiguous [rows, T] (works for T == 0 and empty batches)."""
    return t.contiguous().reshape(t.shape[:-1].numel(), t.shape[-1])


def _token_pass(log_prob, ref_log_prob, mask, kind_code, straight_through, clamp, store_terms,
                store_grad, store_row_sums, coef_dtype=torch.float32):
    """(terms [rows, T] or [0], coef [rows, T] or [0], row_loss [rows] or [0],
    row_count [rows] or [0]) from [rows, T] inputs; ``mask`` None = all ones. All fp32 but
    coef, in ``coef_dtype``.

    coef = m * dl/dlp with the mask applied (0 where m == 0), or dl/dlp without a mask."""
    backend = _dispatch.select_backend("kl_penalty_loss", log_prob, ref_log_prob, mask)
    empty = log_prob.new_empty(0, dtype=torch.float32)
    if backend == "torch":
        terms, grad = ref.kl_terms(log_prob, ref_log_prob, kind_code, straight_through, clamp)
        if mask is None:
            return (terms if store_terms else empty, grad if store_grad else empty,
                    empty, empty)
        row_loss, row_count, coef = ref.masked_row_sums(terms, grad if store_grad else None,
                                                        mask)
        return (terms if store_terms else empty,
                coef.to(coef_dtype) if store_grad else empty, row_loss, row_count)
    from . import _kernels as _kl_kernels
    return _kl_kernels.kl_token_pass(
        log_prob, ref_log_prob, mask, kind_code=kind_code, straight_through=straight_through,
        clamp=clamp, store_terms=store_terms, store_grad=store_grad,
        store_row_sums=store_row_sums, coef_dtype=coef_dtype)


@torch.library.custom_op("glm_kernels::kl_penalty_loss", mutates_args=())
def _kl_loss_op(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, response_mask: torch.Tensor,
                kind_code: int, straight_through: bool, loss_agg_mode: str, dp_size: int,
                batch_num_tokens: Optional[float], global_batch_size: Optional[float],
                loss_scale_factor: Optional[float], need_grad: bool
                ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[rows, T] inputs -> (loss fp32 [], coef [rows, T] in log_prob's dtype or [0],
    row_scale [rows] fp32). The coefficient is rounded once to log_prob's dtype, the dtype the
    gradient is written in: a bf16 step reads and writes 2 B a token for it, not 4."""
    _, coef, row_loss, row_count = _token_pass(log_prob, ref_log_prob, response_mask, kind_code,
                                               straight_through, True, False, need_grad, True,
                                               log_prob.dtype)
    loss, row_scale = ref.aggregate_rows(row_loss, row_count, loss_agg_mode, dp_size,
                                         batch_num_tokens, global_batch_size,
                                         loss_scale_factor, log_prob.shape[-1])
    return loss, coef, row_scale


@_kl_loss_op.register_fake
def _kl_loss_fake(log_prob, ref_log_prob, response_mask, kind_code, straight_through,
                  loss_agg_mode, dp_size, batch_num_tokens, global_batch_size,
                  loss_scale_factor, need_grad):
    new = lambda *shape: log_prob.new_empty(shape, dtype=torch.float32)  # noqa: E731
    coef = log_prob.new_empty(log_prob.shape if need_grad else (0,))
    return new(), coef, new(log_prob.shape[0])


def _kl_loss_setup(ctx, inputs, output):
    _, coef, row_scale = output
    ctx.save_for_backward(coef, row_scale)
    ctx.lp_dtype = inputs[0].dtype


def _kl_loss_backward(ctx, grad_loss, _grad_coef, _grad_row_scale):
    coef, row_scale = ctx.saved_tensors
    if coef.dim() != 2:
        raise RuntimeError("kl_penalty_loss: backward called but forward ran without a "
                           "gradient (log_prob did not require grad)")
    grad = coef * (row_scale * grad_loss).unsqueeze(-1)
    return (grad.to(ctx.lp_dtype),) + (None,) * 10


torch.library.register_autograd("glm_kernels::kl_penalty_loss", _kl_loss_backward,
                                setup_context=_kl_loss_setup)


@torch.library.custom_op("glm_kernels::kl_penalty_terms", mutates_args=())
def _kl_terms_op(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, kind_code: int,
                 straight_through: bool, clamp: bool, need_grad: bool
                 ) -> Tuple[torch.Tensor, torch.Tensor]:
    """[rows, T] inputs -> (terms [rows, T] fp32, dl/dlp [rows, T] fp32 or [0])."""
    terms, grad, _, _ = _token_pass(log_prob, ref_log_prob, None, kind_code, straight_through,
                                    clamp, True, need_grad, False)
    return terms, grad


@_kl_terms_op.register_fake
def _kl_terms_fake(log_prob, ref_log_prob, kind_code, straight_through, clamp, need_grad):
    terms = log_prob.new_empty(log_prob.shape, dtype=torch.float32)
    return terms, (torch.empty_like(terms) if need_grad else terms.new_empty(0))


def _kl_terms_setup(ctx, inputs, output):
    ctx.save_for_backward(output[1])
    ctx.lp_dtype = inputs[0].dtype


def _kl_terms_backward(ctx, grad_terms, _grad_grad):
    (grad,) = ctx.saved_tensors
    if grad.dim() != 2:
        raise RuntimeError("kl_penalty_terms: backward called but forward ran without a "
                           "gradient (log_prob did not require grad)")
    return (grad * grad_terms).to(ctx.lp_dtype), None, None, None, None, None


torch.library.register_autograd("glm_kernels::kl_penalty_terms", _kl_terms_backward,
                                setup_context=_kl_terms_setup)


# --------------------------------------------------------------------------- public API
def kl_penalty_loss(*, log_prob: torch.Tensor, ref_log_prob: torch.Tensor,
                    response_mask: torch.Tensor, kl_penalty: str = "low_var_kl",
                    loss_agg_mode: str = "token-mean", dp_size: int = 1,
                    batch_num_tokens: Optional[float] = None,
                    global_batch_size: Optional[float] = None,
                    loss_scale_factor: Optional[float] = None) -> torch.Tensor:
    """verl's reference-KL loss ``agg_loss(kl_penalty(log_prob, ref_log_prob, kl_penalty),
    response_mask, loss_agg_mode, ...)``, value and gradient, in one fused pass.

    This is what verl's actor adds (times ``kl_loss_coef``) when ``use_kl_loss=True``, with
    ``kl_penalty = actor.kl_loss_type``.

    Parameters
    ----------
    log_prob : Tensor [*B, T], float32 / bfloat16 / float16
        log pi_theta of the sampled tokens; the only input that receives a gradient.
    ref_log_prob : Tensor [*B, T], any float dtype
        log pi_ref of the same tokens (never receives a gradient).
    response_mask : Tensor [*B, T], bool or numbers (0/1)
        Tokens that count. Like verl, a number is a weight: a token contributes l * m.
    kl_penalty : str, default "low_var_kl"
        ``kl`` / ``k1`` (d = lp - ref), ``abs`` (|d|), ``mse`` / ``k2`` (d^2 / 2),
        ``low_var_kl`` / ``k3`` (clamp(e^x - x - 1, -10, 10), x = clamp(ref - lp, -20, 20)),
        each with an optional ``+`` (straight-through: that value, the k2 gradient d).
        ``full`` is refused (verl 0.9.1 does not implement it).
    loss_agg_mode : str, default "token-mean"
        ``token-mean``: dp_size * sum(l m) / (batch_num_tokens or sum(m));
        ``token-sum``: dp_size * sum(l m);
        ``seq-mean-token-sum``: dp_size * sum over rows with tokens of sum_t(l m), divided by
        (global_batch_size or the number of such rows); ``seq-mean-token-sum-norm``: that,
        divided by (loss_scale_factor or T); ``seq-mean-token-mean``: the same with each row's
        sum divided by (sum_t m + 1e-8).
    dp_size : int >= 1, default 1
        Data-parallel size; > 1 needs batch_num_tokens (token-mean) or global_batch_size
        (seq-mean modes), as in verl.
    batch_num_tokens, global_batch_size, loss_scale_factor : number > 0, optional
        verl's ``global_batch_info``: masked tokens in the global batch (token-mean), rows in
        the global batch (seq-mean modes), the divisor of seq-mean-token-sum-norm.

    Returns
    -------
    loss : Tensor [] float32 (verl returns the inputs' dtype; the value agrees to rounding).

    Notes
    -----
    The per-token terms and sums are fp32 whatever the input dtype. A masked-out token
    contributes exactly 0 to the loss and the gradient even when its inputs are inf or NaN
    (verl's token modes give the same loss through ``masked_sum``; its seq-mean modes multiply
    instead, so there a NaN/inf in padding makes verl's loss NaN). As in verl, token-mean
    with no masked token and no batch_num_tokens, or a seq-mean mode with no row holding a
    token and no global_batch_size, gives a NaN loss (0 / 0); its gradient is 0.
    Non-contiguous inputs are copied (one extra read and write).

    Example
    -------
    >>> import torch, glm_kernels
    >>> lp = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    >>> ref_lp = torch.tensor([[-1.5, -2.0, -0.5]])
    >>> mask = torch.tensor([[1, 1, 0]])
    >>> loss = glm_kernels.kl_penalty_loss(log_prob=lp, ref_log_prob=ref_lp,
    ...                                    response_mask=mask, kl_penalty="k1")
    >>> loss.item(), (loss.backward(), lp.grad.tolist())[1]
    (0.25, [[0.5, 0.5, 0.0]])
    """
    _check_log_probs(log_prob, ref_log_prob)
    loss_checks.check_loss_mask(response_mask, "log_prob", log_prob, name="response_mask")
    _checks.check_same_device(dict(log_prob=log_prob, ref_log_prob=ref_log_prob,
                                     response_mask=response_mask))
    kind_code, straight_through = parse_kl_penalty(kl_penalty)
    _checks.check_choice("loss_agg_mode", loss_agg_mode, ref.LOSS_AGG_MODES)
    dp_size = _check_dp_size(dp_size)
    batch_num_tokens = _optional_positive("batch_num_tokens", batch_num_tokens)
    global_batch_size = _optional_positive("global_batch_size", global_batch_size)
    loss_scale_factor = _optional_positive("loss_scale_factor", loss_scale_factor)
    if dp_size > 1 and loss_agg_mode == "token-mean" and batch_num_tokens is None:
        raise ValueError("batch_num_tokens (masked tokens in the global batch) is required "
                         "when dp_size > 1 with loss_agg_mode='token-mean'")
    if dp_size > 1 and loss_agg_mode.startswith("seq-mean") and global_batch_size is None:
        raise ValueError(f"global_batch_size is required when dp_size > 1 with "
                         f"loss_agg_mode={loss_agg_mode!r}")
    need_grad = bool(log_prob.requires_grad and torch.is_grad_enabled())
    loss, _, _ = _kl_loss_op(_rows(log_prob), _rows(ref_log_prob.detach()),
                             _rows(response_mask), kind_code, straight_through, loss_agg_mode,
                             dp_size, batch_num_tokens, global_batch_size, loss_scale_factor,
                             need_grad)
    return loss


def kl_penalty_terms(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, *,
                     kl_penalty: str = "k3", clamp: bool = True) -> torch.Tensor:
    """Per-token KL estimates (verl's ``kl_penalty``), differentiable in ``log_prob``.

    TRL's ``GRPOTrainer`` with ``beta > 0`` uses ``kl_penalty="k3", clamp=False``:
    e^(ref - lp) - (ref - lp) - 1 with no clamp, TRL's per-token KL.

    Parameters
    ----------
    log_prob : Tensor [*S], float32 / bfloat16 / float16 (at least 1 dim)
    ref_log_prob : Tensor [*S], any float dtype (no gradient)
    kl_penalty : str, default "k3"
        Any kind :func:`kl_penalty_loss` takes (k1 / kl, abs, k2 / mse, k3 / low_var_kl, and
        their straight-through ``+`` forms).
    clamp : bool, default True
        Keep verl's k3 clamps (log-ratio to [-20, 20], the term to [-10, 10]); False drops
        both (TRL). The other kinds have no clamp.

    Returns
    -------
    terms : Tensor [*S] float32 (verl returns the inputs' dtype).

    Example
    -------
    >>> import torch, glm_kernels
    >>> lp = torch.tensor([-1.0, -30.0], requires_grad=True)
    >>> ref_lp = torch.tensor([-1.0, -1.0])
    >>> [round(v, 3) for v in glm_kernels.kl_penalty_terms(lp, ref_lp).tolist()]
    [0.0, 10.0]
    >>> glm_kernels.kl_penalty_terms(lp, ref_lp, clamp=False)[1].item() > 1e12
    True
    """
    _check_log_probs(log_prob, ref_log_prob)
    _checks.check_same_device(dict(log_prob=log_prob, ref_log_prob=ref_log_prob))
    kind_code, straight_through = parse_kl_penalty(kl_penalty)
    _checks.check_bool("clamp", clamp)
    need_grad = bool(log_prob.requires_grad and torch.is_grad_enabled())
    terms, _ = _kl_terms_op(_rows(log_prob), _rows(ref_log_prob.detach()), kind_code,
                            straight_through, clamp, need_grad)
    return terms.reshape(log_prob.shape)
