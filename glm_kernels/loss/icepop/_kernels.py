"""Triton kernels of the loss package. No validation here: callers pass contiguous 1-D views."""
from __future__ import annotations

import triton
import triton.language as tl

from .._aot import AotSpec

# Order of the per-program statistics row written by _icepop_fwd_kernel (the ratio columns
# over M: masked tokens whose log-probs are all finite).
STAT_LOSS_SUM, STAT_MASKED, STAT_POPPED, STAT_CLIPPED, STAT_RATIO_SUM, STAT_RATIO_MAX, \
    STAT_RATIO_MIN, STAT_RATIO_COUNT = range(8)
NUM_STATS = 8


@triton.jit
def is_finite(x):
    """Neither NaN nor +-inf (NaN fails the comparison)."""
    return tl.abs(x) < float("inf")


@triton.jit
def icepop_gate(gate_log_ratio, masked, train_ok, gate_low, gate_high, WEIGHTED: tl.constexpr):
    """The IcePop gate on a tile (fp32): (keep, in_gate, gate_ratio, weight).

    gate_ratio = exp(clamp(gate_log_ratio, -20, 20)); in_gate: gate_low <= ratio <= gate_high
    (a NaN ratio fails both: popped); keep = masked & in_gate & train_ok. weight: the ratio
    (decoupled, WEIGHTED) or 1 on kept tokens, exactly 0 elsewhere. Shared by every kernel that
    composes the gate (IcePop's own and the policy-loss family's).
    """
    # A NaN log-ratio stays NaN through the clamp, as with torch.clamp (by default tl.clamp
    # may return an end of the range for NaN).
    gate_ratio = tl.exp(tl.clamp(gate_log_ratio, -20.0, 20.0, propagate_nan=tl.PropagateNan.ALL))
    in_gate = (gate_ratio >= gate_low) & (gate_ratio <= gate_high)
    keep = masked & in_gate & train_ok
    if WEIGHTED:
        weight = tl.where(keep, gate_ratio, 0.0)
    else:
        weight = tl.where(keep, 1.0, 0.0)
    return keep, in_gate, gate_ratio, weight


@triton.jit
def ppo_clip_term(ratio, adv, clip_low, clip_high):
    """PPO's clipped surrogate on a tile: (max(u, c), u, c, branch_cut) with u = -ratio A,
    c = -clip(ratio, clip_low, clip_high) A and branch_cut = c > u (the clipped branch is
    strictly active). Shared by IcePop's kernel and the policy-loss family's."""
    unclipped = -ratio * adv
    clipped_term = -tl.clamp(ratio, clip_low, clip_high) * adv
    return tl.maximum(unclipped, clipped_term), unclipped, clipped_term, clipped_term > unclipped


@triton.jit
def icepop_token_math(lp, rollout, base, adv, masked, train_ok, gate_low, gate_high, clip_low,
                      clip_high, dual_clip, HAS_OLD: tl.constexpr, DUAL_CLIP: tl.constexpr):
    """IcePop for a tile of tokens (all fp32); shared by every kernel that fuses the loss.

    coupled:   rho = exp(lp - rollout), l = 1[lo<=rho<=hi] * max(-rho A, -clip(rho) A)
    decoupled: k = exp(old - rollout), r = exp(lp - old),
               l = k 1[lo<=k<=hi] * max(-r A, -clip(r) A)
    DUAL_CLIP: for A < 0 the PPO term max(...) is capped at -dual_clip A (a constexpr: the
    kernels without it keep their registers; at 16 tokens a thread the cap costs ~2 more each)
    ``base`` is old (decoupled) or rollout (coupled); ``train_ok``: the train-side log-probs
    (lp, and old when decoupled) are finite. Returns
    (loss, dloss/dlp, in_gate, keep, branch_cut, gate_ratio); popped, unmasked and train-side
    non-finite tokens get exactly 0 in loss and gradient.
    """
    if HAS_OLD:
        gate_log_ratio = base - rollout
    else:
        gate_log_ratio = lp - rollout
    keep, in_gate, gate_ratio, weight = icepop_gate(gate_log_ratio, masked, train_ok, gate_low,
                                                    gate_high, HAS_OLD)
    # Popped tokens take zeros before any arithmetic: inf/NaN never reach loss or gradient.
    log_ratio = tl.where(keep, lp, 0.0) - tl.where(keep, base, 0.0)
    log_ratio_in_range = (log_ratio >= -20.0) & (log_ratio <= 20.0)
    ratio = tl.exp(tl.clamp(log_ratio, -20.0, 20.0))
    adv = tl.where(keep, adv, 0.0)
    ppo_term, unclipped, clipped_term, branch_cut = ppo_clip_term(ratio, adv, clip_low,
                                                                  clip_high)
    # Ties (ratio inside the clip band) take the unclipped branch's full gradient, as autograd
    # of max(u, c) does when c == u there; the clamp of the log-ratio passes its ends; a
    # capped term is a constant.
    cut = branch_cut | (~log_ratio_in_range)
    if DUAL_CLIP:
        dual_bound = -dual_clip * adv
        dual_cut = (adv < 0.0) & (ppo_term > dual_bound)
        ppo_term = tl.where(dual_cut, dual_bound, ppo_term)
        cut = cut | dual_cut
    loss = weight * ppo_term
    grad = tl.where(cut, 0.0, -weight * ratio * adv)
    return loss, grad, in_gate, keep, branch_cut, gate_ratio


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


AOT_SPECS = _icepop_aot_specs()
