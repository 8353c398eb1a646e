"""Readable PyTorch definitions: deterministic top-k and DeepSeek-V3 ``noaux_tc`` routing.

These functions are the contract (docs/design.md 3.6), the test oracle and the CPU path.

Top-k is *defined* as the first k entries of ``torch.sort(x, dim, descending=largest,
stable=True)``. On every backend that order is: ties go to the smaller index; NaN (whatever
its sign or payload) is larger than every number, so it comes first for ``largest=True`` and
last for ``largest=False``; -0.0 equals +0.0 (a tie), and the returned value is always the
input element itself (its own bits).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch


def fill_value(dtype: torch.dtype, largest: bool):
    """What an empty output slot (k > a row's length) holds: the last value in sort order."""
    if dtype.is_floating_point:
        return float("-inf") if largest else float("inf")
    info = torch.iinfo(dtype)
    return info.min if largest else info.max


_SAME_WIDTH_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def take_bits(x: torch.Tensor, indices: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """``x.gather(dim, indices)`` moved as raw bits (CPU gather of bf16 rewrites NaN bits)."""
    as_int = x.view(_SAME_WIDTH_INT[x.element_size()])
    return as_int.gather(dim, indices).view(x.dtype)


def stable_order(x: torch.Tensor, largest: bool,
                 excluded: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Permutation of the last dim in contract order; ``excluded`` entries (bool) go last.

    Two stable sorts: by value, then by the excluded flag, which keeps the value order
    among the included entries.
    """
    order = torch.sort(x, dim=-1, descending=largest, stable=True).indices
    if excluded is not None:
        by_flag = torch.sort(excluded.gather(-1, order).to(torch.uint8), dim=-1, stable=True)
        order = order.gather(-1, by_flag.indices)
    return order


def topk_reference(x: torch.Tensor, k: int, dim: int = -1, largest: bool = True,
                   sorted: bool = True, lengths: Optional[torch.Tensor] = None
                   ) -> Tuple[torch.Tensor, torch.Tensor]:
    """(values, indices int64): the first k of the stable sort, optionally per-row lengths.

    ``lengths`` (shape of x without ``dim``, or [rows]) keeps only the first lengths[i]
    entries of row i (values clamped to [0, n]); slots past a row's length get index -1 and
    ``fill_value(dtype, largest)``. ``sorted=False`` lists the same set in ascending index
    order (empty slots last).
    """
    rows_view = x.movedim(dim, -1)
    n = rows_view.shape[-1]
    excluded = None
    if lengths is not None:
        row_lengths = lengths.reshape(rows_view.shape[:-1]).to(torch.int64).clamp(0, n)
        excluded = torch.arange(n, device=x.device) >= row_lengths.unsqueeze(-1)
    indices = stable_order(rows_view, largest, excluded)[..., :k]
    taken = (torch.ones_like(indices, dtype=torch.bool) if excluded is None
             else ~excluded.gather(-1, indices))
    if not sorted:
        indices = torch.sort(torch.where(taken, indices, n), dim=-1).values
        taken = indices < n
    indices = torch.where(taken, indices, -1)
    values = take_bits(rows_view, indices.clamp(min=0))
    fill = torch.tensor(fill_value(x.dtype, largest), dtype=x.dtype, device=x.device)
    values = torch.where(taken, values, fill)
    return values.movedim(-1, dim), indices.movedim(-1, dim)


def noaux_tc_choice(scores: torch.Tensor, k: int, bias: Optional[torch.Tensor] = None,
                    n_group: int = 1, topk_group: int = 1) -> torch.Tensor:
    """The experts ``noaux_tc`` routes each token to: int64 [T, k] from fp32 scores [T, E].

    c = scores + bias; group score = sum of the two largest c of each of the n_group
    contiguous groups; the topk_group best groups stay eligible; ids = top-k of c over
    eligible experts, in descending c (ties: lower group, then lower expert index).
    """
    n_experts = scores.shape[-1]
    choice = (scores if bias is None else scores + bias.float()).detach()
    excluded = None
    if n_group > 1:
        group_size = n_experts // n_group
        grouped = choice.view(-1, n_group, group_size)
        group_scores = topk_reference(grouped, min(2, group_size))[0].sum(-1)
        kept_groups = topk_reference(group_scores, topk_group)[1]
        kept = torch.zeros_like(group_scores, dtype=torch.bool).scatter(1, kept_groups, True)
        excluded = ~kept.repeat_interleave(group_size, dim=1)
    return stable_order(choice, True, excluded)[:, :k]


def _log1p(e: torch.Tensor) -> torch.Tensor:
    """log(1 + e) for e >= 0, accurate for small e: log(u) * e / (u - 1), u = 1 + e (Goldberg),
    in ops whose bits do not depend on where an element sits in the tensor (torch's own
    ``log1p`` / ``softplus`` / ``sigmoid`` on CPU take other code paths in a vector's tail)."""
    u = 1 + e
    return torch.where(u == 1, e, torch.log(u) * e / (u - 1))


def router_scores(logits: torch.Tensor, scoring: str) -> torch.Tensor:
    """Router scores of fp32 logits [T, E]; each element's (row's) bits are independent of the
    rest of the batch (batch-invariant routing on CPU too).

    sigmoid: 1 / (1 + exp(-l));  softmax: over the experts;
    sqrtsoftplus (DeepSeek-V4): sqrt(softplus(l)) = sqrt(max(l, 0) + log1p(exp(-|l|))).
    """
    if scoring == "softmax":
        return logits.softmax(-1)
    if scoring == "sqrtsoftplus":
        return (logits.clamp(min=0) + _log1p(torch.exp(-logits.abs()))).sqrt()
    return 1 / (1 + torch.exp(-logits))


def routing_mismatch_reference(ids: torch.Tensor, other_ids: torch.Tensor) -> torch.Tensor:
    """bool [...]: True where a token's expert *set* differs between two routings [..., k].

    Order within a token does not count (the MoE output does not depend on it).
    """
    return (ids.sort(-1).values != other_ids.to(ids.dtype).sort(-1).values).any(-1)


def moe_route_reference(router_logits: torch.Tensor, k: int, *, scoring: str = "sigmoid",
                        bias: Optional[torch.Tensor] = None, n_group: int = 1,
                        topk_group: int = 1, renormalize: bool = True,
                        scaling_factor: float = 1.0, eps: float = 1e-20,
                        replay_ids: Optional[torch.Tensor] = None
                        ) -> Tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3 / GLM-5 ``noaux_tc`` routing, differentiable in ``router_logits``.

    s = router_scores(l, scoring) (sigmoid, softmax or sqrtsoftplus; fp32);
    ids = ``noaux_tc_choice(s, k, bias, ...)`` (bias
    steers the choice only), or ``replay_ids`` as given (rollout routing replay: the choice
    is skipped); weights = s[ids], divided by (sum + eps) when renormalizing, times
    scaling_factor -- the same expression whichever way the ids were found.
    """
    logits = router_logits.float()
    n_experts = logits.shape[-1]
    logits = logits.reshape(-1, n_experts)
    scores = router_scores(logits, scoring)
    if replay_ids is None:
        ids = noaux_tc_choice(scores, k, bias, n_group, topk_group)
    else:
        ids = replay_ids.reshape(-1, k).to(torch.int64)
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(-1, keepdim=True) + eps)
    weights = weights * scaling_factor
    out_shape = router_logits.shape[:-1] + (k,)
    return weights.reshape(out_shape), ids.reshape(out_shape)
