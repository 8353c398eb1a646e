"""Megatron vocab-parallel layout: combine per-shard softmax statistics across TP ranks.

Rank r of a tensor-parallel group of size P holds the vocab columns [r V_l, (r + 1) V_l) of a
vocabulary of P V_l entries (contiguous, equal shards; Megatron pads the vocab to make them
equal). Every rank computes the statistics of its own columns (one read of its shard), then:

1. all-reduce MAX of the row maxima (m_r -> M), like Megatron's first all-reduce;
2. each rank rescales its sums to M: s_r e^(m_r - M), t_r e^(m_r - M) + (m_r - M) s_r e^(m_r - M);
3. one all-reduce SUM of the packed per-row sums, which also carries the target logit: only the
   owning rank contributes it, the others add 0 (Megatron's "predicted logits" all-reduce,
   merged here with its sum-exp all-reduce).

Backward needs no communication at all: every rank holds the full-vocab lse (and entropy / KL)
of every row, and the gradient of its own columns, g (onehot - p) / T, only reads its columns.
The upstream gradient is the same on every rank (the loss is replicated after the
all-reduces), exactly as in Megatron's vocab-parallel cross-entropy, whose backward is also
communication-free. So the all-reduces sit inside the ops' forward bodies, outside autograd, and
the backward formulas return the local gradient. The ops' schemas carry the group by name
(:func:`group_name`; torch's functional collectives do the same), resolved back in the body.

Assumptions (not checked, that would cost a collective per call): every rank passes the same
token ids and rows, and the same V_l.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from . import softmax as ref

NEG_INF = float("-inf")


def group_name(group) -> str:
    """What a custom op's schema carries for ``group`` (a ProcessGroup is no schema type): its
    name, as torch's functional collectives pass it; "" for None (no vocab parallelism)."""
    return "" if group is None else group.group_name


def resolve_group(name: str):
    """The ProcessGroup :func:`group_name` named (None for ""), inside an op's body."""
    if not name:
        return None
    from torch.distributed.distributed_c10d import _resolve_process_group
    return _resolve_process_group(name)


def shard_range(v_local: int, group) -> tuple:
    """(vocab_start, vocab_total) of this rank's shard ((0, v_local) without a group)."""
    if group is None:
        return 0, v_local
    return dist.get_rank(group) * v_local, dist.get_world_size(group) * v_local


def _all_reduce(t: torch.Tensor, op, group) -> torch.Tensor:
    dist.all_reduce(t, op=op, group=group)
    return t


def _rescale(m, m_global):
    """e^(m - M) per row, 0 where this shard saw only -inf (or the whole row is -inf)."""
    return torch.where(m > NEG_INF, torch.exp(m - ref.row_shift(m_global)), 0.0)


def combine_logprob_stats(partial: torch.Tensor, group):
    """[N, 4] shard statistics (m, s, t, z_t) -> full-vocab (lp, lse, entropy)."""
    m, s, t, z_t = partial.unbind(-1)
    m_global = _all_reduce(m.clone(), dist.ReduceOp.MAX, group)
    alpha = _rescale(m, m_global)
    gap = torch.where(m > NEG_INF, m - ref.row_shift(m_global), 0.0)
    packed = torch.stack([s * alpha, alpha * (t + gap * s), z_t], -1)
    s_g, t_g, z_t_g = _all_reduce(packed, dist.ReduceOp.SUM, group).unbind(-1)
    return ref.finalize_logprob_stats(m_global, s_g, t_g, z_t_g)


def combine_reverse_kl_stats(partial: torch.Tensor, group):
    """[N, 5] shard statistics (m_s, s_s, u, m_t, s_t) -> full-vocab (kl, lse_s, lse_t)."""
    m_s, s_s, u, m_t, s_t = partial.unbind(-1)
    maxima = _all_reduce(torch.stack([m_s, m_t], -1), dist.ReduceOp.MAX, group)
    alpha_s = _rescale(m_s, maxima[:, 0])
    alpha_t = _rescale(m_t, maxima[:, 1])
    # u * alpha_s: u may be +inf (teacher -inf where the student has mass); alpha_s > 0 then.
    packed = torch.stack([s_s * alpha_s, torch.where(alpha_s > 0, u * alpha_s, 0.0),
                          s_t * alpha_t], -1)
    s_s_g, u_g, s_t_g = _all_reduce(packed, dist.ReduceOp.SUM, group).unbind(-1)
    return ref.finalize_reverse_kl(maxima[:, 0], s_s_g, u_g, maxima[:, 1], s_t_g)
