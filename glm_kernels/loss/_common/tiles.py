"""``@triton.jit`` helpers shared by the loss kernels (no kernels and no launchers here).

Vocab sweep (log-probs, IcePop from logits, reverse KL, nucleus): rows hold the vocab columns
[vocab_start, vocab_start + V) of a vocabulary of vocab_total entries, z = logits * inv_temp in
fp32, online log-sum-exp m' = max(m, max z), s' = s e^(m - m') + sum e^(z - m').
IcePop token math (IcePop's kernels and the policy family's tiles): the gate, the PPO clip term
and one token's loss / gradient / counts.
"""
import triton
import triton.language as tl

NEG_INF = float("-inf")


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
def lse_entropy_tile(m, s, t, z):
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
def target_logit(base, tid, vocab_start, V, vocab_total, flag_ptr, inv_temp):
    """z of the target column if this shard owns it, else 0; flags ids outside the vocab."""
    valid = (tid >= 0) & (tid < vocab_total)
    if (tid < 0) | (tid >= vocab_total):
        tl.store(flag_ptr, 1)           # racy but every writer stores the same value
    local = tid - vocab_start
    owned = valid & (local >= 0) & (local < V)
    z_t = tl.load(base + local, mask=owned, other=0.0).to(tl.float32) * inv_temp
    return z_t, valid, owned


@triton.jit
def softmax_grad_tile(z, cols, tid_local, lse, coef, ent, coef_ent, ENTROPY: tl.constexpr):
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
def load_z(base, cols, V, inv_temp):
    return tl.load(base + cols, mask=cols < V, other=float("-inf")).to(tl.float32) * inv_temp


@triton.jit
def load_row_tile(base, k, V, BLOCK_V: tl.constexpr):
    """Tile k of a row, kept in the storage dtype (bf16: half the registers of fp32)."""
    cols = k * BLOCK_V + tl.arange(0, BLOCK_V)
    return tl.load(base + cols, mask=cols < V, other=float("-inf")), cols


@triton.jit
def sum_exp(x, inv_temp, m):
    return tl.sum(tl.exp(x.to(tl.float32) * inv_temp - safe_max(m)), axis=0)


@triton.jit
def store_grad_tile(out, z, cols, V, tid, lse, coef):
    g = softmax_grad_tile(z, cols, tid, lse, coef, 0.0, 0.0, False)
    tl.store(out + cols, g.to(out.dtype.element_ty), mask=cols < V)


@triton.jit
def store_softmax_grad_tile(out, x, cols, V, inv_temp, lse, coef):
    """coef (0 - softmax) on one held tile: the gradient of every column but the target's,
    which the caller writes afterwards. (0 - p), not -p: the arithmetic of softmax_grad_tile,
    zeros included (-p would flip their sign)."""
    p = tl.exp(x.to(tl.float32) * inv_temp - lse)
    g = tl.where(coef == 0.0, 0.0, coef * (0.0 - p))
    tl.store(out + cols, g.to(out.dtype.element_ty), mask=cols < V)
