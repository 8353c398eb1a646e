"""Triton kernels of the loss package. No validation here: callers pass contiguous 1-D views."""
from __future__ import annotations

import triton
import triton.language as tl

from ..._aot import AotSpec
from ..._dispatch import triton_version
from .._common.tiles import (icepop_token_math, is_finite, load_row_tile, load_z, lse_tile,
                             store_grad_tile, store_softmax_grad_tile, sum_exp, target_logit)

# Order of the per-program statistics row written by _icepop_fwd_kernel (the ratio columns
# over M: masked tokens whose log-probs are all finite).
STAT_LOSS_SUM, STAT_MASKED, STAT_POPPED, STAT_CLIPPED, STAT_RATIO_SUM, STAT_RATIO_MAX, \
    STAT_RATIO_MIN, STAT_RATIO_COUNT = range(8)
NUM_STATS = 8


@triton.jit
def _icepop_fwd_kernel(
    # inputs, flat [N]
    logprobs_ptr, rollout_ptr, old_ptr, adv_ptr, mask_ptr,
    # outputs: per-token loss terms [N], per-token d(l*m)/d logprobs [N],
    # stats [programs, 8] (one row per program)
    loss_ptr, grad_ptr, stats_ptr,
    # shapes and runtime hyper-parameters (runtime floats: no recompile per value)
    n_tokens, seq_len, gate_low, gate_high, clip_low, clip_high, dual_clip,
    # code-path switches and tile size
    HAS_OLD: tl.constexpr, HAS_MASK: tl.constexpr, ADV_PER_SEQ: tl.constexpr,
    STORE_LOSS: tl.constexpr, STORE_GRAD: tl.constexpr, DUAL_CLIP: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """IcePop forward and per-token gradient in one pass; one stats row per program."""
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    in_bounds = offs < n_tokens

    lp = tl.load(logprobs_ptr + offs, mask=in_bounds, other=0.0).to(tl.float32)
    rollout = tl.load(rollout_ptr + offs, mask=in_bounds, other=0.0).to(tl.float32)
    if ADV_PER_SEQ:
        adv = tl.load(adv_ptr + offs // seq_len, mask=in_bounds, other=0.0).to(tl.float32)
    else:
        adv = tl.load(adv_ptr + offs, mask=in_bounds, other=0.0).to(tl.float32)
    masked = in_bounds
    if HAS_MASK:
        masked = masked & (tl.load(mask_ptr + offs, mask=in_bounds, other=0) != 0)
    if HAS_OLD:
        base = tl.load(old_ptr + offs, mask=in_bounds, other=0.0).to(tl.float32)
        train_ok = is_finite(lp) & is_finite(base)
    else:
        base = rollout
        train_ok = is_finite(lp)

    loss, grad, in_gate, keep, branch_cut, gate_ratio = icepop_token_math(
        lp, rollout, base, adv, masked, train_ok, gate_low, gate_high, clip_low, clip_high,
        dual_clip, HAS_OLD, DUAL_CLIP)

    if STORE_LOSS:
        tl.store(loss_ptr + offs, loss, mask=in_bounds)
    if STORE_GRAD:
        tl.store(grad_ptr + offs, grad, mask=in_bounds)

    # The ratio statistics describe M: masked tokens whose log-probs are all finite.
    counted = masked & train_ok & is_finite(rollout)
    stats = stats_ptr + pid.to(tl.int64) * 8
    tl.store(stats + 0, tl.sum(loss, axis=0))
    tl.store(stats + 1, tl.sum(masked.to(tl.float32), axis=0))
    tl.store(stats + 2, tl.sum((masked & train_ok & ~in_gate).to(tl.float32), axis=0))
    tl.store(stats + 3, tl.sum((keep & branch_cut).to(tl.float32), axis=0))
    tl.store(stats + 4, tl.sum(tl.where(counted, gate_ratio, 0.0), axis=0))
    tl.store(stats + 5, tl.max(tl.where(counted, gate_ratio, -float("inf")), axis=0))
    tl.store(stats + 6, tl.min(tl.where(counted, gate_ratio, float("inf")), axis=0))
    tl.store(stats + 7, tl.sum(counted.to(tl.float32), axis=0))


def icepop_fwd(logprobs, rollout, old, adv, mask, loss_out, grad_out, stats_out, *,
               seq_len, gate_low, gate_high, clip_low, clip_high, adv_per_seq, block,
               num_warps, dual_clip=None):
    """Launch _icepop_fwd_kernel over flat tokens; stats_out must have cdiv(N, block) rows
    of NUM_STATS columns."""
    n_tokens = logprobs.numel()
    if n_tokens == 0:
        return
    grid = (triton.cdiv(n_tokens, block),)
    _icepop_fwd_kernel[grid](
        logprobs, rollout, logprobs if old is None else old, adv,
        logprobs if mask is None else mask,
        loss_out, grad_out, stats_out,
        n_tokens, max(seq_len, 1), gate_low, gate_high, clip_low, clip_high,
        1.0 if dual_clip is None else dual_clip, HAS_OLD=old is not None,
        HAS_MASK=mask is not None, ADV_PER_SEQ=adv_per_seq,
        STORE_LOSS=loss_out.numel() > 0, STORE_GRAD=grad_out.numel() > 0,
        DUAL_CLIP=dual_clip is not None, BLOCK=block, num_warps=num_warps)


def _icepop_aot_specs():
    # Sizes below 2^31 (every real batch) reach the kernel as i32: the variant a launch compiles.
    signature = {
        "logprobs_ptr": "*fp32", "rollout_ptr": "*fp32", "old_ptr": "*fp32", "adv_ptr": "*fp32",
        "mask_ptr": "*u8", "loss_ptr": "*fp32", "grad_ptr": "*fp32", "stats_ptr": "*fp32",
        "n_tokens": "i32", "seq_len": "i32", "gate_low": "fp32",
        "gate_high": "fp32", "clip_low": "fp32", "clip_high": "fp32", "dual_clip": "fp32",
    }
    specs = []
    for lp_dtype in ("fp32", "bf16"):
        for has_old in (False, True):
            for dual in (False, True):
                sig = dict(signature, logprobs_ptr=f"*{lp_dtype}")
                # Tokens a program on the GPU (icepop.py): 1024 with dual clip, else 4096.
                constexprs = dict(HAS_OLD=has_old, HAS_MASK=True, ADV_PER_SEQ=False,
                                  STORE_LOSS=False, STORE_GRAD=True, DUAL_CLIP=dual,
                                  BLOCK=1024 if dual else 4096)
                for name in constexprs:
                    sig[name] = "constexpr"
                specs.append(AotSpec(
                    f"icepop_fwd[{lp_dtype},old={has_old}{',dual' if dual else ''}]",
                    _icepop_fwd_kernel, sig, constexprs, num_warps=8))
    return specs



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
        z_t, valid, owned = target_logit(base, tid, 0, V, V, flag_ptr, inv_temp)
        if ROW_TILES == 0:
            m = tl.full([], float("-inf"), tl.float32)
            s = tl.zeros([], tl.float32)
            for start in range(0, V, BLOCK_V):
                m, s = lse_tile(m, s, load_z(base, start + tl.arange(0, BLOCK_V), V,
                                               inv_temp))
        else:
            x0, cols0 = load_row_tile(base, 0, V, BLOCK_V)
            m = tl.max(x0.to(tl.float32), axis=0)
            if ROW_TILES >= 2:
                x1, cols1 = load_row_tile(base, 1, V, BLOCK_V)
                m = tl.maximum(m, tl.max(x1.to(tl.float32), axis=0))
            if ROW_TILES >= 3:
                x2, cols2 = load_row_tile(base, 2, V, BLOCK_V)
                m = tl.maximum(m, tl.max(x2.to(tl.float32), axis=0))
            m = m * inv_temp                                  # inv_temp > 0
            s = sum_exp(x0, inv_temp, m)
            if ROW_TILES >= 2:
                s += sum_exp(x1, inv_temp, m)
            if ROW_TILES >= 3:
                s += sum_exp(x2, inv_temp, m)
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
                    store_grad_tile(out, load_z(base, cols, V, inv_temp), cols, V, tid, lse,
                                     coef)
            else:
                store_softmax_grad_tile(out, x0, cols0, V, inv_temp, lse, coef)
                if ROW_TILES >= 2:
                    store_softmax_grad_tile(out, x1, cols1, V, inv_temp, lse, coef)
                if ROW_TILES >= 3:
                    store_softmax_grad_tile(out, x2, cols2, V, inv_temp, lse, coef)
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
# The fused IcePop-from-logits kernel's (row_tiles, BLOCK_V, warps) plans per dtype below
# (the largest on-chip rows that compile without spills: bf16 up to 3 x 8192 columns at 32
# warps, fp32 up to 16384).
ROW_PLANS = {
    "bf16": ((0, 4096, 8), (1, 4096, 8), (1, 8192, 16), (1, 16384, 16), (3, 8192, 32)),
    "fp32": ((0, 4096, 8), (1, 4096, 8), (1, 8192, 16), (1, 16384, 16)),
}


def _icepop_logits_aot_specs():
    specs = []
    for dt in ("bf16", "fp32"):
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


AOT_SPECS = _icepop_aot_specs() + _icepop_logits_aot_specs()
