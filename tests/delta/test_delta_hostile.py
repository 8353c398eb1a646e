"""Hostile packets (issue 17): zstd decompression bombs, in-memory packets that were never
serialized, argument errors that name the argument, and a seeded fuzz harness over every
encoding and codec path (C++ host, its numpy fallback, the Triton kernels)."""
import random
import struct
import tracemalloc

import numpy as np
import pytest
import torch

import glm_kernels
from glm_kernels.delta import DeltaPacket, apply_, encode, verify
from glm_kernels.delta import _host_codec
from glm_kernels.delta import _reference as ref
from glm_kernels.delta.packet import _DTYPES, HEADER_BYTES, element_size
from tests.delta._cases import random_pair
from tests.delta.conftest import path_kwargs

try:
    import zstandard
except ImportError:            # optional: only the zstd cases skip
    zstandard = None
needs_zstd = pytest.mark.skipif(zstandard is None, reason="zstandard not installed")







def _bomb(numel: int, declared: int, with_size: bool = True) -> DeltaPacket:
    """A sealed zstd packet for a ``numel``-element bf16 tensor (count = numel) whose
    gap-low-byte stream is one frame of ``declared`` zero bytes (a 33 KB frame for 32 MiB)."""
    count = numel
    zc = zstandard.ZstdCompressor(level=1, write_content_size=with_size)
    if with_size:
        bomb = zc.compress(bytes(declared))
    else:
        obj = zc.compressobj()
        bomb = obj.compress(bytes(declared)) + obj.flush()
    ok = zstandard.ZstdCompressor(level=1)
    streams = [b"", bomb] + [ok.compress(bytes(count)) for _ in range(3)]
    table = struct.pack("<5Q", *[len(s) for s in streams])
    payload = table + b"".join(streams)
    pkt = DeltaPacket(torch.bfloat16, numel, "zstd", count, 0, bytes(8), b"", payload)
    return DeltaPacket.from_bytes(pkt.to_bytes())       # sealed, as an attacker can


@needs_zstd
@pytest.mark.parametrize("with_size", [True, False], ids=["declared", "undeclared"])
def test_zstd_bomb_refused_before_decompressing(path, with_size):
    """Before the fix a 33 KB packet for a 48-element tensor made zstd allocate and fill the
    size its frame declares (max_output_size is ignored then): peak memory is now bounded."""
    target = torch.zeros(48, dtype=torch.bfloat16, device=path[1])
    before = target.clone()
    pkt = _bomb(48, 32 << 20, with_size)
    assert pkt.nbytes() < 64 << 10
    tracemalloc.start()
    try:
        with pytest.raises(ValueError, match="corrupt zstd delta payload"):
            apply_(target, pkt, **path_kwargs(path))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20, f"decompressing a refused packet peaked at {peak} bytes"
    assert torch.equal(target.view(torch.int16), before.view(torch.int16))


@needs_zstd
def test_zstd_never_asked_for_more_than_the_header_implies(monkeypatch):
    """Every decompress call gets a frame whose declared size is the stream's exact size."""
    asked = []
    real = zstandard.ZstdDecompressor

    class Spy:
        def __init__(self, *a, **k):
            self._d = real(*a, **k)

        def decompress(self, data, *a, **k):
            asked.append(zstandard.frame_content_size(data))
            return self._d.decompress(data, *a, **k)
    monkeypatch.setattr(zstandard, "ZstdDecompressor", Spy)
    with glm_kernels.force_backend("torch"):
        new, old = random_pair(5000, 0.1, torch.bfloat16, seed=3)
        pkt = DeltaPacket.from_bytes(encode(new, old, encoding="zstd").to_bytes())
        target = old.clone()
        apply_(target, pkt)
        assert torch.equal(target.view(torch.int16), new.view(torch.int16))
        assert asked and max(asked) <= pkt.count
        asked.clear()
        with pytest.raises(ValueError):
            apply_(torch.zeros(48, dtype=torch.bfloat16), _bomb(48, 1 << 30))
        assert asked == []


@needs_zstd
def test_trailing_or_oversized_frames_refused():
    with glm_kernels.force_backend("torch"):
        new, old = random_pair(3000, 0.2, torch.float32, seed=4)
        pkt = encode(new, old, encoding="zstd")
        payload = bytes(pkt.payload)
        lengths = list(struct.unpack_from("<7Q", payload))
        frames, at = [], 56
        for n in lengths:
            frames.append(payload[at:at + n])
            at += n
        # the value byte-0 plane replaced by a frame one byte longer than count
        frames[3] = zstandard.ZstdCompressor().compress(bytes(pkt.count + 1))
        bad = struct.pack("<7Q", *[len(f) for f in frames]) + b"".join(frames)
        forged = DeltaPacket(pkt.dtype, pkt.numel, "zstd", pkt.count, pkt.n_escapes,
                             pkt.result_checksum, pkt.base_checksum, bad)
        target = old.clone()
        with pytest.raises(ValueError, match="declares"):
            apply_(target, DeltaPacket.from_bytes(forged.to_bytes()))
        assert torch.equal(target.view(torch.int32), old.view(torch.int32))


# ------------------------------------------------------------------ in-memory packets
def _memory_packets(device):
    new, old = random_pair(3000, 0.05, torch.float32, seed=5)
    new, old = new.to(device), old.to(device)
    good = encode(new, old, encoding="gap16")
    payload = good.payload

    def with_(**kw):
        fields = dict(dtype=good.dtype, numel=good.numel, encoding=good.encoding,
                      count=good.count, n_escapes=good.n_escapes,
                      result_checksum=good.result_checksum, base_checksum=b"", payload=payload)
        fields.update(kw)
        return DeltaPacket(**fields)
    cases = {
        "short payload": with_(payload=payload[:len(payload) // 2]),
        "count=-1": with_(count=-1),
        "count > numel": with_(count=good.numel + 1),
        "numel float": with_(numel=3000.0),
        "escapes=-1": with_(n_escapes=-1),
        "encoding": with_(encoding="lz4"),
        "checksum": with_(result_checksum=b"123"),
        "payload type": with_(payload=[1, 2, 3]),
    }
    return old, cases


@pytest.mark.parametrize("case", ["short payload", "count=-1", "count > numel", "numel float",
                                  "escapes=-1", "encoding", "checksum", "payload type"])
def test_in_memory_packet_checked_before_any_kernel(path, case):
    old, cases = _memory_packets(path[1])
    target = old.clone()
    with pytest.raises((ValueError, TypeError), match="packet|payload"):
        apply_(target, cases[case], **path_kwargs(path))
    with pytest.raises((ValueError, TypeError), match="packet|payload"):
        verify(target, cases[case], **path_kwargs(path))
    assert torch.equal(target.view(torch.int32), old.view(torch.int32))


# ------------------------------------------------------------------ arguments
@pytest.mark.parametrize("kwargs,err,match", [
    (dict(zstd_level="high"), TypeError, "zstd_level"),
    (dict(zstd_level=99), ValueError, "zstd_level"),
    (dict(zstd_level=True), TypeError, "zstd_level"),
    (dict(threads="many"), TypeError, "threads"),
    (dict(threads=2.5), TypeError, "threads"),
])
def test_encode_arguments_named(kwargs, err, match):
    new, old = random_pair(100, 0.1, torch.float32)
    with pytest.raises(err, match=match):
        encode(new, old, encoding="gap16", **kwargs)     # checked whatever the encoding


def test_apply_and_checksum_threads_named():
    new, old = random_pair(100, 0.1, torch.float32)
    pkt = encode(new, old)
    with pytest.raises(TypeError, match="threads"):
        apply_(old.clone(), pkt, threads="many")
    with pytest.raises(TypeError, match="threads"):
        glm_kernels.delta.checksum(old, threads="many")


# ------------------------------------------------------------------ fuzz harness
def _reseal(wire: bytes) -> bytes:
    """Recompute the BLAKE2b seal of a mutated packet (anyone can: it is not keyed)."""
    b = bytearray(wire)
    b[HEADER_BYTES - 8:HEADER_BYTES] = bytes(8)
    seal = ref.checksum_bytes(bytes(b))
    b[HEADER_BYTES - 8:HEADER_BYTES] = seal
    return bytes(b)


def _with_trailing_frame(b: bytearray, rng: random.Random) -> bytearray:
    """A zstd frame appended inside one stream's slot of a zstd payload (its length in the
    table grown to match), or after the payload of the raw encodings (issue 25: a valid
    frame followed by a trailing one used to be accepted)."""
    extra = zstandard.ZstdCompressor().compress(bytes(rng.randrange(0, 9)))
    if b[7] != 2:                                # encoding code 2: zstd
        return b + extra
    n_streams = 3 + element_size(_DTYPES[b[6]])
    table = list(struct.unpack_from(f"<{n_streams}Q", b, HEADER_BYTES))
    used = [i for i, n in enumerate(table) if n]
    i = rng.choice(used)
    at = HEADER_BYTES + 8 * n_streams + sum(table[:i + 1])
    table[i] += len(extra)
    b[at:at] = extra
    struct.pack_into(f"<{n_streams}Q", b, HEADER_BYTES, *table)
    return b


def _mutants(wire: bytes, rng: random.Random, n: int):
    """Seeded mutants: header field rewrites (with the payload length kept consistent),
    escape counts past what the tensor can hold, payload bit flips, byte rewrites,
    truncations and extensions, trailing zstd frames -- all resealed."""
    numel, count = struct.unpack_from("<QQ", wire, 16)
    for _ in range(n):
        b = bytearray(wire)
        kind = rng.randrange(7)
        if kind == 5:                           # escape count: the most that fit, and past it
            bound = (numel - count) // 65535
            struct.pack_into("<Q", b, 32, rng.choice([bound + 1, count, max(1, count // 2),
                                                      (1 << 64) - 1]))
        elif kind == 6 and zstandard is not None:
            b = _with_trailing_frame(b, rng)
        elif kind == 0:                           # a header field (numel/count/escapes/coding)
            off = rng.choice([6, 7, 8, 9, 16, 24, 32])
            width = 1 if off < 16 else 8
            value = rng.choice([0, 1, 2, 255, 1 << 16, 1 << 31, (1 << 63) - 1, (1 << 64) - 1,
                                rng.getrandbits(8 * width)]) % (1 << (8 * width))
            b[off:off + width] = value.to_bytes(width, "little")
        elif kind == 1 and len(b) > HEADER_BYTES:
            for _ in range(rng.randint(1, 4)):
                at = rng.randrange(HEADER_BYTES, len(b))
                b[at] ^= 1 << rng.randrange(8)
        elif kind == 2 and len(b) > HEADER_BYTES:
            at = rng.randrange(HEADER_BYTES, len(b))
            b[at] = rng.choice([0, 0xFF, rng.randrange(256)])
        elif kind == 3:
            del b[rng.randrange(HEADER_BYTES, len(b) + 1):]
        else:
            b += bytes(rng.randrange(1, 17))
        struct.pack_into("<Q", b, 40, len(b) - HEADER_BYTES)     # payload length field
        yield kind, _reseal(bytes(b))


@pytest.mark.parametrize("encoding", ["int32", "gap16",
                                      pytest.param("zstd", marks=needs_zstd)])
def test_fuzz_mutants_never_accepted_wrong_never_half_applied(path, encoding):
    """Bounded and seeded: every mutant either applies to exactly ``new`` or is refused with
    ValueError/TypeError and the target untouched; never another exception, never a crash."""
    n_mutants = 24 if path[0] == "kernels" else 150
    rng = random.Random(f"{encoding}-{path[0]}")
    new, old = random_pair(4099, 0.03, torch.bfloat16, seed=11)
    wire = encode(new, old, encoding=encoding).to_bytes()
    new_d, old_d = new.to(path[1]), old.to(path[1])
    accepted = 0
    refused_kinds = set()
    for kind, mutant in _mutants(wire, rng, n_mutants):
        target = old_d.clone()
        try:
            pkt = DeltaPacket.from_bytes(mutant)
            apply_(target, pkt, **path_kwargs(path))
        except (ValueError, TypeError):
            assert torch.equal(target.view(torch.int16), old_d.view(torch.int16))
            refused_kinds.add(kind)
            continue
        except ImportError:         # a mutant turned into a zstd packet, zstandard missing
            assert zstandard is None and pkt.encoding == "zstd"
            assert torch.equal(target.view(torch.int16), old_d.view(torch.int16))
            continue
        accepted += 1
        assert torch.equal(target.view(torch.int16), new_d.view(torch.int16))
        # escape counts past the bound and trailing frames are refused even when the
        # decoded result would be right (issue 25)
        assert kind != 5 and not (kind == 6 and zstandard is not None), \
            f"a mutant of kind {kind} was accepted"
    assert accepted < n_mutants          # the harness does produce refusals
    assert 5 in refused_kinds           # the new mutation kinds were exercised
    if zstandard is not None:
        assert 6 in refused_kinds


@pytest.mark.parametrize("count", [-1, -(1 << 62), 1 << 62])
def test_cpp_apply_refuses_bad_counts_before_size_arithmetic(count):
    """The extension's own guard (a caller below ``apply_``): 0 <= count <= numel is checked
    before ``4 * count`` is formed, so no overflowed size can match an empty buffer."""
    ext = _host_codec._ext
    if ext is None:
        pytest.skip("C++ host extension not built")
    target = np.zeros(8, np.uint32)
    with pytest.raises(ValueError, match="changes for 8 elements"):
        ext.apply(target, False, False, False, np.zeros(0, np.int32), np.zeros(0, np.uint64),
                  np.zeros(0, np.uint32), count, bytes(8), b"", 1, True)
    assert not target.any()
