"""Token selections of Clip-Cov and KL-Cov (verl 0.9.1), drawn as verl draws them.

verl picks the tokens inside its loss: Clip-Cov takes a random subset (``torch.randperm`` on
the default CPU generator) of the tokens whose centred advantage x log-prob covariance lies in
(lb, ub); KL-Cov takes the top-k covariances. Here the selection is a separate step whose
boolean output :func:`glm_kernels.policy_loss` takes as ``selection=``: the same torch seed
selects the same tokens as verl. Both read one count on the host (``.item()`` / ``.cpu()``), as
verl does.
"""
import torch

from ... import _checks


def _masked_mean(values, mask):
    return (torch.where(mask.bool(), values, 0.0) * mask).sum() / (mask.sum() + 1e-8)


def clip_cov_selection(logprobs: torch.Tensor, old_logprobs: torch.Tensor,
                       advantages: torch.Tensor, loss_mask: torch.Tensor, *,
                       eps_low: float = 0.2, eps_high: float = 0.28,
                       clip_cov_ratio: float = 0.0002, clip_cov_lb: float = 1.0,
                       clip_cov_ub: float = 5.0) -> torch.Tensor:
    """bool [same shape]: the tokens Clip-Cov zeroes (verl ``compute_policy_loss_clip_cov``).

    All inputs [B, T] (or [N]); advantages per token. Candidates: masked tokens not already
    clipped by the PPO band whose cov = (A - mean_m A) (lp - mean_m lp) is in (lb, ub); then
    ``torch.randperm(#candidates)`` picks max(int(ratio * #masked), 1) of them.
    """
    for name, t in (("logprobs", logprobs), ("old_logprobs", old_logprobs),
                    ("advantages", advantages), ("loss_mask", loss_mask)):
        _checks.check_tensor(name, t)
        _checks.check_same_shape(name, t, "logprobs", logprobs)
    ratio_arg = _checks.check_finite_number("clip_cov_ratio", clip_cov_ratio, positive=True)
    lp = logprobs.detach()
    ratio = torch.exp(lp - old_logprobs)
    pg1 = -advantages * ratio
    pg2 = -advantages * torch.clamp(ratio, 1 - eps_low, 1 + eps_high)
    clip_by_origin = (pg2 > pg1) & (loss_mask > 0)
    cov = (advantages - _masked_mean(advantages, loss_mask)) * (lp - _masked_mean(lp, loss_mask))
    cov[loss_mask == 0] = -torch.inf
    cov[clip_by_origin] = -torch.inf
    clip_num = max(int(ratio_arg * loss_mask.sum().item()), 1)
    candidates = (cov < clip_cov_ub) & (cov > clip_cov_lb) & (loss_mask > 0)
    flat_idx = torch.nonzero(candidates.reshape(-1)).reshape(-1)
    selected = torch.zeros(logprobs.numel(), dtype=torch.bool, device=logprobs.device)
    if len(flat_idx) > 0:
        perm = torch.randperm(len(flat_idx))           # verl: default generator, CPU
        selected[flat_idx[perm[: min(clip_num, len(flat_idx))]]] = True
    return selected.reshape(logprobs.shape)


def kl_cov_selection(logprobs: torch.Tensor, advantages: torch.Tensor,
                     loss_mask: torch.Tensor, *, kl_cov_ratio: float = 0.0002) -> torch.Tensor:
    """bool [same shape]: the tokens KL-Cov penalises (verl ``compute_policy_loss_kl_cov``):
    the top max(1, int(#masked * ratio)) covariances (A - mean A)(lp - mean lp) over the masked
    tokens, computed on the CPU as verl does (same ties)."""
    for name, t in (("logprobs", logprobs), ("advantages", advantages),
                    ("loss_mask", loss_mask)):
        _checks.check_tensor(name, t)
        _checks.check_same_shape(name, t, "logprobs", logprobs)
    ratio_arg = _checks.check_finite_number("kl_cov_ratio", kl_cov_ratio, positive=True)
    valid = loss_mask.reshape(-1) > 0
    valid_idx = torch.nonzero(valid, as_tuple=True)[0]
    # gathered by the index already found (a boolean index would search the mask again)
    adv = advantages.reshape(-1).detach()[valid_idx].cpu()
    lp = logprobs.reshape(-1).detach()[valid_idx].cpu()
    selected = torch.zeros(logprobs.numel(), dtype=torch.bool, device=logprobs.device)
    if len(adv) > 0 and min(ratio_arg, len(adv)) != 0:
        cov = (adv - adv.mean()) * (lp - lp.mean())
        k = max(1, int(len(cov) * ratio_arg))
        top = torch.topk(cov, k, largest=True).indices
        selected[valid_idx[top.to(valid_idx.device)]] = True
    return selected.reshape(logprobs.shape)
