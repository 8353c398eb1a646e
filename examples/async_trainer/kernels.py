"""Every place the example selects, routes, optimizes or measures KL goes through here.

Each uses the glm_kernels kernel (Triton on CUDA tensors, the torch reference on CPU). Where
this checkout does not have a kernel yet, a plain torch stand-in with the same contract is
used and announced once in the log (never silently).
"""
import torch

from glm_kernels.loss import reverse_kl_from_logits
from glm_kernels.topk import moe_route as _moe_route
from glm_kernels.topk import topk as _topk

from .log import warn_once


def topk(x: torch.Tensor, k: int):
    """Largest ``k`` along the last dim; ties go to the smaller index (deterministic):
    ``glm_kernels.topk`` (Triton on CUDA tensors, the torch reference on CPU)."""
    return _topk(x, k)


def moe_route(router_logits: torch.Tensor, k: int, bias: torch.Tensor, n_group: int,
              topk_group: int):
    """``glm_kernels.moe_route``: sigmoid noaux_tc routing, ``bias`` steers selection only.

    Returns (expert ids int64 [T, k], fp32 gate weights [T, k], differentiable in the logits).
    """
    weights, ids = _moe_route(router_logits, k, scoring="sigmoid", bias=bias, n_group=n_group,
                              topk_group=topk_group, renormalize=True)
    return ids, weights


def make_optimizer(model, lr: float, weight_decay: float):
    """The RL optimizer. Stand-in until glm_kernels.optim.MuonSplit lands: AdamW."""
    warn_once("optim", "glm_kernels.optim.MuonSplit not available in this checkout: "
                       "using torch.optim.AdamW for every parameter")
    return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)


def reverse_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """Exact full-vocab KL(pi_student || pi_teacher) per position (fp32 [*S])."""
    return reverse_kl_from_logits(student_logits, teacher_logits)
