"""The C++ host codec (glm_kernels._host) against the numpy definition, bit for bit; the
logged numpy fallback; the stream helpers; in-place apply into a memory-mapped file."""
import logging

import numpy as np
import pytest
import torch

import glm_kernels
from glm_kernels import _dispatch
from glm_kernels.delta import DeltaPacket, apply_, apply_safetensors_, encode
from glm_kernels.delta import _host_codec
from glm_kernels.delta import _reference as ref
from tests._compare import assert_bits_equal
from tests.delta._cases import DENSITIES, DTYPES, bits, random_pair, ulp_step_pair

host = pytest.importorskip("glm_kernels._host", reason="C++ host extension not built")

SPECS = [ref.StreamSpec("int32", False, False), ref.StreamSpec("gap16", False, False),
         ref.StreamSpec("gap16", True, True), ref.StreamSpec("gap16", False, True)]
SPEC_IDS = ["int32", "gap16", "zstd-relative", "zstd-absolute"]


def _np_pair(n, density, dtype, seed):
    new, old = random_pair(n, density, dtype, seed)
    return ref.np_bits(new), ref.np_bits(old)


def _checksums(spec, nb, ob, streams):
    words = nb.size * ref.words_per_element(nb.dtype.itemsize)
    return (ref.finalize(streams.s_new, words),
            ref.finalize(streams.s_old, words) if spec.diff else b"")


@pytest.mark.parametrize("spec", SPECS, ids=SPEC_IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("density", DENSITIES)
def test_cpp_matches_numpy(spec, dtype, density):
    nb, ob = _np_pair(20011, density, dtype, seed=SPECS.index(spec) + 5 * DTYPES.index(dtype))
    want = ref.encode_streams(nb, ob, spec)
    got = _host_codec.encode_streams(nb, ob, spec, threads=2)
    assert got.count == want.count and (got.s_new, got.s_old) == (want.s_new, want.s_old)
    for field in ("positions", "escapes", "values"):
        a, b = np.asarray(getattr(got, field)), np.asarray(getattr(want, field))
        assert a.dtype.itemsize == b.dtype.itemsize and a.tobytes() == b.tobytes(), field
    result_ck, base_ck = _checksums(spec, nb, ob, want)
    t_cpp, t_np = ob.copy(), ob.copy()
    _host_codec.apply_streams(t_cpp, got, spec, result_ck, base_ck, threads=2)
    ref.apply_streams(t_np, want, spec, result_ck, base_ck)
    assert np.array_equal(t_cpp, nb) and np.array_equal(t_np, nb)


@pytest.mark.parametrize("size", [1, 2, 4, 8])
def test_checksum_cpp_numpy_and_by_hand(size):
    nb, _ = _np_pair(70001, 0.0, {1: torch.uint8, 2: torch.bfloat16, 4: torch.float32,
                                  8: torch.int64}[size], seed=size)
    assert host.checksum_sum(nb, 2) == ref.checksum_sum(nb, chunk=4096) == \
        ref.checksum_sum(nb)
    # the definition written out with Python integers on the first elements
    s = 0
    for e, v in enumerate(nb[:50].tolist()):
        words = [(v & 0xFFFFFFFF, 2 * e), (v >> 32, 2 * e + 1)] if size == 8 else [(v, e)]
        for w, i in words:
            lo, hi = i & 0xFFFFFFFF, i >> 32
            k = (lo * ref.K1 + hi * ref.K2 + ref.K3) & 0xFFFFFFFF
            m = ((lo * ref.M1 + hi * ref.M2 + ref.M3) & 0xFFFFFFFF) | 1
            n = (lo * ref.N1 + hi * ref.N2 + ref.N3) & 0xFFFFFFFF
            s += (w ^ k) * ((n << 32) + m)
    assert ref.checksum_sum(nb[:50]) == s & ref.MASK64
    assert host.finalize(s & ref.MASK64, 77) == ref.finalize(s, 77)


def test_checksum_detects_every_single_bit_flip():
    x = np.arange(64, dtype=np.uint32) * 2654435761
    base = ref.checksum_sum(x)
    for i in range(64):
        for bit in range(32):
            y = x.copy()
            y[i] ^= np.uint32(1 << bit)
            assert host.checksum_sum(y, 1) != base
    swapped = x.copy()
    swapped[[3, 9]] = swapped[[9, 3]]
    assert ref.checksum_sum(swapped) != base


@pytest.mark.parametrize("spec", SPECS, ids=SPEC_IDS)
def test_cpp_and_numpy_refuse_the_same_corruptions(spec):
    nb, ob = _np_pair(5003, 0.05, torch.bfloat16, seed=2)
    streams = ref.encode_streams(nb, ob, spec)
    result_ck, base_ck = _checksums(spec, nb, ob, streams)
    c = streams.count
    broken = []
    vals = streams.values.copy().view(np.uint8)
    vals[-1] ^= 0x20
    broken.append(ref.Streams(c, streams.positions, streams.escapes,
                              vals.view(streams.values.dtype)))
    pos = streams.positions.copy()
    if spec.positions == "int32":
        pos[1] = pos[0]                                   # not strictly increasing
    elif spec.planar:
        pos[0], pos[c] = 0xFF, 0xFF                       # escape marker, no escape value
    else:
        pos[0] = 0xFFFF
    broken.append(ref.Streams(c, pos, streams.escapes, streams.values))
    for bad in broken:
        for apply in (lambda t: ref.apply_streams(t, bad, spec, result_ck, base_ck),
                      lambda t: _host_codec.apply_streams(t, bad, spec, result_ck, base_ck, 2)):
            target = ob.copy()
            with pytest.raises(ValueError):
                apply(target)
            assert np.array_equal(target, ob)
    wrong = ob.copy()
    wrong[np.flatnonzero(nb == ob)[0]] ^= 1
    for apply in (ref.apply_streams, _host_codec.apply_streams):
        target = wrong.copy()
        with pytest.raises(ValueError, match="base"):
            apply(target, streams, spec, result_ck, base_ck)
        assert np.array_equal(target, wrong)


def test_stream_helpers_match_numpy():
    pos = np.array([0, 1, 65536, 65536 + 65536 + 5, 200000, 200001], dtype=np.int64)
    gaps, esc = host.gap16_pack(pos)
    want_gaps, want_esc = ref.gap16_pack(pos)
    assert gaps.tolist() == want_gaps.tolist() == [0, 0, 65534, 65535, 65535, 0]
    assert esc.tolist() == want_esc.tolist() == [65540, 68922]
    assert host.gap16_unpack(gaps, esc, 200002, 2).tolist() == pos.tolist()
    assert ref.gap16_unpack(gaps, esc, 200002).tolist() == pos.tolist()
    for bad_numel, bad_esc in ((200001, esc), (200002, esc[:1]), (200002, esc - 10)):
        with pytest.raises(ValueError):
            host.gap16_unpack(gaps, bad_esc, bad_numel)
        with pytest.raises(ValueError):
            ref.gap16_unpack(gaps, bad_esc, bad_numel)
    with pytest.raises(ValueError, match="increasing"):
        host.gap16_pack(np.array([3, 3]))
    values = np.random.default_rng(0).integers(0, 2 ** 63, 1001, dtype=np.uint64)
    for dtype in (np.uint8, np.uint16, np.uint32, np.uint64):
        v = values.astype(dtype)
        planes = host.byte_group(v, 2)
        assert planes.tobytes() == ref.byte_group(v).tobytes()
        assert host.byte_ungroup(planes, v.itemsize, 2).view(dtype).tolist() == v.tolist()
        assert ref.byte_ungroup(planes, v.size, v.itemsize).tolist() == v.tolist()


def test_zigzag_by_hand():
    new = np.array([5, 4, 0, 0x8000, 7], dtype=np.uint16)
    old = np.array([4, 5, 0xFFFF, 0x7FFF, 7], dtype=np.uint16)
    zz = ref.zigzag(new, old)
    assert zz.tolist() == [2, 1, 2, 2, 0]
    assert ref.unzigzag_add(zz, old).tolist() == new.tolist()


@pytest.mark.parametrize("enc", ["gap16", "zstd"])
def test_numpy_fallback_is_logged_and_exact(monkeypatch, caplog, enc):
    new, old = ulp_step_pair(9000, 0.02)
    with glm_kernels.force_backend("torch"):
        via_cpp = encode(new, old, encoding=enc)
        monkeypatch.setattr(_host_codec, "_ext", None)
        monkeypatch.setattr(_dispatch, "_warned", set())
        with caplog.at_level(logging.WARNING, logger="glm_kernels"):
            via_numpy = encode(new, old, encoding=enc)
            target = old.clone()
            apply_(target, DeltaPacket.from_bytes(via_cpp.to_bytes()))
    assert_bits_equal(target, new)
    assert "delta:host_extension" in _dispatch.fallbacks_logged()
    assert sum("numpy" in r.getMessage() for r in caplog.records) == 1      # once
    assert via_numpy.result_checksum == via_cpp.result_checksum
    if enc == "gap16":
        assert bytes(via_numpy.payload) == bytes(via_cpp.payload)


def test_apply_into_memory_mapped_safetensors(tmp_path):
    safetensors_torch = pytest.importorskip("safetensors.torch")
    new_w, old_w = ulp_step_pair(40000, 0.03, seed=3)
    new_b, old_b = random_pair(1001, 0.2, torch.float32, seed=4)
    path = str(tmp_path / "weights.safetensors")
    safetensors_torch.save_file({"w": old_w.view(200, 200), "b": old_b, "e": torch.zeros(0)},
                                path)
    for name, new, old in (("w", new_w, old_w), ("b", new_b, old_b)):
        for enc in ("gap16", "zstd"):
            pkt = DeltaPacket.from_bytes(encode(new, old, encoding=enc).to_bytes())
            if enc == "zstd":                   # the file now holds `new`: a relative packet
                before = open(path, "rb").read()      # for `old` must refuse, file untouched
                with pytest.raises(ValueError, match="base"):
                    apply_safetensors_(path, name, pkt)
                assert open(path, "rb").read() == before
                continue
            apply_safetensors_(path, name, pkt)
        loaded = safetensors_torch.load_file(path)
        assert_bits_equal(loaded[name].reshape(-1), new)
    apply_safetensors_(path, "e", encode(torch.zeros(0), torch.zeros(0)))
    with pytest.raises(KeyError, match="nope"):
        apply_safetensors_(path, "nope", encode(new_b, old_b))
    with pytest.raises(TypeError, match="dtype"):
        apply_safetensors_(path, "w", encode(new_b, old_b))
    before = bits(safetensors_torch.load_file(path)["b"])
    bad = encode(new_b + 1, new_b)
    bad = DeltaPacket(bad.dtype, bad.numel, bad.encoding, bad.count, bad.n_escapes,
                      bytes(8), b"", bad.payload)           # wrong result checksum
    with pytest.raises(ValueError, match="checksum"):
        apply_safetensors_(path, "b", bad)
    assert torch.equal(bits(safetensors_torch.load_file(path)["b"]), before)


def test_threads_do_not_change_results():
    nb, ob = _np_pair(300_001, 0.1, torch.float32, seed=8)
    spec = ref.StreamSpec("gap16", True, True)
    one = _host_codec.encode_streams(nb, ob, spec, threads=1)
    four = _host_codec.encode_streams(nb, ob, spec, threads=4)
    assert one.positions.tobytes() == four.positions.tobytes()
    assert one.values.tobytes() == four.values.tobytes()
    assert (one.s_new, one.s_old) == (four.s_new, four.s_old)


@pytest.mark.parametrize("dtype,first", [(np.uint16, 2 ** 32 - 1000), (np.uint64, 2 ** 31 - 700),
                                         (np.uint32, 2 ** 33 + 5)])
def test_checksum_past_2_pow_32_words(dtype, first):
    """The word index's high half (tensors past 2^32 words), without allocating 16 GiB: the
    C++ sum of a slice that starts at element ``first`` against the definition."""
    x = np.random.default_rng(1).integers(0, np.iinfo(dtype).max, 5000, dtype=dtype)
    want = int(ref.element_terms(x, np.arange(first, first + x.size, dtype=np.uint64)).sum(
        dtype=np.uint64))
    assert host.checksum_sum(x, 2, first) == want
    assert host.checksum_sum(x, 1, first) != host.checksum_sum(x, 1, 0)


def test_checksum_change_of_a_small_step_spans_64_bits():
    """A one-ulp step changes a word's term by a full-width 64-bit amount, so the changes of
    many such words (a target one version behind) wrap around 2^64 rather than summing to a
    small number that could cancel (the reason M is a 64-bit multiplier)."""
    rng = np.random.default_rng(3)
    w = rng.integers(0, 2 ** 31, 2000, dtype=np.uint64)
    i = rng.integers(0, 2 ** 40, 2000, dtype=np.uint64)
    delta = ref.word_terms(w + np.uint64(1), i) - ref.word_terms(w, i)
    signed = delta.view(np.int64)
    assert np.mean(np.abs(signed.astype(np.float64)) > 2.0 ** 56) > 0.9


@pytest.mark.parametrize("spec", SPECS, ids=SPEC_IDS)
def test_known_old_sum_cpp_and_numpy(spec):
    nb, ob = _np_pair(70001, 0.02, torch.float32, seed=14)
    full = ref.encode_streams(nb, ob, spec)
    s_old = ref.checksum_sum(ob)
    for streams in (ref.encode_streams(nb, ob, spec, s_old),
                    _host_codec.encode_streams(nb, ob, spec, 2, s_old)):
        assert (streams.s_new, streams.s_old) == (full.s_new, s_old)
        assert streams.values.tobytes() == full.values.tobytes()
