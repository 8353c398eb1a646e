"""IcePop loss straight from logits: log-probs, loss and dL/dlogits in one fused pass.

Math (readable version: ``icepop/_reference.icepop_loss_from_logits_reference``)::

    lp_i = log_softmax(logits_i / T)[t_i]                   (online lse over vocab tiles)
    L    = reduce_i(l_i(lp_i))                              (IcePop, docs/design.md 3.1)
    dL/dlogits_i = scale_i * dl_i/dlp_i / T * (onehot(t_i) - softmax(logits_i / T))

``scale_i`` is the reduction's weight of token i (1/max(sum m, 1) for token_mean, 1 for sum,
1/(tokens_b * rows) for seq_mean_token_mean); it depends on the mask only, so it is known
before the pass.

Two paths:

* fused (token_mean / sum / seq_mean_token_mean, no ``tp_group``): ``_icepop_logits_kernel``
  reads each row, computes lse, lp, the IcePop term (the shared ``icepop_token_math``) and
  writes the gradient for grad_output = 1 into a new buffer. Rows that fit in registers are
  read once (bf16 up to 24576 columns, e.g. 19360 = GLM-5's vocab / 8; fp32 up to 16384);
  longer rows are swept twice by the same program of a persistent grid, the second sweep
  meant to hit L2. Backward multiplies the buffer by grad_output in place, with a kernel that
  returns at once when grad_output == 1 (a device-side test: no host sync). With
  ``inplace_backward=True`` forward writes no gradient; backward runs the same pass over the
  saved logits, writing the gradient over them, then the same scale (the same bits as the new
  buffer, one more read of the logits): the registered op is functional, so its forward
  cannot write over its input.
* composed (``reduction="none"``: the per-token grad_output is only known in backward; or
  ``tp_group``: the full-vocab lse needs all-reduces between reading a row and writing its
  gradient): ``selective_logprobs`` then ``icepop_loss``; backward recomputes the softmax from
  the saved lse (one more read of the logits).

Either way the extra memory is O(tokens): lse / per-token stats, never an fp32 [N, V] tensor.

The fused path is the ``glm_kernels::icepop_loss_from_logits`` custom op with its backward
registered on it (the saved gradient times grad_output, or with ``inplace_backward`` the
mutating ``icepop_loss_from_logits_backward_`` op); eager calls run the op's body directly
under a plain autograd node with the same backward (docs/design.md 1, "Autograd").
"""

import inspect
from typing import Optional, Tuple

import torch

from ... import _checks, _dispatch
from . import _reference as ref
from .._common import checks as loss_checks
from .icepop import (_NUM_STATS, _check_hyperparameters, _check_inputs, _stats_from_partials,
                     icepop_loss, icepop_metrics)
from ..mismatch import raise_if_nonfinite
from ..logprobs import logprobs_rows
from .._common.launch import (LogitsLaunchConfig, call_op, check_logits_and_ids,
                              check_token_id_flag, differentiable_op, in_eager_node,
                              prepare_call, rows_2d)


def kernels_or_none(backend: str):
    """This feature's Triton kernel module, or None for the torch backend."""
    if backend == "torch":
        return None
    from . import _kernels
    return _kernels


# --------------------------------------------------------------------------- shared pieces
def token_scales(loss_mask: Optional[torch.Tensor], shape: torch.Size, reduction: str,
                 device: torch.device) -> torch.Tensor:
    """[N] fp32 weight of each token in the reduced loss (masked-out tokens: any value)."""
    n = shape.numel()
    if reduction == "sum":
        return torch.ones(n, dtype=torch.float32, device=device)
    masked = (torch.ones(shape, dtype=torch.bool, device=device) if loss_mask is None
              else loss_mask.reshape(shape) != 0)
    if reduction == "token_mean":
        inv = 1.0 / masked.sum().clamp(min=1).float()
        return inv.expand(n).contiguous()
    row_tokens = masked.sum(-1).float()                       # seq_mean_token_mean, [B, T]
    valid = row_tokens > 0
    n_valid = valid.sum().clamp(min=1).float()
    row_scale = torch.where(valid, 1.0 / (row_tokens.clamp(min=1.0) * n_valid), 0.0)
    return row_scale.unsqueeze(-1).expand(shape).reshape(-1).contiguous()


def icepop_rows_into(grad, logits, token_ids, rollout, old, adv, mask, scale, rows, lp, *,
                     inv_temp, gate_low, gate_high, eps_low, eps_high, dual_clip=None,
                     config: Optional[LogitsLaunchConfig] = None) -> None:
    """Run the fused pass on [N, V] rows; writes dL/dlogits into ``grad`` unless it is None
    (``grad`` may be ``logits`` itself), the IcePop stats rows into ``rows`` [N, 8] fp32 and,
    unless ``lp`` is None, each row's log-prob into ``lp`` [N] fp32 (the metrics' input)."""
    n, v = logits.shape
    kernels, cfg, flag = prepare_call("icepop_loss_from_logits", logits, token_ids, v,
                                     kernels_or_none)
    if kernels is None:
        full_grad, torch_rows, torch_lp = ref.icepop_logits_rows(
            logits, token_ids, rollout, old, adv, mask, scale, inv_temp=inv_temp,
            gate_low=gate_low, gate_high=gate_high, eps_low=eps_low, eps_high=eps_high,
            need_grad=grad is not None, dual_clip=dual_clip)
        if grad is not None:
            grad.copy_(full_grad)
        rows.copy_(torch_rows)
        if lp is not None:
            lp.copy_(torch_lp)
    else:
        cfg = config or cfg
        row_tiles, block_v, num_warps = cfg.row_plan(v, logits.element_size())
        kernels.icepop_logits(
            logits, token_ids, rollout, old, adv, mask, scale, grad, rows, flag, lp,
            inv_temp=inv_temp, gate_low=gate_low, gate_high=gate_high, clip_low=1.0 - eps_low,
            clip_high=1.0 + eps_high, block_v=block_v, row_tiles=row_tiles,
            num_warps=num_warps, max_programs=cfg.fused_programs(logits.device),
            dual_clip=dual_clip)
    check_token_id_flag(flag, v)


def new_rows(n: int, metrics: bool, device) -> Tuple[torch.Tensor, torch.Tensor]:
    """The fused pass's outputs: stats rows [N, 8] and the log-probs [N] ([0]: no metrics)."""
    return (torch.empty((n, _NUM_STATS), dtype=torch.float32, device=device),
            torch.empty(n if metrics else 0, dtype=torch.float32, device=device))


def loss_from_rows(rows: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """sum_i scale_i * l_i in fp64 (fixed order), returned as an fp32 scalar."""
    return (rows[:, 0].double() * scale.double()).sum().float()


def _scale_impl(x: torch.Tensor, factor: torch.Tensor) -> None:
    kernels = kernels_or_none(_dispatch.select_backend("icepop_loss_from_logits", x))
    if kernels is None:
        # Reading the factor costs nothing on CPU; on a GPU it would be a sync: multiply.
        if x.is_cuda or float(factor) != 1.0:
            x.mul_(factor.to(x.dtype))
    else:
        kernels.scale_inplace(x, factor)
    if not torch.compiler.is_compiling():
        # A second backward through the same graph would scale twice: the version bump makes
        # autograd refuse it ("modified by an inplace operation") instead.
        torch.autograd.graph.increment_version(x)


def scale_by_grad_output(ctx, x: torch.Tensor, grad_output: torch.Tensor) -> torch.Tensor:
    """Backward of the fused losses: the gradient saved by forward times grad_output.

    Eagerly in place, with a kernel that returns at once when grad_output == 1. In a traced
    backward as a product: the saved gradient is an output of the forward op, and AOTAutograd
    refuses an op that mutates it once that output is returned too (its value would change
    after the fact); Inductor writes the product over the saved buffer, dead after it.
    """
    if in_eager_node(ctx):
        _scale_impl(x, grad_output.float().reshape(1).contiguous())
        return x
    return x * grad_output.to(x.dtype)


# --------------------------------------------------------------------------- the fused op
def _icepop_from_logits_impl(logits: torch.Tensor, token_ids: torch.Tensor,
                             rollout: torch.Tensor, old: Optional[torch.Tensor],
                             adv: torch.Tensor, mask: Optional[torch.Tensor],
                             scale: torch.Tensor, inv_temp: float, gate_low: float,
                             gate_high: float, eps_low: float, eps_high: float,
                             dual_clip: Optional[float], need_grad: bool, inplace: bool,
                             metrics: bool
                             ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss fp32 [], dL/dlogits [N, V] for grad_output 1 or [0], stats rows [N, 8],
    log-probs [N] fp32 with ``metrics`` else [0]). With ``inplace`` the gradient is left to
    the backward, which writes it over the logits."""
    store_grad = need_grad and not inplace
    grad = torch.empty_like(logits) if store_grad else logits.new_empty(0)
    rows, lp = new_rows(logits.shape[0], metrics, logits.device)
    icepop_rows_into(grad if store_grad else None, logits, token_ids, rollout, old, adv, mask,
                     scale, rows, lp if metrics else None, inv_temp=inv_temp,
                     gate_low=gate_low, gate_high=gate_high, eps_low=eps_low,
                     eps_high=eps_high, dual_clip=dual_clip)
    return loss_from_rows(rows, scale), grad, rows, lp


_icepop_from_logits_op = torch.library.custom_op(
    "glm_kernels::icepop_loss_from_logits", mutates_args=())(_icepop_from_logits_impl)


@_icepop_from_logits_op.register_fake
def _icepop_from_logits_fake(logits, token_ids, rollout, old, adv, mask, scale, inv_temp,
                             gate_low, gate_high, eps_low, eps_high, dual_clip, need_grad,
                             inplace, metrics):
    grad = torch.empty_like(logits) if need_grad and not inplace else logits.new_empty(0)
    return (logits.new_empty((), dtype=torch.float32), grad,
            *new_rows(logits.shape[0], metrics, logits.device))


def _grad_inplace_impl(logits: torch.Tensor, token_ids: torch.Tensor, rollout: torch.Tensor,
                       old: Optional[torch.Tensor], adv: torch.Tensor,
                       mask: Optional[torch.Tensor], scale: torch.Tensor,
                       grad_output: torch.Tensor, inv_temp: float, gate_low: float,
                       gate_high: float, eps_low: float, eps_high: float,
                       dual_clip: Optional[float]) -> None:
    """dL/dlogits times grad_output (fp32 [1]) written over the logits: the fused pass, then
    the in-place scale, the same two steps (and bits) as the gradient in a new buffer."""
    rows, _ = new_rows(logits.shape[0], False, logits.device)
    icepop_rows_into(logits, logits, token_ids, rollout, old, adv, mask, scale, rows, None,
                     inv_temp=inv_temp, gate_low=gate_low, gate_high=gate_high,
                     eps_low=eps_low, eps_high=eps_high, dual_clip=dual_clip)
    _scale_impl(logits, grad_output)     # its version bump refuses a second backward


_grad_inplace_op = torch.library.custom_op("glm_kernels::icepop_loss_from_logits_backward_",
                                           mutates_args=("logits",))(_grad_inplace_impl)


@_grad_inplace_op.register_fake
def _grad_inplace_fake(logits, token_ids, rollout, old, adv, mask, scale, grad_output,
                       inv_temp, gate_low, gate_high, eps_low, eps_high, dual_clip):
    return None


# The op's inputs by name: the tensors the pass reads (logits .. scale), its float parameters
# (inv_temp .. dual_clip), then the flags.
_INPUTS = list(inspect.signature(_icepop_from_logits_impl).parameters)
_TENSORS = slice(0, _INPUTS.index("scale") + 1)
_PARAMS = slice(_INPUTS.index("inv_temp"), _INPUTS.index("dual_clip") + 1)


def _setup_context(ctx, inputs, output):
    named = dict(zip(_INPUTS, inputs))
    _, grad, rows, lp = output
    ctx.need_grad, ctx.inplace = named["need_grad"], named["inplace"]
    # In place, backward runs the pass again over the saved logits: nothing [N, V] is held
    # beside them (a functional op cannot write over its input in forward).
    ctx.save_for_backward(*(inputs[_TENSORS] if ctx.inplace else (grad,)))
    ctx.params = inputs[_PARAMS]
    ctx.mark_non_differentiable(grad, rows, lp)
    ctx.set_materialize_grads(False)     # no zero-filled [N, V] gradient for ``grad``


def _backward(ctx, grad_loss, _grad_grad, _grad_rows, _grad_lp):
    if not ctx.need_grad:
        raise RuntimeError("icepop_loss_from_logits: backward called but forward ran without "
                           "need_grad")
    if ctx.inplace:
        logits, *token_inputs = ctx.saved_tensors
        call_op(ctx, _grad_inplace_op, _grad_inplace_impl, logits, *token_inputs,
                grad_loss.float().reshape(1).contiguous(), *ctx.params)
        grad = logits
    else:
        grad = scale_by_grad_output(ctx, ctx.saved_tensors[0], grad_loss)
    return (grad,) + (None,) * (len(_INPUTS) - 1)


_icepop_from_logits = differentiable_op(_icepop_from_logits_op, _icepop_from_logits_impl,
                                        _setup_context, _backward)


def check_icepop_arguments(shape, device, rollout, advantages, loss_mask, old_logprobs,
                           reduction, beta, gate_low, gate_high, eps_low, eps_high,
                           temperature):
    """icepop_loss's checks for tokens of ``shape``; returns the validated
    (gate_low, gate_high, eps_low, eps_high, temperature)."""
    # A zero-stride stand-in with the log-probs' shape lets icepop's checks run unchanged.
    lp_shape = torch.empty_strided(shape, (0,) * len(shape), dtype=torch.float32,
                                   device=device)
    _check_inputs(lp_shape, rollout, advantages, loss_mask, old_logprobs, reduction)
    checked = _check_hyperparameters(beta, gate_low, gate_high, eps_low, eps_high)
    return checked + (_checks.check_finite_number("temperature", temperature,
                                                    positive=True),)


def flat_token_inputs(shape, rollout, advantages, loss_mask, old_logprobs):
    """Contiguous [N] views of the per-token inputs (per-sequence advantages expanded, a bool
    mask viewed as uint8 for the kernels)."""
    flat = lambda t: None if t is None else t.reshape(-1).contiguous()   # noqa: E731
    if advantages.shape != shape:
        advantages = advantages.unsqueeze(-1).expand(shape)
    mask = flat(loss_mask)
    if mask is not None and mask.dtype == torch.bool:
        # torch 2.8's Inductor cannot lower a bool -> uint8 view (torch.iinfo(bool)); in a
        # graph the conversion is fused anyway, eagerly the view saves a copy.
        mask = mask.to(torch.uint8) if torch.compiler.is_compiling() else mask.view(torch.uint8)
    return flat(rollout), flat(advantages), mask, flat(old_logprobs)


def icepop_loss_from_logits(logits: torch.Tensor, token_ids: torch.Tensor,
                            rollout_logprobs: torch.Tensor, advantages: torch.Tensor,
                            loss_mask: Optional[torch.Tensor] = None, *,
                            temperature: float = 1.0, tp_group=None,
                            inplace_backward: bool = False,
                            old_logprobs: Optional[torch.Tensor] = None, beta: float = 2.0,
                            gate_low: Optional[float] = None, gate_high: Optional[float] = None,
                            eps_low: float = 0.2, eps_high: float = 0.28,
                            reduction: str = "token_mean", return_metrics: bool = False,
                            raise_on_nonfinite: bool = False,
                            dual_clip: Optional[float] = None):
    """IcePop loss (docs/design.md 3.1) computed from logits in one fused pass.

    Parameters
    ----------
    logits : Tensor [*S, V], any float dtype
        The only input that receives a gradient (written in ``logits.dtype``). With
        ``tp_group``: this rank's vocab shard (Megatron layout, see ``selective_logprobs``).
    token_ids : Tensor [*S], int32 / int64
        The sampled tokens (ids into the full vocabulary).
    rollout_logprobs, advantages, loss_mask, old_logprobs, beta, gate_low, gate_high,
    eps_low, eps_high, dual_clip, reduction, return_metrics, raise_on_nonfinite
        As in :func:`glm_kernels.icepop_loss`, with [*S] = ``token_ids.shape``: the mismatch
        metrics come from the fused pass (the kernel's lp, rollout and old of each token, in
        registers), sequences are the rows of the last dim of ``token_ids``.
    temperature : float, default 1.0
        log-probs are log_softmax(logits / temperature).
    tp_group : ProcessGroup, optional
        Vocab-parallel group: the loss is the full-vocab loss on every rank, the gradient the
        one of this rank's shard (no communication in backward).
    inplace_backward : bool, default False
        Write the logits gradient into the logits buffer during backward and return that
        buffer as the gradient: no second [*S, V] buffer. The logits are destroyed by the
        backward: a node that saved them and runs after it is refused (their version counter
        is bumped: "modified by an inplace operation"), and backward can run once.

    Returns
    -------
    loss : fp32 scalar (or [*S] for reduction="none"); with return_metrics also the metrics
    dict of :func:`glm_kernels.icepop_loss`.

    Notes
    -----
    Popped and unmasked tokens contribute exactly 0 to the loss and get exactly-zero gradient
    rows, even when their logits are NaN/inf. Extra memory: O(tokens) (plus the [*S, V]
    gradient itself unless ``inplace_backward``). Paths: see the module docstring.

    Example
    -------
    >>> import torch
    >>> from glm_kernels.loss import icepop_loss_from_logits, selective_logprobs
    >>> logits = torch.tensor([[1.0, 2.0, 0.5], [0.0, 3.0, 1.0]], requires_grad=True)
    >>> ids = torch.tensor([1, 2])
    >>> rollout = selective_logprobs(logits, ids).detach()       # on-policy: rho = 1
    >>> loss = icepop_loss_from_logits(logits, ids, rollout, torch.tensor([1.0, -1.0]))
    >>> abs(loss.item()) < 1e-6                                   # (-1 * 1 + -1 * -1) / 2
    True
    >>> loss.backward(); logits.grad.shape
    torch.Size([2, 3])
    """
    check_logits_and_ids(logits, token_ids)
    shape = token_ids.shape
    lo, hi, eps_low, eps_high, temperature = check_icepop_arguments(
        shape, logits.device, rollout_logprobs, advantages, loss_mask, old_logprobs, reduction,
        beta, gate_low, gate_high, eps_low, eps_high, temperature)
    dual = loss_checks.check_dual_clip(dual_clip)
    loss_checks.check_tp_group(tp_group)
    for name, flag in (("inplace_backward", inplace_backward),
                       ("return_metrics", return_metrics),
                       ("raise_on_nonfinite", raise_on_nonfinite)):
        _checks.check_bool(name, flag)
    ids = token_ids.reshape(-1).contiguous()

    if tp_group is not None or reduction == "none":
        lp, _ = logprobs_rows(rows_2d(logits), ids, inv_temp=1.0 / temperature,
                              tp_group=tp_group, inplace_backward=inplace_backward)
        return icepop_loss(lp.reshape(shape), rollout_logprobs, advantages, loss_mask,
                           old_logprobs=old_logprobs, gate_low=lo, gate_high=hi,
                           eps_low=eps_low, eps_high=eps_high, reduction=reduction,
                           return_metrics=return_metrics,
                           raise_on_nonfinite=raise_on_nonfinite, dual_clip=dual_clip)

    rollout, adv, mask, old = flat_token_inputs(shape, rollout_logprobs, advantages, loss_mask,
                                                old_logprobs)
    scale = token_scales(loss_mask, shape, reduction, logits.device)
    need_grad = bool(logits.requires_grad and torch.is_grad_enabled())
    metrics = return_metrics or raise_on_nonfinite
    loss, _, rows, lp = _icepop_from_logits(
        rows_2d(logits), ids, rollout, old, adv, mask, scale, 1.0 / temperature, lo, hi,
        eps_low, eps_high, dual, need_grad, inplace_backward, metrics)
    stats = _stats_from_partials(rows)
    return finish_fused_loss("icepop_loss_from_logits", loss, stats, lp, shape,
                             rollout_logprobs, loss_mask, old_logprobs, lo, hi,
                             return_metrics, raise_on_nonfinite)


def finish_fused_loss(what, loss, stats, lp, shape, rollout_logprobs, loss_mask, old_logprobs,
                      gate_low, gate_high, return_metrics, raise_on_nonfinite):
    """The fused losses' return value from the pass's stats and log-probs (metrics, the
    non-finite check: the train side is the pass's lp, or old_logprobs when given)."""
    if not (return_metrics or raise_on_nonfinite):
        return loss
    lp = lp.reshape(shape)
    train, also_finite = (lp, None) if old_logprobs is None else (old_logprobs, lp)
    if raise_on_nonfinite:
        raise_if_nonfinite(what, train, loss_mask, also_finite)
    if not return_metrics:
        return loss
    return loss, icepop_metrics(stats, train, rollout_logprobs, loss_mask, also_finite,
                                gate_low, gate_high)
