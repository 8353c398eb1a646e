"""Whole-model batch-invariant ops in plain torch: the definitions, the test oracle and the CPU
path of ``glm_kernels.invariant``.

Each function gives an output element bits that depend only on the values it is computed from,
never on the tensor's shape, the element's position in it, the thread count, or how many zeros
or masked entries surround it. The rules:

* a matrix product with a fixed K (``linear``: mm, addmm, grouped_mm) runs on row tiles of
  exactly ``row_tile`` rows (16 on the CPU, 64 on CUDA; the last zero-padded): every call
  has one shape, so one BLAS kernel and one order over K for every row, the M = 1 decode row
  included (measured thread-independent for fixed tiles: tests/invariant);
* a sum whose length changes with the batch (attention's keys, a bmm's K) is a fixed binary
  tree over its *non-zero* terms, moved to the front in order (``compact_nonzero``): masked
  keys, left or right padding and a KV cache's shorter rows only add or remove exact zeros,
  and zero padding to a larger power of two leaves a tree sum unchanged, so the decode step
  with L keys and the full forward's masked row give the same bits;
* a row reduction of fixed length (RMSNorm's mean, LayerNorm, softmax over the vocabulary) is a
  fixed binary tree (``tree_sum``), in fp32 for low-precision inputs;
* a transcendental elementwise op (``rsqrt``, ``silu``, ``sigmoid``, ...) runs on a flat copy
  padded to whole vector steps, in pieces below ATen's parallel grain (``elementwise``):
  ATen's vector body and its scalar tail give different bits for some of them, and which
  elements fall in the tail depends on the tensor's size and on the thread split.

``max`` is exact and ``+ - * /`` are IEEE, so they need nothing.
"""
from typing import Callable, List, Optional, Sequence

import torch

from .._row_invariant import matmul_nt, tree_sum

# Elements per piece of an elementwise op: a multiple of every ATen vector step (2 x 32 bf16
# lanes on AVX-512) and below ATen's parallel grain (32768), so one thread runs each piece
# with no scalar tail.
VECTOR_STEP = 64
SERIAL_ELEMENTS = 16384
NEG_INF = float("-inf")


def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def elementwise(fn: Callable, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """``fn(x, *args)`` for an elementwise ``fn``, every element through ATen's vector body."""
    flat = x.reshape(-1)
    n = flat.numel()
    width = -(-n // VECTOR_STEP) * VECTOR_STEP
    padded = flat if width == n else torch.nn.functional.pad(flat, (0, width - n))
    if width <= SERIAL_ELEMENTS:
        out = fn(padded, *args, **kwargs)
    else:
        out = torch.cat([fn(padded[s:s + SERIAL_ELEMENTS], *args, **kwargs)
                         for s in range(0, width, SERIAL_ELEMENTS)])
    return (out if width == n else out[:n]).view(x.shape)


def compact_nonzero(x: torch.Tensor, keep: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``x`` [..., L] with each row's non-zero entries moved to the front in their order, zeros
    after: a row's sum then no longer depends on where zeros (masked keys, padding) sat."""
    length = x.shape[-1]
    keep = x != 0 if keep is None else keep
    dest = torch.where(keep, torch.cumsum(keep, -1) - 1, length)
    out = x.new_zeros(*x.shape[:-1], length + 1)
    out.scatter_(-1, dest, x)         # dropped entries all land in the spare last column
    return out[..., :length]


def sum_nonzero(x: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim as a fixed tree of the non-zero terms in order."""
    keep = x != 0
    if bool(keep.all()):              # nothing to move (a softmax over a whole vocabulary)
        return tree_sum(x)
    return tree_sum(compact_nonzero(x, keep))


def reduce_dims(x: torch.Tensor, dims: Optional[Sequence[int]]) -> torch.Tensor:
    """``x`` with ``dims`` (all when None or empty) moved to the end and flattened into one."""
    if dims and len(dims) == 1 and x.dim() and dims[0] % x.dim() == x.dim() - 1:
        return x            # the last dim alone (a norm over the hidden size): already so
    if not dims:
        dims = range(x.dim())
    dims = sorted({d % max(x.dim(), 1) for d in dims})
    keep = [d for d in range(x.dim()) if d not in dims]
    moved = x.permute(*keep, *dims) if x.dim() else x.reshape(1)
    return moved.reshape(*[x.shape[d] for d in keep], -1)


def _restore_kept(out: torch.Tensor, x: torch.Tensor, dims, keepdim: bool) -> torch.Tensor:
    if not keepdim:
        return out
    if not dims:
        dims = range(x.dim())
    shape = [1 if (d in {e % max(x.dim(), 1) for e in dims}) else s
             for d, s in enumerate(x.shape)]
    return out.reshape(shape)


def sum_dims(x: torch.Tensor, dims=None, keepdim: bool = False,
             dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """``x.sum(dims, keepdim, dtype=dtype)`` as a fixed tree (fp32 for 16-bit inputs)."""
    out_dtype = dtype or x.dtype
    acc = reduce_dims(x, dims).to(_accumulation_dtype(out_dtype))
    return _restore_kept(tree_sum(acc), x, dims, keepdim).to(out_dtype)


def mean_dims(x: torch.Tensor, dims=None, keepdim: bool = False,
              dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """``x.mean(dims, keepdim, dtype=dtype)``: the tree sum over the count."""
    out_dtype = dtype or x.dtype
    acc = reduce_dims(x, dims).to(_accumulation_dtype(out_dtype))
    mean = tree_sum(acc) / max(acc.shape[-1], 1)
    return _restore_kept(mean, x, dims, keepdim).to(out_dtype)


def softmax(x: torch.Tensor, dim: int, half_to_float: bool = False, log: bool = False):
    """``softmax`` / ``log_softmax`` over ``dim``: exact max, e^(x - max), a tree over the
    non-zero exponentials (masked entries are exact zeros wherever they sit)."""
    out_dtype = torch.float32 if half_to_float else x.dtype
    z = x.movedim(dim, -1).to(_accumulation_dtype(x.dtype))
    top = z.amax(-1, keepdim=True)
    shift = torch.where(top == NEG_INF, torch.zeros_like(top), top)
    e = elementwise(torch.exp, z - shift)
    total = sum_nonzero(e).unsqueeze(-1)
    out = (z - shift) - elementwise(torch.log, total) if log else e / total
    return out.to(out_dtype).movedim(-1, dim).contiguous()


def layer_norm(x: torch.Tensor, normalized_shape: Sequence[int], weight, bias, eps: float):
    """``aten.native_layer_norm``: (out, mean, rstd), mean and variance as tree sums."""
    dims = list(range(x.dim() - len(normalized_shape), x.dim()))
    acc = reduce_dims(x, dims).to(_accumulation_dtype(x.dtype))
    n = max(acc.shape[-1], 1)
    mean = tree_sum(acc) / n
    centered = acc - mean.unsqueeze(-1)
    rstd = elementwise(torch.rsqrt, tree_sum(centered * centered) / n + eps)
    out = (centered * rstd.unsqueeze(-1)).reshape(x.shape)
    if weight is not None:
        out = out * weight
    if bias is not None:
        out = out + bias
    stat_shape = list(x.shape[:x.dim() - len(normalized_shape)]) + [1] * len(normalized_shape)
    return out.to(x.dtype), mean.reshape(stat_shape), rstd.reshape(stat_shape)


def mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [M, K] @ b [K, N] on row tiles of exactly ``row_tile`` rows."""
    return matmul_nt(a.contiguous(), b.t())


def addmm(bias: torch.Tensor, a: torch.Tensor, b: torch.Tensor, beta=1, alpha=1,
          mm: Callable = mm):
    """beta * bias + alpha * (a @ b), the product through ``mm`` (row tiles)."""
    out = mm(a, b)
    if alpha != 1:
        out = out * alpha
    if beta == 0:
        return out
    return out + (bias if beta == 1 else bias * beta)


def bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [B, M, K] @ b [B, K, N]: every element a tree over its non-zero products in K order.

    Attention's P @ V is a bmm whose K (the keys) changes between the decode step and the
    full forward and whose masked keys are zero probabilities: the non-zero tree is the same
    for both. Memory B * M * N * K, the price of this shape independence on CPU."""
    acc = _accumulation_dtype(a.dtype)
    products = a.to(acc).unsqueeze(-2) * b.to(acc).transpose(-1, -2).unsqueeze(-3)
    return sum_nonzero(products).to(a.dtype)


def grouped_mm(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor,
               bias: Optional[torch.Tensor] = None, out_dtype: Optional[torch.dtype] = None,
               mm: Callable = mm) -> torch.Tensor:
    """``aten._grouped_mm`` for x [S, K], weight [G, K, N], offsets [G] (row ends): group g's
    rows times weight[g] through ``mm`` (row tiles); rows past offsets[-1] are zero."""
    out = x.new_zeros(x.shape[0], weight.shape[-1], dtype=out_dtype or x.dtype)
    start = 0
    ends: List[int] = [int(e) for e in offsets.tolist()]
    for group, end in enumerate(ends):
        if end > start:
            rows = mm(x[start:end], weight[group])
            if bias is not None:
                rows = rows + bias[group]
            out[start:end] = rows
        start = end
    return out


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              attn_mask: Optional[torch.Tensor] = None, is_causal: bool = False,
              scale: Optional[float] = None):
    """Scaled dot-product attention, q [B, H, T, D], k [B, Hk, L, D], v [B, Hk, L, Dv]
    (Hk divides H: grouped-query heads); returns (out [B, H, T, Dv], logsumexp [B, H, T] fp32;
    +inf for a query that sees no key).

    Scores are trees over D; the softmax sum and P @ V are trees over each query's non-zero
    probabilities in key order. A masked key (bool False, -inf or the -3.4e38 of an additive
    mask) has probability exactly 0, so a query's bits are the same with its keys in a KV cache
    (decode), at the end of a causal row, or behind any left or right padding."""
    acc = _accumulation_dtype(q.dtype)
    batch, heads, t, _ = q.shape
    kv_heads, length = k.shape[-3], k.shape[-2]
    # Grouped-query heads: query head h reads key head h // (H / Hk), by broadcasting.
    qf = q.to(acc).reshape(batch, kv_heads, heads // kv_heads, t, q.shape[-1])
    kf = k.to(acc).unsqueeze(2)                                            # [B, Hk, 1, L, D]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = tree_sum(qf.unsqueeze(-2) * kf.unsqueeze(-3)) * scale        # [B, Hk, G, T, L]
    if is_causal:
        visible = torch.ones(t, length, dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~visible, NEG_INF)
    if attn_mask is not None:
        mask = attn_mask.expand(batch, heads, t, length).reshape(scores.shape)
        if mask.dtype == torch.bool:
            scores = scores.masked_fill(~mask, NEG_INF)
        else:
            scores = scores + mask.to(acc)
    top = scores.amax(-1, keepdim=True)
    shift = torch.where(top == NEG_INF, torch.zeros_like(top), top)
    e = elementwise(torch.exp, scores - shift)
    total = sum_nonzero(e)                                                  # [B, Hk, G, T]
    # A query with every key masked (a padding row) gets 0, not 0/0: NaN there would reach
    # the real rows through the next layer's P @ V (0 * NaN is NaN).
    p = torch.where(total.unsqueeze(-1) > 0, e / total.unsqueeze(-1), torch.zeros_like(e))
    # P @ V over each query's keys of non-zero probability, moved to the front in order.
    keep = p != 0
    order = torch.sort((~keep).to(torch.uint8), dim=-1, stable=True).indices
    p_front = p.gather(-1, order)                     # exact zeros after the kept keys
    v_front = v.to(acc)[torch.arange(batch, device=q.device)[:, None, None, None, None],
                        torch.arange(kv_heads, device=q.device)[None, :, None, None, None],
                        order]                                          # [B, Hk, G, T, L, Dv]
    out = tree_sum((p_front.unsqueeze(-1) * v_front).transpose(-1, -2))  # [B, Hk, G, T, Dv]
    # A query with no visible key: lse = +inf, so a backward's e^(score - lse) is 0, not NaN.
    lse = torch.where(total > 0, shift.squeeze(-1) + elementwise(torch.log, total),
                      torch.full_like(total, float("inf")))
    return (out.reshape(batch, heads, t, -1).to(q.dtype), lse.reshape(batch, heads, t))


def visible_key_ranges(batch: int, t: int, length: int, attn_mask: Optional[torch.Tensor],
                       is_causal: bool, device) -> Optional[tuple]:
    """(lo, hi), int32 [B, T]: query i of row b sees exactly keys [lo, hi), as the split-KV
    kernel takes them; None when a mask is not that (another pattern per head, a bias that is
    neither 0 nor masked, or visible keys that are not one range). An additive entry at or
    below half the dtype's lowest value counts as masked (transformers' padding masks)."""
    visible = torch.ones(batch, 1, t, length, dtype=torch.bool, device=device)
    if is_causal:
        visible = visible & torch.ones(t, length, dtype=torch.bool, device=device).tril()
    if attn_mask is not None:
        mask = attn_mask
        if mask.dtype != torch.bool:
            masked = mask <= torch.finfo(mask.dtype).min / 2
            if not bool(((mask == 0) | masked).all()):
                return None
            mask = ~masked
        while mask.dim() < 4:
            mask = mask.unsqueeze(0)
        if mask.shape[1] != 1:
            if not bool((mask == mask[:, :1]).all()):
                return None
            mask = mask[:, :1]
        visible = visible & mask
    visible = visible[:, 0].expand(batch, t, length)
    count = visible.sum(-1)
    lo = torch.where(count > 0, visible.int().argmax(-1), torch.zeros_like(count))
    hi = lo + count
    keys = torch.arange(length, device=device)
    if not bool((((keys >= lo[..., None]) & (keys < hi[..., None])) == visible).all()):
        return None
    return lo.to(torch.int32).contiguous(), hi.to(torch.int32).contiguous()
