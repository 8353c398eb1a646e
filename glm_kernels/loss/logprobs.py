"""Selective log-probs from logits: log_softmax(logits / T)[token] without materializing it.

Forward (Triton): one program per row, online log-sum-exp over vocab blocks, then
lp = x_t / T - lse. Saved for backward: the logits (already alive) and lse [N] (O(tokens)).
Backward: dlogits = g / T * (onehot(t) - exp(x / T - lse)).
"""
from __future__ import annotations

import torch

from .. import _dispatch
from . import _logits_reference

_BLOCK_V_GPU, _WARPS_GPU, _BLOCK_V_INTERPRET = 4096, 8, 256


class _SelectiveLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits2d, ids, inv_temp, block_v, num_warps):
        from . import _logits_kernels
        n = logits2d.shape[0]
        lp = torch.empty(n, dtype=torch.float32, device=logits2d.device)
        lse = torch.empty(n, dtype=torch.float32, device=logits2d.device)
        _logits_kernels.logprobs_fwd(logits2d, ids, lp, lse, inv_temp=inv_temp,
                                     block_v=block_v, num_warps=num_warps)
        ctx.save_for_backward(logits2d, ids, lse)
        ctx.cfg = (inv_temp, block_v, num_warps)
        return lp

    @staticmethod
    def backward(ctx, grad_lp):
        from . import _logits_kernels
        logits2d, ids, lse = ctx.saved_tensors
        inv_temp, block_v, num_warps = ctx.cfg
        dlogits = torch.empty_like(logits2d)
        _logits_kernels.logprobs_bwd(logits2d, ids, lse, grad_lp.float().contiguous(), dlogits,
                                     inv_temp=inv_temp, block_v=block_v, num_warps=num_warps)
        return dlogits, None, None, None, None


def selective_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, *,
                       temperature: float = 1.0) -> torch.Tensor:
    """fp32 log-probs [*S] of ``token_ids`` [*S] under softmax(logits [*S, V] / temperature).

    Any float logits dtype; differentiable with respect to ``logits``.
    """
    _dispatch.check_tensor("logits", logits, floating=True)
    _dispatch.check_tensor("token_ids", token_ids, dtypes=(torch.int32, torch.int64))
    if logits.dim() < 1 or token_ids.shape != logits.shape[:-1]:
        raise ValueError(f"token_ids must have shape logits.shape[:-1] = "
                         f"{tuple(logits.shape[:-1])}, got {tuple(token_ids.shape)}")
    _dispatch.check_finite_number("temperature", temperature, positive=True)
    _dispatch.check_same_device({"logits": logits, "token_ids": token_ids})
    v = logits.shape[-1]
    if token_ids.numel() and (int(token_ids.min()) < 0 or int(token_ids.max()) >= v):
        raise ValueError(f"token_ids must lie in [0, {v}), got range "
                         f"[{int(token_ids.min())}, {int(token_ids.max())}]")
    backend = _dispatch.select_backend("selective_logprobs", logits)
    if backend == "torch":
        return _logits_reference.selective_logprobs_reference(logits, token_ids, temperature)
    interpret = backend == "interpret"
    block_v = _BLOCK_V_INTERPRET if interpret else _BLOCK_V_GPU
    lp = _SelectiveLogprobs.apply(logits.reshape(-1, v).contiguous(),
                                  token_ids.reshape(-1).long().contiguous(), 1.0 / temperature,
                                  block_v, _WARPS_GPU)
    return lp.reshape(token_ids.shape)
