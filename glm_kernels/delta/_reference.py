"""Readable numpy definition of the delta codec formats (docs/design.md 3.5): the test oracle, and
the host path when the C++ extension ``glm_kernels._host`` is not built.

Every value is handled as its bit pattern (unsigned integer views); there is no
floating-point arithmetic anywhere. Positions are element positions of the flattened tensor.

Checksum (``checksum_sum`` / ``finalize``)
    The tensor is a sequence of 32-bit words: one word per element (its bits zero-extended)
    for 1/2/4-byte dtypes, two words (low half, high half) per element for 8-byte dtypes.
    Word ``w`` at word index ``i`` (``lo``/``hi`` = low/high 32 bits of ``i``) contributes::

        k = lo*K1 + hi*K2 + K3                       (mod 2^32)
        M = (lo*N1 + hi*N2 + N3) * 2^32 + ((lo*M1 + hi*M2 + M3) | 1)   (odd, 64-bit)
        term = (w ^ k) * M                           (mod 2^64)
        S = sum(term)                                (mod 2^64)
        checksum = fmix64(S ^ (W * G))               (8 bytes little-endian; W = word count)

    S is a sum, so it is computed in parallel in any order, and the checksum of a tensor
    after changing a few elements is ``S + sum(term(new) - term(old))`` over those elements
    only: ``apply_`` verifies the result before writing anything. A single changed word
    always changes S (M is odd, so invertible mod 2^64); M spans 64 bits, so the changes of
    many words (a wrong base: many one-ulp differences) wrap around 2^64 and cancel with
    probability about 2^-64. It is a corruption check, not a MAC.

gap16 stream
    For the k-th changed position p_k (p_{-1} = -1) the gap g_k = p_k - p_{k-1} - 1 is one
    uint16 when g_k < 65535; otherwise the uint16 escape 65535 is written and g_k goes, in
    order, into a uint64 escape list (empty, so free, when no gap is that large).

Values
    ``raw``: the new bit patterns. ``diff`` (base-relative): zigzag(new - old), the integer
    difference of the bit patterns modulo 2^bits, zigzag-mapped so that +-1 become 2 and 1;
    a one-ulp optimizer step is a difference of +-1.
    ``planar``: byte planes (all byte 0s, then all byte 1s, ...) instead of element-major.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
import torch

ESCAPE = 65535
MASK32 = 0xFFFFFFFF
MASK64 = (1 << 64) - 1
K1, K2, K3 = 0x9E3779B1, 0x85EBCA77, 0x165667B1
M1, M2, M3 = 0x27D4EB2F, 0xC2B2AE3D, 0x61C88647
N1, N2, N3 = 0x7FEB352D, 0x846CA68B, 0x2545F491
GOLDEN64 = 0x9E3779B97F4A7C15
INT32_MAX_NUMEL = 1 << 31              # int32 positions address elements 0 .. 2^31 - 1

_INT_VIEW = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
NP_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def int_view(t: torch.Tensor) -> torch.Tensor:
    """Flattened signed-integer view with the element size of ``t`` (bit patterns, no copy)."""
    return t.reshape(-1).view(_INT_VIEW[t.element_size()])


def np_bits(t: torch.Tensor) -> np.ndarray:
    """Unsigned numpy view of the bit patterns of a contiguous CPU tensor (no copy)."""
    return int_view(t.detach()).numpy().view(NP_UINT[t.element_size()])


def check_int32_addressable(numel: int) -> None:
    """int32 positions cannot address more than 2^31 elements."""
    if numel > INT32_MAX_NUMEL:
        raise ValueError(f"encoding='int32' cannot address {numel} elements (more than 2^31); "
                         "use encoding='gap16' or 'zstd'")


# ------------------------------------------------------------------------------ checksum
def fmix64(h: int) -> int:
    h ^= h >> 33
    h = (h * 0xFF51AFD7ED558CCD) & MASK64
    h ^= h >> 33
    h = (h * 0xC4CEB9FE1A85EC53) & MASK64
    return h ^ (h >> 33)


def finalize(s: int, n_words: int) -> bytes:
    """8-byte checksum from the word sum S and the word count."""
    return fmix64((s & MASK64) ^ ((n_words * GOLDEN64) & MASK64)).to_bytes(8, "little")


_INV1 = pow(0xFF51AFD7ED558CCD, -1, 1 << 64)
_INV2 = pow(0xC4CEB9FE1A85EC53, -1, 1 << 64)


def unfinalize(checksum: bytes, n_words: int) -> int:
    """S back from a checksum (fmix64 is a bijection: each xorshift by 33 is its own
    inverse, each odd multiplier has an inverse mod 2^64)."""
    h = int.from_bytes(checksum, "little")
    h ^= h >> 33
    h = (h * _INV2) & MASK64
    h ^= h >> 33
    h = (h * _INV1) & MASK64
    h ^= h >> 33
    return h ^ ((n_words * GOLDEN64) & MASK64)


def words_per_element(size: int) -> int:
    return 2 if size == 8 else 1


def word_terms(words: np.ndarray, index: np.ndarray) -> np.ndarray:
    """uint64 terms of 32-bit ``words`` (held in uint64) at uint64 word ``index``."""
    u = np.uint64
    lo, hi = index & u(MASK32), index >> u(32)
    k = (lo * u(K1) + hi * u(K2) + u(K3)) & u(MASK32)
    m = ((lo * u(M1) + hi * u(M2) + u(M3)) & u(MASK32)) | u(1)
    n = (lo * u(N1) + hi * u(N2) + u(N3)) & u(MASK32)
    return (words ^ k) * ((n << u(32)) | m)            # uint64 arithmetic wraps mod 2^64


def element_terms(bits: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """Sum of the word terms of each element (unsigned ``bits``) at element ``positions``."""
    pos = positions.astype(np.uint64)
    vals = bits.astype(np.uint64)
    if bits.dtype.itemsize < 8:
        return word_terms(vals, pos)
    low = word_terms(vals & np.uint64(MASK32), pos * np.uint64(2))
    return low + word_terms(vals >> np.uint64(32), pos * np.uint64(2) + np.uint64(1))


def checksum_sum(bits: np.ndarray, chunk: int = 1 << 20) -> int:
    """S (mod 2^64) of an unsigned bit-pattern array, in chunks to bound the temporaries."""
    total = 0
    for start in range(0, bits.size, chunk):
        part = bits[start:start + chunk]
        index = np.arange(start, start + part.size, dtype=np.uint64)
        total += int(element_terms(part, index).sum(dtype=np.uint64))
    return total & MASK64


def checksum(t: torch.Tensor) -> bytes:
    """The 8-byte checksum of a tensor's bit patterns (definition in the module docstring)."""
    c = t.detach().cpu().contiguous()
    return finalize(checksum_sum(np_bits(c)), c.numel() * words_per_element(c.element_size()))


def checksum_bytes(b) -> bytes:
    """BLAKE2b-64 of serialized bytes (the wire packet's integrity check)."""
    return hashlib.blake2b(b, digest_size=8).digest()


# ----------------------------------------------------------------------- stream pieces
def gap16_pack(pos: np.ndarray):
    """Positions (int64, strictly increasing) -> (uint16 gaps, uint64 escapes)."""
    pos = pos.astype(np.int64, copy=False)
    gaps = np.diff(pos, prepend=np.int64(-1)) - 1
    big = gaps >= ESCAPE
    return np.where(big, ESCAPE, gaps).astype(np.uint16), gaps[big].astype(np.uint64)


def gap16_unpack(gaps: np.ndarray, escapes: np.ndarray, numel: int) -> np.ndarray:
    """Inverse of gap16_pack; ValueError unless the stream is canonical and fits ``numel``."""
    g = gaps.astype(np.int64)
    esc = g == ESCAPE
    if int(esc.sum()) != escapes.size:
        raise ValueError(f"corrupt gap16 stream: {int(esc.sum())} escape markers, "
                         f"{escapes.size} escape values")
    if escapes.size and (escapes.min() < ESCAPE or escapes.max() >= max(numel, 1)):
        raise ValueError(f"corrupt gap16 stream: escape values must lie in [{ESCAPE}, {numel})")
    g[esc] = escapes.astype(np.int64)
    pos = np.cumsum(g + 1) - 1           # each term < numel + 1, so no int64 overflow
    if pos.size and pos[-1] >= numel:
        raise ValueError(f"corrupt delta packet: position {int(pos[-1])} out of range "
                         f"[0, {numel})")
    return pos


def check_positions(pos: np.ndarray, numel: int) -> None:
    """Absolute positions must be strictly increasing and inside [0, numel)."""
    if pos.size and (pos[0] < 0 or pos[-1] >= numel):
        raise ValueError(f"corrupt delta packet: position out of range [0, {numel})")
    if pos.size > 1 and not bool(np.all(pos[1:] > pos[:-1])):
        raise ValueError("corrupt delta packet: positions not strictly increasing")


def byte_group(values: np.ndarray) -> np.ndarray:
    """Element-major values -> byte planes (all byte 0s, then all byte 1s, ...), uint8."""
    size = values.dtype.itemsize
    return np.ascontiguousarray(values.view(np.uint8).reshape(-1, size).T).reshape(-1)


def byte_ungroup(planes: np.ndarray, count: int, size: int) -> np.ndarray:
    """Byte planes -> element-major unsigned values."""
    arr = np.asarray(planes, dtype=np.uint8).reshape(size, count)
    return np.ascontiguousarray(arr.T).view(NP_UINT[size]).reshape(-1)


def zigzag(new: np.ndarray, old: np.ndarray) -> np.ndarray:
    """zigzag(new - old) of unsigned bit patterns, modulo 2^bits: +1 -> 2, -1 -> 1."""
    u = new.dtype.type
    d = new - old
    sign = d >> u(8 * new.dtype.itemsize - 1)
    return (d << u(1)) ^ (u(0) - sign)


def unzigzag_add(zz: np.ndarray, old: np.ndarray) -> np.ndarray:
    """old + unzigzag(zz), modulo 2^bits (inverse of ``zigzag``)."""
    u = old.dtype.type
    return old + ((zz >> u(1)) ^ (u(0) - (zz & u(1))))


# ------------------------------------------------------------------- streams <-> tensors
@dataclass(frozen=True)
class StreamSpec:
    """How an encoding lays out its streams: positions, value coding, byte planes."""
    positions: str          # "int32" | "gap16"
    diff: bool              # values are zigzag(new - old) (base-relative)
    planar: bool            # gaps and values as byte planes (the zstd encoding)


@dataclass
class Streams:
    """Uncompressed streams of one packet (numpy arrays on the host path).

    positions: int32 [count] (int32), uint16 [count] (gap16) or uint8 [2*count] planes;
    escapes: uint64 [n_escapes]; values: unsigned [count] or uint8 [size*count] planes.
    s_new / s_old: checksum sums of new / old (s_old only for base-relative specs).
    """
    count: int
    positions: np.ndarray
    escapes: np.ndarray
    values: np.ndarray
    s_new: int = 0
    s_old: int = 0


def encode_streams(nb: np.ndarray, ob: np.ndarray, spec: StreamSpec,
                   old_sum: int = None) -> Streams:
    """Streams turning bit patterns ``ob`` into ``nb`` (unsigned arrays of one dtype).

    ``old_sum``: S of ``ob`` when the caller knows it; then neither tensor is hashed and
    S(new) = S(old) + the changed elements' term differences.
    """
    pos = np.flatnonzero(nb != ob)
    values = nb[pos]
    if old_sum is None:
        s_new, s_old = checksum_sum(nb), (checksum_sum(ob) if spec.diff else 0)
    else:
        delta = int(element_terms(values, pos).sum(dtype=np.uint64)) - int(
            element_terms(ob[pos], pos).sum(dtype=np.uint64))
        s_new, s_old = (old_sum + delta) & MASK64, old_sum
    if spec.diff:
        values = zigzag(values, ob[pos])
    escapes = np.zeros(0, np.uint64)
    if spec.positions == "int32":
        check_int32_addressable(nb.size)
        positions = pos.astype(np.int32)
    else:
        positions, escapes = gap16_pack(pos)
    if spec.planar:
        positions, values = byte_group(positions), byte_group(values)
    return Streams(int(pos.size), positions, escapes, values, s_new, s_old)


def decode_positions(streams: Streams, spec: StreamSpec, numel: int) -> np.ndarray:
    """Validated int64 positions of a packet's streams."""
    c = streams.count
    if spec.positions == "int32":
        pos = streams.positions.astype(np.int64)
        check_positions(pos, numel)
        return pos
    gaps = byte_ungroup(streams.positions, c, 2) if spec.planar else streams.positions
    return gap16_unpack(gaps, streams.escapes, numel)


def decode_values(streams: Streams, spec: StreamSpec, old: np.ndarray) -> np.ndarray:
    """New bit patterns at the changed positions (``old``: the target's bits there)."""
    size = old.dtype.itemsize
    vals = byte_ungroup(streams.values, streams.count, size) if spec.planar else streams.values
    vals = vals.view(NP_UINT[size])
    return unzigzag_add(vals, old) if spec.diff else vals


def verify_streams(bits: np.ndarray, streams: Streams, spec: StreamSpec, result_checksum: bytes,
                   base_checksum: bytes = b""):
    """Every check of :func:`apply_streams`, reading ``bits`` only; returns the validated
    (positions, new bit patterns there) that the apply writes.

    Positions valid, the base checksum (base-relative packets) and the checksum of the
    result, computed from the target's sum plus the changed elements' terms. Any failure
    raises ValueError.
    """
    n_words = bits.size * words_per_element(bits.dtype.itemsize)
    pos = decode_positions(streams, spec, bits.size)
    old = bits[pos]
    new = decode_values(streams, spec, old)
    s_target = checksum_sum(bits)
    if base_checksum and finalize(s_target, n_words) != base_checksum:
        raise ValueError("target is not the packet's base: base checksum mismatch (the packet "
                         "codes values relative to one exact base version)")
    delta = int(element_terms(new, pos).sum(dtype=np.uint64)) - int(
        element_terms(old, pos).sum(dtype=np.uint64))
    if finalize(s_target + delta, n_words) != result_checksum:
        raise ValueError("delta result checksum mismatch: the target differs from the packet's "
                         "base at unchanged elements, or the packet is corrupt")
    return pos, new


def apply_streams(bits: np.ndarray, streams: Streams, spec: StreamSpec, result_checksum: bytes,
                  base_checksum: bytes = b"") -> None:
    """Verify everything (:func:`verify_streams`), then write the changed elements into
    ``bits`` in place. Any failure raises ValueError and leaves ``bits`` untouched."""
    pos, new = verify_streams(bits, streams, spec, result_checksum, base_checksum)
    bits[pos] = new
