"""Plain-PyTorch definitions of the GRPO and OPD advantages (the oracle and the op itself)."""
import torch


def group_advantages_reference(rewards: torch.Tensor, group_size: int,
                               eps: float = 1e-6) -> torch.Tensor:
    """GRPO: (r - mean_g) / (std_g + eps) per contiguous group; a flat group gets 0."""
    grouped = rewards.float().reshape(-1, group_size)
    mean = grouped.mean(-1, keepdim=True)
    if group_size > 1:
        std = grouped.std(-1, keepdim=True)          # unbiased, like torch.std
    else:
        std = torch.zeros_like(mean)
    flat = grouped.amax(-1, keepdim=True) == grouped.amin(-1, keepdim=True)
    adv = torch.where(flat, 0.0, (grouped - mean) / (std + eps))
    return adv.reshape(rewards.shape)


def opd_advantages_reference(student_logprobs, teacher_logprobs, *, form, advantages=None,
                             coef=1.0):
    """On-policy distillation advantages (no gradient flows through them)."""
    student = student_logprobs.detach().float()
    teacher = teacher_logprobs.detach().float()
    if form == "log_ratio":
        return teacher - student
    if advantages.shape != student.shape:
        advantages = advantages.unsqueeze(-1).expand_as(student)
    return advantages.detach().float() - coef * (student - teacher)
