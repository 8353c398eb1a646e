"""DeltaPacket and its self-describing wire format (docs/design.md 3.5).

Wire layout, format version 2 (little-endian)::

    magic b"GLMD" | u16 format version | u8 dtype code | u8 encoding code |
    u8 value coding (0: new bit patterns, 1: zigzag difference from the base) | 7 zero bytes |
    u64 numel | u64 count | u64 escape count | u64 payload length |
    8B checksum of the result | 8B checksum of the base (zeros unless value coding 1) |
    8B BLAKE2b-64 of (this header with this field zeroed) + payload | payload

Payload by encoding; every section starts at a multiple of 8 bytes (zero padding), so
each can be viewed in place with its own dtype on the host or on a GPU::

    int32: positions int32[count] | values[count]
    gap16: escapes u64[e] | gaps u16[count] | values[count]
    zstd:  u64 compressed length of each stream | the streams, each its own zstd frame
           (length 0 = empty stream): escapes u64[e], gap low bytes, gap high bytes,
           value byte 0, ..., value byte (size - 1)   -- byte planes of `count` bytes each

Checksums of the result and base are the linear word checksum of ``_reference`` (verifiable
from the changed elements alone); the packet checksum is BLAKE2b over the serialized bytes.
"""
from __future__ import annotations

import struct
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Union

import numpy as np
import torch

from . import _reference as ref

MAGIC = b"GLMD"
FORMAT_VERSION = 2
_HEADER = struct.Struct("<4sHBBB7sQQQQ8s8s8s")   # 72 bytes: the payload stays 8-aligned
HEADER_BYTES = _HEADER.size
ENCODINGS = ("int32", "gap16", "zstd")
_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.uint8, torch.int8, torch.int16,
           torch.int32, torch.int64, torch.float64, torch.float8_e4m3fn, torch.float8_e5m2,
           torch.bool]
_DTYPE_CODE = {d: i for i, d in enumerate(_DTYPES)}
SUPPORTED_DTYPES = tuple(_DTYPES)


def element_size(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


def stream_spec(encoding: str, relative: bool) -> ref.StreamSpec:
    return ref.StreamSpec(positions="int32" if encoding == "int32" else "gap16",
                          diff=relative, planar=encoding == "zstd")


def _pad8(n: int) -> int:
    return (n + 7) // 8 * 8


def raw_layout(encoding: str, count: int, n_escapes: int, size: int) -> dict:
    """Byte (offset, length) of each section of an int32 / gap16 payload, and its total."""
    if encoding == "int32":
        sections = {"escapes": (0, 0), "positions": (0, 4 * count)}
        vals_at = _pad8(4 * count)
    else:
        sections = {"escapes": (0, 8 * n_escapes), "positions": (8 * n_escapes, 2 * count)}
        vals_at = _pad8(8 * n_escapes + 2 * count)
    sections["values"] = (vals_at, size * count)
    sections["total"] = (0, vals_at + size * count)
    return sections


@dataclass
class DeltaPacket:
    """One tensor's delta. ``payload`` is bytes-like (host) or a uint8 tensor (any device)."""
    dtype: torch.dtype
    numel: int
    encoding: str
    count: int
    n_escapes: int
    result_checksum: bytes
    base_checksum: bytes                  # b"" unless values are differences from the base
    payload: Union[bytes, memoryview, torch.Tensor]

    @property
    def relative(self) -> bool:
        return bool(self.base_checksum)

    def payload_nbytes(self) -> int:
        p = self.payload
        return p.numel() if isinstance(p, torch.Tensor) else len(p)

    def nbytes(self) -> int:
        """Serialized size in bytes (header + payload)."""
        return HEADER_BYTES + self.payload_nbytes()

    def host_payload(self):
        """The payload as a host bytes-like object (a device payload is copied once)."""
        p = self.payload
        if isinstance(p, torch.Tensor):
            return p.detach().cpu().numpy().tobytes()
        return p

    def _fields(self, seal: bytes):
        return (MAGIC, FORMAT_VERSION, _DTYPE_CODE[self.dtype], ENCODINGS.index(self.encoding),
                1 if self.relative else 0, bytes(7), self.numel, self.count, self.n_escapes,
                self.payload_nbytes(), self.result_checksum, self.base_checksum or bytes(8),
                seal)

    def to_bytes(self) -> bytes:
        payload = self.host_payload()
        unsealed = _HEADER.pack(*self._fields(bytes(8)))
        seal = ref.checksum_bytes(unsealed + payload)
        return _HEADER.pack(*self._fields(seal)) + bytes(payload)

    @classmethod
    def from_bytes(cls, b) -> "DeltaPacket":
        """Parse and verify a serialized packet; ValueError on any inconsistency."""
        b = bytes(b)
        if len(b) < HEADER_BYTES:
            raise ValueError(f"truncated delta packet: {len(b)} bytes, header needs "
                             f"{HEADER_BYTES}")
        (magic, version, dcode, ecode, coding, pad, numel, count, n_esc, plen, res_ck, base_ck,
         seal) = _HEADER.unpack_from(b)
        if magic != MAGIC:
            raise ValueError(f"not a delta packet: magic {magic!r}, expected {MAGIC!r}")
        if version != FORMAT_VERSION:
            raise ValueError(f"delta packet format version {version}, this build reads "
                             f"{FORMAT_VERSION}")
        if len(b) - HEADER_BYTES != plen:
            raise ValueError(f"truncated or padded delta packet: payload {len(b) - HEADER_BYTES}"
                             f" bytes, header says {plen}")
        if ref.checksum_bytes(b[:HEADER_BYTES - 8] + bytes(8) + b[HEADER_BYTES:]) != seal:
            raise ValueError("corrupt delta packet: packet checksum mismatch")
        if dcode >= len(_DTYPES) or ecode >= len(ENCODINGS) or coding > 1 or pad != bytes(7):
            raise ValueError(f"corrupt delta packet: dtype code {dcode}, encoding code {ecode}, "
                             f"value coding {coding}")
        encoding = ENCODINGS[ecode]
        if coding and encoding != "zstd":
            raise ValueError(f"corrupt delta packet: relative values with encoding {encoding}")
        if count > numel or n_esc > max_escapes(encoding, numel, count):
            raise ValueError(f"corrupt delta packet: count {count}, escapes {n_esc}, "
                             f"numel {numel} (at most {max_escapes(encoding, numel, count)} "
                             f"escapes fit)")
        packet = cls(_DTYPES[dcode], numel, encoding, count, n_esc, res_ck,
                     base_ck if coding else b"", memoryview(b)[HEADER_BYTES:])
        check_payload_size(packet)
        return packet


def max_escapes(encoding: str, numel: int, count: int) -> int:
    """The most gap16 escapes a packet of ``count`` changes in ``numel`` elements can need.

    The gaps and their changes add up to at most ``numel`` (sum of gap + 1 = last position
    + 1); an escaped gap is at least ``ESCAPE`` long, every change takes one element:
    ``count + ESCAPE * escapes <= numel``. A header claiming more is refused before any
    stream is allocated or decompressed (the escape list would otherwise be bounded only
    by ``count``: 8 bytes per claimed change)."""
    if encoding == "int32" or count > numel:
        return 0
    return (numel - count) // ref.ESCAPE


def check_packet(packet) -> None:
    """Every field of a packet built in memory (never serialized, so never checked by
    :meth:`DeltaPacket.from_bytes`) the way ``from_bytes`` checks a wire packet: a short
    payload or a negative count must not reach a kernel. ValueError / TypeError."""
    if not isinstance(packet, DeltaPacket):
        raise TypeError(f"packet must be a DeltaPacket, got {type(packet).__name__}")
    if packet.dtype not in _DTYPE_CODE:
        raise TypeError(f"packet.dtype {packet.dtype} is not one of {list(_DTYPE_CODE)}")
    if packet.encoding not in ENCODINGS:
        raise ValueError(f"packet.encoding={packet.encoding!r}: expected one of "
                         f"{list(ENCODINGS)}")
    numel = check_int("packet.numel", packet.numel, 0)
    count = check_int("packet.count", packet.count, 0, numel)
    check_int("packet.n_escapes", packet.n_escapes, 0, max_escapes(packet.encoding, numel, count))
    for name in ("result_checksum", "base_checksum"):
        value = getattr(packet, name)
        if not isinstance(value, (bytes, bytearray)) or len(value) not in (
                (8,) if name == "result_checksum" else (0, 8)):
            raise ValueError(f"packet.{name} must be 8 bytes{' or empty' if name[0] == 'b' else ''}"
                             f", got {value!r:.40}")
    if packet.base_checksum and packet.encoding != "zstd":
        raise ValueError(f"packet with a base checksum (relative values) must use encoding "
                         f"'zstd', got {packet.encoding!r}")
    payload = packet.payload
    if isinstance(payload, torch.Tensor):
        if payload.dtype != torch.uint8 or payload.dim() != 1 or not payload.is_contiguous():
            raise TypeError(f"packet.payload tensor must be 1-D contiguous uint8, got dtype "
                            f"{payload.dtype}, shape {tuple(payload.shape)}")
    elif not isinstance(payload, (bytes, bytearray, memoryview)):
        raise TypeError(f"packet.payload must be bytes-like or a uint8 tensor, got "
                        f"{type(payload).__name__}")
    check_payload_size(packet)


def check_payload_size(packet: DeltaPacket) -> None:
    """The payload length the header implies (exact for int32/gap16, the table for zstd)."""
    size = element_size(packet.dtype)
    have = packet.payload_nbytes()
    if packet.encoding == "zstd":
        table = 8 * (3 + size)
        if have < table:
            raise ValueError(f"corrupt delta packet: zstd payload {have} bytes, its frame table "
                             f"alone needs {table}")
        return
    want = raw_layout(packet.encoding, packet.count, packet.n_escapes, size)["total"][1]
    if have != want:
        raise ValueError(f"corrupt delta packet: payload {have} bytes, expected {want} for "
                         f"{packet.count} {packet.encoding} changes of {packet.dtype}")


# ------------------------------------------------------------------------------- zstd
def _zstandard():
    try:
        import zstandard
    except ImportError:
        raise ImportError("encoding='zstd' needs the 'zstandard' package: pip install zstandard "
                          "(or glm_kernels[delta])") from None
    return zstandard


def require_zstd() -> None:
    _zstandard()


def _threads(threads: int) -> int:
    import os
    return max(1, os.cpu_count() or 1) if threads is None or threads < 1 else int(threads)


def check_int(name: str, value, lo: int = None, hi: int = None) -> int:
    """``value`` as an int in [lo, hi]; TypeError / ValueError naming ``name`` otherwise."""
    import numbers
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r:.40}")
    value = int(value)
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise ValueError(f"{name} must be in [{lo if lo is not None else '-inf'}, "
                         f"{hi if hi is not None else 'inf'}], got {value}")
    return value


def check_threads(threads) -> None:
    """``threads``: None or an int (< 1 means every core)."""
    if threads is not None:
        check_int("threads", threads)


# zstd's own range (ZSTD_minCLevel() .. ZSTD_maxCLevel()); negative levels are the fast ones.
ZSTD_MIN_LEVEL, ZSTD_MAX_LEVEL = -(1 << 17), 22


def check_zstd_level(zstd_level) -> int:
    return check_int("zstd_level", zstd_level, ZSTD_MIN_LEVEL, ZSTD_MAX_LEVEL)


# zstd frames smaller than this in total are (de)compressed in the calling thread: handing
# tiny frames to threads costs more than it saves (a 1% delta of a 5 MiB tensor is ~100 KB).
_SERIAL_BYTES = 1 << 20
_pools: dict = {}


def _map_frames(fn, items, threads: int, total_bytes: int) -> list:
    """``[fn(x) for x in items]``, on a process-wide pool of ``threads`` workers when the
    frames are big enough to gain from it (one pool per size: no thread start per packet)."""
    workers = min(_threads(threads), len(items))
    if workers <= 1 or total_bytes < _SERIAL_BYTES:
        return [fn(x) for x in items]
    import os
    key = (os.getpid(), _threads(threads))     # a forked child gets fresh threads
    pool = _pools.get(key)
    if pool is None:
        pool = _pools[key] = ThreadPoolExecutor(max_workers=key[1],
                                                thread_name_prefix="glm_kernels-zstd")
    return list(pool.map(fn, items))


def compress_streams(streams, zstd_level: int, threads: int) -> bytes:
    """zstd payload: length table, then one frame per non-empty stream, compressed in parallel."""
    zstandard = _zstandard()
    raw = [np.ascontiguousarray(s).view(np.uint8).reshape(-1) for s in streams]

    def one(buf):
        if buf.size == 0:
            return b""
        return zstandard.ZstdCompressor(level=zstd_level).compress(buf)

    frames = _map_frames(one, raw, threads, sum(buf.size for buf in raw))
    table = np.array([len(f) for f in frames], dtype="<u8").tobytes()
    return table + b"".join(frames)


def decompress_streams(payload, sizes, threads: int):
    """Inverse of compress_streams with the expected raw size of every stream (uint8 arrays).

    Decompression bombs: every frame must declare its content size in its header (our
    compressor always does), and that size must equal the size the packet header implies
    before anything is decompressed; zstd then allocates exactly that and fails on a frame
    whose blocks produce more. (``max_output_size`` alone is not a bound: zstandard ignores it
    when the frame declares a size.) So the output is never larger than ``sizes``, which the
    caller has checked against the target tensor."""
    zstandard = _zstandard()
    mv = memoryview(payload)
    if len(mv) < 8 * len(sizes):
        raise ValueError(f"corrupt zstd delta payload: {len(mv)} bytes, its frame table alone "
                         f"needs {8 * len(sizes)}")
    lengths = np.frombuffer(mv[:8 * len(sizes)], dtype="<u8")
    # Python ints: a uint64 sum could wrap around to the payload size.
    if sum(int(n) for n in lengths) != len(mv) - 8 * len(sizes):
        raise ValueError("corrupt zstd delta payload: frame lengths do not add up to the payload")
    starts = 8 * len(sizes) + np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)

    def frame(i):
        n, want = int(lengths[i]), int(sizes[i])
        data = mv[int(starts[i]):int(starts[i]) + n]
        if n == 0:
            if want:
                raise ValueError(f"corrupt zstd delta payload: stream {i} empty, expected {want}")
            return data
        try:
            declared = zstandard.frame_content_size(data)
        except zstandard.ZstdError as exc:
            raise ValueError(f"corrupt zstd delta payload: stream {i}: {exc}") from None
        if declared != want:
            what = "no content size" if declared < 0 else f"{declared} bytes"
            raise ValueError(f"corrupt zstd delta payload: stream {i} declares {what}, the "
                             f"packet header implies {want} (refused before decompressing)")
        return data

    frames = [frame(i) for i in range(len(sizes))]      # every frame checked before any work

    def one(i):
        want = int(sizes[i])
        if want == 0:
            return np.zeros(0, np.uint8)
        try:
            # allow_extra_data=False: bytes after the frame (a second, trailing frame) are
            # refused, not silently ignored.
            out = zstandard.ZstdDecompressor().decompress(frames[i], max_output_size=want,
                                                          allow_extra_data=False)
        except zstandard.ZstdError as exc:
            raise ValueError(f"corrupt zstd delta payload: {exc}") from None
        if len(out) != want:
            raise ValueError(f"corrupt zstd delta payload: stream {i} has {len(out)} bytes, "
                             f"expected {want}")
        return np.frombuffer(out, np.uint8)

    return _map_frames(one, range(len(sizes)), threads, int(sum(sizes)))


# ------------------------------------------------------------------ streams <-> payload
def build_payload(streams: ref.Streams, encoding: str, size: int, zstd_level: int = 3,
                  threads: int = -1) -> bytes:
    """Host payload bytes from numpy streams (see the module docstring for the layout)."""
    c = streams.count
    if encoding == "zstd":
        planes = [streams.escapes, streams.positions[:c], streams.positions[c:]]
        planes += [streams.values[b * c:(b + 1) * c] for b in range(size)]
        return compress_streams(planes, zstd_level, threads)
    layout = raw_layout(encoding, c, streams.escapes.size, size)
    out = np.zeros(layout["total"][1], np.uint8)
    for name in ("escapes", "positions", "values"):
        at, n = layout[name]
        out[at:at + n] = np.ascontiguousarray(getattr(streams, name)).view(np.uint8).reshape(-1)
    return out.tobytes()


def parse_payload(packet: DeltaPacket, threads: int = -1) -> ref.Streams:
    """Numpy streams (views into the payload where possible) of a host packet."""
    size = element_size(packet.dtype)
    c, e = packet.count, packet.n_escapes
    payload = packet.host_payload()
    if packet.encoding == "zstd":
        parts = decompress_streams(payload, [8 * e, c, c] + [c] * size, threads)
        return ref.Streams(c, np.concatenate(parts[1:3]), parts[0].view(np.uint64),
                           np.concatenate(parts[3:]))
    layout = raw_layout(packet.encoding, c, e, size)
    buf = np.frombuffer(payload, np.uint8)
    if buf[sum(layout["positions"]):layout["values"][0]].any():
        raise ValueError("corrupt delta packet: nonzero padding between payload sections")
    pos_dtype = np.int32 if packet.encoding == "int32" else np.uint16

    def view(name, dtype):
        at, n = layout[name]
        return buf[at:at + n].view(dtype)
    return ref.Streams(c, view("positions", pos_dtype), view("escapes", np.uint64),
                       view("values", ref.NP_UINT[size]))
