"""IcePop loss from the last hidden states and the output layer, chunked over tokens.

Math: logits = hidden @ weight^T (weight [V, H]); the loss is ``icepop_loss_from_logits``
of those logits. Per chunk of C tokens (C chosen from a memory budget)::

    logits_c  = hidden_c @ weight^T                  [C, V] in the weight dtype (GEMM 1)
    fused pass over logits_c, gradient written in place: logits_c <- dL/dlogits_c
    grad_hidden_c  = logits_c @ weight               [C, H]                     (GEMM 2)
    grad_weight   += logits_c^T @ hidden_c           [V, H]                     (GEMM 3)

so [tokens, V] never exists: the only vocab-sized buffers are one [C, V] chunk and the
[V, H] weight gradient (which any path needs). The gradients are computed during forward for
grad_output = 1 (a scalar loss); backward multiplies them by grad_output (eagerly in place,
with a kernel that returns at once when grad_output == 1). The weight gradient accumulates
over chunks in the weight's dtype (one rounding per chunk when it is bf16, as in Liger's
fused linear cross-entropy).

Registered as the ``glm_kernels::fused_linear_icepop_loss`` custom op, whose outputs include
the two gradients, with its backward (those gradients times grad_output) registered on it;
eager calls run the op's body directly under a plain autograd node with the same backward
(docs/design.md 1, "Autograd").
"""

from typing import Optional, Tuple

import torch

from ... import _checks
from .._common import checks as loss_checks
from .._common.launch import differentiable_op
from .._common.linear import (DEFAULT_MEMORY_BUDGET, FusedLinearConfig, check_linear_inputs,
                              chunk_config, chunked_linear_pass, make_fused_linear_config)
from .from_logits import (check_icepop_arguments, finish_fused_loss, flat_token_inputs,
                          icepop_rows_into, loss_from_rows, new_rows, scale_by_grad_output,
                          token_scales)
from .icepop import _stats_from_partials

# [C, V] fp32 buffers the torch backend's pass holds beside the chunk at its peak (scaled
# logits, then softmax and gradient; icepop/_reference.icepop_logits_rows). The kernels: none.
TORCH_FP32_TEMPORARIES = 3


def _fused_linear_impl(hidden: torch.Tensor, weight: torch.Tensor, token_ids: torch.Tensor,
                       rollout: torch.Tensor, old: Optional[torch.Tensor], adv: torch.Tensor,
                       mask: Optional[torch.Tensor], scale: torch.Tensor, inv_temp: float,
                       gate_low: float, gate_high: float, eps_low: float, eps_high: float,
                       dual_clip: Optional[float], chunk_size: int, need_grad_hidden: bool,
                       need_grad_weight: bool, metrics: bool
                       ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                  torch.Tensor]:
    """(loss, dL/dhidden [N, H] or [0], dL/dweight [V, H] or [0], stats rows [N, 8],
    log-probs [N] fp32 with ``metrics`` else [0]); gradients for grad_output = 1."""
    rows, lp = new_rows(hidden.shape[0], metrics, hidden.device)
    need_grad = need_grad_hidden or need_grad_weight
    pick = lambda t, part: None if t is None else t[part]   # noqa: E731

    def icepop_pass(part, logits_c):
        icepop_rows_into(
            logits_c if need_grad else None, logits_c, token_ids[part], rollout[part],
            pick(old, part), adv[part], pick(mask, part), scale[part], rows[part],
            lp[part] if metrics else None, inv_temp=inv_temp, gate_low=gate_low,
            gate_high=gate_high, eps_low=eps_low, eps_high=eps_high, dual_clip=dual_clip)

    grad_hidden, grad_weight = chunked_linear_pass(
        hidden, weight, chunk_size, icepop_pass, need_grad_hidden=need_grad_hidden,
        need_grad_weight=need_grad_weight)
    return loss_from_rows(rows, scale), grad_hidden, grad_weight, rows, lp


_fused_linear_op = torch.library.custom_op("glm_kernels::fused_linear_icepop_loss",
                                           mutates_args=())(_fused_linear_impl)


@_fused_linear_op.register_fake
def _fused_linear_fake(hidden, weight, token_ids, rollout, old, adv, mask, scale, inv_temp,
                       gate_low, gate_high, eps_low, eps_high, dual_clip, chunk_size,
                       need_grad_hidden, need_grad_weight, metrics):
    return (hidden.new_empty((), dtype=torch.float32),
            torch.empty_like(hidden) if need_grad_hidden else hidden.new_empty(0),
            torch.empty_like(weight) if need_grad_weight else weight.new_empty(0),
            *new_rows(hidden.shape[0], metrics, hidden.device))


def _setup_context(ctx, inputs, output):
    _, grad_hidden, grad_weight, rows, lp = output
    ctx.save_for_backward(grad_hidden, grad_weight)
    ctx.num_inputs = len(inputs)
    ctx.mark_non_differentiable(grad_hidden, grad_weight, rows, lp)
    ctx.set_materialize_grads(False)     # no zero-filled [N, H] / [V, H] for the gradients


def _backward(ctx, grad_loss, _grad_hidden, _grad_weight, _grad_rows, _grad_lp):
    grads = [scale_by_grad_output(ctx, g, grad_loss) if g.numel() else None
             for g in ctx.saved_tensors]
    return (*grads,) + (None,) * (ctx.num_inputs - 2)


_fused_linear_icepop = differentiable_op(_fused_linear_op, _fused_linear_impl, _setup_context,
                                         _backward)


def fused_linear_icepop_loss(hidden: torch.Tensor, weight: torch.Tensor,
                             token_ids: torch.Tensor, rollout_logprobs: torch.Tensor,
                             advantages: torch.Tensor, loss_mask: Optional[torch.Tensor] = None,
                             *, temperature: float = 1.0, chunk_size: Optional[int] = None,
                             memory_budget: Optional[int] = None,
                             old_logprobs: Optional[torch.Tensor] = None, beta: float = 2.0,
                             gate_low: Optional[float] = None, gate_high: Optional[float] = None,
                             eps_low: float = 0.2, eps_high: float = 0.28,
                             reduction: str = "token_mean", return_metrics: bool = False,
                             raise_on_nonfinite: bool = False,
                             dual_clip: Optional[float] = None):
    """IcePop loss of ``hidden @ weight.T`` without ever holding [tokens, V] logits.

    Parameters
    ----------
    hidden : Tensor [*S, H], fp32 / bf16 / fp16
        Last hidden states (after the final norm); differentiable.
    weight : Tensor [V, H], same dtype as ``hidden``
        Output layer (lm_head) weight; differentiable.
    token_ids : Tensor [*S], int32 / int64
    rollout_logprobs, advantages, loss_mask, old_logprobs, beta, gate_low, gate_high,
    eps_low, eps_high, dual_clip, return_metrics, raise_on_nonfinite
        As in :func:`glm_kernels.icepop_loss` (the mismatch metrics come from the fused pass
        of each chunk; sequences are the rows of the last dim of ``token_ids``).
    reduction : {"token_mean", "seq_mean_token_mean", "sum"}
        "none" is refused: the gradients are computed during forward, which needs a scalar
        loss (use ``icepop_loss_from_logits`` for per-token losses).
    temperature : float, default 1.0
    chunk_size : int, optional
        Tokens per chunk (overrides the memory budget).
    memory_budget : int, optional
        Bytes allowed for the [chunk, V] logits chunk (default 512 MiB), and on the torch
        backend (CPU, no Triton) also for the three [chunk, V] fp32 buffers its pass holds.

    Returns
    -------
    loss : fp32 scalar; with return_metrics also the metrics dict of ``icepop_loss``.

    Notes
    -----
    Memory beyond the inputs: one [chunk, V] buffer in the weight dtype, the gradients
    ([*S, H] and [V, H], kept from forward to backward) and O(tokens) statistics. Backward
    can run once (the saved gradients are scaled in place). No ``tp_group``: a vocab-parallel
    output layer would need an all-reduce per chunk plus one of the hidden gradient.

    Example
    -------
    >>> import torch
    >>> from glm_kernels.loss import fused_linear_icepop_loss, selective_logprobs
    >>> hidden = torch.randn(6, 16, requires_grad=True)
    >>> weight = torch.randn(50, 16, requires_grad=True)
    >>> ids = torch.randint(0, 50, (6,))
    >>> with torch.no_grad():
    ...     rollout = selective_logprobs(hidden @ weight.T, ids)
    >>> loss = fused_linear_icepop_loss(hidden, weight, ids, rollout, torch.ones(6),
    ...                                 chunk_size=4)
    >>> loss.backward(); hidden.grad.shape, weight.grad.shape
    (torch.Size([6, 16]), torch.Size([50, 16]))
    """
    check_linear_inputs(hidden, weight, token_ids)
    if reduction == "none":
        raise ValueError("reduction='none' is not supported by fused_linear_icepop_loss (its "
                         "gradients are computed in forward for a scalar loss); use "
                         "icepop_loss_from_logits")
    shape = token_ids.shape
    lo, hi, eps_low, eps_high, temperature = check_icepop_arguments(
        shape, hidden.device, rollout_logprobs, advantages, loss_mask, old_logprobs, reduction,
        beta, gate_low, gate_high, eps_low, eps_high, temperature)
    dual = loss_checks.check_dual_clip(dual_clip)
    _checks.check_bool("return_metrics", return_metrics)
    _checks.check_bool("raise_on_nonfinite", raise_on_nonfinite)
    config = chunk_config("icepop_loss_from_logits", hidden, weight, chunk_size=chunk_size,
                          memory_budget=memory_budget,
                          torch_fp32_temporaries=TORCH_FP32_TEMPORARIES)

    rollout, adv, mask, old = flat_token_inputs(shape, rollout_logprobs, advantages, loss_mask,
                                                old_logprobs)
    scale = token_scales(loss_mask, shape, reduction, hidden.device)
    grad_on = torch.is_grad_enabled()
    loss, _, _, rows, lp = _fused_linear_icepop(
        hidden.reshape(-1, hidden.shape[-1]).contiguous(), weight.contiguous(),
        token_ids.reshape(-1).contiguous(), rollout, old, adv, mask, scale, 1.0 / temperature,
        lo, hi, eps_low, eps_high, dual, config.chunk_size,
        bool(grad_on and hidden.requires_grad),
        bool(grad_on and weight.requires_grad), return_metrics or raise_on_nonfinite)
    stats = _stats_from_partials(rows)
    return finish_fused_loss("fused_linear_icepop_loss", loss, stats, lp, shape,
                             rollout_logprobs, loss_mask, old_logprobs, lo, hi,
                             return_metrics, raise_on_nonfinite)
