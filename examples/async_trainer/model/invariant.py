"""Batch-invariant forward of the example's ``TinyLM`` (``--batch-invariant``): every token's
hidden state, logits and log-prob are bitwise the same whatever else is in the batch, where
the token sits in it, and whether it is computed by a full causal forward (the trainer) or
by decode steps against a KV cache (the rollout).

Why the default forward is not: a matrix product's bits depend on its shape (BLAS picks a
blocking from the row count; M=1 decode and M=B*T training differ), a reduction over a row
may be split across threads depending on the row count, and some vectorized elementwise ops
(``sigmoid``) take another path in a tensor's scalar tail. The rules here:

* every matrix product and every library op with internal reductions runs on fixed-shape
  tiles of ``TILE_ROWS`` rows (zero rows pad the last one): the same call shape for every
  row, wherever it is (``by_row_tiles``);
* sums over a row (norm statistics, dot products, softmax denominators, attention outputs,
  the MoE's weighted sum) are a fixed binary tree of elementwise adds (``tree_sum``); zero
  padding to any power of two gives the same bits, so a decode step's keys 0..t and the
  full forward's masked row t agree;
* max is exact; ``exp``, ``rsqrt``, ``relu``, products and quotients are elementwise and
  IEEE (or position-independent in ATen: checked by
  tests/examples/test_trainer_invariant.py);
* the whole forward runs on one intra-op thread (``one_thread``): BLAS blocking can depend
  on the thread count, and the trainer and the rollout engines run with different counts.

Log-probs come from ``glm_kernels.selective_logprobs`` under ``glm_kernels.batch_invariant()``
on the same tiles (``token_logprobs``), on both sides.
"""
import contextlib
from typing import Callable, Dict, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

import glm_kernels
from glm_kernels.loss import selective_logprobs

from .. import kernels

TILE_ROWS = 64     # a multiple of every SIMD chunk ATen uses: no scalar tail inside a tile


def mode(enabled: bool):
    """``glm_kernels.batch_invariant()`` when ``enabled`` (the model reads the library's
    switch), else a no-op context."""
    return glm_kernels.batch_invariant() if enabled else contextlib.nullcontext()


@contextlib.contextmanager
def one_thread():
    """Compute on one intra-op thread inside the block (restored after; nests)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def by_row_tiles(fn: Callable, tensors: Sequence[torch.Tensor],
                 fills: Sequence[torch.Tensor]) -> Tuple[torch.Tensor, ...]:
    """``fn(*tiles)`` on consecutive [TILE_ROWS, ...] row tiles of ``tensors`` (each [N, ...],
    the same N), the last tile padded with the rows ``fills[i]`` ([1, ...] each); returns
    ``fn``'s outputs (a tensor or a tuple) concatenated over the N real rows."""
    n = tensors[0].shape[0]
    pad = -n % TILE_ROWS
    padded = [torch.cat([t, f.expand(pad, *t.shape[1:]).to(t.dtype)]) if pad else t
              for t, f in zip(tensors, fills)]
    outs = [fn(*(t[i:i + TILE_ROWS] for t in padded)) for i in range(0, n + pad, TILE_ROWS)]
    if not outs:
        outs = [fn(*(t[:0] for t in tensors))]
    single = isinstance(outs[0], torch.Tensor)
    outs = [(o,) if single else o for o in outs]
    joined = tuple(torch.cat(parts)[:n] for parts in zip(*outs))
    return joined[0] if single else joined


def matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [..., in] @ w [in, out] on fixed row tiles (the same bits for a row wherever it is)."""
    flat = x.reshape(-1, x.shape[-1])
    out = by_row_tiles(lambda tile: torch.mm(tile, w), [flat], [flat.new_zeros(1, 1)])
    return out.reshape(*x.shape[:-1], w.shape[1])


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``F.linear(x, weight)`` (no bias) on fixed row tiles; weight [out, in]."""
    return matmul(x, weight.t())


def tree_sum(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Sum over ``dim`` (removed) as a fixed binary tree of elementwise adds, after zero
    padding to a power of two: the order never depends on the batch, the threads, or how
    many zeros pad the row."""
    x = x.movedim(dim, -1)
    n = x.shape[-1]
    width = 1 << max(n - 1, 0).bit_length()
    if width != n:
        x = F.pad(x, (0, width - n))
    while x.shape[-1] > 1:
        x = x[..., 0::2] + x[..., 1::2]
    return x[..., 0]


def layer_norm(x: torch.Tensor, norm: torch.nn.LayerNorm) -> torch.Tensor:
    """``norm(x)`` with tree-summed mean and variance (biased, as LayerNorm)."""
    d = x.shape[-1]
    centered = x - (tree_sum(x) / d)[..., None]
    var = tree_sum(centered * centered) / d
    return centered * torch.rsqrt(var + norm.eps)[..., None] * norm.weight + norm.bias


class KVCache:
    """Per-layer keys and values [B, heads, positions, head_dim] of the positions a
    decode has run so far; ``length`` positions (the next forward starts there)."""

    def __init__(self):
        self.keys: Dict[int, torch.Tensor] = {}
        self.values: Dict[int, torch.Tensor] = {}
        self.length = 0

    def extend(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        if layer in self.keys:
            k = torch.cat([self.keys[layer], k], 2)
            v = torch.cat([self.values[layer], v], 2)
        self.keys[layer], self.values[layer] = k, v
        return k, v


def attention(attn, x: torch.Tensor, cache: Optional[KVCache], layer: int) -> torch.Tensor:
    """``MLA.forward`` for the positions of ``x`` [B, T, d], which start at ``cache.length``
    (0 without a cache). Query t's scores, softmax and output are reduced over keys 0..t
    padded to a power of two: the same tree whether the keys come from a cache (decode)
    or are the full forward's row t with later keys masked to exactly 0."""
    b, t, d = x.shape
    h, dh = attn.h, attn.dh
    q = linear(linear(x, attn.q_a.weight), attn.q_b.weight).view(b, t, h, dh).transpose(1, 2)
    kv = linear(linear(x, attn.kv_a.weight), attn.kv_b.weight)
    k, v = kv.view(b, t, h, 2 * dh).transpose(1, 2).chunk(2, -1)
    start = 0
    if cache is not None:
        start = cache.length
        k, v = cache.extend(layer, k, v)
    n_keys = k.shape[2]
    scores = tree_sum((q * dh ** -0.5)[:, :, :, None, :] * k[:, :, None, :, :])  # [b,h,t,L]
    query_pos = torch.arange(start, start + t, device=x.device)
    visible = torch.arange(n_keys, device=x.device)[None, :] <= query_pos[:, None]  # [t, L]
    scores = scores.masked_fill(~visible, float("-inf"))
    e = torch.exp(scores - scores.amax(-1, keepdim=True))
    p = e / tree_sum(e)[..., None]
    weighted = torch.where(visible[..., None], p[..., None] * v[:, :, None, :, :], 0.0)
    y = tree_sum(weighted, dim=-2)                                               # [b,h,t,dh]
    return linear(y.transpose(1, 2).reshape(b, t, d), attn.o.weight)


def moe_route(logits: torch.Tensor, k: int, bias: torch.Tensor, n_group: int,
              topk_group: int):
    """``kernels.moe_route`` on fixed row tiles (its sigmoid has a scalar tail path)."""
    return by_row_tiles(lambda tile: kernels.moe_route(tile, k, bias, n_group, topk_group),
                        [logits], [logits.new_zeros(1, 1)])


def moe_route_replay(logits: torch.Tensor, k: int, bias: torch.Tensor, n_group: int,
                     topk_group: int, recorded: torch.Tensor):
    """``kernels.moe_route_replay`` on fixed row tiles (padding rows replay experts 0..k-1)."""
    fill = torch.arange(k, device=recorded.device, dtype=recorded.dtype)[None]
    return by_row_tiles(
        lambda tile, ids: kernels.moe_route_replay(tile, k, bias, n_group, topk_group, ids),
        [logits, recorded], [logits.new_zeros(1, 1), fill])


def experts(flat: torch.Tensor, up: torch.Tensor, down: torch.Tensor, ids: torch.Tensor,
            weights: torch.Tensor) -> torch.Tensor:
    """The MoE output of tokens ``flat`` [N, d]: every expert on tiles (up [E, d, f], down
    [E, f, d]), the picked ones' outputs weighted and tree-summed over the k picks."""
    d = flat.shape[1]
    y = torch.stack([matmul(matmul(flat, up[e]).relu(), down[e]) for e in range(up.shape[0])],
                    1)                                                           # [N, E, d]
    picked = y.gather(1, ids[..., None].expand(*ids.shape, d))                   # [N, k, d]
    return tree_sum(picked * weights[..., None].to(picked.dtype), dim=1)


def hidden(model, tokens: torch.Tensor, cache: Optional[KVCache]) -> torch.Tensor:
    """``TinyLM.hidden`` for ``tokens`` [B, T] at positions cache.length .. + T (0 .. T
    without a cache); the cache, if any, grows by T positions."""
    start = cache.length if cache is not None else 0
    positions = torch.arange(start, start + tokens.shape[1], device=tokens.device)
    x = model.emb(tokens) + model.pos(positions)
    for layer, (n1, attn, n2, moe) in enumerate(model.blocks):
        x = x + attention(attn, layer_norm(x, n1), cache, layer)
        x = x + moe(layer_norm(x, n2))          # MoE.forward takes its invariant path
    if cache is not None:
        cache.length += tokens.shape[1]
    return layer_norm(x, model.norm)


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """fp32 log p(token) [*S] from logits [*S, V]: ``glm_kernels.selective_logprobs`` under
    ``glm_kernels.batch_invariant()`` on fixed row tiles, on one thread (differentiable)."""
    flat = logits.reshape(-1, logits.shape[-1])
    ids = token_ids.reshape(-1)
    with glm_kernels.batch_invariant(), one_thread():
        lp = by_row_tiles(selective_logprobs, [flat, ids],
                          [flat.new_zeros(1, 1), ids.new_zeros(1)])
    return lp.reshape(token_ids.shape)
