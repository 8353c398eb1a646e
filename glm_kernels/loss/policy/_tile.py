"""Per-tile math of the policy-loss family (``@triton.jit`` helpers only), shared by the
token and the sequence kernel of ``loss/policy/_kernels.py``: the objective of one tile, a
tile's inputs, a token-ratio tile's weighted terms and gradient, the sequence IS weight, and
the stats row."""
import triton
import triton.language as tl

from .._common.tiles import icepop_gate, ppo_clip_term

# 20.0 = verl rollout_corr_helper.SAFETY_BOUND (loss/policy/sequence_is.py): the sequence IS
# log-weight's clamp
_SEQ_IS_LOG_BOUND = tl.constexpr(20.0)


@triton.jit
def pick_tie(a, b, da, db):
    """d max(a, b) as autograd takes it: the larger branch's derivative, the mean at a tie."""
    return tl.where(a > b, da, tl.where(b > a, db, 0.5 * (da + db)))


@triton.jit
def policy_objective(lp, old, adv, ratio, log_ratio, sel, clip_low, clip_high, eps_low,
                     eps_high, dual_clip, p0, p1, p2, p3,
                     OBJECTIVE: tl.constexpr, HAS_DELTA: tl.constexpr, DUAL_CLIP: tl.constexpr):
    """Per-token loss of one objective (fp32 tile) and its partial derivatives.

    Returns (loss, dl/dratio, dl/dlp held ratio fixed, dl/dlog_ratio held ratio fixed,
    clip indicator, clip-lower indicator). ``ratio`` is the variant's (token or sequence)
    ratio, ``log_ratio`` the token's (clamped) log-ratio, ``sel`` the clip_cov / kl_cov
    selection. Formulas: docs/policy_loss.md; p0..p3 are the objective's parameters.
    """
    zero = tl.zeros_like(lp)
    d_ratio = zero
    d_lp = zero
    d_log_ratio = zero
    clip = zero
    clip_lower = zero
    if OBJECTIVE == 0 or OBJECTIVE == 7:                      # ppo, clip_cov
        loss, unclipped, clipped_term, branch_cut = ppo_clip_term(ratio, adv, clip_low,
                                                                  clip_high)
        d_clipped = tl.where((ratio >= clip_low) & (ratio <= clip_high), -adv, 0.0)
        if HAS_DELTA:                                         # TRL: min(ratio, delta) A
            unclipped = -tl.minimum(ratio, p0) * adv
            loss = tl.maximum(unclipped, clipped_term)
            d_unclipped = tl.where(ratio <= p0, -adv, 0.0)
        else:
            d_unclipped = -adv
        d_ratio = pick_tie(unclipped, clipped_term, d_unclipped, d_clipped)
        clip = branch_cut.to(tl.float32)
        if OBJECTIVE == 7:
            keep = 1.0 - sel
            loss = loss * keep
            d_ratio = d_ratio * keep
            clip = sel
        elif DUAL_CLIP:
            bound = -dual_clip * adv
            neg = adv < 0.0
            clip_lower = (neg & (loss > bound)).to(tl.float32)
            d_capped = tl.where(loss < bound, d_ratio, tl.where(loss > bound, 0.0, 0.5 * d_ratio))
            d_ratio = tl.where(neg, d_capped, d_ratio)
            loss = tl.where(neg, tl.minimum(loss, bound), loss)
    elif OBJECTIVE == 1:                                      # cispo: -sg(clip(r)) A lp
        clipped = tl.minimum(tl.maximum(ratio, p0), p1)
        loss = -clipped * adv * lp
        d_lp = -clipped * adv
        clip = (ratio != clipped).to(tl.float32)
    elif OBJECTIVE == 2:                                      # sapo: soft gate
        tau = tl.where(adv > 0.0, p0, p1)
        soft = tl.sigmoid(tau * (ratio - 1.0))
        loss = -soft * (4.0 / tau) * adv
        d_ratio = -4.0 * adv * soft * (1.0 - soft)
    elif OBJECTIVE == 3:                                      # reinforce / gpg
        loss = -adv * lp
        d_lp = -adv
    elif OBJECTIVE == 4 or OBJECTIVE == 5:                    # dppo_tv, dppo_kl
        truncated = tl.minimum(ratio, p0)
        prob = tl.exp(lp)
        old_prob = tl.exp(old)
        if OBJECTIVE == 4:
            valid_pos = (prob - old_prob) <= eps_high
            valid_neg = (prob - old_prob) >= -eps_low
        else:
            binary_kl = old_prob * (old - lp) + (1.0 - old_prob) * tl.log(
                (1.0 - old_prob + 1e-8) / (1.0 - prob + 1e-8))
            valid_pos = (binary_kl <= eps_high) | (prob <= old_prob)
            valid_neg = (binary_kl <= eps_low) | (prob >= old_prob)
        valid = tl.where(adv > 0.0, valid_pos, valid_neg).to(tl.float32)
        loss = -adv * truncated * lp * valid
        d_lp = -adv * truncated * valid
        clip = 1.0 - valid
        clip_lower = (ratio > p0).to(tl.float32) * valid
    elif OBJECTIVE == 6:                                      # dro
        loss = -(lp * adv - 0.5 * p0 * log_ratio * log_ratio)
        d_lp = -adv
        d_log_ratio = p0 * log_ratio
    elif OBJECTIVE == 8:                                      # kl_cov
        abs_lr = tl.abs(log_ratio)
        loss = -adv * ratio + sel * p0 * abs_lr
        d_ratio = -adv
        sign = tl.where(log_ratio > 0.0, 1.0, tl.where(log_ratio < 0.0, -1.0, 0.0))
        d_log_ratio = sel * p0 * sign
    else:                                                     # vespo: ratio holds phi
        loss = -ratio * adv * lp
        d_lp = -ratio * adv
    return loss, d_ratio, d_lp, d_log_ratio, clip, clip_lower


@triton.jit
def load_tile(offs, valid, lp_ptr, old_ptr, mask_ptr, tw_ptr, rollout_ptr, sel_ptr,
               gate_low, gate_high, log_clamp,
               HAS_MASK: tl.constexpr, HAS_TW: tl.constexpr, GATE: tl.constexpr,
               HAS_SEL: tl.constexpr, CLAMP: tl.constexpr):
    """Per-token inputs of a tile: (lp, old, masked, keep, factor, popped, sel, raw log-ratio,
    clamped log-ratio, its in-range indicator)."""
    lp = tl.load(lp_ptr + offs, mask=valid, other=0.0).to(tl.float32)
    old = tl.load(old_ptr + offs, mask=valid, other=0.0).to(tl.float32)
    masked = valid
    if HAS_MASK:
        masked = masked & (tl.load(mask_ptr + offs, mask=valid, other=0) != 0)
    if GATE != 0:
        rollout = tl.load(rollout_ptr + offs, mask=valid, other=0.0).to(tl.float32)
        if GATE == 1:
            gate_log_ratio = lp - rollout
        else:
            gate_log_ratio = old - rollout
        keep, in_gate, gate_ratio, factor = icepop_gate(gate_log_ratio, masked, valid,
                                                        gate_low, gate_high, GATE == 2)
        popped = masked & ~in_gate
    else:
        keep = masked
        factor = tl.where(masked, 1.0, 0.0)
        popped = masked & (lp != lp) & (lp == lp)             # all False, a tile's shape
    if HAS_TW:
        tw = tl.load(tw_ptr + offs, mask=valid, other=1.0).to(tl.float32)
    else:
        tw = tl.full(lp.shape, 1.0, tl.float32)
    if HAS_SEL:
        sel = (tl.load(sel_ptr + offs, mask=valid, other=0) != 0).to(tl.float32)
    else:
        sel = tl.zeros_like(lp)
    raw = lp - old
    if CLAMP:
        log_ratio = tl.clamp(raw, -log_clamp, log_clamp)
        in_range = ((raw >= -log_clamp) & (raw <= log_clamp)).to(tl.float32)
    else:
        log_ratio = raw
        in_range = tl.full(lp.shape, 1.0, tl.float32)
    return lp, old, masked, keep, factor, popped, tw, sel, raw, log_ratio, in_range


@triton.jit
def store_stats(stats, loss_sum, masked, popped, clip, clip_lower, kl):
    tl.store(stats + 0, loss_sum)
    tl.store(stats + 1, tl.sum(masked.to(tl.float32), axis=0))
    tl.store(stats + 2, tl.sum(popped.to(tl.float32), axis=0))
    tl.store(stats + 3, tl.sum(tl.where(masked, clip, 0.0), axis=0))
    tl.store(stats + 4, tl.sum(tl.where(masked, clip_lower, 0.0), axis=0))
    tl.store(stats + 5, tl.sum(tl.where(masked, kl, 0.0), axis=0))


@triton.jit
def token_terms(lp, old, adv, keep, factor, sel, log_ratio, in_range, clip_low, clip_high,
                eps_low, eps_high, dual_clip, p0, p1, p2, p3, OBJECTIVE: tl.constexpr,
                HAS_DELTA: tl.constexpr, DUAL_CLIP: tl.constexpr):
    """A token-ratio tile: (weighted loss terms, d terms / d lp, clip and clip-lower
    indicators, kl term). ``factor``: the token's whole weight (gate x token weights x
    sequence IS weight); a token of factor 0 gets exactly 0 in both, whatever its inputs."""
    ratio = tl.exp(log_ratio)
    loss, d_ratio, d_lp, d_log_ratio, clip, clip_lower = policy_objective(
        lp, old, adv, ratio, log_ratio, sel, clip_low, clip_high, eps_low, eps_high, dual_clip,
        p0, p1, p2, p3, OBJECTIVE, HAS_DELTA, DUAL_CLIP)
    live = keep & (factor != 0.0)
    terms = tl.where(live, factor * loss, 0.0)
    grad = tl.where(live, factor * ((d_ratio * ratio + d_log_ratio) * in_range + d_lp), 0.0)
    if OBJECTIVE == 8:                                        # kl_cov: verl's |lr|
        kl = tl.abs(log_ratio)
    else:
        kl = -log_ratio
    return terms, grad, clip, clip_lower, kl


@triton.jit
def seq_is_weight(log_sum, seq_is_low, seq_is_high, SEQ_IS: tl.constexpr):
    """The sequence IS weight from the row's sum of masked old - rollout: exp of it clamped to
    +-20, truncated at seq_is_high (SEQ_IS 1) or zeroed outside [seq_is_low, seq_is_high]
    (SEQ_IS 2). NaN propagates, as torch's clamp and min do (the torch backend's weight)."""
    w = tl.exp(tl.clamp(log_sum, -_SEQ_IS_LOG_BOUND, _SEQ_IS_LOG_BOUND,
                        propagate_nan=tl.PropagateNan.ALL))
    if SEQ_IS == 1:
        w = tl.minimum(w, seq_is_high, propagate_nan=tl.PropagateNan.ALL)
    else:
        w = tl.where((w >= seq_is_low) & (w <= seq_is_high), w, 0.0)
    return w


@triton.jit
def row_seq_is_weight(start, end, old_ptr, rollout_ptr, mask_ptr, seq_is_low, seq_is_high,
                      HAS_MASK: tl.constexpr, SEQ_IS: tl.constexpr, BLOCK: tl.constexpr):
    """The sequence IS weight of the row [start, end): one loop over its old, rollout and
    mask (the row's first pass, for the sequence programs whose phase 1 needs the weight
    already: token ratios and GMPO)."""
    lane = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], tl.float32)
    for chunk in range(start, end, BLOCK):
        offs = chunk + lane
        valid = offs < end
        masked = valid
        if HAS_MASK:
            masked = masked & (tl.load(mask_ptr + offs, mask=valid, other=0) != 0)
        old = tl.load(old_ptr + offs, mask=valid, other=0.0).to(tl.float32)
        rollout = tl.load(rollout_ptr + offs, mask=valid, other=0.0).to(tl.float32)
        acc += tl.where(masked, old - rollout, 0.0)
    return seq_is_weight(tl.sum(acc, axis=0), seq_is_low, seq_is_high, SEQ_IS)


@triton.jit
def row_bounds(cu_ptr, row, seq_len, HAS_CU: tl.constexpr):
    """[start, end) of sequence ``row``: from ``cu_seqlens`` (packed) or row x seq_len."""
    if HAS_CU:
        start = tl.load(cu_ptr + row).to(tl.int64)
        end = tl.load(cu_ptr + row + 1).to(tl.int64)
    else:
        start = row.to(tl.int64) * seq_len
        end = start + seq_len
    return start, end
