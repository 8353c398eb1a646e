"""torch's fused CUDA attention ops, answered by the override's fixed-split attention.

``F.scaled_dot_product_attention`` on CUDA picks one of three aten ops below autograd, each
with its own signature and return tuple (which also changed between torch releases)::

    _scaled_dot_product_flash_attention      (q, k, v, dropout_p, is_causal,
                                              return_debug_mask, *, scale)
    _scaled_dot_product_efficient_attention  (q, k, v, attn_bias, compute_log_sumexp,
                                              dropout_p, is_causal, *, scale)
    _scaled_dot_product_cudnn_attention      torch >= 2.5: as efficient + return_debug_mask;
                                              torch 2.4: as flash

The override binds the call by the op's own schema, computes (out, logsumexp) with the same
fixed key splits as the CPU op (so a CUDA decode step and a CUDA full forward agree to the
bit), and returns every output the op's autograd formula saves, laid out as the op lays it
out: logsumexp [B, H, T] (flash), [B, H, ceil(T / 32) * 32] (efficient, the kernel's
alignment; [B, H, 0] without ``compute_log_sumexp``), [B, H, T, 1] (cudnn, torch >= 2.5);
no nested batch (``cum_seq_*`` undefined, ``max_q`` / ``max_k`` the lengths); the random
state zeros (no dropout: a call with dropout is left to torch and reported). torch's own
backward kernels then run from these outputs (they read q, k, v, out and logsumexp).

Declined (left to torch, reported once as uncovered): dropout, and ``is_causal`` with
T != L (the kernels align that mask differently). Not measured on GPU.
"""
from typing import Callable, Optional

import torch

aten = torch.ops.aten

OPS = ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
       "_scaled_dot_product_cudnn_attention")
_EFFICIENT_LSE_ALIGN = 32           # the memory-efficient kernel pads logsumexp's T to this
_KNOWN_RETURNS = frozenset((
    "output", "logsumexp", "log_sumexp", "cum_seq_q", "cum_seq_k", "max_q", "max_k",
    "rng_state", "unused", "philox_seed", "philox_offset", "debug_attn_mask"))


def _logsumexp(op_name: str, lse: torch.Tensor, bound: dict) -> torch.Tensor:
    lse = lse.float()
    if op_name.endswith("efficient_attention"):
        if not bound["compute_log_sumexp"]:
            return lse.new_empty(*lse.shape[:-1], 0)
        t = lse.shape[-1]
        padded = lse.new_full((*lse.shape[:-1], -(-t // _EFFICIENT_LSE_ALIGN) *
                               _EFFICIENT_LSE_ALIGN), float("inf"))
        padded[..., :t] = lse
        return padded
    if op_name.endswith("cudnn_attention") and "attn_bias" in bound:
        return lse.unsqueeze(-1)
    return lse.contiguous()


def _returned(name: str, op_name: str, out, lse, bound: dict):
    q, k = bound["query"], bound["key"]
    if name == "output":
        return out
    if name in ("logsumexp", "log_sumexp"):
        return _logsumexp(op_name, lse, bound)
    if name in ("cum_seq_q", "cum_seq_k"):
        return None                                   # undefined: not a nested batch
    if name in ("max_q", "max_k"):
        return q.shape[2] if name == "max_q" else k.shape[2]
    if name == "rng_state":
        return torch.zeros(2, dtype=torch.uint64, device=q.device)
    if name == "unused":
        return torch.zeros((), dtype=torch.uint64, device=q.device)
    if name in ("philox_seed", "philox_offset"):
        return torch.zeros((), dtype=torch.int64, device=q.device)
    # debug_attn_mask, not requested: flash returns an empty tensor, cuDNN an undefined one
    return None if op_name.endswith("cudnn_attention") else q.new_empty(0)


def handler(op_name: str, attention: Callable) -> Optional[Callable]:
    """The override of ``aten.<op_name>.default``, or None where this torch lacks the op or
    returns something this module does not know how to lay out (then it stays uncovered)."""
    packet = getattr(aten, op_name, None)
    if packet is None or "default" not in packet.overloads():
        return None
    schema = packet.default._schema
    if any(r.name not in _KNOWN_RETURNS for r in schema.returns):
        return None
    names = [a.name for a in schema.arguments]
    defaults = {a.name: a.default_value for a in schema.arguments if a.has_default_value()}

    def run(*args, **kwargs):
        bound = {**defaults, **dict(zip(names, args)), **kwargs}
        q, k, v = bound["query"], bound["key"], bound["value"]
        is_causal = bool(bound.get("is_causal", False))
        if bound.get("dropout_p", 0.0) != 0.0 or (is_causal and q.shape[2] != k.shape[2]):
            return NotImplemented
        out, lse = attention(q, k, v, bound.get("attn_bias"), is_causal, bound.get("scale"))
        return tuple(_returned(r.name, op_name, out, lse, bound) for r in schema.returns)

    return run
