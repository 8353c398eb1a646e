"""GRPO group advantages and on-policy-distillation (OPD) advantages.

Both run on a few thousand numbers per step (one reward per sample, or one value per token
for OPD, read once): torch's elementwise and row reductions are already at the launch /
bandwidth floor there, so these stay plain torch and share ``_reference.py``'s definition.
"""
from __future__ import annotations

from typing import Optional

import torch

from ... import _checks
from . import _reference

OPD_FORMS = ("log_ratio", "kl_penalty")


def group_advantages(rewards: torch.Tensor, group_size: int, *, eps: float = 1e-6
                     ) -> torch.Tensor:
    """GRPO advantages: (r - mean_g) / (std_g + eps) within contiguous groups.

    Parameters
    ----------
    rewards : Tensor [n * group_size], any real dtype (bool / int rewards are cast to fp32)
        Samples of one prompt are contiguous: rewards[i*G:(i+1)*G] is group i.
    group_size : int >= 1
    eps : float >= 0

    Returns
    -------
    Tensor [n * group_size], fp32. std is unbiased (n - 1) like ``torch.std``; a group whose
    rewards are all equal (or group_size 1) gets exactly 0.

    >>> [round(a, 4) for a in group_advantages(torch.tensor([1., 0., 0., 0.]), 2).tolist()]
    [0.7071, -0.7071, 0.0, 0.0]
    """
    _checks.check_tensor("rewards", rewards, ndim=(1,))
    if rewards.is_complex():
        raise TypeError(f"rewards must be real, got dtype {rewards.dtype}")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be an int >= 1, got {group_size!r}")
    if rewards.numel() % group_size:
        raise ValueError(f"rewards has {rewards.numel()} elements, not a multiple of "
                         f"group_size={group_size}")
    eps = _checks.check_finite_number("eps", eps, nonnegative=True)
    if rewards.numel() == 0:
        return torch.zeros(0, dtype=torch.float32, device=rewards.device)
    return _reference.group_advantages_reference(rewards, group_size, eps)


def opd_advantages(student_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor, *,
                   form: str, advantages: Optional[torch.Tensor] = None, coef: float = 1.0
                   ) -> torch.Tensor:
    """Per-token advantages for on-policy distillation (detached, fp32).

    form="log_ratio" (GLM-5):      A_hat = sg(teacher - student)
    form="kl_penalty" (slime):     A_hat = A - coef * sg(student - teacher)

    student_logprobs, teacher_logprobs : Tensor [*S], float
    advantages : Tensor [*S] or [B] for [B, T] inputs; required for "kl_penalty".

    >>> opd_advantages(torch.tensor([-1.0]), torch.tensor([-0.25]), form="log_ratio").tolist()
    [0.75]
    """
    _checks.check_tensor("student_logprobs", student_logprobs, floating=True)
    _checks.check_tensor("teacher_logprobs", teacher_logprobs, floating=True)
    _checks.check_same_shape("teacher_logprobs", teacher_logprobs, "student_logprobs",
                               student_logprobs)
    _checks.check_choice("form", form, OPD_FORMS)
    coef = _checks.check_finite_number("coef", coef)
    if form == "kl_penalty":
        if advantages is None:
            raise ValueError("form='kl_penalty' needs advantages (the outcome advantages A)")
        _checks.check_tensor("advantages", advantages, floating=True)
        shape = student_logprobs.shape
        if advantages.shape != shape and not (len(shape) == 2
                                              and advantages.shape == shape[:1]):
            raise ValueError(f"advantages must have shape {tuple(shape)} (or [B] for [B, T]), "
                             f"got {tuple(advantages.shape)}")
    elif advantages is not None:
        raise ValueError("advantages is only used with form='kl_penalty'")
    _checks.check_same_device(dict(student_logprobs=student_logprobs,
                                     teacher_logprobs=teacher_logprobs, advantages=advantages))
    return _reference.opd_advantages_reference(student_logprobs, teacher_logprobs, form=form,
                                               advantages=advantages, coef=coef)
