"""selective_logprobs' torch backend, in row chunks: the closed forms of ``_common/softmax``
(lse, H = log s - t / s, d/dz = c (onehot - p) - c_H p (log p + H)) computed over a few rows
at a time in two reused fp32 scratch buffers.

Why chunks: on CPU the whole-tensor version spends most of its time on fresh [N, V]
temporaries, not arithmetic. A new buffer of that size is fresh memory from the OS, and
filling it page-faults every page (measured, one thread, [2048, 32768] fp32: a fresh
zeros_like 221 ms against 76 ms for an exp into a reused buffer; torch.logsumexp 338 ms,
special.entr 472 ms). A chunk's scratch is reused, stays in cache, and every [N, V] pass
reads the logits once. Forward allocates no [N, V] tensor; backward writes the gradient
(its only [N, V] tensor, or the logits themselves in place) chunk by chunk.

Under ``glm_kernels.batch_invariant()`` the whole-row reference (fixed-order tree sums) runs
instead (``logprobs.py`` picks it), so these need no invariance of their own.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

NEG_INF = float("-inf")
FLT_MIN_FINITE = -torch.finfo(torch.float32).max
# Elements per scratch buffer. CPU: 1 MiB fp32, so a chunk and its two buffers stay in L2 /
# L3. CUDA (the torch backend there is a fallback; the caching allocator has no first-touch
# cost): 64 MiB, so the per-chunk launches stay few (~110 rows of a 152k vocab per chunk).
CHUNK_ELEMENTS = {"cpu": 1 << 18, "cuda": 1 << 24}


def _rows_per_chunk(v: int, device: torch.device) -> int:
    return max(1, CHUNK_ELEMENTS.get(device.type, 1 << 18) // max(v, 1))


def _scaled_into(buf: torch.Tensor, logits_chunk: torch.Tensor, inv_temp: float) -> torch.Tensor:
    """buf <- fp32 logits_chunk * inv_temp (one pass)."""
    if inv_temp != 1.0 and logits_chunk.dtype == torch.float32:
        return torch.mul(logits_chunk, inv_temp, out=buf)
    buf.copy_(logits_chunk)                     # widen first: scale in fp32, as the reference
    return buf if inv_temp == 1.0 else buf.mul_(inv_temp)


def logprobs_lse_entropy(logits: torch.Tensor, token_ids: torch.Tensor, inv_temp: float,
                         want_entropy: bool
                         ) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """(lp, lse, entropy or None) [N] fp32 of [N, V] logits: the reference's values."""
    n, v = logits.shape
    rows = _rows_per_chunk(v, logits.device)
    device = logits.device
    lse = torch.empty(n, dtype=torch.float32, device=device)
    entropy = torch.empty(n, dtype=torch.float32, device=device) if want_entropy else None
    shifted = torch.empty((min(rows, n), v), dtype=torch.float32, device=device)
    e = torch.empty_like(shifted)
    for start in range(0, n, rows):
        stop = min(start + rows, n)
        z = _scaled_into(shifted[:stop - start], logits[start:stop], inv_temp)
        m = z.amax(-1, keepdim=True)
        m = torch.where(m == NEG_INF, 0.0, m)          # all -inf rows: e = 0, not NaN
        z.sub_(m)
        ez = torch.exp(z, out=e[:stop - start])
        s = ez.sum(-1)
        lse[start:stop] = m.squeeze(-1) + torch.log(s)
        if want_entropy:
            # -inf entries: e = 0 times a finite stand-in, so they contribute 0 (not NaN).
            z.clamp_(min=FLT_MIN_FINITE)
            t = torch.bmm(ez.unsqueeze(1), z.unsqueeze(2)).reshape(-1)
            entropy[start:stop] = torch.log(s) - t / s
    z_t = logits.gather(1, token_ids.long().unsqueeze(1)).squeeze(1).float() * inv_temp
    return z_t - lse, lse, entropy


def softmax_grad_into(out: torch.Tensor, logits: torch.Tensor, token_ids: torch.Tensor,
                      lse: torch.Tensor, entropy: Optional[torch.Tensor], coef: torch.Tensor,
                      coef_entropy: Optional[torch.Tensor], inv_temp: float,
                      vocab_start: int) -> None:
    """out <- dL/dlogits (``out`` may be ``logits``: each chunk is read before it is written).

    L = sum coef * lp + coef_entropy * H; a row whose coefficients are exactly 0 gets exactly
    0 (even with NaN / inf logits), as the reference.
    """
    n, v = logits.shape
    rows = _rows_per_chunk(v, logits.device)
    c = coef.float() * inv_temp
    c_ent = None if coef_entropy is None else coef_entropy.float() * inv_temp
    live = c != 0 if c_ent is None else (c != 0) | (c_ent != 0)
    check_rows = not logits.is_cuda            # skipping dead chunks reads c on the host
    local = token_ids.long() - vocab_start
    owned = (local >= 0) & (local < v)
    target = local.clamp(0, v - 1).unsqueeze(1)
    onehot = torch.where(owned, c, 0.0).unsqueeze(1)
    logp = torch.empty((min(rows, n), v), dtype=torch.float32, device=logits.device)
    p = torch.empty_like(logp) if c_ent is not None else None
    for start in range(0, n, rows):
        stop = min(start + rows, n)
        if check_rows and not bool(live[start:stop].any()):
            out[start:stop].zero_()            # e.g. prompt rows: no exp at all
            continue
        lg = _scaled_into(logp[:stop - start], logits[start:stop], inv_temp)
        lg.sub_(lse[start:stop].unsqueeze(1))
        cc = c[start:stop].unsqueeze(1)
        if c_ent is None:
            g = lg.exp_().mul_(-cc)                                  # -c p
        else:
            pp = torch.exp(lg, out=p[:stop - start])
            # -c p - c_H p (log p + H), with p log p = 0 where p = 0 (-inf logits).
            lg.add_(entropy[start:stop].unsqueeze(1)).mul_(-c_ent[start:stop].unsqueeze(1))
            lg.sub_(cc).mul_(pp)
            g = torch.where(pp > 0, lg, -cc * pp)
        g.scatter_add_(1, target[start:stop], onehot[start:stop])
        dead = ~live[start:stop]
        if not check_rows or bool(dead.any()):
            g.masked_fill_(dead.unsqueeze(1), 0.0)
        out[start:stop].copy_(g)
