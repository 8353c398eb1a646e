"""Triton kernels of the top-p nucleus (``_nucleus.py`` has the math). No validation here.

One program per row walks that row's CSR slice of kept ids in tiles of BLOCK_K, gathering
their logits (the only reads of the [N, V] logits: K of them, plus the target). Rows hold the
vocab columns [vocab_start, vocab_start + V) (the whole vocabulary or one TP shard); ids held
by another shard count as -inf here and are folded in by the all-reduces.
"""
from __future__ import annotations

import triton
import triton.language as tl

from ..._aot import AotSpec
from .._common.tiles import lse_tile, safe_max


@triton.jit
def _kept_tile(base, keep_ptr, k, hi, tid, vocab_start, V, inv_temp,
               BLOCK_K: tl.constexpr):
    """(positions, inside, owned, z, target hit) of one tile of a row's kept ids."""
    kk = k + tl.arange(0, BLOCK_K)
    inside = kk < hi
    kid = tl.load(keep_ptr + kk, mask=inside, other=-1).to(tl.int64)
    local = kid - vocab_start
    owned = inside & (local >= 0) & (local < V)
    z = tl.load(base + local, mask=owned, other=float("-inf")).to(tl.float32) * inv_temp
    return kk, inside, owned, z, inside & (kid == tid), local


@triton.jit
def _target(base, tid, vocab_start, V, inv_temp):
    local = tid - vocab_start
    owned = (local >= 0) & (local < V)
    z_t = tl.load(base + local, mask=owned, other=0.0).to(tl.float32) * inv_temp
    return z_t, owned, local


@triton.jit
def _nucleus_stats_kernel(
    logits_ptr, ids_ptr, keep_ptr, offsets_ptr,   # [N, V] (row stride), [N], [K], [N + 1]
    out_ptr,                                      # [N, 3] fp32: (m, s, z_t)
    V, vocab_start, stride_row, inv_temp,
    BLOCK_K: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride_row
    lo = tl.load(offsets_ptr + row).to(tl.int64)
    hi = tl.load(offsets_ptr + row + 1).to(tl.int64)
    tid = tl.load(ids_ptr + row).to(tl.int64)
    m = tl.full([], float("-inf"), tl.float32)
    s = tl.zeros([], tl.float32)
    hit = tl.zeros([], tl.int32)
    for k in range(lo, hi, BLOCK_K):
        _, _, _, z, is_t, _ = _kept_tile(base, keep_ptr, k, hi, tid, vocab_start, V,
                                         inv_temp, BLOCK_K)
        m, s = lse_tile(m, s, z)
        hit = tl.maximum(hit, tl.max(is_t.to(tl.int32), axis=0))
    z_t, owned_t, _ = _target(base, tid, vocab_start, V, inv_temp)
    # The target counts beside the kept ids when it is not among them (slime keeps it).
    extra = owned_t & (hi > lo) & (hit == 0)
    m_new = tl.where(extra, tl.maximum(m, z_t), m)
    shift = safe_max(m_new)
    s = tl.where(extra, s * tl.exp(m - shift) + tl.exp(z_t - shift), s)
    out = out_ptr + row * 3
    tl.store(out + 0, m_new)
    tl.store(out + 1, s)
    tl.store(out + 2, tl.where(owned_t, z_t, 0.0))


@triton.jit
def _nucleus_grad_terms_kernel(
    logits_ptr, ids_ptr, keep_ptr, offsets_ptr, lse_keep_ptr, coef_ptr,
    index_ptr, value_ptr,                         # [K + N] int64 / fp32
    V, vocab_start, stride_row, inv_temp, K,
    BLOCK_K: tl.constexpr,
):
    """value = c (onehot(t) - e^(z - lse_K)) at each kept id, then c (1 - q_t) at the target
    when it is not among them; 0 where c = 0 or another shard holds the column."""
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride_row
    lo = tl.load(offsets_ptr + row).to(tl.int64)
    hi = tl.load(offsets_ptr + row + 1).to(tl.int64)
    tid = tl.load(ids_ptr + row).to(tl.int64)
    c = tl.load(coef_ptr + row).to(tl.float32) * inv_temp
    lse_k = tl.load(lse_keep_ptr + row)
    hit = tl.zeros([], tl.int32)
    for k in range(lo, hi, BLOCK_K):
        kk, inside, owned, z, is_t, local = _kept_tile(base, keep_ptr, k, hi, tid, vocab_start,
                                                       V, inv_temp, BLOCK_K)
        hit = tl.maximum(hit, tl.max(is_t.to(tl.int32), axis=0))
        vals = c * (is_t.to(tl.float32) - tl.exp(z - lse_k))
        vals = tl.where(owned, vals, 0.0)
        vals = tl.where(c != 0.0, vals, 0.0)     # exactly 0, even for NaN logits
        col = tl.minimum(tl.maximum(local, 0), V - 1)
        tl.store(index_ptr + kk, row * V + col, mask=inside)
        tl.store(value_ptr + kk, vals, mask=inside)
    z_t, owned_t, local_t = _target(base, tid, vocab_start, V, inv_temp)
    extra = owned_t & (hi > lo) & (hit == 0) & (c != 0.0)
    t_val = tl.where(extra, c * (1.0 - tl.exp(z_t - lse_k)), 0.0)
    col_t = tl.minimum(tl.maximum(local_t, 0), V - 1)
    tl.store(index_ptr + K + row, row * V + col_t)
    tl.store(value_ptr + K + row, t_val)


def nucleus_stats(logits, ids, keep, offsets, out, *, inv_temp, vocab_start, block_k,
                  num_warps):
    n, v = logits.shape
    if n:
        _nucleus_stats_kernel[(n,)](logits, ids, keep, offsets, out, v, vocab_start,
                                    logits.stride(0), inv_temp, BLOCK_K=block_k,
                                    num_warps=num_warps)


def nucleus_grad_terms(logits, ids, keep, offsets, lse_keep, coef, index, value, *, inv_temp,
                       vocab_start, block_k, num_warps):
    n, v = logits.shape
    if n:
        _nucleus_grad_terms_kernel[(n,)](logits, ids, keep, offsets, lse_keep, coef, index,
                                         value, v, vocab_start, logits.stride(0), inv_temp,
                                         keep.numel(), BLOCK_K=block_k, num_warps=num_warps)


def _aot_specs():
    specs = []
    for dt in ("bf16", "fp32"):
        common = {"logits_ptr": f"*{dt}", "ids_ptr": "*i64", "keep_ptr": "*i64",
                  "offsets_ptr": "*i64"}
        specs.append(AotSpec(f"nucleus_stats[{dt}]", _nucleus_stats_kernel, dict(
            common, out_ptr="*fp32", V="i32", vocab_start="i32", stride_row="i64",
            inv_temp="fp32", BLOCK_K="constexpr"), {"BLOCK_K": 128}, num_warps=4))
        specs.append(AotSpec(f"nucleus_grad_terms[{dt}]", _nucleus_grad_terms_kernel, dict(
            common, lse_keep_ptr="*fp32", coef_ptr="*fp32", index_ptr="*i64",
            value_ptr="*fp32", V="i32", vocab_start="i32", stride_row="i64", inv_temp="fp32",
            K="i64", BLOCK_K="constexpr"), {"BLOCK_K": 128}, num_warps=4))
    return specs


AOT_SPECS = _aot_specs()
