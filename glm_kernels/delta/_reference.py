"""Readable torch/numpy reference of the delta codec formats (DESIGN 3.5).

Positions are element positions of the flattened tensor. A changed element is one whose
bit pattern differs, so values are compared and carried as integer views (no float math).

gap16 stream: for the k-th changed position p_k (p_{-1} = -1) the gap g_k = p_k - p_{k-1} - 1
(>= 0) is written as one uint16 when g_k < 65535; otherwise the uint16 escape 65535 is written
and g_k goes, in order, into a separate uint64 escape list (empty when no gap is that large, so
the escape costs nothing when unused).
"""
import hashlib

import numpy as np
import torch

ESCAPE = 65535
_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_NP_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def int_view(t: torch.Tensor) -> torch.Tensor:
    """Flattened integer view with the element size of ``t`` (bit patterns, no copy)."""
    return t.reshape(-1).view(_INT_VIEW[t.element_size()])


def np_bits(t: torch.Tensor) -> np.ndarray:
    """Unsigned numpy view of the bit patterns of a CPU tensor."""
    return int_view(t.detach().cpu().contiguous()).numpy().view(_NP_UINT[t.element_size()])


def checksum(t: torch.Tensor) -> bytes:
    """8-byte BLAKE2b digest of the tensor's bytes in memory order (little-endian)."""
    return hashlib.blake2b(np_bits(t).tobytes(), digest_size=8).digest()


def checksum_bytes(b) -> bytes:
    return hashlib.blake2b(b, digest_size=8).digest()


def changed_positions(new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """int64 positions where the bit patterns of ``new`` and ``old`` differ."""
    return torch.nonzero(int_view(new) != int_view(old)).reshape(-1)


def gap16_pack(pos: np.ndarray):
    """Positions (int64, strictly increasing) -> (uint16 gaps, uint64 escapes)."""
    pos = pos.astype(np.int64, copy=False)
    gaps = np.diff(pos, prepend=np.int64(-1)) - 1
    big = gaps >= ESCAPE
    out = np.where(big, ESCAPE, gaps).astype(np.uint16)
    return out, gaps[big].astype(np.uint64)


def gap16_unpack(gaps: np.ndarray, escapes: np.ndarray) -> np.ndarray:
    """Inverse of gap16_pack; raises ValueError if the escape count does not match."""
    g = gaps.astype(np.int64)
    esc = g == ESCAPE
    if int(esc.sum()) != escapes.size:
        raise ValueError(f"corrupt gap16 stream: {int(esc.sum())} escapes, "
                         f"{escapes.size} escape values")
    g[esc] = escapes.astype(np.int64)
    return np.cumsum(g + 1) - 1


def byte_group(values: np.ndarray) -> bytes:
    """Element-major values -> byte planes (all byte 0s, then all byte 1s, ...)."""
    size = values.dtype.itemsize
    return values.view(np.uint8).reshape(-1, size).T.tobytes()


def byte_ungroup(planes: bytes, count: int, size: int) -> np.ndarray:
    arr = np.frombuffer(planes, dtype=np.uint8)
    return np.ascontiguousarray(arr.reshape(size, count).T).view(_NP_UINT[size]).reshape(-1)
