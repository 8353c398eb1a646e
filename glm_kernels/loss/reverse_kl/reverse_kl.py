"""Exact full-vocab reverse KL from logits (on-policy distillation), fused, vocab-parallel.

Math (readable version: ``reverse_kl/_reference.reverse_kl_reference``), z = logits / T::

    KL(p_s || p_t) = sum_v p_s,v (log p_s,v - log p_t,v)
                   = u / s_s - (lse_s - lse_t),   u = sum_v e^(z_s,v - m_s) (z_s,v - z_t,v)
    dKL/dz_s,v     = p_s,v (log p_s,v - log p_t,v - KL)        (the teacher gets no gradient)

One sweep reads both logits tensors once and carries (m_s, s_s, u, m_t, s_t) online; forward
saves lse_s, lse_t and KL [N] fp32; backward reads both tensors again and writes the student
gradient. With ``tp_group`` the five statistics of each shard are combined by two
all-reduces (``_vocab_parallel.combine_reverse_kl_stats``); backward needs no communication.

Registered as the ``glm_kernels::reverse_kl_from_logits`` custom op (the group enters its schema
by name, the all-reduces run inside it) with its backward, the
``reverse_kl_from_logits_backward`` op, registered on it; eager calls run the op's body
directly under a plain autograd node with the same backward (docs/design.md 1, "Autograd").
"""

from typing import Tuple

import torch

from ... import _checks, _dispatch
from .._common import checks as loss_checks
from . import _reference as ref
from .._common import vocab_parallel as _vocab_parallel
from .._common.launch import call_op, differentiable_op, make_launch_config, rows_2d


def _kernels_or_none(backend: str):
    if backend == "torch":
        return None
    from . import _kernels as _reverse_kl_kernels
    return _reverse_kl_kernels


def _shard_stats(student, teacher, inv_temp: float, partial: bool):
    """(kl, lse_s, lse_t) [N] fp32, or with ``partial`` ([N, 5] shard statistics, [0], [0])."""
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


def _reverse_kl_impl(student: torch.Tensor, teacher: torch.Tensor, inv_temp: float,
                     group: str) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(kl, lse_s, lse_t) [N] fp32 of [N, V] logits: this rank's shard of the group named
    ``group`` ("" for none)."""
    tp_group = _vocab_parallel.resolve_group(group)
    if tp_group is None:
        return _shard_stats(student, teacher, inv_temp, False)
    stats, _, _ = _shard_stats(student, teacher, inv_temp, True)
    return _vocab_parallel.combine_reverse_kl_stats(stats, tp_group)


_reverse_kl_op = torch.library.custom_op("glm_kernels::reverse_kl_from_logits",
                                         mutates_args=())(_reverse_kl_impl)


@_reverse_kl_op.register_fake
def _reverse_kl_fake(student, teacher, inv_temp, group):
    new = lambda: student.new_empty((student.shape[0],), dtype=torch.float32)  # noqa: E731
    return new(), new(), new()


def _backward_impl(student: torch.Tensor, teacher: torch.Tensor, lse_s: torch.Tensor,
                   lse_t: torch.Tensor, kl: torch.Tensor, grad_kl: torch.Tensor,
                   inv_temp: float) -> torch.Tensor:
    """d(sum grad_kl * KL)/d student [N, V] in the student's dtype."""
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


_backward_op = torch.library.custom_op("glm_kernels::reverse_kl_from_logits_backward",
                                       mutates_args=())(_backward_impl)


@_backward_op.register_fake
def _backward_fake(student, teacher, lse_s, lse_t, kl, grad_kl, inv_temp):
    return torch.empty_like(student)


def _setup_context(ctx, inputs, output):
    student, teacher, inv_temp, _ = inputs
    kl, lse_s, lse_t = output
    ctx.save_for_backward(student, teacher, lse_s, lse_t, kl)
    ctx.inv_temp = inv_temp
    ctx.mark_non_differentiable(lse_s, lse_t)
    ctx.set_materialize_grads(False)


def _backward(ctx, grad_kl, _grad_lse_s, _grad_lse_t):
    student, teacher, lse_s, lse_t, kl = ctx.saved_tensors
    grad = call_op(ctx, _backward_op, _backward_impl, student, teacher, lse_s, lse_t, kl,
                   grad_kl.float().contiguous(), ctx.inv_temp)
    return grad, None, None, None


_reverse_kl = differentiable_op(_reverse_kl_op, _reverse_kl_impl, _setup_context, _backward)


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
    kl, _, _ = _reverse_kl(rows_2d(student_logits), rows_2d(teacher_logits.detach()),
                           1.0 / temperature, _vocab_parallel.group_name(tp_group))
    return kl.reshape(student_logits.shape[:-1])
