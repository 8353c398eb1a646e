"""Bitwise masking of fp32 tensors, shared by the loss torch paths and the verl integration.

An AND with all-ones / all-zeros int32 bits keeps a value exactly (NaN and inf included) or
makes it +0.0: a branch-free ``torch.where(mask, x, 0.0)``.
"""
from typing import Optional

import torch


def keep_bits(mask: torch.Tensor) -> torch.Tensor:
    """int32 [N]: all ones where ``mask`` (bool) holds, 0 elsewhere: the operand of
    :func:`and_bits`."""
    return mask.to(torch.int32).neg_()


def and_bits(x: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """fp32 ``x`` where ``bits`` are all ones, +0.0 elsewhere (a new tensor)."""
    return torch.bitwise_and(x.view(torch.int32), bits).view(torch.float32)


def and_optional(a: Optional[torch.Tensor], b: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """a & b of optional bool tensors (None: all true)."""
    return b if a is None else a if b is None else a & b
