"""DeltaPacket: encode/apply and the self-describing wire format (DESIGN 3.5).

Wire layout (little-endian):
  magic b"GLMD" | u16 format version | u8 dtype code | u8 encoding code | u8 has_base |
  3 pad bytes | u64 numel | u64 count | u64 escape count | u64 payload length |
  8B checksum of the result | 8B checksum of the base (zeros unless has_base) |
  8B checksum of header (this field zeroed) + payload | payload
Checksums are BLAKE2b-64 (hashlib) over the bytes in memory order.
"""
import struct
from dataclasses import dataclass

import numpy as np
import torch

from . import _reference as ref

MAGIC = b"GLMD"
FORMAT_VERSION = 1
_HEADER = struct.Struct("<4sHBBB3xQQQQ8s8s8s")
ENCODINGS = ("int32", "gap16", "zstd")
_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.uint8, torch.int8, torch.int16,
           torch.int32, torch.int64, torch.float64, torch.float8_e4m3fn, torch.float8_e5m2,
           torch.bool]
_DTYPE_CODE = {d: i for i, d in enumerate(_DTYPES)}


@dataclass
class DeltaPacket:
    dtype: torch.dtype
    numel: int
    encoding: str
    count: int
    n_escapes: int
    result_checksum: bytes
    base_checksum: bytes  # b"" unless the values are XOR'd against the base
    payload: bytes

    def to_bytes(self) -> bytes:
        has_base = 1 if self.base_checksum else 0
        fields = (MAGIC, FORMAT_VERSION, _DTYPE_CODE[self.dtype],
                  ENCODINGS.index(self.encoding), has_base, self.numel, self.count,
                  self.n_escapes, len(self.payload), self.result_checksum,
                  self.base_checksum or bytes(8))
        unsealed = _HEADER.pack(*fields, bytes(8))
        return _HEADER.pack(*fields, ref.checksum_bytes(unsealed + self.payload)) + self.payload

    @classmethod
    def from_bytes(cls, b) -> "DeltaPacket":
        b = bytes(b)
        if len(b) < _HEADER.size:
            raise ValueError(f"truncated delta packet: {len(b)} bytes, header needs {_HEADER.size}")
        (magic, version, dcode, ecode, has_base, numel, count, n_esc, plen, res_ck, base_ck,
         pay_ck) = _HEADER.unpack_from(b)
        if magic != MAGIC:
            raise ValueError(f"not a delta packet: magic {magic!r}, expected {MAGIC!r}")
        if version != FORMAT_VERSION:
            raise ValueError(f"delta packet format version {version}, expected {FORMAT_VERSION}")
        if dcode >= len(_DTYPES) or ecode >= len(ENCODINGS):
            raise ValueError(f"corrupt delta packet: dtype code {dcode}, encoding code {ecode}")
        payload = b[_HEADER.size:]
        if len(payload) != plen:
            raise ValueError(f"truncated or padded delta packet: payload {len(payload)} bytes, "
                             f"header says {plen}")
        if ref.checksum_bytes(b[:_HEADER.size - 8] + bytes(8) + payload) != pay_ck:
            raise ValueError("corrupt delta packet: packet checksum mismatch")
        return cls(_DTYPES[dcode], numel, ENCODINGS[ecode], count, n_esc, res_ck,
                   base_ck if has_base else b"", payload)

    def nbytes(self) -> int:
        return _HEADER.size + len(self.payload)


def _zstd(level, threads):
    import zstandard
    return (zstandard.ZstdCompressor(level=level, threads=threads),
            zstandard.ZstdDecompressor())


def _check_pair(new, old):
    from .._dispatch import check_tensor, check_same_shape
    check_tensor("new", new)
    check_tensor("old", old)
    check_same_shape("old", old, "new", new)
    if old.dtype != new.dtype:
        raise TypeError(f"old must have dtype {new.dtype}, got {old.dtype}")
    if new.dtype not in _DTYPE_CODE:
        raise TypeError(f"new has unsupported dtype {new.dtype}; expected one of {_DTYPES}")


def encode(new: torch.Tensor, old: torch.Tensor, *, encoding: str = "gap16",
           zstd_level: int = 3, xor_base: bool = True, threads: int = -1) -> DeltaPacket:
    """Packet that turns ``old`` into ``new`` bit for bit (host reference path)."""
    from .._dispatch import check_choice
    check_choice("encoding", encoding, ENCODINGS)
    _check_pair(new, old)
    new_c = new.detach().cpu().contiguous()
    old_c = old.detach().cpu().contiguous()
    n = new_c.numel()
    if encoding == "int32" and n > 2 ** 31:
        raise ValueError(f"encoding='int32' cannot address {n} elements (> 2^31); use 'gap16'")
    nb, ob = ref.np_bits(new_c), ref.np_bits(old_c)
    pos = np.flatnonzero(nb != ob)
    values = nb[pos]
    base_ck = b""
    n_esc = 0
    if encoding == "int32":
        payload = pos.astype(np.int32).tobytes() + values.tobytes()
    else:
        gaps, esc = ref.gap16_pack(pos)
        n_esc = esc.size
        if encoding == "gap16":
            payload = gaps.tobytes() + esc.tobytes() + values.tobytes()
        else:
            if xor_base:
                values = values ^ ob[pos]
                base_ck = ref.checksum(old_c)
            cctx, _ = _zstd(zstd_level, threads)
            raw = gaps.tobytes() + esc.tobytes() + ref.byte_group(values)
            payload = cctx.compress(raw)
    return DeltaPacket(new_c.dtype, n, encoding, int(pos.size), int(n_esc),
                       ref.checksum(new_c), base_ck, payload)


def decode(packet: DeltaPacket, base_bits: np.ndarray):
    """(positions int64, values as unsigned bit patterns); validates structure."""
    size = torch.empty(0, dtype=packet.dtype).element_size()
    c, e = packet.count, packet.n_escapes
    raw = packet.payload
    if packet.encoding == "zstd":
        _, dctx = _zstd(3, 0)
        try:
            raw = dctx.decompress(raw, max_output_size=2 * c + 8 * e + size * c + 1)
        except Exception as exc:  # zstandard.ZstdError
            raise ValueError(f"corrupt zstd delta payload: {exc}") from None
    want = (4 * c if packet.encoding == "int32" else 2 * c + 8 * e) + size * c
    if len(raw) != want:
        raise ValueError(f"corrupt delta packet: payload {len(raw)} bytes, expected {want}")
    if packet.encoding == "int32":
        pos = np.frombuffer(raw, np.int32, c).astype(np.int64)
        if c and np.any(np.diff(pos) <= 0):
            raise ValueError("corrupt delta packet: positions not strictly increasing")
        off = 4 * c
    else:
        pos = ref.gap16_unpack(np.frombuffer(raw, np.uint16, c),
                               np.frombuffer(raw, np.uint64, e, offset=2 * c))
        off = 2 * c + 8 * e
    if c and (pos[0] < 0 or pos[-1] >= packet.numel):
        raise ValueError(f"corrupt delta packet: position out of range [0, {packet.numel})")
    if packet.encoding == "zstd":
        vals = ref.byte_ungroup(raw[off:], c, size)
        if packet.base_checksum:
            vals = vals ^ base_bits[pos]
    else:
        vals = np.frombuffer(raw, ref._NP_UINT[size], c, offset=off)
    return pos, vals


def apply_(target: torch.Tensor, packet: DeltaPacket) -> torch.Tensor:
    """Apply ``packet`` to ``target`` in place; raises before any write if anything is off.

    The result is built in a scratch copy, its checksum compared with the packet's, and only
    then copied into ``target`` (one extra tensor of memory buys the all-or-nothing write).
    """
    from .._dispatch import check_tensor
    check_tensor("target", target)
    if not isinstance(packet, DeltaPacket):
        raise TypeError(f"packet must be a DeltaPacket, got {type(packet).__name__}")
    if target.dtype != packet.dtype:
        raise TypeError(f"target has dtype {target.dtype}, packet is for {packet.dtype}")
    if target.numel() != packet.numel:
        raise ValueError(f"target has {target.numel()} elements, packet is for {packet.numel}")
    if not target.is_contiguous():
        raise ValueError(f"target must be contiguous, got strides {target.stride()}")
    base = target.detach().cpu().contiguous()
    if packet.base_checksum and ref.checksum(base) != packet.base_checksum:
        raise ValueError("packet values are XOR'd against a base; target is not that base")
    bits = ref.np_bits(base)
    pos, vals = decode(packet, bits)
    scratch = bits.copy()
    scratch[pos] = vals
    if ref.checksum_bytes(scratch.tobytes()) != packet.result_checksum:
        raise ValueError("delta result checksum mismatch: target is not the packet's base")
    result = torch.from_numpy(scratch).view(ref._INT_VIEW[target.element_size()])
    with torch.no_grad():
        ref.int_view(target).copy_(result.to(target.device))
    return target
