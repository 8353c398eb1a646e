"""Plain-PyTorch definition of the reverse KL from logits: the oracle and the torch backend.

With z = logits / T, KL(p_s || p_t) = sum_v p_s,v (log p_s,v - log p_t,v) and
d KL / dz_s = p_s (log p_s - log p_t - KL); the teacher gets no gradient. The per-shard
statistics (m_s, s_s, u, m_t, s_t) are combined across a vocab-parallel group by
``loss/_common/vocab_parallel.py`` and finished by ``finalize_reverse_kl``
(``loss/_common/softmax.py``).
"""
import torch

from ..._row_invariant import row_shift
from .._common.softmax import NEG_INF, finalize_reverse_kl  # noqa: F401 (the op's finish)


def reverse_kl_reference(student_logits, teacher_logits, temperature=1.0):
    """KL(p_student || p_teacher) per row in fp32; the teacher gets no gradient."""
    log_s = torch.log_softmax(student_logits.float() / temperature, dim=-1)
    log_t = torch.log_softmax(teacher_logits.detach().float() / temperature, dim=-1)
    support = log_s != NEG_INF
    diff = torch.where(support, log_s - torch.where(support, log_t, 0.0), 0.0)
    return (log_s.exp() * diff).sum(-1)


def reverse_kl_partial_stats(student, teacher, inv_temp):
    """[N, 5] fp32 statistics of the columns held: (m_s, s_s, u, m_t, s_t), where
    u = sum e^(z_s - m_s) (z_s - z_t) over columns with z_s > -inf."""
    z_s = student.float() * inv_temp
    z_t = teacher.float() * inv_temp
    m_s, m_t = z_s.amax(-1), z_t.amax(-1)
    e_s = (z_s - row_shift(m_s).unsqueeze(-1)).exp()
    e_t = (z_t - row_shift(m_t).unsqueeze(-1)).exp()
    u = (e_s * torch.where(z_s > NEG_INF, z_s - z_t, 0.0)).sum(-1)
    return torch.stack([m_s, e_s.sum(-1), u, m_t, e_t.sum(-1)], -1)


def reverse_kl_grad(student, teacher, lse_s, lse_t, kl, coef, inv_temp):
    """d(sum coef * KL)/d student [N, V] fp32: coef / T * p_s (log p_s - log p_t - KL)."""
    log_s = student.float() * inv_temp - lse_s.unsqueeze(-1)
    log_t = teacher.float() * inv_temp - lse_t.unsqueeze(-1)
    p = log_s.exp()
    c = (coef.float() * inv_temp).unsqueeze(-1)
    term = p * torch.where(p > 0, log_s - log_t - kl.unsqueeze(-1), 0.0)
    return torch.where(c == 0, 0.0, c * term)
