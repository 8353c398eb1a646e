"""Argument checks shared by every public function: each names the argument it refuses, with
its shape, dtype and device, and what was expected (a ``TypeError`` for a wrong kind, a
``ValueError`` for a wrong value)."""
from typing import Optional, Sequence

import torch


def _describe(t: torch.Tensor) -> str:
    return f"shape {tuple(t.shape)}, dtype {t.dtype}, device {t.device}"


def check_tensor(name: str, t, *, dtypes: Optional[Sequence[torch.dtype]] = None,
                 ndim: Optional[Sequence[int]] = None, floating: bool = False) -> torch.Tensor:
    """Raise TypeError/ValueError naming ``name`` unless ``t`` is a tensor of the expected kind."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if floating and not t.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got {_describe(t)}")
    if dtypes is not None and t.dtype not in dtypes:
        raise TypeError(f"{name} must have dtype in {[str(d) for d in dtypes]}, got {_describe(t)}")
    if ndim is not None and t.dim() not in ndim:
        raise ValueError(f"{name} must have {' or '.join(map(str, ndim))} dims, got {_describe(t)}")
    return t


def check_same_shape(name: str, t: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    if t.shape != ref.shape:
        raise ValueError(f"{name} must have the shape of {ref_name} {tuple(ref.shape)}, "
                         f"got {_describe(t)}")


def check_same_device(named: dict) -> torch.device:
    """All non-None tensors in ``named`` on one device; returns it."""
    devices = {n: t.device for n, t in named.items() if t is not None}
    if len(set(devices.values())) > 1:
        listing = ", ".join(f"{n} on {d}" for n, d in devices.items())
        raise ValueError(f"all tensors must be on one device, got {listing}")
    return next(iter(devices.values()))


def check_choice(name: str, value, choices: Sequence) -> None:
    if value not in choices:
        raise ValueError(f"{name}={value!r}: expected one of {list(choices)}")


def check_finite_number(name: str, value, *, positive: bool = False,
                        nonnegative: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    value = float(value)
    if value != value or value in (float("inf"), float("-inf")):
        raise ValueError(f"{name} must be finite, got {value}")
    if positive and value <= 0:
        raise ValueError(f"{name} must be > 0, got {value}")
    if nonnegative and value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    return value


def check_bool(name: str, value) -> bool:
    """A real ``bool``: ``'no'`` (truthy), ``1``, ``None`` or ``numpy.bool_`` are refused, since
    each would silently pick a branch the caller did not write."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r:.40} "
                        f"({type(value).__name__})")
    return value
