"""Exact full-vocab reverse KL from logits (on-policy distillation), fused, vocab-parallel.

Math (readable version: ``reverse_kl/_reference.reverse_kl_reference``), z = logits / T::

    KL(p_s || p_t) = sum_v p_s,v (log p_s,v - log p_t,v)
                   = u / s_s - (lse_s - lse_t),   u = sum_v e^(z_s,v - m_s) (z_s,v - z_t,v)
    dKL/dz_s,v     = p_s,v (log p_s,v - log p_t,v - KL)        (the teacher gets no gradient)

One sweep reads both logits tensors once and carries (m_s, s_s, u, m_t, s_t) online; forward
saves lse_s, lse_t and KL [N] fp32; backward reads both tensors again and writes the student
gradient. With ``tp_group`` the five statistics of each shard are combined by two
all-reduces (``_vocab_parallel.combine_reverse_kl_stats``); backward needs no communication.
"""

from typing import Tuple

import torch

from ... import _checks, _dispatch
from .._common import checks as loss_checks
from . import _reference as ref
from .._common import vocab_parallel as _vocab_parallel
from .._common.launch import make_launch_config, rows_2d, run_op


def _kernels_or_none(backend: str):
    if backend == "torch":
        return None
    from . import _kernels as _reverse_kl_kernels
    return _reverse_kl_kernels


def _stats_impl(student: torch.Tensor, teacher: torch.Tensor, inv_temp: float,
                partial: bool) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    backend = _dispatch.select_backend("reverse_kl_from_logits", student, teacher)
    kernels = _kernels_or_none(backend)
    if kernels is None:
        stats = ref.reverse_kl_partial_stats(student, teacher, inv_temp)
        if partial:
            return stats, stats.new_empty(0), stats.new_empty(0)
        return ref.finalize_reverse_kl(*stats.unbind(-1))
    cfg = make_launch_config(backend)
    n = student.shape[0]
    new = lambda *shape: torch.empty(shape, dtype=torch.float32, device=student.device)  # noqa
    if partial:
        stats = new(n, 5)
        kernels.reverse_kl(student, teacher, kl=None, lse_s=None, lse_t=None, partial=stats,
                           inv_temp=inv_temp, block_v=cfg.block_v, num_warps=cfg.num_warps)
        return stats, new(0), new(0)
    kl, lse_s, lse_t = new(n), new(n), new(n)
    kernels.reverse_kl(student, teacher, kl=kl, lse_s=lse_s, lse_t=lse_t, partial=None,
                       inv_temp=inv_temp, block_v=cfg.block_v, num_warps=cfg.num_warps)
    return kl, lse_s, lse_t


@torch.library.custom_op("glm_kernels::reverse_kl_from_logits", mutates_args=())
def _stats_op(student: torch.Tensor, teacher: torch.Tensor, inv_temp: float,
              partial: bool) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(kl, lse_s, lse_t) [N] fp32, or with ``partial`` ([N, 5] shard statistics, [0], [0])."""
    return _stats_impl(student, teacher, inv_temp, partial)


@_stats_op.register_fake
def _stats_fake(student, teacher, inv_temp, partial):
    n = student.shape[0]
    new = lambda *shape: student.new_empty(shape, dtype=torch.float32)  # noqa: E731
    return (new(n, 5), new(0), new(0)) if partial else (new(n), new(n), new(n))


def _grad_impl(student: torch.Tensor, teacher: torch.Tensor, lse_s: torch.Tensor,
               lse_t: torch.Tensor, kl: torch.Tensor, grad_kl: torch.Tensor,
               inv_temp: float) -> torch.Tensor:
    backend = _dispatch.select_backend("reverse_kl_from_logits", student, teacher)
    kernels = _kernels_or_none(backend)
    if kernels is None:
        return ref.reverse_kl_grad(student, teacher, lse_s, lse_t, kl, grad_kl,
                                   inv_temp).to(student.dtype)
    cfg = make_launch_config(backend)
    grad = torch.empty_like(student)
    kernels.reverse_kl_grad(student, teacher, lse_s, lse_t, kl, grad_kl, grad,
                            inv_temp=inv_temp, block_v=cfg.block_v, num_warps=cfg.num_warps)
    return grad


@torch.library.custom_op("glm_kernels::reverse_kl_from_logits_backward", mutates_args=())
def _grad_op(student: torch.Tensor, teacher: torch.Tensor, lse_s: torch.Tensor,
             lse_t: torch.Tensor, kl: torch.Tensor, grad_kl: torch.Tensor,
             inv_temp: float) -> torch.Tensor:
    """d(sum grad_kl * KL)/d student [N, V] in the student's dtype."""
    return _grad_impl(student, teacher, lse_s, lse_t, kl, grad_kl, inv_temp)


@_grad_op.register_fake
def _grad_fake(student, teacher, lse_s, lse_t, kl, grad_kl, inv_temp):
    return torch.empty_like(student)


class _ReverseKL(torch.autograd.Function):
    @staticmethod
    def forward(ctx, student, teacher, inv_temp, tp_group):
        if tp_group is None:
            kl, lse_s, lse_t = run_op(_stats_op, _stats_impl, student, teacher, inv_temp, False)
        else:
            stats, _, _ = run_op(_stats_op, _stats_impl, student, teacher, inv_temp, True)
            kl, lse_s, lse_t = _vocab_parallel.combine_reverse_kl_stats(stats, tp_group)
        ctx.save_for_backward(student, teacher, lse_s, lse_t, kl)
        ctx.inv_temp = inv_temp
        return kl

    @staticmethod
    def backward(ctx, grad_kl):
        student, teacher, lse_s, lse_t, kl = ctx.saved_tensors
        grad = run_op(_grad_op, _grad_impl, student, teacher, lse_s, lse_t, kl,
                      grad_kl.float().contiguous(), ctx.inv_temp)
        return grad, None, None, None


def reverse_kl_from_logits(student_logits: torch.Tensor, teacher_logits: torch.Tensor, *,
                           temperature: float = 1.0, tp_group=None) -> torch.Tensor:
    """Per-token reverse KL(pi_student || pi_teacher) over the full vocabulary (mode-seeking).

    Parameters
    ----------
    student_logits : Tensor [*S, V], any float dtype
        Differentiable. With ``tp_group``: this rank's vocab shard (Megatron layout).
    teacher_logits : Tensor [*S, V], any float dtype (may differ from the student's)
        Never receives a gradient (detached inside).
    temperature : float, default 1.0
        Both distributions are softmax(logits / temperature).
    tp_group : ProcessGroup, optional
        Vocab-parallel group: the full-vocab KL on every rank; two all-reduces in forward
        (maxima; packed sums), none in backward.

    Returns
    -------
    kl : Tensor [*S] fp32, >= 0 up to rounding.

    Notes
    -----
    Vocab entries where the student is -inf contribute 0 (also where the teacher is -inf);
    an entry where only the teacher is -inf makes the KL +inf (the student puts mass where
    the teacher has none) and its gradient non-finite. Extra memory: three [N] fp32 vectors
    saved for backward; backward reads both logits tensors again.

    Example
    -------
    >>> import torch
    >>> from glm_kernels.loss import reverse_kl_from_logits
    >>> student = torch.tensor([[0.0, 0.0], [1.0, 1.0]], requires_grad=True)
    >>> teacher = torch.tensor([[0.0, 0.0], [0.0, 2.0]])
    >>> kl = reverse_kl_from_logits(student, teacher)
    >>> [round(x, 4) for x in kl.tolist()]          # identical rows: 0; [0.5, 0.5] vs teacher
    [0.0, 0.4338]
    >>> kl.sum().backward(); student.grad.shape
    torch.Size([2, 2])
    """
    _checks.check_tensor("student_logits", student_logits, floating=True)
    _checks.check_tensor("teacher_logits", teacher_logits, floating=True)
    _checks.check_same_shape("teacher_logits", teacher_logits, "student_logits",
                               student_logits)
    if student_logits.dim() < 1 or student_logits.shape[-1] == 0:
        raise ValueError("student_logits must be [*S, V] with V >= 1, got shape "
                         f"{tuple(student_logits.shape)}")
    _checks.check_same_device({"student_logits": student_logits,
                                 "teacher_logits": teacher_logits})
    temperature = _checks.check_finite_number("temperature", temperature, positive=True)
    loss_checks.check_tp_group(tp_group)
    kl = _ReverseKL.apply(rows_2d(student_logits), rows_2d(teacher_logits.detach()),
                          1.0 / temperature, tp_group)
    return kl.reshape(student_logits.shape[:-1])


# torch 2.4's dynamo traces _ReverseKL to a wrong gradient (up to 100% off, even with the
# "eager" backend; torch 2.5 and newer are exact, tests/loss/test_logits_reverse_kl.py). There
# the op stays out of compiled graphs: a graph break runs it eagerly, and fullgraph=True
# raises instead of training on a wrong gradient.
if _dispatch.torch_version() < (2, 5):
    reverse_kl_from_logits = torch.compiler.disable(reverse_kl_from_logits)
