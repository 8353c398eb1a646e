"""Triton kernels of the policy-loss family. No validation here: callers pass contiguous flat
views (``loss/policy/policy.py``).

Two launch shapes of one design, both built from the same per-tile helpers
(``loss/policy/_tile.py``: ``policy_objective``, ``token_terms``, ...; and
``_kernels.icepop_gate`` / ``ppo_clip_term``, shared with IcePop):

* token-ratio variants: one program per BLOCK of flat tokens, a single pass.
* sequence-ratio variants (GSPO, TRL sequence level, GMPO, VESPO), and the token-ratio ones
  under sequence TIS / MIS (``seq_is``): one program per sequence, looping over its tokens in
  BLOCK chunks: phase 1 reduces the masked log-ratio (GMPO: the clipped log-ratio, the
  advantage and the log-weights) in registers; TRL's sequence ratio takes a phase 2 that
  sums dl/dratio over the row (its gradient reaches every token through the mean); the last
  phase writes each token's loss and gradient. Sequence IS sums the row's masked
  old - rollout in phase 1 (GSPO, TRL), or in a phase 0 of its own where phase 1 needs the
  weight already (GMPO's log-weight sum) or there is no phase 1 (token ratios: their last
  phase is the token kernel's math with the row's weight; :func:`row_splits` programs share
  a row when rows are few). The phases re-read the
  row (from L2 for rows up to a few MB), nothing is written between them and no host sync
  is needed; a two-phase segmented reduction over flat blocks would need a second launch and
  a [B] scratch round trip instead (and, packed, each token's row: a search of cu_seqlens).
  One program per row keeps the row's sums exact and ordered (deterministic), for padded
  [B, T] (row b spans [b T, (b+1) T)) and packed (``cu_seqlens``) layouts alike.

Each program writes one stats row: loss sum, masked tokens, popped tokens, and the sums of
the clip / clip-lower / kl indicators over the masked tokens (verl's metrics' numerators).
"""
from __future__ import annotations

import triton
import triton.language as tl

from ..._dispatch import triton_version
from ._tile import (load_tile, pick_tie, policy_objective, row_bounds, row_seq_is_weight,
                    seq_is_weight, store_stats, token_terms)

# Left to itself, ptxas gives some sequence-kernel variants (4 warps) 128 registers and an 8 B
# stack frame on sm_90 (AOT: GMPO on triton 3.6; GSPO with sequence IS on 3.9); capped at 168
# they keep everything in registers (141-168, no stack) on 3.4 and 3.9. On 3.6 (the GPU
# image's) PPO with the dual clip under sequence IS still gets the 8 B stack at 168 (and at
# 160); 176 keeps it in registers. 4 warps x 176 registers stay far inside the SM's file.
_SEQ_MAXNREG = 176 if (3, 6) <= triton_version() < (3, 7) else 168

RATIO_CODES = {"token": 0, "sequence_stopgrad": 1, "sequence": 2, "geo_mean": 3,
               "sequence_sum": 4}
OBJECTIVE_CODES = {"ppo": 0, "cispo": 1, "sapo": 2, "reinforce": 3, "dppo_tv": 4,
                   "dppo_kl": 5, "dro": 6, "clip_cov": 7, "kl_cov": 8, "vespo": 9}
GATE_CODES = {None: 0, "coupled": 1, "decoupled": 2}
STAT_LOSS, STAT_MASKED, STAT_POPPED, STAT_CLIP, STAT_CLIP_LOWER, STAT_KL, STAT_PHI = range(7)
NUM_STATS = 7                 # STAT_PHI: VESPO's phi of the row (sequence kernel only)


@triton.jit
def _policy_token_kernel(
    lp_ptr, old_ptr, adv_ptr, mask_ptr, tw_ptr, rollout_ptr, sel_ptr,
    loss_ptr, grad_ptr, stats_ptr,
    n_tokens, seq_len, gate_low, gate_high, log_clamp, clip_low, clip_high, eps_low, eps_high,
    dual_clip, p0, p1, p2, p3,
    OBJECTIVE: tl.constexpr, GATE: tl.constexpr, HAS_MASK: tl.constexpr,
    HAS_TW: tl.constexpr, HAS_SEL: tl.constexpr, CLAMP: tl.constexpr,
    HAS_DELTA: tl.constexpr, DUAL_CLIP: tl.constexpr, ADV_PER_SEQ: tl.constexpr,
    STORE_LOSS: tl.constexpr, STORE_GRAD: tl.constexpr, BLOCK: tl.constexpr,
):
    """Token-ratio variants: one pass, one stats row per program."""
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    valid = offs < n_tokens
    lp, old, masked, keep, factor, popped, tw, sel, raw, log_ratio, in_range = load_tile(
        offs, valid, lp_ptr, old_ptr, mask_ptr, tw_ptr, rollout_ptr, sel_ptr, gate_low,
        gate_high, log_clamp, HAS_MASK, HAS_TW, GATE, HAS_SEL, CLAMP)
    if ADV_PER_SEQ:
        adv = tl.load(adv_ptr + offs // seq_len, mask=valid, other=0.0).to(tl.float32)
    else:
        adv = tl.load(adv_ptr + offs, mask=valid, other=0.0).to(tl.float32)
    terms, grad, clip, clip_lower, kl = token_terms(
        lp, old, adv, keep, factor * tw, sel, log_ratio, in_range, clip_low, clip_high,
        eps_low, eps_high, dual_clip, p0, p1, p2, p3, OBJECTIVE, HAS_DELTA, DUAL_CLIP)
    if STORE_LOSS:
        tl.store(loss_ptr + offs, terms, mask=valid)
    if STORE_GRAD:
        tl.store(grad_ptr + offs, grad, mask=valid)
    store_stats(stats_ptr + pid.to(tl.int64) * 7, tl.sum(terms, axis=0), masked, popped, clip,
                clip_lower, kl)


@triton.jit
def _policy_seq_kernel(
    lp_ptr, old_ptr, adv_ptr, mask_ptr, tw_ptr, rollout_ptr, sel_ptr, cu_ptr,
    loss_ptr, grad_ptr, stats_ptr,
    seq_len, n_splits, gate_low, gate_high, log_clamp, clip_low, clip_high, eps_low, eps_high,
    dual_clip, seq_log_max, p0, p1, p2, p3, seq_is_low, seq_is_high,
    RATIO: tl.constexpr, OBJECTIVE: tl.constexpr, GATE: tl.constexpr, HAS_MASK: tl.constexpr,
    HAS_TW: tl.constexpr, HAS_SEL: tl.constexpr, CLAMP: tl.constexpr,
    HAS_SEQ_MAX: tl.constexpr, HAS_DELTA: tl.constexpr, DUAL_CLIP: tl.constexpr,
    HAS_CU: tl.constexpr, ADV_PER_SEQ: tl.constexpr, STORE_LOSS: tl.constexpr,
    STORE_GRAD: tl.constexpr, SEQ_IS: tl.constexpr, BLOCK: tl.constexpr,
):
    """One program per sequence (module docstring), one stats row per sequence: the
    sequence-ratio variants, and the token-ratio ones (RATIO 0) under sequence IS. GMPO
    (RATIO 3) writes its sequence loss to loss_ptr[row].
    SEQ_IS (1 truncate, 2 mask; not VESPO): w_b = exp(clamp(sum_m (old - rollout), -20, 20))
    truncated at seq_is_high or zeroed outside [seq_is_low, seq_is_high] multiplies every
    token weight of the row (loss/policy/sequence_is.py's weight, without its [N] tensor).
    RATIO 1 /
    2 sum the row's old - rollout in phase 1; RATIO 0 and 3 need w_b in their first pass
    already (GMPO sums log(weight) over the row) and take a phase 0 over old, rollout, mask.
    n_splits programs share a row (RATIO 0 only; 1 elsewhere): each reduces the whole row's
    w_b (the others' re-reads come from L2) and takes every n_splits-th chunk of the last
    phase, with a stats row of its own (program r n_splits + s)."""
    program = tl.program_id(0)
    row = program // n_splits
    split = program - row * n_splits
    start, end = row_bounds(cu_ptr, row, seq_len, HAS_CU)
    lane = tl.arange(0, BLOCK)
    if ADV_PER_SEQ:
        row_adv = tl.load(adv_ptr + row).to(tl.float32)

    seq_is_w = 1.0
    if SEQ_IS != 0 and (RATIO == 0 or RATIO == 3):
        # Phase 0: the row's sequence IS weight.
        seq_is_w = row_seq_is_weight(start, end, old_ptr, rollout_ptr, mask_ptr, seq_is_low,
                                     seq_is_high, HAS_MASK, SEQ_IS, BLOCK)

    # Phase 1 (sequence ratios): the row's reductions.
    if RATIO != 0:
        acc_a = tl.zeros([BLOCK], tl.float32)  # masked log-ratio sum / GMPO clipped log-ratio
        acc_b = tl.zeros([BLOCK], tl.float32)  # masked tokens / GMPO kept tokens
        acc_c = tl.zeros([BLOCK], tl.float32)  # GMPO kept advantage sum
        acc_d = tl.zeros([BLOCK], tl.float32)  # GMPO log-weight sum; VESPO log token weights
        acc_e = tl.zeros([BLOCK], tl.float32)  # sequence IS (RATIO 1 / 2): masked old - rollout
        for chunk in range(start, end, BLOCK):
            offs = chunk + lane
            valid = offs < end
            lp, old, masked, keep, factor, popped, tw, sel, raw, log_ratio, in_range = \
                load_tile(offs, valid, lp_ptr, old_ptr, mask_ptr, tw_ptr, rollout_ptr, lp_ptr,
                          gate_low, gate_high, log_clamp, HAS_MASK, HAS_TW, GATE, False, CLAMP)
            if RATIO == 3:
                if ADV_PER_SEQ:
                    adv = tl.where(valid, row_adv, 0.0)
                else:
                    adv = tl.load(adv_ptr + offs, mask=valid, other=0.0).to(tl.float32)
                sign = tl.where(adv > 0.0, 1.0, tl.where(adv < 0.0, -1.0, 0.0))
                band = tl.clamp(log_ratio, -eps_low, eps_high)
                log_min = sign * tl.minimum(sign * log_ratio, sign * band)
                acc_a += tl.where(keep, log_min, 0.0)
                acc_b += keep.to(tl.float32)
                acc_c += tl.where(keep, adv, 0.0)
                if HAS_TW or GATE == 2 or SEQ_IS != 0:
                    acc_d += tl.where(keep, tl.log(factor * tw * seq_is_w + 1e-10), 0.0)
            elif RATIO == 4:
                acc_a += tl.where(masked, log_ratio, 0.0)
                if HAS_TW:
                    # -18.42... = log(1e-8), TRL get_gamma_weights' lower clamp
                    acc_d += tl.where(valid, tl.clamp(tl.log(tw), -18.420680743952367, 20.0),
                                      0.0)
            else:
                acc_a += tl.where(masked, raw, 0.0)
                acc_b += masked.to(tl.float32)
                if SEQ_IS != 0:
                    is_rollout = tl.load(rollout_ptr + offs, mask=valid,
                                         other=0.0).to(tl.float32)
                    acc_e += tl.where(masked, old - is_rollout, 0.0)
        sum_a = tl.sum(acc_a, axis=0)
        if SEQ_IS != 0 and (RATIO == 1 or RATIO == 2):
            seq_is_w = seq_is_weight(tl.sum(acc_e, axis=0), seq_is_low, seq_is_high, SEQ_IS)
        count = tl.sum(acc_b, axis=0)
        if RATIO == 3:
            denom = count + 1e-8
            seq_ratio = tl.exp(sum_a / denom)
            seq_adv = tl.sum(acc_c, axis=0) / denom
            seq_weight = 1.0
            if HAS_TW or GATE == 2 or SEQ_IS != 0:
                seq_weight = tl.exp(tl.sum(acc_d, axis=0) / denom)
            seq_loss = -seq_adv * seq_ratio * seq_weight
            seq_d_ratio = -seq_adv * seq_weight * seq_ratio / denom
            ratio_val = seq_ratio
            d_seq = 0.0
        elif RATIO == 4:
            seq_log_w = tl.clamp(sum_a + tl.sum(acc_d, axis=0), -18.420680743952367, 20.0)
            ratio_val = tl.exp(seq_log_w)
            d_seq = 0.0
            # the row's phi for the stats (TRL's vespo/phi_seq_mean): the row's first advantage
            if ADV_PER_SEQ:
                first_adv = row_adv
            else:
                first_adv = tl.load(adv_ptr + start, mask=start < end, other=0.0).to(tl.float32)
            row_nonneg = first_adv >= 0.0
            row_lam = tl.maximum(tl.where(row_nonneg, p1, p3), 1e-4)
            row_phi = tl.exp(row_lam + tl.where(row_nonneg, p0, p2) * seq_log_w
                             - row_lam * ratio_val)
            row_phi = tl.where(tl.abs(row_phi) < float("inf"), row_phi, 0.0)
        else:
            seq_log = sum_a / tl.maximum(count, 1.0)
            d_seq = 1.0
            if HAS_SEQ_MAX:
                d_seq = tl.where(seq_log <= seq_log_max, 1.0, 0.0)
                seq_log = tl.minimum(seq_log, seq_log_max)
            ratio_val = tl.exp(seq_log)

    # Phase 2 (TRL sequence ratio): S = sum over the row of factor * dl/dratio.
    row_d_ratio = 0.0
    if RATIO == 2:
        acc_g = tl.zeros([BLOCK], tl.float32)
        for chunk in range(start, end, BLOCK):
            offs = chunk + lane
            valid = offs < end
            lp, old, masked, keep, factor, popped, tw, sel, raw, log_ratio, in_range = \
                load_tile(offs, valid, lp_ptr, old_ptr, mask_ptr, tw_ptr, rollout_ptr, lp_ptr,
                           gate_low, gate_high, log_clamp, HAS_MASK, HAS_TW, GATE, False, CLAMP)
            if SEQ_IS != 0:
                tw = tw * seq_is_w
            if ADV_PER_SEQ:
                adv = tl.where(valid, row_adv, 0.0)
            else:
                adv = tl.load(adv_ptr + offs, mask=valid, other=0.0).to(tl.float32)
            ratio = tl.zeros_like(lp) + ratio_val
            loss, d_ratio, d_lp, d_log_ratio, clip, clip_lower = policy_objective(
                lp, old, adv, ratio, log_ratio, tl.zeros_like(lp), clip_low, clip_high,
                eps_low, eps_high, dual_clip, p0, p1, p2, p3, OBJECTIVE, HAS_DELTA, DUAL_CLIP)
            acc_g += tl.where(keep & (factor * tw != 0.0), factor * tw * d_ratio, 0.0)
        row_d_ratio = tl.sum(acc_g, axis=0) * ratio_val * d_seq / tl.maximum(count, 1.0)

    # Last phase: each token's loss, gradient and metric indicators.
    acc_loss = tl.zeros([BLOCK], tl.float32)
    acc_masked = tl.zeros([BLOCK], tl.float32)
    acc_popped = tl.zeros([BLOCK], tl.float32)
    acc_clip = tl.zeros([BLOCK], tl.float32)
    acc_lower = tl.zeros([BLOCK], tl.float32)
    acc_kl = tl.zeros([BLOCK], tl.float32)
    for chunk in range(start + split * BLOCK, end, n_splits * BLOCK):
        offs = chunk + lane
        valid = offs < end
        lp, old, masked, keep, factor, popped, tw, sel, raw, log_ratio, in_range = load_tile(
            offs, valid, lp_ptr, old_ptr, mask_ptr, tw_ptr, rollout_ptr, sel_ptr, gate_low,
            gate_high, log_clamp, HAS_MASK, HAS_TW, GATE, HAS_SEL, CLAMP)
        if SEQ_IS != 0:
            tw = tw * seq_is_w
        if ADV_PER_SEQ:
            adv = tl.where(valid, row_adv, 0.0)
        else:
            adv = tl.load(adv_ptr + offs, mask=valid, other=0.0).to(tl.float32)
        kl = -raw
        if RATIO == 0:
            terms, grad, clip, clip_lower, kl = token_terms(
                lp, old, adv, keep, factor * tw, sel, log_ratio, in_range, clip_low, clip_high,
                eps_low, eps_high, dual_clip, p0, p1, p2, p3, OBJECTIVE, HAS_DELTA, DUAL_CLIP)
            if STORE_LOSS:
                tl.store(loss_ptr + offs, terms, mask=valid)
            acc_loss += terms
        elif RATIO == 3:
            sign = tl.where(adv > 0.0, 1.0, tl.where(adv < 0.0, -1.0, 0.0))
            band = tl.clamp(log_ratio, -eps_low, eps_high)
            plain = sign * log_ratio
            banded = sign * band
            d_band = tl.where((log_ratio >= -eps_low) & (log_ratio <= eps_high), sign, 0.0)
            d_min = sign * pick_tie(-plain, -banded, sign, d_band)     # min = -max(-a, -b)
            grad = tl.where(keep, seq_d_ratio * d_min * in_range, 0.0)
            is_clipped = log_ratio != band
            clip = (is_clipped & (adv > 0.0)).to(tl.float32)
            clip_lower = (is_clipped & (adv < 0.0)).to(tl.float32)
        else:
            ratio = tl.zeros_like(lp) + ratio_val
            if RATIO == 4:
                nonneg = adv >= 0.0
                k = tl.where(nonneg, p0, p2)
                lam = tl.maximum(tl.where(nonneg, p1, p3), 1e-4)
                phi = tl.exp(lam + k * seq_log_w - lam * ratio)
                ratio = tl.where(tl.abs(phi) < float("inf"), phi, 0.0)
                tw = tl.full(lp.shape, 1.0, tl.float32)       # VESPO: weights in log w only
                kl = -log_ratio
            loss, d_ratio, d_lp, d_log_ratio, clip, clip_lower = policy_objective(
                lp, old, adv, ratio, log_ratio, tl.zeros_like(lp), clip_low, clip_high,
                eps_low, eps_high, dual_clip, p0, p1, p2, p3, OBJECTIVE, HAS_DELTA, DUAL_CLIP)
            if RATIO != 4 and OBJECTIVE != 0:
                kl = -log_ratio
            weight = factor * tw
            live = keep & (weight != 0.0)     # factor 0: exactly 0, whatever the inputs
            terms = tl.where(live, weight * loss, 0.0)
            own = tl.zeros_like(lp)
            if RATIO == 1:
                own = d_ratio * ratio * d_seq
            grad = tl.where(live, weight * (own + d_log_ratio * in_range + d_lp), 0.0)
            if RATIO == 2:
                # The row's ratio reaches every masked token through the mean (popped too).
                grad += tl.where(masked, row_d_ratio, 0.0)
            if STORE_LOSS:
                tl.store(loss_ptr + offs, terms, mask=valid)
            acc_loss += terms
        if STORE_GRAD:
            tl.store(grad_ptr + offs, grad, mask=valid)
        acc_masked += masked.to(tl.float32)
        acc_popped += popped.to(tl.float32)
        acc_clip += tl.where(masked, clip, 0.0)
        acc_lower += tl.where(masked, clip_lower, 0.0)
        acc_kl += tl.where(masked, kl, 0.0)
    stats = stats_ptr + program.to(tl.int64) * 7
    if RATIO == 3:
        tl.store(loss_ptr + row, seq_loss)
        tl.store(stats + 0, seq_loss)
    else:
        tl.store(stats + 0, tl.sum(acc_loss, axis=0))
    tl.store(stats + 1, tl.sum(acc_masked, axis=0))
    tl.store(stats + 2, tl.sum(acc_popped, axis=0))
    tl.store(stats + 3, tl.sum(acc_clip, axis=0))
    tl.store(stats + 4, tl.sum(acc_lower, axis=0))
    tl.store(stats + 5, tl.sum(acc_kl, axis=0))
    if RATIO == 4:
        tl.store(stats + 6, row_phi)


def row_programs(ratio_code, seq_is):
    """Whether a launch runs one program per sequence (the sequence kernel: every
    sequence-level ratio, and token ratios under sequence IS) rather than one per block of
    tokens."""
    return ratio_code != 0 or seq_is != 0


# Token ratios under seq_is run one program per sequence; few long rows would leave most SMs
# idle, so up to _MAX_ROW_SPLITS programs share a row (each re-reads the row's old / rollout /
# mask for w_b, from L2), aiming at _PROGRAMS_PER_SM programs per SM. The interpreter aims at
# _INTERPRET_PROGRAMS so that the tests meet split rows.
_MAX_ROW_SPLITS, _PROGRAMS_PER_SM, _INTERPRET_PROGRAMS = 16, 4, 8


def row_splits(n, num_rows, block, device, interpret):
    """Programs per sequence for token ratios under seq_is: enough for the GPU when the rows
    are few, never more than the mean row's chunks (sizes the host has: no sync)."""
    from ..._launch import sm_count
    rows = max(num_rows, 1)
    mean_chunks = -(-n // (rows * block))
    target = _INTERPRET_PROGRAMS if interpret else _PROGRAMS_PER_SM * sm_count(device.index)
    return max(1, min(mean_chunks, -(-target // rows), _MAX_ROW_SPLITS))


def seq_maxnreg():
    """The register cap a sequence-kernel launch passes."""
    return _SEQ_MAXNREG


def policy_fwd(spec, codes, lp, old, adv, mask, token_weights, rollout, selection, cu_seqlens,
               loss_out, grad_out, stats_out, *, row_len, adv_per_seq, gate_low, gate_high,
               eps_low, eps_high, dual_clip, params, has_delta, block, num_warps,
               seq_is=0, seq_is_low=0.0, seq_is_high=0.0, row_splits=1):
    """Launch the family's kernel for ``spec``: token kernel over cdiv(N, block) programs or,
    where :func:`row_programs`, the sequence kernel over ``row_splits`` programs per row
    (token ratios only; ``stats_out`` rows must match)."""
    ratio_code, objective_code, gate_code = codes
    floats = dict(gate_low=gate_low, gate_high=gate_high,
                  log_clamp=spec.log_ratio_clamp or 0.0, clip_low=1.0 - eps_low,
                  clip_high=1.0 + eps_high, eps_low=eps_low, eps_high=eps_high,
                  dual_clip=1.0 if dual_clip is None else dual_clip,
                  p0=params[0], p1=params[1], p2=params[2], p3=params[3])
    switches = dict(OBJECTIVE=objective_code, GATE=gate_code, HAS_MASK=mask is not None,
                    HAS_TW=token_weights is not None, CLAMP=spec.log_ratio_clamp is not None,
                    HAS_DELTA=objective_code == 0 and has_delta,
                    DUAL_CLIP=dual_clip is not None, ADV_PER_SEQ=adv_per_seq,
                    STORE_LOSS=loss_out.numel() > 0, STORE_GRAD=grad_out.numel() > 0,
                    BLOCK=block, num_warps=num_warps)
    fallback = lp                       # a valid pointer for absent optional inputs
    pointers = [lp, old, adv, fallback if mask is None else mask,
                fallback if token_weights is None else token_weights,
                fallback if rollout is None else rollout]
    grid = (stats_out.shape[0],)
    if not row_programs(ratio_code, seq_is):
        _policy_token_kernel[grid](
            *pointers, fallback if selection is None else selection, loss_out, grad_out,
            stats_out, lp.numel(), max(row_len, 1), HAS_SEL=selection is not None,
            **floats, **switches)
    else:
        _policy_seq_kernel[grid](
            *pointers, fallback if selection is None else selection,
            fallback if cu_seqlens is None else cu_seqlens, loss_out, grad_out,
            stats_out, max(row_len, 1), row_splits, HAS_SEL=selection is not None,
            seq_log_max=spec.seq_log_ratio_max or 0.0,
            seq_is_low=seq_is_low, seq_is_high=seq_is_high, SEQ_IS=seq_is,
            RATIO=ratio_code, HAS_SEQ_MAX=spec.seq_log_ratio_max is not None,
            HAS_CU=cu_seqlens is not None, maxnreg=seq_maxnreg(), **floats, **switches)


def _policy_aot_specs():
    """The GPU launches of the presets (bf16 log-probs, mask, decoupled gate and token
    weights: the most inputs a launch reads), at the block sizes loss/policy/policy.py uses."""
    from ..._aot import AotSpec
    floats = ("gate_low", "gate_high", "log_clamp", "clip_low", "clip_high", "eps_low",
              "eps_high", "dual_clip", "p0", "p1", "p2", "p3")
    base = {"lp_ptr": "*bf16", "old_ptr": "*fp32", "adv_ptr": "*fp32", "mask_ptr": "*u8",
            "tw_ptr": "*fp32", "rollout_ptr": "*fp32"}
    outputs = {"loss_ptr": "*fp32", "grad_ptr": "*fp32", "stats_ptr": "*fp32"}
    specs = []
    token = [("vanilla", 0, dict(DUAL_CLIP=True)), ("cispo", 1, {}), ("sapo", 2, {}),
             ("dppo_kl", 5, {}), ("kl_cov", 8, dict(HAS_SEL=True))]
    for name, objective, extra in token:
        sig = dict(base, sel_ptr="*u8", **outputs, n_tokens="i32", seq_len="i32",
                   **{f: "fp32" for f in floats})
        constexprs = dict(OBJECTIVE=objective, GATE=2, HAS_MASK=True, HAS_TW=True,
                          HAS_SEL=False, CLAMP=True, HAS_DELTA=False, DUAL_CLIP=False,
                          ADV_PER_SEQ=False, STORE_LOSS=False, STORE_GRAD=True, BLOCK=2048)
        constexprs.update(extra)
        sig.update({k: "constexpr" for k in constexprs})
        specs.append(AotSpec(f"policy_token[{name},gate,weights]", _policy_token_kernel, sig,
                             constexprs, num_warps=8))
    # (name, ratio, objective, seq_is, extra constexprs); the token presets under sequence IS
    # run the sequence kernel (RATIO 0: phase 0 + the token math), as GMPO does (phase 0)
    seq = [("gspo", 1, 0, 0, {}), ("grpo_sequence", 2, 0, 0, {}), ("geo_mean", 3, 0, 0, {}),
           ("vespo", 4, 9, 0, {}), ("gspo", 1, 0, 2, {}), ("grpo_sequence", 2, 0, 2, {}),
           ("geo_mean", 3, 0, 2, {}), ("vanilla", 0, 0, 2, dict(DUAL_CLIP=True)),
           ("vanilla", 0, 0, 1, dict(DUAL_CLIP=True)), ("cispo", 0, 1, 1, {}),
           ("sapo", 0, 2, 2, {}), ("dppo_kl", 0, 5, 2, {}),
           ("kl_cov", 0, 8, 2, dict(HAS_SEL=True, CLAMP=False))]
    for name, ratio, objective, seq_is, extra in seq:
        sig = dict(base, sel_ptr="*u8", cu_ptr="*i32", **outputs, seq_len="i32",
                   n_splits="i32", **{f: "fp32" for f in floats[:8]}, seq_log_max="fp32",
                   **{f: "fp32" for f in floats[8:]}, seq_is_low="fp32", seq_is_high="fp32")
        constexprs = dict(RATIO=ratio, OBJECTIVE=objective, GATE=2, HAS_MASK=True,
                          HAS_TW=True, HAS_SEL=False, CLAMP=ratio != 2,
                          HAS_SEQ_MAX=ratio == 1, HAS_DELTA=False, DUAL_CLIP=False,
                          HAS_CU=True, ADV_PER_SEQ=True, STORE_LOSS=False, STORE_GRAD=True,
                          SEQ_IS=seq_is, BLOCK=1024)
        constexprs.update(extra)
        if ratio != 0:
            constexprs["n_splits"] = 1     # a runtime 1: Triton's JIT specializes it so
        sig.update({k: "constexpr" for k in constexprs})
        label = f"{name},packed,gate,weights" + ("", ",seq_tis", ",seq_mis")[seq_is]
        specs.append(AotSpec(f"policy_seq[{label}]", _policy_seq_kernel, sig, constexprs,
                             num_warps=4, maxnreg=seq_maxnreg()))
    return specs


AOT_SPECS = _policy_aot_specs()
