"""Log-probs renormalised over a per-token nucleus (sampling with top-p < 1), sparse.

Math, with z = logits / T, t the target and S_i the kept ids of row i (CSR:
``keep_token_ids[keep_offsets[i]:keep_offsets[i + 1]]``)::

    K_i  = S_i u {t_i}                       (the target always counts, as slime does)
    lp_i = z_t - log sum_{v in K_i} e^(z_v)  (= lp over the full vocab when S_i is empty)
    H_i  = -sum_v p_v log p_v                (the entropy stays over the full vocabulary)
    d lp_i / d z_v = onehot(t)_v - q_v,   q_v = e^(z_v - lse_K) on K_i, 0 elsewhere

An empty S_i means "no nucleus recorded": the row is the plain full-vocab log-prob. The
full-vocab pass (``logprobs.py``: lse, entropy, one read of the logits) runs for every row;
the nucleus adds a gather of the K = len(keep_token_ids) kept logits and per-row reductions
of them (O(K + N), no [N, V] mask): torch ops on the torch backend, one Triton program per
row on the others (``_nucleus_kernels.py``). Backward: the dense softmax gradient with the log-prob
coefficient zeroed on nucleus rows (it keeps the entropy term), then the nucleus rows' sparse
terms added at their K_i columns. Shard-aware: with a vocab-parallel ``tp_group`` each rank
sums its own kept columns and two all-reduces (max; sum and target logit) combine them.
"""
from typing import Tuple

import torch
import torch.distributed as dist

from ... import _checks, _dispatch
from .._common import softmax as ref
from ..._row_invariant import row_shift

NEG_INF = float("-inf")
INDEX_DTYPES = (torch.int32, torch.int64)


# --------------------------------------------------------------------------- checks
def check_nucleus(keep_token_ids, keep_offsets, n_rows: int, vocab_total: int,
                  device: torch.device) -> None:
    """Validate the CSR nucleus of ``n_rows`` rows.

    Everywhere (shapes, no data read): 1-D int32/int64 tensors on the logits' device,
    ``keep_offsets`` of N + 1 entries. On CPU (free: no device to wait for) also the values:
    keep_offsets[0] == 0, non-decreasing, keep_offsets[N] == len(keep_token_ids), ids in
    [0, vocab_total), no id twice in a row. On CUDA, and inside a torch.compile graph, the
    value checks but the last are asynchronous asserts (``torch._assert_async``, no host
    sync); duplicate ids in a row are not checked there (they would count twice in the row's
    sum).
    """
    if (keep_token_ids is None) != (keep_offsets is None):
        raise ValueError("keep_token_ids and keep_offsets go together: pass both or neither")
    _checks.check_tensor("keep_token_ids", keep_token_ids, dtypes=INDEX_DTYPES, ndim=(1,))
    _checks.check_tensor("keep_offsets", keep_offsets, dtypes=INDEX_DTYPES, ndim=(1,))
    if keep_offsets.numel() != n_rows + 1:
        raise ValueError(f"keep_offsets must have one entry per row plus one ({n_rows + 1}), "
                         f"got {keep_offsets.numel()}")
    if keep_token_ids.device != device or keep_offsets.device != device:
        raise ValueError(f"keep_token_ids and keep_offsets must be on the logits' device "
                         f"{device}, got {keep_token_ids.device} and {keep_offsets.device}")
    k = keep_token_ids.numel()
    if keep_offsets.is_cuda or torch.compiler.is_compiling():   # no host read in a graph
        torch._assert_async(keep_offsets[0] == 0, "keep_offsets[0] must be 0")
        torch._assert_async(keep_offsets[-1] == k, "keep_offsets[-1] must be len(keep_token_ids)")
        torch._assert_async((keep_offsets.diff() >= 0).all(), "keep_offsets must not decrease")
        if k:
            torch._assert_async(((keep_token_ids >= 0) & (keep_token_ids < vocab_total)).all(),
                                f"keep_token_ids must lie in [0, {vocab_total})")
        return
    first, last = int(keep_offsets[0]), int(keep_offsets[-1])
    if first != 0 or last != k:
        raise ValueError(f"keep_offsets must run from 0 to len(keep_token_ids) = {k}, got "
                         f"{first} ... {last}")
    if n_rows and bool((keep_offsets.diff() < 0).any()):
        row = int((keep_offsets.diff() < 0).nonzero()[0])
        raise ValueError(f"keep_offsets must not decrease, got keep_offsets[{row}] = "
                         f"{int(keep_offsets[row])} > keep_offsets[{row + 1}] = "
                         f"{int(keep_offsets[row + 1])}")
    if not k:
        return
    lo, hi = int(keep_token_ids.min()), int(keep_token_ids.max())
    if lo < 0 or hi >= vocab_total:
        raise ValueError(f"keep_token_ids must lie in [0, {vocab_total}), got range [{lo}, {hi}]")
    keys = kept_rows(keep_offsets, k) * vocab_total + keep_token_ids.long()
    if torch.unique(keys).numel() != k:
        raise ValueError("keep_token_ids holds an id twice within one row's nucleus")


# --------------------------------------------------------------------------- torch math
def kept_rows(keep_offsets: torch.Tensor, k: int) -> torch.Tensor:
    """The row of every kept id [K] int64 (CSR offsets expanded)."""
    counts = keep_offsets.diff().long()
    return torch.repeat_interleave(torch.arange(counts.numel(), device=keep_offsets.device),
                                   counts, output_size=k)


def _kept_logits(logits, token_ids, keep_ids, keep_offsets, inv_temp, vocab_start):
    """(rows [K], flat column index [K], owned [K], z of each kept id [K] fp32 (-inf where
    another shard holds it), whether the target is among the row's ids [N], whether the row
    has a nucleus [N])."""
    n, v = logits.shape
    k = keep_ids.numel()
    rows = kept_rows(keep_offsets, k)
    local = keep_ids.long() - vocab_start
    owned = (local >= 0) & (local < v)
    flat = rows * v + local.clamp(0, v - 1)
    z = logits.reshape(-1).index_select(0, flat).float() * inv_temp
    z = torch.where(owned, z, NEG_INF)
    hit = (keep_ids.long() == token_ids.long().index_select(0, rows)).to(torch.int32)
    target_in = torch.zeros(n, dtype=torch.int32, device=logits.device).index_add_(0, rows, hit)
    has_set = keep_offsets.diff() > 0
    return rows, flat, owned, z, target_in > 0, has_set


def _target_logit(logits, token_ids, inv_temp, vocab_start):
    """(z of the target [N] fp32, 0 where another shard owns it; owned [N])."""
    v = logits.shape[1]
    local = token_ids.long() - vocab_start
    owned = (local >= 0) & (local < v)
    z_t = logits.gather(1, local.clamp(0, v - 1).unsqueeze(1)).squeeze(1).float() * inv_temp
    return torch.where(owned, z_t, 0.0), owned


def nucleus_partial_stats(logits, token_ids, keep_ids, keep_offsets, inv_temp: float,
                          vocab_start: int) -> torch.Tensor:
    """[N, 3] fp32 (m, s, z_t) of the kept columns this tensor holds: m = max over K_i's
    columns here, s = sum e^(z - m) over them, z_t the target logit where held (else 0)."""
    n = logits.shape[0]
    rows, _, _, z, target_in, has_set = _kept_logits(logits, token_ids, keep_ids, keep_offsets,
                                                     inv_temp, vocab_start)
    z_t, owned_t = _target_logit(logits, token_ids, inv_temp, vocab_start)
    extra = owned_t & has_set & ~target_in               # the target counted beside S_i
    z_extra = torch.where(extra, z_t, NEG_INF)
    m = torch.full((n,), NEG_INF, device=logits.device).scatter_reduce_(
        0, rows, z, reduce="amax", include_self=True)
    m = torch.maximum(m, z_extra)
    shift = row_shift(m)
    s = torch.zeros(n, device=logits.device).index_add_(0, rows, torch.exp(z - shift[rows]))
    s = s + torch.exp(z_extra - shift)
    return torch.stack([m, s, z_t], -1)


def combine_nucleus_stats(partial: torch.Tensor, group) -> torch.Tensor:
    """Shards' [N, 3] (m, s, z_t) -> the full (m, s, z_t): all-reduce MAX, then SUM."""
    m, s, z_t = partial.unbind(-1)
    m_global = m.clone()
    dist.all_reduce(m_global, op=dist.ReduceOp.MAX, group=group)
    alpha = torch.where(m > NEG_INF, torch.exp(m - row_shift(m_global)), 0.0)
    packed = torch.stack([s * alpha, z_t], -1)
    dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=group)
    return torch.stack([m_global, packed[:, 0], packed[:, 1]], -1)


def finalize_nucleus(stats: torch.Tensor, keep_offsets: torch.Tensor, lp_full: torch.Tensor,
                     lse_full: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(lp, lse_K) [N] fp32; rows without a nucleus keep the full-vocab lp and lse."""
    m, s, z_t = stats.unbind(-1)
    lse_keep = row_shift(m) + torch.log(s)
    has_set = keep_offsets.diff() > 0
    return (torch.where(has_set, z_t - lse_keep, lp_full),
            torch.where(has_set, lse_keep, lse_full))


def nucleus_grad_terms(logits, token_ids, keep_ids, keep_offsets, lse_keep, grad_lp,
                       inv_temp: float, vocab_start: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """(flat index [K + N] int64, values [K + N] fp32): the nucleus rows' log-prob gradient
    g (onehot(t) - q) / T at the kept ids, then at each target not among its row's ids (value 0
    where the row has no nucleus, its coefficient is 0, or another shard holds the column)."""
    n, v = logits.shape
    rows, flat, owned, z, target_in, has_set = _kept_logits(logits, token_ids, keep_ids,
                                                            keep_offsets, inv_temp, vocab_start)
    c = grad_lp.float() * inv_temp
    c_k = c.index_select(0, rows)
    onehot = (keep_ids.long() == token_ids.long().index_select(0, rows)).float()
    vals = c_k * (onehot - torch.exp(z - lse_keep.index_select(0, rows)))
    # 0 exactly where the coefficient is 0 (even for NaN logits) or the column is not here.
    vals = torch.where(owned & (c_k != 0), vals, 0.0)
    z_t, owned_t = _target_logit(logits, token_ids, inv_temp, vocab_start)
    extra = owned_t & has_set & ~target_in & (c != 0)
    t_vals = torch.where(extra, c * (1.0 - torch.exp(z_t - lse_keep)), 0.0)
    t_local = (token_ids.long() - vocab_start).clamp(0, v - 1)
    t_flat = torch.arange(n, device=logits.device) * v + t_local
    return torch.cat([flat, t_flat]), torch.cat([vals, t_vals])


# --------------------------------------------------------------------------- backends
# Kernel tiles of kept ids: 128 on a GPU; 16 under the interpreter, so that test-sized nuclei
# span several tiles.
BLOCK_K = {"triton": 128, "interpret": 16}


def _kernels(logits):
    """(Triton kernel module, BLOCK_K) or (None, None) for the torch backend."""
    backend = _dispatch.select_backend("selective_logprobs", logits)
    if backend == "torch":
        return None, None
    from . import _nucleus_kernels
    return _nucleus_kernels, BLOCK_K[backend]


def _index(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype == torch.int64 else x.long()


def stats(logits, token_ids, keep_ids, keep_offsets, inv_temp: float,
          vocab_start: int) -> torch.Tensor:
    """[N, 3] fp32 nucleus statistics of this tensor's columns (see nucleus_partial_stats)."""
    kernels, block_k = _kernels(logits)
    if kernels is None:
        return nucleus_partial_stats(logits, token_ids, keep_ids, keep_offsets, inv_temp,
                                     vocab_start)
    out = torch.empty((logits.shape[0], 3), dtype=torch.float32, device=logits.device)
    kernels.nucleus_stats(logits, _index(token_ids), _index(keep_ids), _index(keep_offsets),
                          out, inv_temp=inv_temp, vocab_start=vocab_start, block_k=block_k,
                          num_warps=4)
    return out


def grad_terms(logits, token_ids, keep_ids, keep_offsets, lse_keep, grad_lp, inv_temp: float,
               vocab_start: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """(flat index [K + N] int64, values [K + N] fp32) of the nucleus rows' gradient (see
    nucleus_grad_terms)."""
    kernels, block_k = _kernels(logits)
    if kernels is None:
        return nucleus_grad_terms(logits, token_ids, keep_ids, keep_offsets, lse_keep, grad_lp,
                                  inv_temp, vocab_start)
    size = keep_ids.numel() + logits.shape[0]
    index = torch.empty(size, dtype=torch.int64, device=logits.device)
    value = torch.empty(size, dtype=torch.float32, device=logits.device)
    kernels.nucleus_grad_terms(logits, _index(token_ids), _index(keep_ids),
                               _index(keep_offsets), lse_keep, grad_lp.float().contiguous(),
                               index, value, inv_temp=inv_temp, vocab_start=vocab_start,
                               block_k=block_k, num_warps=4)
    return index, value


def add_grad_terms(out, index, values) -> torch.Tensor:
    """out (an [N, V] gradient) with the nucleus terms added at their flat positions."""
    flat = out.view(-1)
    flat.index_add_(0, index, values.to(out.dtype))
    return out


def reference(logits: torch.Tensor, token_ids: torch.Tensor, keep_ids: torch.Tensor,
              keep_offsets: torch.Tensor, temperature: float = 1.0,
              return_entropy: bool = False):
    """The oracle: a dense [N, V] keep-mask (S_i u {t_i}; all True for rows without a
    nucleus), log_softmax over the kept logits; entropy over the full vocabulary."""
    z = logits.float() / temperature
    n, v = z.shape
    rows = kept_rows(keep_offsets, keep_ids.numel())
    keep = torch.zeros(n, v, dtype=torch.bool, device=z.device)
    keep[rows, keep_ids.long()] = True
    keep[torch.arange(n), token_ids.long()] = True
    keep[keep_offsets.diff() == 0] = True
    lp = torch.log_softmax(z.masked_fill(~keep, NEG_INF), -1)
    lp = lp.gather(1, token_ids.long().unsqueeze(1)).squeeze(1)
    if not return_entropy:
        return lp
    return lp, ref.selective_logprobs_reference(logits, token_ids, temperature, True)[1]

