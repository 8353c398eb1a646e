"""Public API of the delta codec on the default CPU backend (the C++ host codec): round trips,
special values, gap escapes, wire corruption, refusals that leave the target unchanged."""
import struct
import sys

import pytest
import torch

import glm_kernels
from glm_kernels.delta import ENCODINGS, DeltaPacket, apply_, checksum, encode
from glm_kernels.delta import packet as packet_mod
from tests._compare import assert_bits_equal
from tests.delta._cases import DENSITIES, DTYPES, bits, changed_count, random_pair, \
    ulp_step_pair


@pytest.fixture(autouse=True)
def _host_backend():
    with glm_kernels.force_backend("torch"):
        yield


def _roundtrip(new, old, enc, **kwargs):
    pkt = DeltaPacket.from_bytes(encode(new, old, encoding=enc, **kwargs).to_bytes())
    target = old.clone()
    assert apply_(target, pkt) is target
    assert_bits_equal(target, new)
    return pkt


@pytest.mark.parametrize("enc", ENCODINGS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("density", DENSITIES)
def test_roundtrip_random(enc, dtype, density):
    seed = ENCODINGS.index(enc) * 10 + DTYPES.index(dtype)
    new, old = random_pair(30011, density, dtype, seed=seed)
    pkt = _roundtrip(new, old, enc)
    assert pkt.count == changed_count(new, old)
    assert pkt.result_checksum == checksum(new)
    assert pkt.relative == (enc == "zstd")
    if pkt.relative:
        assert pkt.base_checksum == checksum(old)


@pytest.mark.parametrize("enc", ENCODINGS)
def test_special_values_are_changes(enc):
    old = torch.tensor([0.0, float("nan"), float("inf"), 1.0, -0.0])
    new = torch.tensor([-0.0, float("nan"), float("-inf"), 1.0, -0.0])
    new.view(torch.int32)[1] ^= 1                                # another NaN payload
    pkt = _roundtrip(new, old, enc)
    assert pkt.count == 3


@pytest.mark.parametrize("enc", ENCODINGS)
@pytest.mark.parametrize("gap", [65534, 65535, 65536, (1 << 20) + 7])
def test_large_gaps(enc, gap):
    # changes at 0, gap + 1 and gap + 3: gaps 0, gap, 1
    old = torch.zeros(gap + 5, dtype=torch.bfloat16)
    new = old.clone()
    new[0], new[gap + 1], new[gap + 3] = 1.0, 2.0, 3.0
    pkt = _roundtrip(new, old, enc)
    assert pkt.count == 3
    if enc != "int32":
        assert pkt.n_escapes == (1 if gap >= 65535 else 0)


@pytest.mark.parametrize("enc", ENCODINGS)
@pytest.mark.parametrize("n", [0, 1])
def test_empty_and_one(enc, n):
    pkt = _roundtrip(torch.ones(n), torch.zeros(n), enc)
    assert pkt.count == n


def test_shapes_and_noncontiguous_inputs():
    new, old = random_pair(4 * 6 * 5, 0.3, torch.float32)
    new, old = new.view(4, 6, 5), old.view(4, 6, 5)
    pkt = encode(new.transpose(0, 2), old.transpose(0, 2))      # copied to contiguous
    target = old.transpose(0, 2).contiguous()
    apply_(target, pkt)
    assert_bits_equal(target, new.transpose(0, 2).contiguous())


@pytest.mark.parametrize("enc", ENCODINGS)
def test_corrupt_truncated_refused(enc):
    new, old = random_pair(5003, 0.05, torch.bfloat16)
    raw = encode(new, old, encoding=enc).to_bytes()
    bad_packets = [raw[:-1], raw[:10], raw + b"\0", raw[:30] + bytes([raw[30] ^ 1]) + raw[31:],
                   raw[:-3] + bytes([raw[-3] ^ 0x40]) + raw[-2:], b"XXXX" + raw[4:]]
    for bad in bad_packets:
        with pytest.raises(ValueError):
            DeltaPacket.from_bytes(bad)


def _reseal(pkt, payload):
    """A packet whose payload was altered after encoding, with a valid packet checksum:
    what a sender bug or in-memory corruption looks like to the receiver."""
    return DeltaPacket(pkt.dtype, pkt.numel, pkt.encoding, pkt.count, pkt.n_escapes,
                       pkt.result_checksum, pkt.base_checksum, bytes(payload))


def _refused(target, pkt, err=ValueError, match=None):
    before = bits(target)
    with pytest.raises(err, match=match):
        apply_(target, pkt)
    assert torch.equal(bits(target), before), "target modified by a refused packet"


@pytest.mark.parametrize("enc", ["int32", "gap16"])
def test_resealed_corruption_refused_before_any_write(enc):
    new, old = random_pair(5003, 0.05, torch.bfloat16, seed=3)
    pkt = encode(new, old, encoding=enc)
    payload = bytearray(pkt.host_payload())
    pos_at = 0 if enc == "int32" else 8 * pkt.n_escapes
    layouts = {
        "value flipped": lambda p: p.__setitem__(len(p) - 1, p[-1] ^ 0x10),
        "position moved": lambda p: p.__setitem__(pos_at + 4, p[pos_at + 4] ^ 1),
        "position past numel": lambda p: p.__setitem__(
            slice(pos_at, pos_at + 4), struct.pack("<i", 6000) if enc == "int32"
            else struct.pack("<HH", 65535, 0)),
    }
    for name, corrupt in layouts.items():
        bad = bytearray(payload)
        corrupt(bad)
        _refused(old.clone(), _reseal(pkt, bad))
    first_two = struct.unpack_from("<ii", payload) if enc == "int32" else None
    if enc == "int32":                         # positions out of order
        bad = bytearray(payload)
        struct.pack_into("<ii", bad, 0, first_two[1], first_two[0])
        _refused(old.clone(), _reseal(pkt, bad), match="increasing")


def test_zstd_corrupt_frame_refused():
    new, old = ulp_step_pair(20000, 0.05)
    pkt = encode(new, old, encoding="zstd")
    payload = bytearray(pkt.host_payload())
    payload[-5] ^= 0xFF
    _refused(old.clone(), _reseal(pkt, payload))
    _refused(old.clone(), _reseal(pkt, payload[:-1]))


@pytest.mark.parametrize("enc", ENCODINGS)
def test_wrong_target_unchanged(enc):
    new, old = random_pair(5003, 0.05, torch.bfloat16, seed=4)
    pkt = encode(new, old, encoding=enc)
    wrong_base = old.clone()
    same = (new.view(torch.int16) == old.view(torch.int16)).nonzero()[0, 0]
    wrong_base.view(torch.int16)[same] ^= 1                # an element the packet keeps
    _refused(wrong_base, pkt, match="base")
    _refused(old.float(), pkt, TypeError, match="dtype")
    _refused(old[:-1].clone(), pkt, ValueError, match="elements")
    _refused(torch.zeros(2, 5003, dtype=torch.bfloat16)[:, 0], pkt, ValueError)


def test_versions_out_of_order_refused():
    """v0 -> v1 -> v2: the v1->v2 packet refuses v0, and a relative packet refuses a target
    already at v2; an absolute packet re-applied to its own result is a no-op."""
    v0, _ = ulp_step_pair(8000, 0.0)
    v1, v2 = v0.clone(), v0.clone()
    v1.view(torch.int16)[::7] += 1
    v2.view(torch.int16)[::7] += 1
    v2.view(torch.int16)[3::11] -= 1
    for enc in ENCODINGS:
        pkt12 = encode(v2, v1, encoding=enc)
        _refused(v0.clone(), pkt12)
        target = v1.clone()
        apply_(target, pkt12)
        if pkt12.relative:
            _refused(target, pkt12, match="base")
        else:
            apply_(target, pkt12)
            assert_bits_equal(target, v2)


def test_bad_arguments():
    a = torch.zeros(4)
    with pytest.raises(ValueError, match="encoding"):
        encode(a, a, encoding="lz4")
    with pytest.raises(ValueError, match="old"):
        encode(a, torch.zeros(5))
    with pytest.raises(TypeError, match="old"):
        encode(a, a.double())
    with pytest.raises(TypeError, match="new"):
        encode(a.to(torch.complex64), a.to(torch.complex64))
    with pytest.raises(TypeError, match="packet"):
        apply_(a, b"not a packet")
    with pytest.raises(TypeError, match="new"):
        encode([0.0], a)


def test_int32_refuses_more_than_2_pow_31_elements():
    big = torch.empty(2 ** 31 + 1, dtype=torch.uint8, device="meta")   # never allocated
    with pytest.raises(ValueError, match="2\\^31"):
        encode(big, big, encoding="int32")
    from glm_kernels.delta import _reference as ref
    ref.check_int32_addressable(2 ** 31)                    # positions up to 2^31 - 1 fit
    with pytest.raises(ValueError, match="gap16"):
        ref.check_int32_addressable(2 ** 31 + 1)


def test_zstd_missing_is_a_clear_import_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "zstandard", None)
    a, b = torch.zeros(8), torch.ones(8)
    with pytest.raises(ImportError, match="zstandard"):
        encode(a, b, encoding="zstd")
    assert encode(a, b, encoding="gap16").count == 8       # the other encodings still work


def test_zstd_relative_compresses_ulp_steps():
    new, old = ulp_step_pair(400_000, 0.01, seed=1)
    sizes = {e: encode(new, old, encoding=e).nbytes() / changed_count(new, old)
             for e in ENCODINGS}
    absolute = encode(new, old, encoding="zstd", relative=False).nbytes() / changed_count(new, old)
    assert sizes["zstd"] < absolute < sizes["gap16"] < sizes["int32"]
    assert sizes["zstd"] < 1.45          # ~1.3 B/change at this size (notes: 1.27 at 16M)


def test_header_fields_roundtrip():
    new, old = ulp_step_pair(3000, 0.1)
    pkt = encode(new, old, encoding="zstd", zstd_level=1)
    back = DeltaPacket.from_bytes(pkt.to_bytes())
    for field in ("dtype", "numel", "encoding", "count", "n_escapes", "result_checksum",
                  "base_checksum"):
        assert getattr(back, field) == getattr(pkt, field), field
    assert bytes(back.payload) == bytes(pkt.payload)
    assert len(pkt.to_bytes()) == pkt.nbytes() == packet_mod.HEADER_BYTES + len(pkt.payload)
    v1 = bytearray(pkt.to_bytes())
    v1[4:6] = struct.pack("<H", 1)
    with pytest.raises(ValueError, match="version"):
        DeltaPacket.from_bytes(bytes(v1))


@pytest.mark.parametrize("enc", ENCODINGS)
def test_old_checksum_skips_hashing_and_gives_the_same_packet(enc):
    new, old = random_pair(20011, 0.03, torch.bfloat16, seed=12)
    plain = encode(new, old, encoding=enc)
    chained = encode(new, old, encoding=enc, old_checksum=checksum(old))
    assert chained.result_checksum == plain.result_checksum == checksum(new)
    assert chained.base_checksum == plain.base_checksum
    if enc != "zstd":
        assert bytes(chained.payload) == bytes(plain.payload)
    target = old.clone()
    apply_(target, chained)
    assert_bits_equal(target, new)
    liar = encode(new, old, encoding=enc, old_checksum=checksum(new))   # wrong: refused
    _refused(old.clone(), liar)
    with pytest.raises(TypeError, match="old_checksum"):
        encode(new, old, old_checksum="abc")


def test_unfinalize_inverts_finalize():
    from glm_kernels.delta import _reference as ref
    for s, w in ((0, 0), (1, 7), (2 ** 64 - 1, 12345), (0x0123456789ABCDEF, 2 ** 40)):
        assert ref.unfinalize(ref.finalize(s, w), w) == s
