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

from .._aot import AotSpec
from .._dispatch import triton_version
from ._kernels import icepop_token_math, is_finite

NEG_INF = float("-inf")


@triton.jit
def safe_max(m):
    """m, or 0 where m is -inf (a row or tile of only -inf): keeps e^(z - m) = 0, not NaN."""
    return tl.where(m == float("-inf"), 0.0, m)


@triton.jit
def lse_tile(m, s, z):
    """Fold one tile z into the running (max m, sum s of e^(z - m))."""
    m_new = tl.maximum(m, tl.max(z, axis=0))
    shift = safe_max(m_new)
    s = s * tl.exp(m - shift) + tl.sum(tl.exp(z - shift), axis=0)
    return m_new, s


@triton.jit
def _lse_entropy_tile(m, s, t, z):
    """lse_tile plus t = sum e^(z - m) (z - m); -inf entries contribute 0 (not 0 * inf)."""
    m_new = tl.maximum(m, tl.max(z, axis=0))
    shift = safe_max(m_new)
    alpha = tl.exp(m - shift)
    # Select before multiplying: 0 * inf would be NaN.
    t = alpha * (t + tl.where(m > float("-inf"), m - shift, 0.0) * s)
    e = tl.exp(z - shift)
    t += tl.sum(e * tl.where(z > float("-inf"), z - shift, 0.0), axis=0)
    s = s * alpha + tl.sum(e, axis=0)
    return m_new, s, t


@triton.jit
def _target_logit(base, tid, vocab_start, V, vocab_total, flag_ptr, inv_temp):
    """z of the target column if this shard owns it, else 0; flags ids outside the vocab."""
    valid = (tid >= 0) & (tid < vocab_total)
    if (tid < 0) | (tid >= vocab_total):
        tl.store(flag_ptr, 1)           # racy but every writer stores the same value
    local = tid - vocab_start
    owned = valid & (local >= 0) & (local < V)
    z_t = tl.load(base + local, mask=owned, other=0.0).to(tl.float32) * inv_temp
    return z_t, valid, owned


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
            m, s, t = _lse_entropy_tile(m, s, t, z)
        else:
            m, s = lse_tile(m, s, z)
    z_t, valid, owned = _target_logit(base, tl.load(ids_ptr + row), vocab_start, V,
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
def _softmax_grad_tile(z, cols, tid_local, lse, coef, ent, coef_ent, ENTROPY: tl.constexpr):
    """d/dz of coef * lp + coef_ent * H on one tile: coef (onehot - p) - coef_ent p (log p + H).

    A term whose coefficient is exactly 0 contributes exactly 0, even where p is NaN (a row of
    NaN/inf logits): that is how popped IcePop tokens keep an exactly-zero gradient row.
    """
    p = tl.exp(z - lse)
    g = tl.where(coef == 0.0, 0.0, coef * (tl.where(cols == tid_local, 1.0, 0.0) - p))
    if ENTROPY:
        plogp = p * tl.where(p > 0.0, z - lse + ent, 0.0)
        g -= tl.where(coef_ent == 0.0, 0.0, coef_ent * plogp)
    return g


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
        g = _softmax_grad_tile(z, cols, tid_local, lse, coef, ent, coef_ent, ENTROPY)
        tl.store(out + cols, g.to(grad_ptr.dtype.element_ty), mask=valid)


@triton.jit
def _load_z(base, cols, V, inv_temp):
    return tl.load(base + cols, mask=cols < V, other=float("-inf")).to(tl.float32) * inv_temp


@triton.jit
def _load_row_tile(base, k, V, BLOCK_V: tl.constexpr):
    """Tile k of a row, kept in the storage dtype (bf16: half the registers of fp32)."""
    cols = k * BLOCK_V + tl.arange(0, BLOCK_V)
    return tl.load(base + cols, mask=cols < V, other=float("-inf")), cols


@triton.jit
def _sum_exp(x, inv_temp, m):
    return tl.sum(tl.exp(x.to(tl.float32) * inv_temp - safe_max(m)), axis=0)


@triton.jit
def _store_grad_tile(out, z, cols, V, tid, lse, coef):
    g = _softmax_grad_tile(z, cols, tid, lse, coef, 0.0, 0.0, False)
    tl.store(out + cols, g.to(out.dtype.element_ty), mask=cols < V)


@triton.jit
def _store_softmax_grad_tile(out, x, cols, V, inv_temp, lse, coef):
    """coef (0 - softmax) on one held tile: the gradient of every column but the target's,
    which the caller writes afterwards. (0 - p), not -p: the arithmetic of _softmax_grad_tile,
    zeros included (-p would flip their sign)."""
    p = tl.exp(x.to(tl.float32) * inv_temp - lse)
    g = tl.where(coef == 0.0, 0.0, coef * (0.0 - p))
    tl.store(out + cols, g.to(out.dtype.element_ty), mask=cols < V)


@triton.jit
def _icepop_logits_kernel(
    # inputs: logits [N, V]; per token [N]: ids, rollout, old, advantages, mask, reduction scale
    logits_ptr, ids_ptr, rollout_ptr, old_ptr, adv_ptr, mask_ptr, scale_ptr,
    # outputs: dL/dlogits [N, V] (may alias logits_ptr), IcePop stats rows [N, 8], flag [1],
    # with METRICS the train-side log-prob lp [N] (the mismatch metrics' input)
    grad_ptr, rows_ptr, flag_ptr, lp_ptr,
    # shapes and runtime floats
    n_rows, V, stride_row, stride_grad, inv_temp, gate_low, gate_high, clip_low, clip_high,
    dual_clip, HAS_OLD: tl.constexpr, HAS_MASK: tl.constexpr, STORE_GRAD: tl.constexpr,
    METRICS: tl.constexpr, DUAL_CLIP: tl.constexpr, ROW_TILES: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """log-prob, IcePop loss and dL/dlogits of whole rows, one fused pass, persistent grid.

    ROW_TILES = 1..3 (V <= ROW_TILES * BLOCK_V): the row is read once and stays in registers
    (in its storage dtype) until its gradient is written. ROW_TILES = 0: the row is streamed, and
    a second sweep re-reads it right after the first one (the persistent grid keeps few rows in
    flight so that sweep mostly hits L2). dL/dz = scale * dl/dlp * (onehot - softmax); the
    stats row has the layout of _kernels._icepop_fwd_kernel's; METRICS also stores each row's
    lp (one value a row: the mismatch metrics are computed from it, never from the logits).
    """
    pid = tl.program_id(0).to(tl.int64)
    for row in range(pid, n_rows, tl.num_programs(0)):
        base = logits_ptr + row * stride_row
        tid = tl.load(ids_ptr + row)
        # Every warp reads the target logit before the row's first cross-warp reduction (a
        # barrier): with grad aliasing logits, no warp can then see a column another warp has
        # already overwritten with its gradient.
        z_t, valid, owned = _target_logit(base, tid, 0, V, V, flag_ptr, inv_temp)
        if ROW_TILES == 0:
            m = tl.full([], float("-inf"), tl.float32)
            s = tl.zeros([], tl.float32)
            for start in range(0, V, BLOCK_V):
                m, s = lse_tile(m, s, _load_z(base, start + tl.arange(0, BLOCK_V), V,
                                               inv_temp))
        else:
            x0, cols0 = _load_row_tile(base, 0, V, BLOCK_V)
            m = tl.max(x0.to(tl.float32), axis=0)
            if ROW_TILES >= 2:
                x1, cols1 = _load_row_tile(base, 1, V, BLOCK_V)
                m = tl.maximum(m, tl.max(x1.to(tl.float32), axis=0))
            if ROW_TILES >= 3:
                x2, cols2 = _load_row_tile(base, 2, V, BLOCK_V)
                m = tl.maximum(m, tl.max(x2.to(tl.float32), axis=0))
            m = m * inv_temp                                  # inv_temp > 0
            s = _sum_exp(x0, inv_temp, m)
            if ROW_TILES >= 2:
                s += _sum_exp(x1, inv_temp, m)
            if ROW_TILES >= 3:
                s += _sum_exp(x2, inv_temp, m)
        lse = m + tl.log(s)
        lp = tl.where(valid, z_t - lse, float("nan"))

        rollout = tl.load(rollout_ptr + row).to(tl.float32)
        adv = tl.load(adv_ptr + row).to(tl.float32)
        if HAS_MASK:
            masked = tl.load(mask_ptr + row) != 0
        else:
            masked = valid | (~valid)
        if HAS_OLD:
            base_lp = tl.load(old_ptr + row).to(tl.float32)
            train_ok = is_finite(lp) & is_finite(base_lp)
        else:
            base_lp = rollout
            train_ok = is_finite(lp)
        loss, dl_dlp, in_gate, keep, branch_cut, gate_ratio = icepop_token_math(
            lp, rollout, base_lp, adv, masked, train_ok, gate_low, gate_high, clip_low,
            clip_high, dual_clip, HAS_OLD, DUAL_CLIP)

        # The ratio statistics describe M: masked tokens whose log-probs are all finite.
        counted = masked & train_ok & is_finite(rollout)
        stats = rows_ptr + row * 8
        tl.store(stats + 0, loss)
        tl.store(stats + 1, masked.to(tl.float32))
        tl.store(stats + 2, (masked & train_ok & ~in_gate).to(tl.float32))
        tl.store(stats + 3, (keep & branch_cut).to(tl.float32))
        tl.store(stats + 4, tl.where(counted, gate_ratio, 0.0))
        tl.store(stats + 5, tl.where(counted, gate_ratio, float("-inf")))
        tl.store(stats + 6, tl.where(counted, gate_ratio, float("inf")))
        if METRICS:
            tl.store(lp_ptr + row, lp)
        tl.store(stats + 7, counted.to(tl.float32))

        if STORE_GRAD:
            coef = dl_dlp * tl.load(scale_ptr + row) * inv_temp
            out = grad_ptr + row * stride_grad
            if ROW_TILES == 0:
                for start in range(0, V, BLOCK_V):
                    cols = start + tl.arange(0, BLOCK_V)
                    _store_grad_tile(out, _load_z(base, cols, V, inv_temp), cols, V, tid, lse,
                                     coef)
            else:
                _store_softmax_grad_tile(out, x0, cols0, V, inv_temp, lse, coef)
                if ROW_TILES >= 2:
                    _store_softmax_grad_tile(out, x1, cols1, V, inv_temp, lse, coef)
                if ROW_TILES >= 3:
                    _store_softmax_grad_tile(out, x2, cols2, V, inv_temp, lse, coef)
                # Every thread's tile stores are visible before the target column's
                # gradient coef (1 - p_t) replaces its -coef p_t.
                tl.debug_barrier()
                p_t = tl.exp(z_t - lse)
                g_t = tl.where(coef == 0.0, 0.0, coef * (1.0 - p_t))
                tl.store(out + tid, g_t.to(out.dtype.element_ty), mask=owned)


@triton.jit
def _scale_kernel(x_ptr, factor_ptr, n, BLOCK: tl.constexpr):
    """x *= factor in place; every program returns at once when factor == 1 (the usual
    grad_output of a scalar loss), so the common case costs a launch, not a pass over x."""
    factor = tl.load(factor_ptr).to(tl.float32)
    if factor != 1.0:
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inside = offs < n
        x = tl.load(x_ptr + offs, mask=inside).to(tl.float32)
        tl.store(x_ptr + offs, (x * factor).to(x_ptr.dtype.element_ty), mask=inside)


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


def icepop_logits_maxnreg(row_tiles: int):
    """The register cap of a fused IcePop launch (None: ptxas's choice). Triton 3.6's code for
    the streamed plan gets 48 registers from ptxas and one spilled value (an 8 B stack, fp32,
    sm_90 AOT); capped at 128 it takes 64 and spills nothing. Triton >= 3.7: no cap needed."""
    return 128 if row_tiles == 0 and triton_version() < (3, 7) else None


def icepop_logits(logits, ids, rollout, old, adv, mask, scale, grad, rows, flag, lp, *,
                  inv_temp, gate_low, gate_high, clip_low, clip_high, block_v, row_tiles,
                  num_warps, max_programs, dual_clip=None):
    """row_tiles 0: streamed rows (tile block_v); 1..3: rows held in that many register
    tiles of block_v columns (V <= row_tiles * block_v). ``rows`` [N, 8] receives the stats;
    ``lp`` [N] (or None: no metrics) each row's log-prob."""
    n, v = logits.shape
    if n == 0:
        return
    store_grad = grad is not None
    _icepop_logits_kernel[(min(n, max_programs),)](
        logits, ids, rollout, rollout if old is None else old, adv,
        ids if mask is None else mask, scale, grad if store_grad else logits, rows, flag,
        rows if lp is None else lp,
        n, v, logits.stride(0), grad.stride(0) if store_grad else 0, inv_temp, gate_low,
        gate_high, clip_low, clip_high, 1.0 if dual_clip is None else dual_clip,
        HAS_OLD=old is not None, HAS_MASK=mask is not None, STORE_GRAD=store_grad,
        METRICS=lp is not None, DUAL_CLIP=dual_clip is not None, ROW_TILES=row_tiles,
        BLOCK_V=block_v, num_warps=num_warps, maxnreg=icepop_logits_maxnreg(row_tiles))


def scale_inplace(x, factor, *, block=4096, num_warps=4):
    n = x.numel()
    if n:
        _scale_kernel[(triton.cdiv(n, block),)](x, factor, n, BLOCK=block, num_warps=num_warps)


# --------------------------------------------------------------------------- AOT configurations
# The GPU launch configurations of logprobs.LogitsLaunchConfig: streaming kernels use tile 4096
# with 8 warps; the fused IcePop kernel's (row_tiles, BLOCK_V, warps) plans per dtype below
# (the largest on-chip rows that compile without spills: bf16 up to 3 x 8192 columns at 32
# warps, fp32 up to 16384).
ROW_PLANS = {
    "bf16": ((0, 4096, 8), (1, 4096, 8), (1, 8192, 16), (1, 16384, 16), (3, 8192, 32)),
    "fp32": ((0, 4096, 8), (1, 4096, 8), (1, 8192, 16), (1, 16384, 16)),
}


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
        for row_tiles, block, warps in ROW_PLANS[dt]:
            sig = {"logits_ptr": f"*{dt}", "ids_ptr": "*i64", "rollout_ptr": "*fp32",
                   "old_ptr": "*fp32", "adv_ptr": "*fp32", "mask_ptr": "*u8",
                   "scale_ptr": "*fp32", "grad_ptr": f"*{dt}", "rows_ptr": "*fp32",
                   "flag_ptr": "*i32", "lp_ptr": "*fp32", "n_rows": "i32", "V": "i32",
                   "stride_row": "i64",
                   "stride_grad": "i64", "inv_temp": "fp32", "gate_low": "fp32",
                   "gate_high": "fp32", "clip_low": "fp32", "clip_high": "fp32",
                   "dual_clip": "fp32", "HAS_OLD": "constexpr", "HAS_MASK": "constexpr",
                   "STORE_GRAD": "constexpr", "METRICS": "constexpr", "DUAL_CLIP": "constexpr",
                   "ROW_TILES": "constexpr", "BLOCK_V": "constexpr"}
            # (old, metrics, dual clip): the three-tile plan runs closest to the register cap
            # (64 at 32 warps): its decoupled variants are compiled too.
            variants = [(False, False, False), (False, True, False), (False, True, True)]
            if row_tiles == 3:
                variants += [(True, False, False), (True, True, False), (True, True, True)]
            for has_old, metrics, dual in variants:
                specs.append(AotSpec(
                    f"icepop_logits[{dt},row_tiles={row_tiles},BLOCK_V={block},"
                    f"metrics={metrics}{',old' if has_old else ''}{',dual' if dual else ''}]",
                    _icepop_logits_kernel, sig,
                    {"HAS_OLD": has_old, "HAS_MASK": True, "STORE_GRAD": True,
                     "METRICS": metrics, "DUAL_CLIP": dual, "ROW_TILES": row_tiles,
                     "BLOCK_V": block},
                    num_warps=warps, maxnreg=icepop_logits_maxnreg(row_tiles)))
    for dt in ("bf16", "fp32"):
        specs.append(AotSpec(f"scale_inplace[{dt}]", _scale_kernel,
                             {"x_ptr": f"*{dt}", "factor_ptr": "*fp32", "n": "i64",
                              "BLOCK": "constexpr"}, {"BLOCK": 4096}, num_warps=4))
    return specs


AOT_SPECS = _aot_specs()
