"""Plain-PyTorch definitions of the from-logits ops: the oracle, the CPU path, the spec.

With z = logits / T (temperature T), p = softmax(z), lse = logsumexp(z):

    selective log-prob   lp = z[t] - lse                       (log p of the sampled token t)
    entropy              H  = -sum_v p_v log p_v               (-inf entries contribute 0)
    reverse KL           KL(p_s || p_t) = sum_v p_s,v (log p_s,v - log p_t,v)
    IcePop from logits   icepop_loss(lp(logits, t), ...)       (loss/icepop/_reference.py)

Gradients (what the kernels write, softmax recomputed from the saved lse):

    d lp / dz = onehot(t) - p
    d H  / dz = -p (log p + H)
    d KL / dz_s = p_s (log p_s - log p_t - KL)

The first block holds the oracles (autograd gives the gradients). The second block is the
torch backend: the same closed forms the Triton kernels compute, shard-aware (a tensor may hold
only the vocab columns [vocab_start, vocab_start + V) of a vocab-parallel layout).
"""
from __future__ import annotations

import torch

from ..._row_invariant import row_logsumexp, row_shift, row_sum

NEG_INF = float("-inf")


# --------------------------------------------------------------------------- oracles
def selective_logprobs_reference(logits, token_ids, temperature=1.0, return_entropy=False):
    """log_softmax(logits / T)[token] in fp32; optionally the entropy -sum p log p."""
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    lp = logp.gather(-1, token_ids.long().unsqueeze(-1)).squeeze(-1)
    if not return_entropy:
        return lp
    # -inf entries (p = 0) contribute 0; select before multiplying so autograd sees no 0 * inf.
    finite_logp = torch.where(logp == NEG_INF, 0.0, logp)
    entropy = -(logp.exp() * finite_logp).sum(-1)
    return lp, entropy


# --------------------------------------------------------------------------- torch backend
def logprob_partial_stats(logits, token_ids, inv_temp, vocab_start, want_entropy):
    """[N, 4] fp32 statistics of the columns this tensor holds: (m, s, t, z_t).

    m = max z, s = sum e^(z - m), t = sum e^(z - m) (z - m) (0 unless ``want_entropy``),
    z_t = z of the target column when this tensor holds it, else 0 (another shard owns it).
    """
    z = scaled_fp32(logits, inv_temp)
    v = z.shape[-1]
    m = z.amax(-1)
    shifted = z - row_shift(m).unsqueeze(-1)
    e = shifted.exp()
    s = row_sum(e)
    if want_entropy:
        t = row_sum(e * torch.where(z > NEG_INF, shifted, 0.0))
    else:
        t = torch.zeros_like(s)
    local = token_ids.long() - vocab_start
    owned = (local >= 0) & (local < v)
    z_t = z.gather(-1, local.clamp(0, v - 1).unsqueeze(-1)).squeeze(-1)
    return torch.stack([m, s, t, torch.where(owned, z_t, 0.0)], -1)


def finalize_logprob_stats(m, s, t, z_t):
    """(lp, lse, entropy) from full-vocab statistics: lse = m + log s, H = log s - t / s."""
    log_s = torch.log(s)
    lse = m + log_s
    return z_t - lse, lse, log_s - t / s


def scaled_fp32(logits, inv_temp):
    """A private fp32 copy of z = logits * inv_temp (callers modify it in place)."""
    z = logits.to(torch.float32, copy=True)
    return z if inv_temp == 1.0 else z.mul_(inv_temp)


def logprobs_lse_entropy(logits, token_ids, inv_temp, want_entropy):
    """(lp, lse, entropy or None) of whole rows: lse = logsumexp z, lp = z_t - lse,
    H = sum entr(softmax z) (entr(0) = 0: -inf entries contribute 0)."""
    z = scaled_fp32(logits, inv_temp)
    lse = row_logsumexp(z)
    lp = z.gather(-1, token_ids.long().unsqueeze(-1)).squeeze(-1) - lse
    if not want_entropy:
        return lp, lse, None
    # softmax as e^(z - lse): elementwise, so the same bits in any batch (torch.softmax is not).
    return lp, lse, row_sum(torch.special.entr(torch.exp(z - lse.unsqueeze(-1))))


def softmax_grad(logits, token_ids, lse, entropy, coef, coef_entropy, inv_temp, vocab_start):
    """dL/dlogits [N, V] fp32 for L = sum coef * lp + coef_entropy * H (entropy optional).

    A row whose coefficients are exactly 0 gets exactly 0 even if its logits are NaN/inf.
    """
    return softmax_grad_of_z(scaled_fp32(logits, inv_temp), token_ids, lse, entropy, coef,
                             coef_entropy, inv_temp, vocab_start)


def softmax_grad_of_z(z, token_ids, lse, entropy, coef, coef_entropy, inv_temp, vocab_start):
    """softmax_grad from z = logits * inv_temp in fp32 (consumed: modified in place)."""
    logp = z.sub_(lse.unsqueeze(-1))
    p = logp.exp()
    c = coef.float() * inv_temp
    grad = p * -c.unsqueeze(-1)                                   # the -c p part of c(onehot - p)
    local = token_ids.long() - vocab_start
    owned = (local >= 0) & (local < logp.shape[-1])
    grad.scatter_add_(-1, local.clamp(0, logp.shape[-1] - 1).unsqueeze(-1),
                      torch.where(owned, c, 0.0).unsqueeze(-1))
    zero_rows = c == 0
    if coef_entropy is not None:
        c_ent = coef_entropy.float() * inv_temp
        plogp = p * torch.where(p > 0, logp + entropy.unsqueeze(-1), 0.0)
        grad -= c_ent.unsqueeze(-1) * plogp
        zero_rows &= c_ent == 0
    # Only rows with a non-finite lse (NaN/inf logits) can hold NaN here; on CPU the check is
    # free, on a GPU it would cost a sync, so the fill runs unconditionally there.
    zero_rows &= ~torch.isfinite(lse)
    if grad.is_cuda or bool(zero_rows.any()):
        grad.masked_fill_(zero_rows.unsqueeze(-1), 0.0)
    return grad


def finalize_reverse_kl(m_s, s_s, u, m_t, s_t):
    """(kl, lse_s, lse_t): KL = E_s[z_s - z_t] - (lse_s - lse_t)."""
    lse_s = m_s + torch.log(s_s)
    lse_t = m_t + torch.log(s_t)
    return u / s_s - (lse_s - lse_t), lse_s, lse_t


