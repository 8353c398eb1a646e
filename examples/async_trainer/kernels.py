"""Every place the example selects, routes, optimizes or measures KL goes through here.

Each uses the glm_kernels kernel (Triton on CUDA tensors, the torch reference on CPU).
"""
import torch

from glm_kernels.loss import reverse_kl_from_logits
from glm_kernels.topk import decode_routing_batch as _decode_routing_batch
from glm_kernels.topk import encode_routing as _encode_routing
from glm_kernels.topk import moe_route as _moe_route
from glm_kernels.topk import routing_mismatch as _routing_mismatch
from glm_kernels.topk import topk as _topk


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


def moe_route_replay(router_logits: torch.Tensor, k: int, bias: torch.Tensor, n_group: int,
                     topk_group: int, replay_ids: torch.Tensor):
    """``glm_kernels.moe_route(replay_ids=...)``: route to the recorded experts (R3), weights
    recomputed from these logits. Returns (ids, weights, mismatch bool [T]: the token's own
    choice would be another expert set)."""
    weights, ids, mismatch = _moe_route(router_logits, k, scoring="sigmoid", bias=bias,
                                        n_group=n_group, topk_group=topk_group,
                                        renormalize=True, replay_ids=replay_ids,
                                        return_mismatch=True)
    return ids, weights, mismatch


def routing_mismatch(ids: torch.Tensor, recorded: torch.Tensor) -> torch.Tensor:
    """``glm_kernels.topk.routing_mismatch``: bool per token, the expert sets differ."""
    return _routing_mismatch(ids, recorded)


def encode_routing(ids: torch.Tensor, n_experts: int) -> bytes:
    """One sequence's routing, ids [layers, tokens, k], as ``glm_kernels.topk`` wire bytes."""
    return _encode_routing(ids, n_experts).cpu().numpy().tobytes()


def decode_routing_batch(packets, width: int, device):
    """Packets -> (ids int64 [layers, B, width, k], lengths [B]) (``glm_kernels.topk``)."""
    return _decode_routing_batch(packets, width=width, device=device)


def reverse_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """Exact full-vocab KL(pi_student || pi_teacher) per position (fp32 [*S])."""
    return reverse_kl_from_logits(student_logits, teacher_logits)
