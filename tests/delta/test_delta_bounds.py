"""Allocations bounded by what the target can hold (issue 25): a packet's escape count is
refused past ``(numel - count) // 65535`` before any stream is decompressed (peak memory
measured in a fresh process), on the wire, in memory and in the C++ extension's own guard;
bytes after a zstd frame (a trailing frame) are refused on every codec path."""
import struct

import numpy as np
import pytest
import torch

from glm_kernels.delta import DeltaPacket, _host_codec, apply_, encode, verify
from glm_kernels.delta.packet import HEADER_BYTES, max_escapes
from tests._bounded import peak_rss_growth
from tests.delta._cases import random_pair
from tests.delta.conftest import path_kwargs

try:
    import zstandard
except ImportError:            # optional: only the zstd cases skip
    zstandard = None
needs_zstd = pytest.mark.skipif(zstandard is None, reason="zstandard not installed")


def test_max_escapes_is_what_a_tensor_can_hold():
    assert max_escapes("gap16", 65535 + 1, 1) == 1      # one gap of 65535, then the change
    assert max_escapes("gap16", 65535, 1) == 0
    assert max_escapes("zstd", 10 * 65536, 10) == 10
    assert max_escapes("int32", 1 << 40, 1) == 0
    # every escape the encoder writes fits the bound (a change after each long gap)
    n = 3 * 65536 + 7
    old = torch.zeros(n, dtype=torch.uint8)
    new = old.clone()
    new[[65535, 2 * 65536, 3 * 65536 + 6]] = 1
    for encoding in ("gap16",) + (("zstd",) if zstandard else ()):
        pkt = DeltaPacket.from_bytes(encode(new, old, encoding=encoding).to_bytes())
        assert 0 < pkt.n_escapes <= max_escapes(encoding, n, pkt.count)
        target = old.clone()
        apply_(target, pkt)
        assert torch.equal(target, new)


@needs_zstd
def test_forged_escape_count_refused_before_decompressing():
    """A ~10 KB resealed packet claiming one escape per change of a 16M-element tensor made
    the decoder allocate 8 bytes per claimed escape (about 200 MiB with the planes) before
    finding the streams wrong; the header is now refused first."""
    setup = """
import zstandard, struct, torch
from glm_kernels.delta import DeltaPacket, apply_

def zeros_frame(n):
    obj = zstandard.ZstdCompressor(level=1).compressobj(size=n)
    chunk = bytes(1 << 20)
    out = [obj.compress(chunk[:min(len(chunk), n - at)]) for at in range(0, n, len(chunk))]
    return b"".join(out) + obj.flush()

N = 16 << 20
target = torch.zeros(N, dtype=torch.bfloat16)
streams = [zeros_frame(8 * N)] + [zeros_frame(N) for _ in range(4)]
payload = struct.pack("<5Q", *map(len, streams)) + b"".join(streams)
wire = DeltaPacket(torch.bfloat16, N, "zstd", N, N, bytes(8), b"", payload).to_bytes()
del streams, payload
"""
    code = """
print("WIRE", len(wire))
try:
    apply_(target, DeltaPacket.from_bytes(wire))
    print("ACCEPTED")
except ValueError as exc:
    print("REFUSED", exc)
"""
    growth, out = peak_rss_growth(setup, code)
    assert "REFUSED" in out and "escapes" in out, out
    assert int(out.split("WIRE ")[1].split()[0]) < 64 << 10
    assert growth < 48 << 20, f"refusing the packet grew peak memory by {growth >> 20} MiB"


def test_in_memory_packet_escape_count_checked(path):
    new, old = random_pair(3000, 0.05, torch.float32, seed=2)
    good = encode(new, old, encoding="gap16")
    forged = DeltaPacket(good.dtype, good.numel, "gap16", good.count, 1, good.result_checksum,
                         b"", bytes(good.payload) + bytes(8))
    target = old.to(path[1])
    before = target.clone()
    with pytest.raises(ValueError, match="n_escapes"):
        apply_(target, forged, **path_kwargs(path))
    with pytest.raises(ValueError, match="n_escapes"):
        verify(target, forged, **path_kwargs(path))
    assert torch.equal(target.view(torch.int32), before.view(torch.int32))


def test_cpp_apply_refuses_escapes_the_target_cannot_hold():
    """The extension's own guard, for a caller below ``apply_``."""
    ext = _host_codec._ext
    if ext is None:
        pytest.skip("C++ host extension not built")
    target = np.zeros(65536, np.uint32)
    escapes = np.full(2, 65535, np.uint64)      # 2 escapes cannot fit 65536 elements
    gaps = np.array([65535], np.uint16)
    with pytest.raises(ValueError, match="2 escapes for 1 changes"):
        ext.apply(target, True, False, False, gaps, escapes, np.zeros(1, np.uint32), 1,
                  bytes(8), b"", 1, True)
    assert not target.any()


def _zstd_parts(pkt):
    size = pkt.dtype.itemsize
    payload = bytes(pkt.payload)
    table = list(struct.unpack_from(f"<{3 + size}Q", payload))
    frames, at = [], 8 * (3 + size)
    for n in table:
        frames.append(payload[at:at + n])
        at += n
    return frames


@needs_zstd
@pytest.mark.parametrize("extra", ["frame", "bytes"])
def test_trailing_zstd_data_refused(path, extra):
    """A valid stream followed by a second zstd frame (or stray bytes) used to be accepted:
    zstd stops after the first frame and the rest was ignored."""
    new, old = random_pair(3000, 0.2, torch.float32, seed=4)
    pkt = encode(new, old, encoding="zstd")
    frames = _zstd_parts(pkt)
    tail = zstandard.ZstdCompressor().compress(b"x" * 5) if extra == "frame" else b"\x00\x01"
    frames[3] += tail                         # value byte-0 plane: valid frame + trailing data
    payload = struct.pack(f"<{len(frames)}Q", *map(len, frames)) + b"".join(frames)
    forged = DeltaPacket(pkt.dtype, pkt.numel, "zstd", pkt.count, pkt.n_escapes,
                         pkt.result_checksum, pkt.base_checksum, payload)
    wire = forged.to_bytes()
    assert len(wire) > HEADER_BYTES
    target = old.to(path[1])
    with pytest.raises(ValueError, match="unused data|corrupt zstd"):
        apply_(target, DeltaPacket.from_bytes(wire), **path_kwargs(path))
    assert torch.equal(target.view(torch.int32), old.view(torch.int32))
    frames[3] = frames[3][:-len(tail)]        # the same packet without the tail applies
    payload = struct.pack(f"<{len(frames)}Q", *map(len, frames)) + b"".join(frames)
    clean = DeltaPacket(pkt.dtype, pkt.numel, "zstd", pkt.count, pkt.n_escapes,
                        pkt.result_checksum, pkt.base_checksum, payload)
    apply_(target, DeltaPacket.from_bytes(clean.to_bytes()), **path_kwargs(path))
    assert torch.equal(target.view(torch.int32), new.view(torch.int32))
