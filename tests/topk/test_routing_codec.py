"""The routed-expert-id wire packet: exact round trips (uneven lengths; 1, 8, 256, 512 and
65536 experts), the byte layout, Adler-32 on any device, and every kind of bad packet refused."""
import struct
import zlib

import pytest
import torch

from glm_kernels.topk import (decode_routing, decode_routing_batch, encode_routing,
                              encode_routing_batch, routing_header)
from glm_kernels.topk import routing_codec as codec
from tests.conftest import DEVICE, HAS_CUDA


def routed(n_layers, n_tokens, k, n_experts, seed=0):
    """k distinct random experts per (layer, token), int64 [L, T, k]."""
    gen = torch.Generator().manual_seed(seed)
    if n_experts > 1024:    # slot j takes ids = j mod k: distinct, without an [L, T, E] sort
        return (torch.randint(0, n_experts // k, (n_layers, n_tokens, k), generator=gen) * k
                + torch.arange(k))
    return torch.rand(n_layers, n_tokens, n_experts, generator=gen).argsort(-1)[..., :k]


@pytest.mark.parametrize("n_experts, k", [(1, 1), (8, 2), (256, 8), (257, 3), (512, 8),
                                          (65536, 4)])
@pytest.mark.parametrize("n_tokens", [0, 1, 7, 133])
def test_round_trip(n_experts, k, n_tokens):
    for n_layers in (1, 3):
        ids = routed(n_layers, n_tokens, k, n_experts, seed=n_tokens * 7 + n_layers)
        if n_experts > 256 and ids.numel():     # the extreme ids take both bytes
            ids[0, 0, 0] = n_experts - 1
        packet = encode_routing(ids.to(DEVICE), n_experts)
        assert packet.dtype == torch.uint8 and packet.device.type == torch.device(DEVICE).type
        width = 1 if n_experts <= 256 else 2
        assert packet.numel() == 28 + n_layers * n_tokens * k * width
        assert packet.numel() == codec.packet_bytes(n_layers, n_tokens, k, n_experts)
        assert routing_header(packet) == (1, width, n_experts, n_layers, n_tokens, k)
        back = decode_routing(packet)
        assert back.dtype == torch.int64 and torch.equal(back.cpu(), ids)
        wire = packet.cpu().numpy().tobytes()
        assert torch.equal(decode_routing(wire), ids)
        assert torch.equal(decode_routing(bytearray(wire), dtype=torch.int32),
                           ids.to(torch.int32))
        assert torch.equal(decode_routing(memoryview(wire), device=DEVICE).cpu(), ids)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int16, torch.uint8])
def test_narrow_id_dtypes_encode_the_same_bytes(dtype):
    ids = routed(2, 9, 4, 200, seed=3)
    assert torch.equal(encode_routing(ids.to(dtype), 200), encode_routing(ids, 200))


def test_byte_layout_by_hand():
    ids = torch.tensor([[[0x1234, 0x0001]], [[0x00FF, 0x0100]]])      # 2 layers, 1 token
    packet = encode_routing(ids, 5000).numpy().tobytes()
    header = struct.pack("<4sBBHIIII", b"GLMR", 1, 2, 0, 5000, 2, 1, 2)
    body = bytes([0x34, 0x12, 0x01, 0x00, 0xFF, 0x00, 0x00, 0x01])
    assert packet == header + body + struct.pack("<I", zlib.adler32(header + body))
    small = encode_routing(torch.tensor([[[3, 1]], [[0, 2]]]), 4).numpy().tobytes()
    assert small[24:-4] == bytes([3, 1, 0, 2])          # layer-major, slots as recorded


@pytest.mark.parametrize("n", [0, 1, 5552, 5553, 70_001])
def test_adler32_closed_form_matches_zlib(n, monkeypatch):
    data = torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(n),
                         dtype=torch.uint8)
    want = zlib.adler32(data.numpy().tobytes())
    assert codec.adler32(data.to(DEVICE)) == want
    monkeypatch.setattr(codec, "_ADLER_CHUNK", 4096)    # several passes
    assert codec.adler32(data.to(DEVICE)) == want
    assert codec.adler32(torch.full((n,), 255, dtype=torch.uint8)) == \
        zlib.adler32(b"\xff" * n)


def test_batch_with_uneven_lengths():
    ids = routed(3, 5 * 11, 4, 64, seed=5).reshape(3, 5, 11, 4)
    lengths = [11, 0, 1, 7, 10]
    packets = encode_routing_batch(ids, lengths, 64)
    assert [routing_header(p).n_tokens for p in packets] == lengths
    batch = decode_routing_batch([p.numpy().tobytes() for p in packets], width=12)
    assert batch.ids.shape == (3, 5, 12, 4) and batch.lengths.tolist() == lengths
    for b, n in enumerate(lengths):
        assert torch.equal(batch.ids[:, b, :n], ids[:, b, :n])
        assert torch.equal(batch.ids[:, b, n:], torch.arange(4).expand(3, 12 - n, 4))
    with pytest.raises(ValueError, match="width=3 is shorter than the longest sequence"):
        decode_routing_batch(packets, width=3)
    batch = decode_routing_batch(iter(packets))                 # any iterable; width = 11
    assert batch.ids.shape == (3, 5, 11, 4) and batch.lengths.tolist() == lengths


def test_batch_refuses_packets_of_another_model():
    """Each field that makes ids mean something else (expert count, k, layer count) is
    checked against packets[0], by index and name; the packet's own errors carry its index."""
    first = encode_routing(routed(3, 5, 4, 64, seed=1), 64)
    others = {"n_experts": (encode_routing(routed(3, 5, 4, 32, seed=2), 32), 32, 64),
              "k": (encode_routing(routed(3, 5, 2, 64, seed=3), 64), 2, 4),
              "n_layers": (encode_routing(routed(2, 5, 4, 64, seed=4), 64), 2, 3)}
    for field, (other, theirs, ours) in others.items():
        with pytest.raises(ValueError, match=rf"packets\[2\] has {field}={theirs}, packets\[0\] "
                                             rf"has {field}={ours}: one batch"):
            decode_routing_batch([first, first, other, first])
    # same ids, 200 experts declared instead of 64: same width (1 byte), n_experts differs
    wide = encode_routing(routed(3, 5, 4, 64, seed=1), 200)
    with pytest.raises(ValueError, match=r"packets\[1\] has n_experts=200"):
        decode_routing_batch([first, wide])
    wire = bytearray(first.numpy().tobytes())
    wire[30] ^= 4
    with pytest.raises(ValueError, match=r"packets\[1\] is corrupt: checksum"):
        decode_routing_batch([first, bytes(wire)])
    with pytest.raises(ValueError, match=r"packets\[0\] is truncated"):
        decode_routing_batch([b"GLMR"])
    with pytest.raises(TypeError, match="packets must be a sequence of packets"):
        decode_routing_batch(first)
    with pytest.raises(TypeError, match=r"packets\[1\] must be a uint8 torch.Tensor or bytes"):
        decode_routing_batch([first, [1, 2]])
    with pytest.raises(ValueError, match="at least one packet"):
        decode_routing_batch([])


def test_batch_encode_refuses_bad_lengths():
    ids = routed(3, 5 * 11, 4, 64, seed=5).reshape(3, 5, 11, 4)
    with pytest.raises(ValueError, match="lengths must give one length"):
        encode_routing_batch(ids, [11, 0, 1, 7], 64)
    with pytest.raises(ValueError, match="lengths must give one length"):
        encode_routing_batch(ids, [12, 0, 1, 7, 1], 64)


@pytest.mark.parametrize("n_experts", [8, 512])
def test_every_corrupted_byte_is_refused(n_experts):
    wire = encode_routing(routed(2, 3, 2, n_experts, seed=1), n_experts).numpy().tobytes()
    for pos in range(len(wire)):
        for flip in (0x01, 0x80):
            bad = bytearray(wire)
            bad[pos] ^= flip
            with pytest.raises(ValueError, match="packet"):
                decode_routing(bytes(bad))
            with pytest.raises(ValueError, match="packet"):
                decode_routing(torch.frombuffer(bad, dtype=torch.uint8).to(DEVICE))


def test_bad_packets_name_the_problem():
    wire = encode_routing(routed(2, 3, 2, 8), 8).numpy().tobytes()
    for cut in (0, 10, 27):
        with pytest.raises(ValueError, match=f"truncated: {cut} bytes, shorter than"):
            decode_routing(wire[:cut])
    with pytest.raises(ValueError, match=rf"truncated: {len(wire) - 1} bytes.*needs {len(wire)}"):
        decode_routing(wire[:-1])
    with pytest.raises(ValueError, match="longer than its header says"):
        decode_routing(wire + b"\0")
    with pytest.raises(ValueError, match="not a routing packet: magic b'XLMR'"):
        decode_routing(b"X" + wire[1:])
    with pytest.raises(ValueError, match="format version 2; this glm_kernels reads version 1"):
        decode_routing(wire[:4] + b"\x02" + wire[5:])
    with pytest.raises(ValueError, match="packet is corrupt: checksum"):
        decode_routing(wire[:30] + bytes([wire[30] ^ 4]) + wire[31:])
    # An id out of range behind a valid checksum (a buggy writer, not line noise).
    body = bytearray(wire[:-4])
    body[24] = 9
    with pytest.raises(ValueError, match="an id >= n_experts=8"):
        decode_routing(bytes(body) + struct.pack("<I", zlib.adler32(bytes(body))))
    with pytest.raises(TypeError, match="packet must be a uint8 torch.Tensor or bytes"):
        decode_routing([1, 2, 3])
    with pytest.raises(TypeError, match="packet must have dtype"):
        decode_routing(torch.zeros(40, dtype=torch.int32))
    with pytest.raises(ValueError, match="dtype="):
        decode_routing(wire, dtype=torch.float32)


def test_bad_ids_are_refused_by_encode():
    ids = routed(2, 3, 2, 8)
    high, low = ids.clone(), ids.clone()
    high[1, 2, 1], low[0, 1, 0] = 8, -1
    with pytest.raises(ValueError, match=r"ids must lie in \[0, 8\).*\[\d, 8\]"):
        encode_routing(high, 8)
    with pytest.raises(ValueError, match=r"ids must lie in \[0, 8\).*\[-1, \d\]"):
        encode_routing(low, 8)
    with pytest.raises(ValueError, match="n_experts must be an int in"):
        encode_routing(ids, 65537)
    with pytest.raises(ValueError, match="n_experts must be an int in"):
        encode_routing(ids, 0)
    with pytest.raises(ValueError, match=r"k \(ids.shape\[2\]\) must be an int in \[1, 1\]"):
        encode_routing(torch.zeros(2, 3, 2, dtype=torch.int64), 1)
    with pytest.raises(TypeError, match="ids must have dtype"):
        encode_routing(ids.float(), 8)
    with pytest.raises(ValueError, match="ids must have 3 dims"):
        encode_routing(ids[0], 8)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_gpu_packets_equal_cpu_packets():
    ids = routed(78, 4096, 8, 256, seed=2)
    gpu = encode_routing(ids.cuda(), 256)
    assert torch.equal(gpu.cpu(), encode_routing(ids, 256))
    assert torch.equal(decode_routing(gpu.cpu().numpy().tobytes(), device="cuda"), ids.cuda())
    wide = routed(4, 1000, 8, 512, seed=3).cuda()
    assert torch.equal(decode_routing(encode_routing(wide, 512)), wide)
