"""Selective log-probs (and entropy) from logits, without an fp32 [tokens, V] tensor.

Math (readable version in ``loss/_common/softmax.py``), with z = logits / T::

    lp  = z[t] - lse,   lse = log sum_v e^(z_v)          (online over vocab tiles, one read)
    H   = -sum_v p_v log p_v = log s - t / s              (s, t carried with the lse)
    d(g lp + h H)/d logits = (g (onehot(t) - p) - h p (log p + H)) / T

Forward reads the logits once and saves lse (and H) [N] fp32; backward recomputes p from the
logits and lse (one read, one write). With ``tp_group`` each rank holds a Megatron
vocab-parallel shard; the shard statistics are combined by two all-reduces
(``_common/vocab_parallel.py``) and backward stays communication-free.

Registered as the ``glm_kernels::selective_logprobs`` custom op (a fake kernel gives shapes,
the backward is registered on the op), so it traces through ``torch.compile``, vocab-parallel
too: the schema carries the group by name and the all-reduces run inside the op. Backward is
the ``selective_logprobs_backward`` op, or ``selective_logprobs_backward_``, which writes the
gradient over the saved logits (``inplace_backward``). Eager calls run the op's body directly
under a plain autograd node with the same backward (docs/design.md 1, "Autograd").
"""

from typing import Optional, Tuple

import torch

from ... import _checks, _dispatch
from .._common import checks as loss_checks
from .._common.launch import (call_op, check_logits_and_ids, check_token_id_flag,
                              differentiable_op, make_launch_config, prepare_call, rows_2d)
from .._common import softmax as ref
from . import _torch as _logits_torch
from . import _nucleus
from .._common import vocab_parallel as _vocab_parallel


def kernels_or_none(backend: str):
    """This feature's Triton kernel module, or None for the torch backend."""
    if backend == "torch":
        return None
    from . import _kernels
    return _kernels


def _torch_path():
    """The torch backend's whole-row functions: the fixed-order reference under
    batch_invariant(), the chunked ones (no [N, V] temporaries) otherwise."""
    return ref if _dispatch.batch_invariant_enabled() else _logits_torch


# --------------------------------------------------------------------------- forward
def _logprobs_impl(logits: torch.Tensor, token_ids: torch.Tensor, inv_temp: float,
                   want_entropy: bool) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(lp [N], entropy [N] or [0], lse [N]) fp32 of full-vocab [N, V] rows."""
    n, v = logits.shape
    kernels, cfg, flag = prepare_call("selective_logprobs", logits, token_ids, v, kernels_or_none)
    if kernels is None:
        lp, lse, entropy = _torch_path().logprobs_lse_entropy(logits, token_ids, inv_temp,
                                                              want_entropy)
        entropy = lp.new_empty(0) if entropy is None else entropy
    else:
        lp, lse = (torch.empty(n, dtype=torch.float32, device=logits.device) for _ in range(2))
        entropy = torch.empty(n if want_entropy else 0, dtype=torch.float32,
                              device=logits.device)
        kernels.logprob_final(logits, token_ids, flag, lp, lse,
                              entropy if want_entropy else None, inv_temp=inv_temp,
                              block_v=cfg.block_v, num_warps=cfg.num_warps)
    check_token_id_flag(flag, v)
    return lp, entropy, lse


def _shard_stats(logits, token_ids, inv_temp, want_entropy, vocab_start, vocab_total):
    """[N, 4] fp32 (m, s, t, z_t) of one vocab shard (``_vocab_parallel`` combines them)."""
    n, _ = logits.shape
    kernels, cfg, flag = prepare_call("selective_logprobs", logits, token_ids, vocab_total,
                                      kernels_or_none)
    if kernels is None:
        partial = ref.logprob_partial_stats(logits, token_ids, inv_temp, vocab_start,
                                            want_entropy)
    else:
        partial = torch.empty((n, 4), dtype=torch.float32, device=logits.device)
        kernels.logprob_partial(logits, token_ids, flag, partial, want_entropy=want_entropy,
                                inv_temp=inv_temp, vocab_start=vocab_start,
                                vocab_total=vocab_total, block_v=cfg.block_v,
                                num_warps=cfg.num_warps)
    check_token_id_flag(flag, vocab_total)
    return partial


def _selective_logprobs_impl(logits: torch.Tensor, token_ids: torch.Tensor,
                             keep_ids: Optional[torch.Tensor],
                             keep_offsets: Optional[torch.Tensor], inv_temp: float,
                             want_entropy: bool, group: str, inplace_backward: bool
                             ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(lp [N], entropy [N] or [0], lse [N], lse over the nucleus [N] or [0]) fp32 of [N, V]
    logits: this rank's shard of the group named ``group`` ("" for none). ``inplace_backward``
    is read by the backward only."""
    tp_group = _vocab_parallel.resolve_group(group)
    vocab_start, vocab_total = _vocab_parallel.shard_range(logits.shape[1], tp_group)
    if tp_group is None:
        lp, entropy, lse = _logprobs_impl(logits, token_ids, inv_temp, want_entropy)
    else:
        partial = _shard_stats(logits, token_ids, inv_temp, want_entropy, vocab_start,
                               vocab_total)
        lp, lse, entropy = _vocab_parallel.combine_logprob_stats(partial, tp_group)
        if not want_entropy:
            entropy = entropy.new_empty(0)
    lse_keep = lse.new_empty(0)
    if keep_ids is not None:
        # Renormalise the log-prob over the nucleus (entropy and lse stay full-vocab).
        stats = _nucleus.stats(logits, token_ids, keep_ids, keep_offsets, inv_temp,
                               vocab_start)
        if tp_group is not None:
            stats = _nucleus.combine_nucleus_stats(stats, tp_group)
        lp, lse_keep = _nucleus.finalize_nucleus(stats, keep_offsets, lp, lse)
    return lp, entropy, lse, lse_keep


_selective_logprobs_op = torch.library.custom_op(
    "glm_kernels::selective_logprobs", mutates_args=())(_selective_logprobs_impl)


@_selective_logprobs_op.register_fake
def _selective_logprobs_fake(logits, token_ids, keep_ids, keep_offsets, inv_temp,
                             want_entropy, group, inplace_backward):
    n = logits.shape[0]
    new = lambda k: logits.new_empty((k,), dtype=torch.float32)   # noqa: E731
    return new(n), new(n if want_entropy else 0), new(n), new(0 if keep_ids is None else n)


# --------------------------------------------------------------------------- backward
def _grad_into(out, logits, token_ids, lse, entropy, grad_lp, grad_entropy, inv_temp,
               vocab_start) -> None:
    """Write the dense dL/dlogits into ``out`` (which may be ``logits`` itself)."""
    backend = _dispatch.select_backend("selective_logprobs", logits)
    kernels = kernels_or_none(backend)
    if kernels is None:
        if _dispatch.batch_invariant_enabled():
            out.copy_(ref.softmax_grad(logits, token_ids, lse, entropy, grad_lp, grad_entropy,
                                       inv_temp, vocab_start))
        else:
            _logits_torch.softmax_grad_into(out, logits, token_ids, lse, entropy, grad_lp,
                                            grad_entropy, inv_temp, vocab_start)
        return
    cfg = make_launch_config(backend)
    kernels.logits_grad(logits, token_ids, lse, entropy, grad_lp, grad_entropy, out,
                        inv_temp=inv_temp, vocab_start=vocab_start, block_v=cfg.block_v,
                        num_warps=cfg.num_warps)


def _gradient_into(out, logits, token_ids, keep_ids, keep_offsets, lse, entropy, lse_keep,
                   grad_lp, grad_entropy, inv_temp, vocab_start) -> None:
    terms = None
    if keep_ids is not None:
        # The nucleus rows' log-prob terms, read from the logits before an in-place
        # backward overwrites them; the dense pass keeps only their entropy term.
        terms = _nucleus.grad_terms(logits, token_ids, keep_ids, keep_offsets, lse_keep,
                                    grad_lp, inv_temp, vocab_start)
        grad_lp = torch.where(keep_offsets.diff() > 0, 0.0, grad_lp)
    _grad_into(out, logits, token_ids, lse, entropy, grad_lp, grad_entropy, inv_temp,
               vocab_start)
    if terms is not None:
        _nucleus.add_grad_terms(out, *terms)


def _backward_impl(logits: torch.Tensor, token_ids: torch.Tensor,
                   keep_ids: Optional[torch.Tensor], keep_offsets: Optional[torch.Tensor],
                   lse: torch.Tensor, entropy: torch.Tensor, lse_keep: torch.Tensor,
                   grad_lp: torch.Tensor, grad_entropy: Optional[torch.Tensor],
                   inv_temp: float, vocab_start: int) -> torch.Tensor:
    """dL/dlogits [N, V] in the logits dtype for upstream gradients grad_lp [N] and
    grad_entropy [N] (None: no entropy term), the softmax recomputed from the saved lse."""
    out = torch.empty_like(logits)
    _gradient_into(out, logits, token_ids, keep_ids, keep_offsets, lse, entropy, lse_keep,
                   grad_lp, grad_entropy, inv_temp, vocab_start)
    return out


_backward_op = torch.library.custom_op("glm_kernels::selective_logprobs_backward",
                                       mutates_args=())(_backward_impl)


@_backward_op.register_fake
def _backward_fake(logits, token_ids, keep_ids, keep_offsets, lse, entropy, lse_keep, grad_lp,
                   grad_entropy, inv_temp, vocab_start):
    return torch.empty_like(logits)


def _backward_inplace_impl(logits: torch.Tensor, token_ids: torch.Tensor,
                           keep_ids: Optional[torch.Tensor], keep_offsets: Optional[torch.Tensor],
                           lse: torch.Tensor, entropy: torch.Tensor, lse_keep: torch.Tensor,
                           grad_lp: torch.Tensor, grad_entropy: Optional[torch.Tensor],
                           inv_temp: float, vocab_start: int) -> None:
    """The backward written over the logits buffer (inplace_backward): no second [N, V]."""
    _gradient_into(logits, logits, token_ids, keep_ids, keep_offsets, lse, entropy, lse_keep,
                   grad_lp, grad_entropy, inv_temp, vocab_start)
    if not torch.compiler.is_compiling():
        torch.autograd.graph.increment_version(logits)   # the op does it when dispatched


_backward_inplace_op = torch.library.custom_op("glm_kernels::selective_logprobs_backward_",
                                               mutates_args=("logits",))(_backward_inplace_impl)


@_backward_inplace_op.register_fake
def _backward_inplace_fake(logits, token_ids, keep_ids, keep_offsets, lse, entropy, lse_keep,
                           grad_lp, grad_entropy, inv_temp, vocab_start):
    return None


def _upstream(grad_lp, grad_entropy, lse, want_entropy):
    """The upstream gradients as backward's kernels take them: fp32, contiguous; None (the
    grads are not materialised) for an unused output: zeros for the log-prob, no entropy
    term at all, rather than that term times 0."""
    grad_lp = torch.zeros_like(lse) if grad_lp is None else grad_lp.float().contiguous()
    # A traced backward may hand the non-differentiable [0] entropy a gradient anyway.
    grad_entropy = (grad_entropy.float().contiguous()
                    if want_entropy and grad_entropy is not None else None)
    return grad_lp, grad_entropy


def _setup_context(ctx, inputs, output):
    logits, token_ids, keep_ids, keep_offsets, inv_temp, want_entropy, group, inplace = inputs
    _, entropy, lse, lse_keep = output
    ctx.save_for_backward(logits, token_ids, keep_ids, keep_offsets, lse, entropy, lse_keep)
    vocab_start = _vocab_parallel.shard_range(logits.shape[1],
                                              _vocab_parallel.resolve_group(group))[0]
    ctx.cfg = (inv_temp, vocab_start, want_entropy, inplace)
    ctx.mark_non_differentiable(lse, lse_keep, *(() if want_entropy else (entropy,)))
    ctx.set_materialize_grads(False)     # see _upstream


def _backward(ctx, grad_lp, grad_entropy, _grad_lse, _grad_lse_keep):
    logits, token_ids, keep_ids, keep_offsets, lse, entropy, lse_keep = ctx.saved_tensors
    inv_temp, vocab_start, want_entropy, inplace = ctx.cfg
    grad_lp, grad_entropy = _upstream(grad_lp, grad_entropy, lse, want_entropy)
    args = (logits, token_ids, keep_ids, keep_offsets, lse, entropy, lse_keep, grad_lp,
            grad_entropy, inv_temp, vocab_start)
    if inplace:
        call_op(ctx, _backward_inplace_op, _backward_inplace_impl, *args)
        grad = logits
    else:
        grad = call_op(ctx, _backward_op, _backward_impl, *args)
    return (grad,) + (None,) * 7


_selective_logprobs = differentiable_op(_selective_logprobs_op, _selective_logprobs_impl,
                                        _setup_context, _backward)


def logprobs_rows(logits2d, token_ids1d, *, inv_temp, want_entropy=False, tp_group=None,
                  inplace_backward=False, keep_ids=None, keep_offsets=None):
    """Differentiable (lp [N], entropy [N] or [0]) of [N, V] rows; no validation."""
    lp, entropy, _, _ = _selective_logprobs(
        logits2d, token_ids1d, keep_ids, keep_offsets, inv_temp, want_entropy,
        _vocab_parallel.group_name(tp_group), inplace_backward)
    return lp, entropy


def selective_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, *,
                       temperature: float = 1.0, return_entropy: bool = False, tp_group=None,
                       keep_token_ids: Optional[torch.Tensor] = None,
                       keep_offsets: Optional[torch.Tensor] = None):
    """Log-probabilities of chosen tokens (and the entropy) straight from logits.

    Parameters
    ----------
    logits : Tensor [*S, V], any float dtype (bf16 / fp16 / fp32 / fp64)
        Differentiable. With ``tp_group``: this rank's vocab shard, columns
        [rank V, (rank + 1) V) of a vocabulary of world_size * V (Megatron layout).
    token_ids : Tensor [*S], int32 / int64
        Sampled tokens, ids into the full vocabulary, identical on every TP rank.
    temperature : float, default 1.0
        Sampling temperature T > 0: probabilities are softmax(logits / T).
    return_entropy : bool, default False
        Also return the entropy H = -sum p log p [*S] fp32 (differentiable).
    tp_group : torch.distributed ProcessGroup, optional
        Vocab-parallel group; the result is the full-vocab value on every rank. Two
        all-reduces in forward (max; packed sum-exp, entropy sum and target logit), none in
        backward.
    keep_token_ids : Tensor [K], int32 / int64, optional
        The rollout's top-p nucleus of every position, packed (CSR): row i (of the flattened
        [*S]) keeps ids ``keep_token_ids[keep_offsets[i]:keep_offsets[i + 1]]`` of the full
        vocabulary, no id twice in a row. The log-prob is then renormalised over the kept ids
        and the target (slime's ``--rollout-top-p``): lp = z[t] - log sum_{v in S u {t}} e^z_v,
        gradient onehot(t) - softmax over S u {t} (0 outside it). A row with no ids has no
        nucleus: the full-vocab log-prob. The entropy stays over the full vocabulary.
    keep_offsets : Tensor [N + 1], int32 / int64, optional (with ``keep_token_ids``)
        0 = keep_offsets[0] <= ... <= keep_offsets[N] = K, N = token_ids.numel().

    Returns
    -------
    logprobs : Tensor [*S] fp32 -- log softmax(logits / T)[token]; or (logprobs, entropy).

    Notes
    -----
    * A token whose logit is -inf (a masked vocab entry) gets log-prob -inf; its gradient
      stays finite (onehot - p). A row whose logits are all -inf has no distribution: NaN
      log-prob and entropy. -inf entries contribute 0 to the entropy.
    * Rows whose upstream gradient is exactly 0 get an exactly-zero gradient row even when
      their logits are NaN/inf (autograd of the reference would give NaN there).
    * token_ids are checked against the vocab: on CPU a ValueError before anything runs; on
      CUDA an asynchronous device-side assert raised by the kernel's flag (no host sync).
    * Extra memory: lse (and entropy) [N] fp32 saved for backward, plus the logits themselves.
      Non-contiguous logits are copied once. A nucleus adds O(K + N) (its kept logits, one
      lse per row), never an [N, V] mask; its cost over the plain call is a gather of K
      logits and per-row reductions of them, forward and backward.
    * The nucleus is checked on CPU (offsets from 0 to K and non-decreasing, ids in the
      vocabulary, no repeated id in a row: ValueError naming the argument); on CUDA the same
      checks but the last are asynchronous device-side asserts (no host sync).

    Example
    -------
    >>> import torch
    >>> from glm_kernels.loss import selective_logprobs
    >>> logits = torch.tensor([[2.0, 0.0, 0.0], [0.0, 0.0, 0.0]], requires_grad=True)
    >>> lp, h = selective_logprobs(logits, torch.tensor([0, 2]), return_entropy=True)
    >>> [round(x, 4) for x in lp.tolist()], round(h[1].item(), 4)   # uniform row: log 3
    ([-0.2395, -1.0986], 1.0986)
    >>> lp.sum().backward(); [round(x, 4) for x in logits.grad[1].tolist()]
    [-0.3333, -0.3333, 0.6667]
    """
    check_logits_and_ids(logits, token_ids)
    temperature = _checks.check_finite_number("temperature", temperature, positive=True)
    _checks.check_bool("return_entropy", return_entropy)
    loss_checks.check_tp_group(tp_group)
    if keep_token_ids is not None or keep_offsets is not None:
        vocab_total = _vocab_parallel.shard_range(logits.shape[-1], tp_group)[1]
        _nucleus.check_nucleus(keep_token_ids, keep_offsets, token_ids.numel(), vocab_total,
                               logits.device)
        keep_token_ids, keep_offsets = keep_token_ids.contiguous(), keep_offsets.contiguous()
    lp, entropy = logprobs_rows(rows_2d(logits), token_ids.reshape(-1).contiguous(),
                                inv_temp=1.0 / temperature, want_entropy=return_entropy,
                                tp_group=tp_group, keep_ids=keep_token_ids,
                                keep_offsets=keep_offsets)
    lp = lp.reshape(token_ids.shape)
    if not return_entropy:
        return lp
    return lp, entropy.reshape(token_ids.shape)
