"""Triton kernels for log-probs, entropy and IcePop from logits. No validation here.

Callers pass [N, V_local] rows with unit column stride, where this tensor holds the vocab
columns [vocab_start, vocab_start + V_local) of a vocabulary of size vocab_total (the whole
vocabulary, or one Megatron vocab-parallel shard). Every kernel computes in fp32 on
z = logits * inv_temp.

Online log-sum-exp (one sweep): per vocab tile, m' = max(m, max z), s' = s e^(m - m') +
sum e^(z - m'): one exp per element (a per-lane running max would need two, and the exp unit,
not memory, would then bound the sweep on H100/H200). Entropy carries
t = sum e^(z - m) (z - m) alongside; t' = e^(m - m') (t + (m - m') s) + sum e^(z-m')(z-m'),
so H = log s - t / s never subtracts two large numbers.
"""
from __future__ import annotations

import triton
import triton.language as tl

from ..._aot import AotSpec
from .._common.tiles import lse_entropy_tile, lse_tile, softmax_grad_tile, target_logit

NEG_INF = float("-inf")


@triton.jit
def _logprob_stats_kernel(
    # inputs [N, V] (row stride), [N]
    logits_ptr, ids_ptr,
    # outputs: final lp/lse/entropy [N] each, or partial stats [N, 4]; out-of-range flag [1]
    lp_ptr, lse_ptr, ent_ptr, partial_ptr, flag_ptr,
    # shapes and runtime floats
    V, vocab_start, vocab_total, stride_row, inv_temp,
    ENTROPY: tl.constexpr, PARTIAL: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """One row per program. Final: lp = z_t - lse, lse, H. Partial (a vocab shard, combined
    by all-reduces afterwards): (m, s, t, z_t or 0 when another shard owns the target)."""
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride_row
    m = tl.full([], float("-inf"), tl.float32)
    s = tl.zeros([], tl.float32)
    t = tl.zeros([], tl.float32)
    for start in range(0, V, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        z = tl.load(base + cols, mask=cols < V, other=float("-inf")).to(tl.float32) * inv_temp
        if ENTROPY:
            m, s, t = lse_entropy_tile(m, s, t, z)
        else:
            m, s = lse_tile(m, s, z)
    z_t, valid, owned = target_logit(base, tl.load(ids_ptr + row), vocab_start, V,
                                      vocab_total, flag_ptr, inv_temp)
    if PARTIAL:
        out = partial_ptr + row * 4
        tl.store(out + 0, m)
        tl.store(out + 1, s)
        tl.store(out + 2, t)
        tl.store(out + 3, z_t)
    else:
        lse = m + tl.log(s)
        tl.store(lse_ptr + row, lse)
        tl.store(lp_ptr + row, tl.where(valid, z_t - lse, float("nan")))
        if ENTROPY:
            tl.store(ent_ptr + row, tl.log(s) - t / s)


@triton.jit
def _logits_grad_kernel(
    # inputs: logits [N, V], ids [N], saved lse / entropy [N], upstream grads [N]
    logits_ptr, ids_ptr, lse_ptr, ent_ptr, coef_ptr, coef_ent_ptr,
    # output [N, V] (may alias logits_ptr: each tile is read before it is written)
    grad_ptr,
    V, vocab_start, stride_row, stride_grad, inv_temp,
    ENTROPY: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """Backward of selective log-probs (and entropy), softmax recomputed from the saved lse."""
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride_row
    out = grad_ptr + row * stride_grad
    lse = tl.load(lse_ptr + row)
    coef = tl.load(coef_ptr + row) * inv_temp
    tid_local = tl.load(ids_ptr + row) - vocab_start
    if ENTROPY:
        ent = tl.load(ent_ptr + row)
        coef_ent = tl.load(coef_ent_ptr + row) * inv_temp
    else:
        ent = 0.0
        coef_ent = 0.0
    for start in range(0, V, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        valid = cols < V
        z = tl.load(base + cols, mask=valid, other=float("-inf")).to(tl.float32) * inv_temp
        g = softmax_grad_tile(z, cols, tid_local, lse, coef, ent, coef_ent, ENTROPY)
        tl.store(out + cols, g.to(grad_ptr.dtype.element_ty), mask=valid)


# --------------------------------------------------------------------------- launchers
def logprob_final(logits, ids, flag, lp, lse, entropy, *, inv_temp, block_v, num_warps):
    """lp, lse and (when ``entropy`` is a tensor) the entropy of every row of a whole vocab."""
    n, v = logits.shape
    if n:
        _logprob_stats_kernel[(n,)](
            logits, ids, lp, lse, lse if entropy is None else entropy, lse, flag, v, 0, v,
            logits.stride(0), inv_temp, ENTROPY=entropy is not None, PARTIAL=False,
            BLOCK_V=block_v, num_warps=num_warps)


def logprob_partial(logits, ids, flag, partial, *, want_entropy, inv_temp, vocab_start,
                    vocab_total, block_v, num_warps):
    """[N, 4] statistics (m, s, t, z_t) of one vocab shard, combined across shards later."""
    n, v = logits.shape
    if n:
        _logprob_stats_kernel[(n,)](
            logits, ids, partial, partial, partial, partial, flag, v, vocab_start, vocab_total,
            logits.stride(0), inv_temp, ENTROPY=want_entropy, PARTIAL=True, BLOCK_V=block_v,
            num_warps=num_warps)


def logits_grad(logits, ids, lse, entropy, coef, coef_entropy, grad, *, inv_temp, vocab_start,
                block_v, num_warps):
    n, v = logits.shape
    if n == 0:
        return
    with_entropy = coef_entropy is not None
    _logits_grad_kernel[(n,)](
        logits, ids, lse, entropy if with_entropy else lse, coef,
        coef_entropy if with_entropy else coef, grad, v, vocab_start, logits.stride(0),
        grad.stride(0), inv_temp, ENTROPY=with_entropy, BLOCK_V=block_v, num_warps=num_warps)


# --------------------------------------------------------------------------- AOT configurations
# The GPU launch configurations of LogitsLaunchConfig (loss/_common/launch.py): streaming
# kernels use tile 4096 with 8 warps.
def _aot_specs():
    specs = []
    for dt in ("bf16", "fp32"):
        for partial, entropy in ((False, False), (False, True), (True, True)):
            sig = {"logits_ptr": f"*{dt}", "ids_ptr": "*i64", "lp_ptr": "*fp32",
                   "lse_ptr": "*fp32", "ent_ptr": "*fp32", "partial_ptr": "*fp32",
                   "flag_ptr": "*i32", "V": "i32", "vocab_start": "i32", "vocab_total": "i32",
                   "stride_row": "i64", "inv_temp": "fp32", "ENTROPY": "constexpr",
                   "PARTIAL": "constexpr", "BLOCK_V": "constexpr"}
            specs.append(AotSpec(f"logprob_stats[{dt},partial={partial},entropy={entropy}]",
                                 _logprob_stats_kernel, sig,
                                 {"ENTROPY": entropy, "PARTIAL": partial, "BLOCK_V": 4096},
                                 num_warps=8))
        for entropy in (False, True):
            sig = {"logits_ptr": f"*{dt}", "ids_ptr": "*i64", "lse_ptr": "*fp32",
                   "ent_ptr": "*fp32", "coef_ptr": "*fp32", "coef_ent_ptr": "*fp32",
                   "grad_ptr": f"*{dt}", "V": "i32", "vocab_start": "i32", "stride_row": "i64",
                   "stride_grad": "i64", "inv_temp": "fp32", "ENTROPY": "constexpr",
                   "BLOCK_V": "constexpr"}
            specs.append(AotSpec(f"logits_grad[{dt},entropy={entropy}]", _logits_grad_kernel,
                                 sig, {"ENTROPY": entropy, "BLOCK_V": 4096}, num_warps=8))
    return specs


AOT_SPECS = _aot_specs()
