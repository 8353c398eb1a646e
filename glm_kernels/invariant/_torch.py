"""The CPU path of whole-model batch-invariant attention and ``bmm``: fixed-size key splits as
fixed-shape matrix products (the torch counterpart of ``_kernels.attention``; ``bmm`` below
applies the same idea to eager attention's two products).

For queries whose visible keys are one range ``[lo, hi)`` (causal, left or right padding, a
KV cache), with S = ``KEY_SPLIT`` and R = ``QUERY_TILE``::

    split j of query i      keys lo_i + j*S ... lo_i + (j+1)*S - 1   (counted from lo_i)
    scores                  one bmm entry per (query tile, head, split): [R, D] @ [D, S]
    softmax sum, P @ V      per split a fixed tree over its S keys / one [R, S] @ [S, Dv]
                            bmm entry; then a fixed tree over the splits, in order

Why it is invariant: every product has the one shape [R, D] x [D, S] or [R, S] x [S, Dv], so
one kernel and one order over its K for every entry, whatever the batch and wherever the
query row sits in its tile (measured on x86 for 1 and 2 threads: tests/invariant). A query's
splits start at its own first visible key, so its keys sit at the same place of the same
split in a full forward, behind any padding, and in a KV-cache decode; keys past ``hi`` are
masked to probability exactly 0 and whole splits past them are exact zeros, which change no
tree sum. Queries are grouped by (batch row, lo) (usually one group per row, plus the padding
rows' own), each group cut into tiles of R rows, the last zero-padded.

The definition this must agree with within tolerance (not bitwise: another summation order)
is ``_reference.attention``; its memory is O(T * L * D), this path's O(T * L).
"""
from typing import Tuple

import torch

from .._row_invariant import tree_sum
from ._reference import NEG_INF, _accumulation_dtype, elementwise

KEY_SPLIT = 64           # keys per split: the K of every P @ V product
# Query rows per product. 16 made a decode step's attention ~5% cheaper and a forward's 10-30%
# dearer than 64 (CPU, NOTES.md): the forward keeps the larger tile.
QUERY_TILE = 64
TREE_SPAN = 16           # bmm rows with at most this many terms: a tree, not a product


def _query_tiles(lo: torch.Tensor, hi: torch.Tensor):
    """The visible queries grouped by (batch row, lo) and cut into tiles of QUERY_TILE rows:
    (batch index, query index, tile, row in tile) of each visible query, the tile count, and
    each tile's batch row and lo."""
    batch, t = lo.shape
    b_idx, q_idx = torch.nonzero(hi > lo, as_tuple=True)
    if b_idx.numel() == 0:
        return None
    key = b_idx * (int(lo.max()) + 1) + lo[b_idx, q_idx].long()
    groups, group_of = torch.unique(key, return_inverse=True)          # sorted, stable ids
    order = torch.argsort(group_of * t + q_idx)                        # by group, then query
    b_idx, q_idx, group_of = b_idx[order], q_idx[order], group_of[order]
    counts = torch.bincount(group_of, minlength=groups.numel())
    starts = torch.cumsum(counts, 0) - counts
    rank = torch.arange(group_of.numel(), device=lo.device) - starts[group_of]
    tiles_per_group = (counts + QUERY_TILE - 1) // QUERY_TILE
    first_tile = torch.cumsum(tiles_per_group, 0) - tiles_per_group
    tile = first_tile[group_of] + rank // QUERY_TILE
    n_tiles = int(tiles_per_group.sum())
    tile_group = torch.repeat_interleave(torch.arange(groups.numel(), device=lo.device),
                                         tiles_per_group)
    group_b = torch.zeros_like(groups)
    group_b[group_of] = b_idx
    group_lo = torch.zeros_like(groups)
    group_lo[group_of] = lo[b_idx, q_idx].long()
    return b_idx, q_idx, tile, rank % QUERY_TILE, n_tiles, group_b[tile_group], \
        group_lo[tile_group]


def _window(start: torch.Tensor, width: int, length: int):
    """Positions start[i] ... start[i] + width - 1 along a dim of ``length``, clamped into it
    (for gathering), and which of them are inside (the rest are read as zeros)."""
    pos = start[..., None] + torch.arange(width, device=start.device)
    inside = pos < length
    return pos.clamp(max=length - 1), inside


def _bmm_nt(a: torch.Tensor, b_rows: torch.Tensor) -> torch.Tensor:
    """a [E, R, K] @ b_rows[E, N, K]^T, the second operand passed transposed: with it in
    [K, N] layout, x86 BLAS runs N = 5-7 and 9-11 (a narrow value head) through a kernel
    whose order over K depends on the row's place in the tile (measured: tests/invariant)."""
    return torch.bmm(a, b_rows.contiguous().transpose(1, 2))


def _row_tiles(q: torch.Tensor, lo: torch.Tensor, span: torch.Tensor, acc):
    """The common case, every visible query of a batch row with one ``lo`` (causal with left
    or right padding, decode): each row's queries in order, cut into tiles (no gather)."""
    batch, heads, t, d = q.shape
    n_t = -(-t // QUERY_TILE)
    padded = torch.nn.functional.pad(q.to(acc), (0, 0, 0, n_t * QUERY_TILE - t))
    q_tiles = padded.view(batch, heads, n_t, QUERY_TILE, d).transpose(1, 2)
    row_span = torch.nn.functional.pad(span, (0, n_t * QUERY_TILE - t)).view(-1, QUERY_TILE)
    tile_b = torch.arange(batch, device=q.device).repeat_interleave(n_t)
    return q_tiles.reshape(-1, heads, QUERY_TILE, d), tile_b, lo.repeat_interleave(n_t), row_span


def _split_softmax(real: torch.Tensor, visible: torch.Tensor):
    """Scaled scores [..., W] (W whole splits) and which keys each sees (broadcastable):
    (probabilities, masked keys exactly 0; the row max shift [...]; the exponentials' sum
    [...], a tree over each split's keys then over the splits)."""
    real = real.masked_fill(~visible, NEG_INF)
    top = real.amax(-1, keepdim=True)
    shift = torch.where(top == NEG_INF, torch.zeros_like(top), top)
    e = elementwise(torch.exp, real - shift)                            # masked: exactly 0
    total = tree_sum(tree_sum(e.view(*e.shape[:-1], -1, KEY_SPLIT)))
    p = torch.where(total[..., None] > 0, e / total[..., None], torch.zeros_like(e))
    return p, shift[..., 0], total


def _logsumexp(shift: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
    """fp32; +inf for a query that sees no key (a backward's e^(s - lse) is then 0)."""
    return torch.where(total > 0, shift + elementwise(torch.log, total),
                       torch.full_like(total, float("inf"))).float()


def _core(q_tiles, tile_b, tile_lo, row_span, k, v, scale):
    """(out [n, H, R, Dv], logsumexp [n, H, R]) of query tiles [n, H, R, D] whose rows see
    keys tile_lo[n] ... tile_lo[n] + row_span[n, r] - 1 of batch row tile_b[n]."""
    n_tiles, heads, _, d = q_tiles.shape
    kv_heads, length, dv = k.shape[1], k.shape[2], v.shape[-1]
    n_splits = max(-(-int(row_span.max()) // KEY_SPLIT), 1)
    width = n_splits * KEY_SPLIT
    pos, inside = _window(tile_lo, width, length)                       # [n, W]

    def gather(x):                                                      # [n, H, W, *]
        rows = x[tile_b[:, None], :, pos].to(q_tiles.dtype)             # [n, W, Hk, *]
        rows = rows.masked_fill(~inside[..., None, None], 0.0).transpose(1, 2)
        return rows.repeat_interleave(heads // kv_heads, 1)

    k_tiles, v_tiles = gather(k), gather(v)
    # Scores: one [R, D] @ [D, S] product per (tile, head, split)
    a = q_tiles.unsqueeze(2).expand(n_tiles, heads, n_splits, QUERY_TILE, d)
    scores = _bmm_nt(a.reshape(-1, QUERY_TILE, d), k_tiles.reshape(-1, KEY_SPLIT, d))
    scores = scores.view(n_tiles, heads, n_splits, QUERY_TILE, KEY_SPLIT).transpose(2, 3)
    scores = scores.reshape(n_tiles, heads, QUERY_TILE, width)
    # The softmax on the tiles' real rows only (elementwise and trees: where a row sits does
    # not matter to them); a decode step's tile is one real row and 63 of padding.
    tile_i, row_i = torch.nonzero(row_span > 0, as_tuple=True)
    visible = torch.arange(width, device=k.device) < row_span[tile_i, row_i, None]
    p, shift, total = _split_softmax(scores[tile_i, :, row_i] * scale, visible[:, None])
    p_tiles = scores.new_zeros(n_tiles, heads, QUERY_TILE, width)
    p_tiles[tile_i, :, row_i] = p                                       # [N, H, W]
    # P @ V: one [R, S] @ [S, Dv] product per (tile, head, split), then a tree over splits
    p_splits = p_tiles.view(n_tiles, heads, QUERY_TILE, n_splits, KEY_SPLIT).transpose(2, 3)
    v_t = v_tiles.view(n_tiles, heads, n_splits, KEY_SPLIT, dv).transpose(-1, -2)
    partial = _bmm_nt(p_splits.reshape(-1, QUERY_TILE, KEY_SPLIT), v_t.reshape(-1, dv, KEY_SPLIT))
    partial = partial.view(n_tiles, heads, n_splits, QUERY_TILE, dv)[tile_i, :, :, row_i]
    out = q_tiles.new_zeros(n_tiles, heads, QUERY_TILE, dv)
    out[tile_i, :, row_i] = tree_sum(partial.transpose(-1, -2))         # [N, H, Dv]
    lse = torch.full((n_tiles, heads, QUERY_TILE), float("inf"), device=k.device)
    lse[tile_i, :, row_i] = _logsumexp(shift, total)
    return out, lse


def _one_tile(q, k, v, lo, span, scale, acc):
    """A decode step's attention: every batch row's t <= QUERY_TILE queries see the same keys
    [lo_b, lo_b + span_b) (span_b > 0), q and k with the same head count. ``_core``'s math,
    op for op on the same tile (so the same bits), without its scatter and gather of rows:
    (out [B, H, t, Dv] in acc, logsumexp [B, H, t] fp32)."""
    batch, heads, t, d = q.shape
    length, dv = k.shape[2], v.shape[-1]
    n_splits = max(-(-int(span.max()) // KEY_SPLIT), 1)
    width = n_splits * KEY_SPLIT
    pos, inside = _window(lo, width, length)                              # [B, W]

    def window(x):                                                        # [B, H, W, *]
        rows = x.gather(2, pos[:, None, :, None].expand(batch, heads, width, x.shape[-1]))
        return rows.to(acc).masked_fill(~inside[:, None, :, None], 0.0)

    k_w, v_w = window(k), window(v)
    q_tile = torch.nn.functional.pad(q.to(acc), (0, 0, 0, QUERY_TILE - t))
    a = q_tile.unsqueeze(2).expand(batch, heads, n_splits, QUERY_TILE, d)
    scores = _bmm_nt(a.reshape(-1, QUERY_TILE, d), k_w.reshape(-1, KEY_SPLIT, d))
    scores = scores.view(batch, heads, n_splits, QUERY_TILE, KEY_SPLIT)[:, :, :, :t]
    visible = torch.arange(width, device=k.device) < span[:, None]        # [B, W]
    p, shift, total = _split_softmax(
        scores.transpose(2, 3).reshape(batch, heads, t, width) * scale, visible[:, None, None])
    p_tile = torch.nn.functional.pad(p, (0, 0, 0, QUERY_TILE - t))
    p_splits = p_tile.view(batch, heads, QUERY_TILE, n_splits, KEY_SPLIT).transpose(2, 3)
    v_t = v_w.view(batch, heads, n_splits, KEY_SPLIT, dv).transpose(-1, -2)
    partial = _bmm_nt(p_splits.reshape(-1, QUERY_TILE, KEY_SPLIT), v_t.reshape(-1, dv, KEY_SPLIT))
    partial = partial.view(batch, heads, n_splits, QUERY_TILE, dv)[:, :, :, :t]
    out = tree_sum(partial.permute(0, 1, 3, 4, 2))                        # [B, H, t, Dv]
    return out, _logsumexp(shift, total)


def _repeated_heads(k: torch.Tensor, v: torch.Tensor) -> int:
    """G when every run of G key and value heads holds bitwise equal copies (transformers
    repeats grouped heads before sdpa when it passes a mask), else 1."""
    heads, group = k.shape[1], 1
    while group < heads and torch.equal(k[:, group], k[:, 0]) and torch.equal(v[:, group],
                                                                              v[:, 0]):
        group += 1
    if group == 1 or heads % group:
        return 1
    for x in (k, v):
        runs = x.unflatten(1, (heads // group, group))
        if not torch.equal(runs, runs[:, :, :1].expand_as(runs)):
            return 1
    return group


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lo: torch.Tensor,
              hi: torch.Tensor, scale: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """q [B, H, T, D], k [B, Hk, L, D], v [B, Hk, L, Dv] (Hk divides H), lo / hi int [B, T]:
    query t of row b sees keys [lo, hi). Returns (out [B, H, T, Dv] in q's dtype, logsumexp
    [B, H, T] fp32; +inf and out 0 for a query that sees no key)."""
    batch, heads, t, _ = q.shape
    repeats = _repeated_heads(k, v) if heads == k.shape[1] > 1 else 1
    if repeats > 1:                    # transformers' repeat_kv: pack the group (below)
        k, v = k[:, ::repeats], v[:, ::repeats]
    kv_heads = k.shape[1]
    if heads == kv_heads:
        return _attention(q, k, v, lo, hi, scale)
    # A group's query heads read the same keys: their rows share tiles ((head, query) in
    # order), so a decode step's G rows fill one tile instead of G tiles of one row each. A
    # row's bits do not depend on its place in the tile or on the other rows.
    group = heads // kv_heads
    out, lse = _attention(q.reshape(batch, kv_heads, group * t, q.shape[-1]), k, v,
                          lo.repeat(1, group), hi.repeat(1, group), scale)
    return out.reshape(batch, heads, t, -1), lse.reshape(batch, heads, t)


def _attention(q, k, v, lo, hi, scale):
    """``attention`` with as many query heads as key heads."""
    batch, heads, t, _ = q.shape
    acc = _accumulation_dtype(q.dtype)
    lo, span = lo.long(), (hi - lo).long().clamp(min=0)
    seen = span > 0
    if not bool(seen.any()):
        return (q.new_zeros(batch, heads, t, v.shape[-1]),
                torch.full((batch, heads, t), float("inf"), device=q.device))
    if t <= QUERY_TILE and bool((seen & (lo == lo[:, :1]) & (span == span[:, :1])).all()):
        out, lse = _one_tile(q, k, v, lo[:, 0], span[:, 0], scale, acc)
        return out.to(q.dtype), lse
    row_lo = torch.where(seen, lo, lo.amax()).amin(1)   # a row that sees nothing: any lo
    if bool(((lo == row_lo[:, None]) | ~seen).all()):
        q_tiles, tile_b, tile_lo, row_span = _row_tiles(q, row_lo, span, acc)
        out, lse = _core(q_tiles, tile_b, tile_lo, row_span, k, v, scale)
        n_t = q_tiles.shape[0] // batch
        out = out.view(batch, n_t, heads, QUERY_TILE, -1).transpose(1, 2).reshape(
            batch, heads, n_t * QUERY_TILE, -1)[:, :, :t]
        lse = lse.view(batch, n_t, heads, QUERY_TILE).transpose(1, 2).reshape(
            batch, heads, -1)[:, :, :t]
        return out.to(q.dtype), lse.contiguous()
    # Rows whose queries start at different keys (e.g. padding queries that see every key):
    # queries grouped by (row, lo), each group in tiles of its own.
    b_idx, q_idx, tile, row, n_tiles, tile_b, tile_lo = _query_tiles(lo, lo + span)
    q_tiles = q.new_zeros(n_tiles, heads, QUERY_TILE, q.shape[-1], dtype=acc)
    q_tiles[tile, :, row] = q[b_idx, :, q_idx].to(acc)
    row_span = torch.zeros(n_tiles, QUERY_TILE, dtype=torch.long, device=q.device)
    row_span[tile, row] = span[b_idx, q_idx]
    tile_out, tile_lse = _core(q_tiles, tile_b, tile_lo, row_span, k, v, scale)
    out = torch.zeros(batch, heads, t, v.shape[-1], dtype=acc, device=q.device)
    lse = torch.full((batch, heads, t), float("inf"), dtype=torch.float32, device=q.device)
    out[b_idx, :, q_idx] = tile_out[tile, :, row]
    lse[b_idx, :, q_idx] = tile_lse[tile, :, row]
    return out.to(q.dtype), lse


def bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [E, M, K] @ b [E, K, N] (eager attention's QK^T and P.V, the DSA indexer's products)
    with each row's sum over K cut into splits of ``KEY_SPLIT`` counted from the row's first
    non-zero entry of ``a``: per split one [R, S] x [S, 64] product (N in chunks of 64), then a
    fixed tree over the splits. A masked key is a zero probability, so a row's bits depend
    only on its non-zero pattern counted from its first non-zero (a decode step's keys, the
    same keys behind padding or before masked future keys). Rows of zeros give zeros.

    A row whose non-zeros span at most ``TREE_SPAN`` entries (the DSA indexer's sum over its
    few heads, a query's first keys, QK^T over a head dim of 16) is a fixed tree over the
    products of its window of ``TREE_SPAN`` entries from its first non-zero instead, each in
    its place (zeros inside the window included): a 64-wide product for 2 terms costs 30x the
    rest of a tiny model. The span is the row's own (the
    same in a decode step and a full forward), so each row always takes the same path."""
    acc = _accumulation_dtype(a.dtype)
    entries, m, k = a.shape
    n = b.shape[-1]
    out = torch.zeros(entries, m, n, dtype=acc, device=a.device)
    # Contiguous rows first: argmax along a strided K (the DSA indexer's transposed head
    # weights) took 5x the rest of the call.
    a = a.contiguous()
    nonzero = a != 0
    first = nonzero.int().argmax(-1)
    last = k - nonzero.flip(-1).int().argmax(-1)
    span = torch.where(nonzero.any(-1), last - first, torch.zeros_like(first))
    short = (span > 0) & (span <= TREE_SPAN)
    # A short row's window: ``w`` entries from its first non-zero, each product in its place
    # (zeros inside the window included), summed by a tree over the window. Every zero product
    # is made +0 first (a zero of ``a`` times a masked key's value, 0 * -x, is -0; IEEE: -0 +
    # 0 is +0, every other value unchanged): with no -0 among the terms, trailing zeros change
    # no tree, so a decode step's narrower K (a smaller ``w``) gives the full forward's bits.
    w = min(TREE_SPAN, k)
    at_start = short & (first == 0)
    if bool(at_start.any()):
        # Rows whose window is K's first entries (QK^T over the head dim, the DSA indexer's
        # head sum): the window products by broadcasting instead of a gather.
        products = a[..., :w, None].to(acc) * b[:, None, :w].to(acc)              # [E, M, w, N]
        out = torch.where(at_start[..., None], tree_sum(products + 0.0, dim=-2), out)
    elsewhere = short & ~at_start
    if bool(elsewhere.any()):
        e_s, m_s = torch.nonzero(elsewhere, as_tuple=True)
        window, inside = _window(first[e_s, m_s], w, k)
        a_w = a[e_s[:, None], m_s[:, None], window].to(acc).masked_fill(~inside, 0.0)
        products = a_w[..., None] * b[e_s[:, None], window].to(acc)      # [rows, w, N]
        out[e_s, m_s] = tree_sum(products + 0.0, dim=-2)
    span = torch.where(short, torch.zeros_like(span), span)
    tiles = _query_tiles(first, first + span)
    if tiles is None or n == 0:
        return out.to(a.dtype)
    e_idx, m_idx, tile, row, n_tiles, tile_e, tile_lo = tiles
    n_splits = -(-int(span.max()) // KEY_SPLIT)
    width, n_chunks = n_splits * KEY_SPLIT, -(-n // KEY_SPLIT)
    pos, inside = _window(tile_lo, width, k)                              # [n, W]
    a_rows = a[e_idx[:, None], m_idx[:, None], pos[tile]].to(acc)        # [rows, W]
    a_tiles = a.new_zeros(n_tiles, QUERY_TILE, width, dtype=acc)
    a_tiles[tile, row] = a_rows.masked_fill(~inside[tile], 0.0)
    b_rows = b[tile_e[:, None], pos].to(acc).masked_fill(~inside[..., None], 0.0)  # [n, W, N]
    b_rows = torch.nn.functional.pad(b_rows, (0, n_chunks * KEY_SPLIT - n))
    # [n, splits, chunks, 64 (N), S (K)]: the second operand of each product, row-major
    b_t = b_rows.view(n_tiles, n_splits, KEY_SPLIT, n_chunks, KEY_SPLIT).permute(0, 1, 3, 4, 2)
    a_s = a_tiles.view(n_tiles, QUERY_TILE, n_splits, KEY_SPLIT).transpose(1, 2).unsqueeze(2) \
        .expand(n_tiles, n_splits, n_chunks, QUERY_TILE, KEY_SPLIT)
    partial = _bmm_nt(a_s.reshape(-1, QUERY_TILE, KEY_SPLIT), b_t.reshape(-1, KEY_SPLIT, KEY_SPLIT))
    partial = partial.view(n_tiles, n_splits, n_chunks, QUERY_TILE, KEY_SPLIT)
    rows = partial[tile, :, :, row]                                      # [rows, splits, chunks, 64]
    summed = tree_sum(rows.permute(0, 2, 3, 1)).reshape(rows.shape[0], -1)[:, :n]
    out[e_idx, m_idx] = summed
    return out.to(a.dtype)
