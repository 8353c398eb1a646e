"""Per-token log-probs and entropy from the last hidden states and the output layer, chunked.

Math: logits = hidden @ weight^T (weight [V, H]), z = logits / T, p = softmax(z)::

    lp = z[t] - lse,   H = -sum_v p_v log p_v
    d(g lp + h H)/d logits = (g (onehot(t) - p) - h p (log p + H)) / T

The outputs are per token, so their upstream gradients (g, h) exist only in backward: unlike
``fused_linear_icepop_loss`` (a scalar loss whose gradient is written during forward), the
logits are computed twice. Per chunk of C tokens (C from a memory budget)::

    forward   logits_c = hidden_c @ weight^T           [C, V] weight dtype      (GEMM 1)
              lp_c, H_c, lse_c from one pass over logits_c (selective_logprobs' pass)
    backward  logits_c = hidden_c @ weight^T                                    (GEMM 1 again)
              logits_c <- dL/dlogits_c in place (selective_logprobs' backward pass)
              grad_hidden_c  = logits_c @ weight        [C, H]                  (GEMM 2)
              grad_weight   += logits_c^T @ hidden_c    [V, H]                  (GEMM 3)

so [tokens, V] never exists: the vocab-sized buffers are one [C, V] chunk and the [V, H]
weight gradient. Saved for backward: hidden and weight (references), lse and H [N] fp32.
The weight gradient of bf16 / fp16 weights sums over chunks in fp32 by default (one rounding
at the end, as TRL's fused LM head does); ``fp32_weight_grad=False`` sums in the weight
dtype, one rounding per chunk, as ``fused_linear_icepop_loss`` does.

Registered as the ``glm_kernels::fused_linear_logprobs`` custom op with its backward (the
``fused_linear_logprobs_backward`` op) registered on it; eager calls run the op's body directly
under a plain autograd node with the same backward (docs/design.md 1, "Autograd").
"""

from typing import Optional, Tuple

import torch

from ... import _checks
from .._common.launch import call_op, differentiable_op
from .._common.linear import check_linear_inputs, chunk_config, chunked_linear_pass
from .logprobs import _grad_into, _logprobs_impl, _upstream

# [C, V] fp32 buffers the torch backend's passes hold beside the chunk at their peak (the
# backward one with the entropy term; _common/softmax.softmax_grad): measured by
# tests/loss/test_linear_logprobs.py. The kernels: none.
TORCH_FP32_TEMPORARIES = 5


def _fused_linear_logprobs_impl(hidden: torch.Tensor, weight: torch.Tensor,
                                token_ids: torch.Tensor, inv_temp: float, want_entropy: bool,
                                chunk_size: int, fp32_weight_grad: bool
                                ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(lp [N], entropy [N] or [0], lse [N]) fp32 of hidden [N, H] @ weight [V, H]^T;
    ``fp32_weight_grad`` is read by the backward only."""
    n = hidden.shape[0]
    new = lambda k: torch.empty(k, dtype=torch.float32, device=hidden.device)  # noqa: E731
    lp, entropy, lse = new(n), new(n if want_entropy else 0), new(n)

    def logprobs_pass(part, logits_c):
        lp_c, entropy_c, lse_c = _logprobs_impl(logits_c, token_ids[part], inv_temp,
                                                want_entropy)
        lp[part], lse[part] = lp_c, lse_c
        if want_entropy:
            entropy[part] = entropy_c

    chunked_linear_pass(hidden, weight, chunk_size, logprobs_pass, need_grad_hidden=False,
                        need_grad_weight=False)
    return lp, entropy, lse


_fused_linear_logprobs_op = torch.library.custom_op(
    "glm_kernels::fused_linear_logprobs", mutates_args=())(_fused_linear_logprobs_impl)


@_fused_linear_logprobs_op.register_fake
def _fused_linear_logprobs_fake(hidden, weight, token_ids, inv_temp, want_entropy,
                                chunk_size, fp32_weight_grad):
    n = hidden.shape[0]
    new = lambda k: hidden.new_empty((k,), dtype=torch.float32)   # noqa: E731
    return new(n), new(n if want_entropy else 0), new(n)


def _backward_impl(hidden: torch.Tensor, weight: torch.Tensor, token_ids: torch.Tensor,
                   lse: torch.Tensor, entropy: torch.Tensor, grad_lp: torch.Tensor,
                   grad_entropy: Optional[torch.Tensor], inv_temp: float, chunk_size: int,
                   need_grad_hidden: bool, need_grad_weight: bool, fp32_weight_grad: bool
                   ) -> Tuple[torch.Tensor, torch.Tensor]:
    """(dL/dhidden [N, H] or [0], dL/dweight [V, H] or [0]) for upstream gradients grad_lp
    [N] and grad_entropy [N] (None: the entropy was not asked for), logits recomputed."""
    def gradient_pass(part, logits_c):
        _grad_into(logits_c, logits_c, token_ids[part], lse[part],
                   entropy[part] if grad_entropy is not None else entropy, grad_lp[part],
                   None if grad_entropy is None else grad_entropy[part], inv_temp, 0)

    return chunked_linear_pass(hidden, weight, chunk_size, gradient_pass,
                               need_grad_hidden=need_grad_hidden,
                               need_grad_weight=need_grad_weight,
                               fp32_weight_grad=fp32_weight_grad)


_backward_op = torch.library.custom_op("glm_kernels::fused_linear_logprobs_backward",
                                       mutates_args=())(_backward_impl)


@_backward_op.register_fake
def _backward_fake(hidden, weight, token_ids, lse, entropy, grad_lp, grad_entropy, inv_temp,
                   chunk_size, need_grad_hidden, need_grad_weight, fp32_weight_grad):
    return (torch.empty_like(hidden) if need_grad_hidden else hidden.new_empty(0),
            torch.empty_like(weight) if need_grad_weight else weight.new_empty(0))


def _setup_context(ctx, inputs, output):
    hidden, weight, token_ids, inv_temp, want_entropy, chunk_size, fp32_weight_grad = inputs
    _, entropy, lse = output
    ctx.save_for_backward(hidden, weight, token_ids, lse, entropy)
    ctx.cfg = (inv_temp, want_entropy, chunk_size, fp32_weight_grad)
    ctx.mark_non_differentiable(lse, *(() if want_entropy else (entropy,)))
    ctx.set_materialize_grads(False)     # see logprobs._upstream


def _backward(ctx, grad_lp, grad_entropy, _grad_lse):
    hidden, weight, token_ids, lse, entropy = ctx.saved_tensors
    inv_temp, want_entropy, chunk_size, fp32_weight_grad = ctx.cfg
    need_hidden, need_weight = ctx.needs_input_grad[:2]
    grad_lp, grad_entropy = _upstream(grad_lp, grad_entropy, lse, want_entropy)
    grad_hidden, grad_weight = call_op(
        ctx, _backward_op, _backward_impl, hidden, weight, token_ids, lse, entropy, grad_lp,
        grad_entropy, inv_temp, chunk_size, bool(need_hidden), bool(need_weight),
        fp32_weight_grad)
    return (grad_hidden if need_hidden else None, grad_weight if need_weight else None,
            None, None, None, None, None)


_fused_linear_logprobs = differentiable_op(_fused_linear_logprobs_op,
                                           _fused_linear_logprobs_impl, _setup_context,
                                           _backward)


def fused_linear_logprobs(hidden: torch.Tensor, weight: torch.Tensor, token_ids: torch.Tensor,
                          *, temperature: float = 1.0, return_entropy: bool = False,
                          chunk_size: Optional[int] = None,
                          memory_budget: Optional[int] = None, fp32_weight_grad: bool = True):
    """Log-probs of the sampled tokens (and the entropy) of ``hidden @ weight.T``, without
    ever holding [tokens, V] logits.

    Parameters
    ----------
    hidden : Tensor [*S, H], fp32 / bf16 / fp16
        Last hidden states (after the final norm); differentiable.
    weight : Tensor [V, H], same dtype as ``hidden``
        Output layer (lm_head) weight; differentiable.
    token_ids : Tensor [*S], int32 / int64
        Sampled tokens, in [0, V).
    temperature : float, default 1.0
        Probabilities are softmax(hidden @ weight.T / T).
    return_entropy : bool, default False
        Also return the entropy H = -sum p log p [*S] fp32 (differentiable).
    chunk_size : int, optional
        Tokens per chunk (overrides the memory budget).
    memory_budget : int, optional
        Bytes allowed for the [chunk, V] logits chunk (default 512 MiB), and on the torch
        backend (CPU, no Triton) also for the fp32 [chunk, V] buffers its passes hold.
    fp32_weight_grad : bool, default True
        For bf16 / fp16 weights: sum the weight gradient over chunks in an fp32 [V, H] buffer
        and round it once (as TRL's fused LM head does: a bf16 sum rounded after every chunk
        loses accuracy as chunks add up). False sums in the weight dtype, no extra buffer, as
        ``fused_linear_icepop_loss`` does.

    Returns
    -------
    logprobs : Tensor [*S] fp32 -- log softmax(hidden @ weight.T / T)[token]; or
    (logprobs, entropy), both [*S] fp32.

    Notes
    -----
    * The logits of each chunk are computed in the weight dtype (bf16 weights: bf16 logits,
      as an unfused ``hidden @ weight.T`` gives), everything after in fp32.
    * Gradients reach ``hidden`` and ``weight`` (in their dtype) from both outputs. Backward
      recomputes each chunk's logits: four GEMMs per step instead of three, for memory
      bounded by one [chunk, V] buffer instead of [tokens, V].
    * Memory beyond the inputs: one [chunk, V] buffer in the weight dtype, O(tokens) fp32
      (lse and entropy saved for backward); backward adds the [*S, H] and [V, H] gradients
      (and the fp32 [V, H] sum of ``fp32_weight_grad`` for bf16 / fp16 weights).
    * No ``tp_group`` (a vocab-parallel output layer would need all-reduces per chunk).
    * Edge cases as in :func:`selective_logprobs` (ids outside [0, V): ValueError on CPU,
      device-side assert on CUDA).

    Example
    -------
    >>> import torch
    >>> from glm_kernels.loss import fused_linear_logprobs
    >>> hidden = torch.zeros(2, 3, 4, requires_grad=True)   # zero logits: uniform over V = 5
    >>> weight = torch.randn(5, 4, requires_grad=True)
    >>> lp, entropy = fused_linear_logprobs(hidden, weight, torch.zeros(2, 3, dtype=torch.long),
    ...                                     return_entropy=True, chunk_size=4)
    >>> round(lp[0, 0].item(), 4), round(entropy[1, 2].item(), 4)        # -log 5, log 5
    (-1.6094, 1.6094)
    >>> (lp.sum() + entropy.sum()).backward(); hidden.grad.shape, weight.grad.shape
    (torch.Size([2, 3, 4]), torch.Size([5, 4]))
    """
    check_linear_inputs(hidden, weight, token_ids)
    temperature = _checks.check_finite_number("temperature", temperature, positive=True)
    _checks.check_bool("return_entropy", return_entropy)
    _checks.check_bool("fp32_weight_grad", fp32_weight_grad)
    config = chunk_config("selective_logprobs", hidden, weight, chunk_size=chunk_size,
                          memory_budget=memory_budget,
                          torch_fp32_temporaries=TORCH_FP32_TEMPORARIES)
    lp, entropy, _ = _fused_linear_logprobs(
        hidden.reshape(-1, hidden.shape[-1]).contiguous(), weight.contiguous(),
        token_ids.reshape(-1).contiguous(), 1.0 / temperature, return_entropy,
        config.chunk_size, fp32_weight_grad)
    lp = lp.reshape(token_ids.shape)
    if not return_entropy:
        return lp
    return lp, entropy.reshape(token_ids.shape)
