"""Argument checks shared by the public loss functions (each names the argument it refuses).

Tensor checks live in ``glm_kernels._checks``; these are the non-tensor arguments: flags,
process groups and the IcePop hyper-parameters, whose bad values would otherwise give an empty
or inverted band and a silently wrong loss.
"""
from typing import Optional, Tuple

import torch

from ... import _checks


def check_loss_mask(loss_mask, ref_name: str, ref: torch.Tensor, *,
                    name: str = "loss_mask") -> None:
    """loss_mask: bool or 0/1 numbers of ``ref``'s shape (``name``: what the caller calls it)."""
    _checks.check_tensor(name, loss_mask)
    if not (loss_mask.dtype == torch.bool or loss_mask.is_floating_point()
            or loss_mask.dtype in (torch.uint8, torch.int8, torch.int32, torch.int64)):
        raise TypeError(f"{name} must be bool or 0/1 numbers, got dtype {loss_mask.dtype}")
    _checks.check_same_shape(name, loss_mask, ref_name, ref)


def check_tp_group(tp_group) -> None:
    """None, or a torch.distributed ProcessGroup."""
    if tp_group is None:
        return
    try:
        from torch.distributed import ProcessGroup
    except ImportError:                                   # torch built without distributed
        ProcessGroup = None
    if ProcessGroup is None or not isinstance(tp_group, ProcessGroup):
        raise TypeError(f"tp_group must be a torch.distributed ProcessGroup or None, got "
                        f"{tp_group!r} ({type(tp_group).__name__})")


def check_icepop_hyperparameters(beta, gate_low: Optional[float], gate_high: Optional[float],
                                 eps_low, eps_high) -> Tuple[float, float, float, float]:
    """(gate_low, gate_high, eps_low, eps_high) as validated floats.

    beta > 1 (beta = 1 keeps only ratios of exactly 1); 0 <= gate_low < gate_high (finite);
    0 <= eps_low < 1 (the lower clip 1 - eps_low stays positive); eps_high >= 0.
    """
    beta = _checks.check_finite_number("beta", beta)
    if beta <= 1.0:
        raise ValueError(f"beta must be > 1 (the gate [1/beta, beta] is empty or inverted "
                         f"otherwise), got {beta}")
    lo = 1.0 / beta if gate_low is None else _checks.check_finite_number("gate_low", gate_low)
    hi = beta if gate_high is None else _checks.check_finite_number("gate_high", gate_high)
    if lo < 0:
        raise ValueError(f"gate_low must be >= 0 (a ratio is never negative), got {lo}")
    if not lo < hi:
        raise ValueError(f"gate_low must be < gate_high (the gate [gate_low, gate_high] is "
                         f"empty or a single point otherwise), got gate_low={lo}, "
                         f"gate_high={hi}")
    eps_low = _checks.check_finite_number("eps_low", eps_low, nonnegative=True)
    if eps_low >= 1.0:
        raise ValueError(f"eps_low must be in [0, 1) (the clip band starts at 1 - eps_low > 0), "
                         f"got {eps_low}")
    eps_high = _checks.check_finite_number("eps_high", eps_high, nonnegative=True)
    return lo, hi, eps_low, eps_high


def check_dual_clip(dual_clip: Optional[float]) -> Optional[float]:
    """None (off), or a finite number > 1 as a float: the cap -dual_clip * A of a negative-
    advantage token's PPO term lies above the clip band's -(1 + eps_high) A only for c > 1."""
    if dual_clip is None:
        return None
    value = _checks.check_finite_number("dual_clip", dual_clip)
    if value <= 1.0:
        raise ValueError(f"dual_clip must be > 1 (dual-clip PPO caps a negative-advantage "
                         f"token's term at -dual_clip * A), got {value}")
    return value
