"""Triton kernels of the whole-model batch-invariant override (the GPU path of
``glm_kernels.invariant``; the interpreter runs them on CPU in tests).

* ``_persistent_matmul_kernel``: C = A B on one fixed tile shape (BLOCK_M x BLOCK_N, K in
  BLOCK_K steps in ascending order, fp32 accumulation), a persistent grid walking the tiles
  row-major. Nothing depends on M: no split-K, no configuration chosen by shape, so a row's
  bits are the same alone (M = 1 decode), in any batch, at any tile position.
* ``_split_kv_attention_kernel`` + ``_combine_splits_kernel``: attention for one query per
  program row, its visible keys [lo, hi) cut into splits of SPLIT keys *counted from lo*,
  each split an online softmax over BLOCK_N-key blocks, the splits merged in order. A query's
  keys sit at other indices in a KV-cache decode, a causal full forward and a left-padded
  batch, but always at the same offsets from lo: the same blocks, the same bits.

UPCAST (interpreter with bf16 operands) feeds ``tl.dot`` fp32 copies: the interpreter's
``tl.dot`` cannot multiply bf16, and the bf16 values are exact in fp32.
"""
from __future__ import annotations

import triton
import triton.language as tl

import torch

from .._aot import AotSpec

_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


@triton.jit
def _persistent_matmul_kernel(a_ptr, b_ptr, c_ptr, M, N, K, num_programs,
                              stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
                              DOT_DTYPE: tl.constexpr, UPCAST: tl.constexpr,
                              INPUT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
                              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """C[M, N] = A[M, K] @ B[K, N]: tiles pid, pid + num_programs, ... in row-major order."""
    pid = tl.program_id(0)
    tiles_n = tl.cdiv(N, BLOCK_N)
    num_tiles = tl.cdiv(M, BLOCK_M) * tiles_n
    for tile in range(pid, num_tiles, num_programs):
        rows = (tile // tiles_n) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = (tile % tiles_n) * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            a = tl.load(a_ptr + rows[:, None] * stride_am + ks[None, :] * stride_ak,
                        mask=(rows[:, None] < M) & (ks[None, :] < K), other=0.0)
            b = tl.load(b_ptr + ks[:, None] * stride_bk + cols[None, :] * stride_bn,
                        mask=(ks[:, None] < K) & (cols[None, :] < N), other=0.0)
            if UPCAST:
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            else:
                a = a.to(DOT_DTYPE)
                b = b.to(DOT_DTYPE)
            acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
        tl.store(c_ptr + rows[:, None] * stride_cm + cols[None, :] * stride_cn,
                 acc.to(c_ptr.dtype.element_ty), mask=(rows[:, None] < M) & (cols[None, :] < N))


@triton.jit
def _split_kv_attention_kernel(q_ptr, k_ptr, v_ptr, lo_ptr, hi_ptr, part_ptr,
                               T, H, KV_GROUP, D, DV, max_splits, scale,
                               stride_qb, stride_qh, stride_qt,
                               stride_kb, stride_kh, stride_kl,
                               stride_vb, stride_vh, stride_vl,
                               SPLIT: tl.constexpr, BLOCK_N: tl.constexpr,
                               BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr):
    """Split ``program_id(1)`` of query ``program_id(0)`` (over B*H*T): its running max m,
    exp-sum l and weighted values acc [DV] -> part[row, split, :] = (m, l, acc)."""
    row = tl.program_id(0)
    split = tl.program_id(1)
    t = row % T
    h = (row // T) % H
    b = row // (T * H)
    kv_h = h // KV_GROUP
    lo = tl.load(lo_ptr + b * T + t)
    hi = tl.load(hi_ptr + b * T + t)
    start = lo + split * SPLIT
    dims = tl.arange(0, BLOCK_D)
    vdims = tl.arange(0, BLOCK_DV)
    q = tl.load(q_ptr + b * stride_qb + h * stride_qh + t * stride_qt + dims,
                mask=dims < D, other=0.0).to(tl.float32)
    m = tl.max(tl.full((BLOCK_N,), float("-inf"), tl.float32), axis=0)
    l_sum = tl.sum(tl.zeros((BLOCK_N,), tl.float32), axis=0)
    acc = tl.zeros((BLOCK_DV,), tl.float32)
    for n0 in range(0, SPLIT, BLOCK_N):
        keys = start + n0 + tl.arange(0, BLOCK_N)
        valid = keys < hi
        k = tl.load(k_ptr + b * stride_kb + kv_h * stride_kh + keys[:, None] * stride_kl
                    + dims[None, :], mask=valid[:, None] & (dims[None, :] < D), other=0.0)
        scores = tl.sum(k.to(tl.float32) * q[None, :], axis=1) * scale
        scores = tl.where(valid, scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=0))
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(scores - shift)
        rescale = tl.exp(m - shift)
        v = tl.load(v_ptr + b * stride_vb + kv_h * stride_vh + keys[:, None] * stride_vl
                    + vdims[None, :], mask=valid[:, None] & (vdims[None, :] < DV), other=0.0)
        l_sum = l_sum * rescale + tl.sum(p, axis=0)
        acc = acc * rescale + tl.sum(p[:, None] * v.to(tl.float32), axis=0)
        m = m_new
    base = part_ptr + (row * max_splits + split) * (BLOCK_DV + 2)
    tl.store(base, m)
    tl.store(base + 1, l_sum)
    tl.store(base + 2 + vdims, acc)


@triton.jit
def _combine_splits_kernel(part_ptr, lo_ptr, hi_ptr, out_ptr, lse_ptr, T, H, DV, max_splits,
                           stride_ob, stride_oh, stride_ot,
                           SPLIT: tl.constexpr, BLOCK_DV: tl.constexpr):
    """Merge query ``program_id(0)``'s non-empty splits in order: out = acc / l,
    lse = m + log l (a query with no visible key: out 0, lse +inf, so a backward's
    e^(score - lse) is 0)."""
    row = tl.program_id(0)
    t = row % T
    h = (row // T) % H
    b = row // (T * H)
    lo = tl.load(lo_ptr + b * T + t)
    hi = tl.load(hi_ptr + b * T + t)
    n_splits = tl.cdiv(tl.maximum(hi - lo, 0), SPLIT)
    vdims = tl.arange(0, BLOCK_DV)
    m = tl.max(tl.full((BLOCK_DV,), float("-inf"), tl.float32), axis=0)
    l_sum = tl.sum(tl.zeros((BLOCK_DV,), tl.float32), axis=0)
    acc = tl.zeros((BLOCK_DV,), tl.float32)
    for s in range(0, n_splits):
        base = part_ptr + (row * max_splits + s) * (BLOCK_DV + 2)
        m_s = tl.load(base)
        l_s = tl.load(base + 1)
        acc_s = tl.load(base + 2 + vdims)
        m_new = tl.maximum(m, m_s)
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        a_old = tl.exp(m - shift)
        a_new = tl.exp(m_s - shift)
        l_sum = l_sum * a_old + l_s * a_new
        acc = acc * a_old + acc_s * a_new
        m = m_new
    safe = tl.where(l_sum > 0, l_sum, 1.0)
    out = tl.where(l_sum > 0, acc / safe, 0.0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + t * stride_ot + vdims,
             out.to(out_ptr.dtype.element_ty), mask=vdims < DV)
    tl.store(lse_ptr + row, tl.where(l_sum > 0, m + tl.log(safe), float("inf")))


# ----------------------------------------------------------------------------- launchers
# BLOCK_M, BLOCK_N, BLOCK_K, warps and stages per operand dtype: one shape for every call of
# a dtype (fp32 "ieee" products run on FMA units, not tensor cores: smaller tiles, no
# software pipelining, or it spills).
MATMUL_CONFIGS = {"bf16": (128, 128, 32, 8, 3), "fp16": (128, 128, 32, 8, 3),
                  "fp32": (64, 64, 32, 4, 1)}
ATTENTION_SPLIT = 64                  # keys per split, counted from a query's first key
ATTENTION_BLOCK_N = 16


def _dot_dtype(dtype, interpret: bool):
    table = {"bf16": tl.bfloat16, "fp16": tl.float16, "fp32": tl.float32}
    return table[_DTYPE_NAMES[dtype]], bool(interpret and _DTYPE_NAMES[dtype] == "bf16")


def matmul(a, b, out, *, num_programs: int, interpret: bool) -> None:
    """out [M, N] = a [M, K] @ b [K, N] (any strides) on the persistent grid."""
    m, k = a.shape
    n = b.shape[1]
    block_m, block_n, block_k, warps, stages = MATMUL_CONFIGS[_DTYPE_NAMES[a.dtype]]
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    programs = max(1, min(tiles, num_programs))
    dot_dtype, upcast = _dot_dtype(a.dtype, interpret)
    _persistent_matmul_kernel[(programs,)](
        a, b, out, m, n, k, programs, a.stride(0), a.stride(1), b.stride(0), b.stride(1),
        out.stride(0), out.stride(1), DOT_DTYPE=dot_dtype, UPCAST=upcast,
        INPUT_PRECISION="ieee", BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=warps, num_stages=stages)


def attention(q, k, v, lo, hi, out, lse, scale: float) -> None:
    """out [B, H, T, DV], lse [B, H, T] fp32 from q [B, H, T, D], k [B, Hk, L, D],
    v [B, Hk, L, DV] (last dims contiguous), each query's visible keys [lo, hi) ([B, T] int32)."""
    batch, heads, t, d = q.shape
    dv = v.shape[-1]
    length = k.shape[2]
    block_d, block_dv = triton.next_power_of_2(d), triton.next_power_of_2(dv)
    max_splits = max(1, triton.cdiv(length, ATTENTION_SPLIT))
    rows = batch * heads * t
    part = torch.empty(rows * max_splits * (block_dv + 2), device=q.device, dtype=torch.float32)
    if rows == 0:
        return
    _split_kv_attention_kernel[(rows, max_splits)](
        q, k, v, lo, hi, part, t, heads, heads // k.shape[1], d, dv, max_splits, scale,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), SPLIT=ATTENTION_SPLIT,
        BLOCK_N=ATTENTION_BLOCK_N, BLOCK_D=block_d, BLOCK_DV=block_dv, num_warps=2)
    _combine_splits_kernel[(rows,)](
        part, lo, hi, out, lse, t, heads, dv, max_splits, out.stride(0), out.stride(1),
        out.stride(2), SPLIT=ATTENTION_SPLIT, BLOCK_DV=block_dv, num_warps=1)


def _invariant_aot_specs():
    """Every configuration the GPU path launches."""
    specs = []
    ints = ("M", "N", "K", "num_programs", "stride_am", "stride_ak", "stride_bk", "stride_bn",
            "stride_cm", "stride_cn")
    for name, dtype, precision in (("bf16", tl.bfloat16, "ieee"), ("fp16", tl.float16, "ieee"),
                                   ("fp32", tl.float32, "ieee")):
        block_m, block_n, block_k, warps, stages = MATMUL_CONFIGS[name]
        sig = {"a_ptr": f"*{name}", "b_ptr": f"*{name}", "c_ptr": f"*{name}"}
        sig.update({i: "i32" for i in ints})
        const = dict(DOT_DTYPE=dtype, UPCAST=False, INPUT_PRECISION=precision, BLOCK_M=block_m,
                     BLOCK_N=block_n, BLOCK_K=block_k)
        sig.update({c: "constexpr" for c in const})
        # fp32 "ieee" products run on FMA units (tensor cores would round to tf32).
        specs.append(AotSpec(f"invariant_matmul[{name},{block_m}x{block_n}x{block_k}]",
                             _persistent_matmul_kernel, sig, const, num_warps=warps,
                             num_stages=stages, expects_hgmma=name != "fp32"))
    for name in ("bf16", "fp32"):
        for head_dim in (64, 128, 256):
            sig = {"q_ptr": f"*{name}", "k_ptr": f"*{name}", "v_ptr": f"*{name}",
                   "lo_ptr": "*i32", "hi_ptr": "*i32", "part_ptr": "*fp32"}
            sig.update({i: "i32" for i in ("T", "H", "KV_GROUP", "D", "DV", "max_splits")})
            sig["scale"] = "fp32"
            sig.update({f"stride_{x}{y}": "i32" for x in "qkv" for y in ("b", "h", "t" if
                                                                         x == "q" else "l")})
            const = dict(SPLIT=ATTENTION_SPLIT, BLOCK_N=ATTENTION_BLOCK_N, BLOCK_D=head_dim,
                         BLOCK_DV=head_dim)
            sig.update({c: "constexpr" for c in const})
            specs.append(AotSpec(f"invariant_split_kv[{name},d={head_dim}]",
                                 _split_kv_attention_kernel, sig, const, num_warps=2,
                                 num_stages=1))
        sig = {"part_ptr": "*fp32", "lo_ptr": "*i32", "hi_ptr": "*i32", "out_ptr": f"*{name}",
               "lse_ptr": "*fp32"}
        sig.update({i: "i32" for i in ("T", "H", "DV", "max_splits", "stride_ob", "stride_oh",
                                       "stride_ot")})
        const = dict(SPLIT=ATTENTION_SPLIT, BLOCK_DV=256)
        sig.update({c: "constexpr" for c in const})
        specs.append(AotSpec(f"invariant_combine_splits[{name}]", _combine_splits_kernel, sig,
                             const, num_warps=1, num_stages=1))
    return specs


AOT_SPECS = _invariant_aot_specs()
