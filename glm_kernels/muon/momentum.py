"""Muon's momentum step, shared by one-process and sharded ``MuonSplit``.

    M <- momentum * M + g                    (in M's dtype, in place)
    U  = g + momentum * M   (nesterov)   or   U = M

U is computed in fp32 whatever the parameter dtype, as one multiply and one add (each
correctly rounded once). Why: torch's bf16 ``g.add(M, alpha=momentum)`` rounds differently
in its vectorized body and its scalar tail (a fused multiply-add in one, not in the other),
so the same element could round two ways depending on where a shard boundary put it -- a
sharded step was then not bitwise one process (measured: 9 elements differed over five row
slices of a random 24 x 13 bf16 matrix; none in fp32). Elementwise ops with one rounding
each give the same bits at any offset. fp32 also spares the NS input one bf16 rounding.
"""
import torch


def momentum_update(buf: torch.Tensor, grad: torch.Tensor, momentum: float,
                    nesterov: bool) -> torch.Tensor:
    """Update the momentum buffer ``buf`` in place with ``grad``; return U (fp32 when
    ``nesterov``, else ``buf`` itself). ``buf`` and ``grad``: plain tensors of one shape
    (the local shards of DTensors)."""
    buf.mul_(momentum).add_(grad)
    if not nesterov:
        return buf
    return buf.to(torch.float32, copy=True).mul_(momentum).add_(grad)
