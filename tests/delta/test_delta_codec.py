import pytest
import torch

from glm_kernels.delta import ENCODINGS, DeltaPacket, apply_, encode
from tests._compare import assert_bits_equal

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.uint8, torch.int64]


def _bits(t):
    return t.contiguous().view(torch.uint8).clone()


def _pair(n, density, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    old = torch.randint(0, 256, (n * torch.empty(0, dtype=dtype).element_size(),),
                        generator=g, dtype=torch.uint8).view(dtype)
    new = old.clone()
    mask = torch.rand(n, generator=g) < density
    flip = torch.randint(1, 256, (int(mask.sum()) * new.element_size(),), generator=g,
                         dtype=torch.uint8).view(dtype)
    nb = new.view(torch.uint8).view(-1, new.element_size())
    nb[mask] ^= flip.view(torch.uint8).view(-1, new.element_size())
    return new, old


def _roundtrip(new, old, enc):
    pkt = DeltaPacket.from_bytes(encode(new, old, encoding=enc).to_bytes())
    target = old.clone()
    apply_(target, pkt)
    assert_bits_equal(target, new)
    return pkt


@pytest.mark.parametrize("enc", ENCODINGS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("density", [0.0, 1e-4, 1e-2, 0.5, 1.0])
def test_roundtrip_random(enc, dtype, density):
    new, old = _pair(30011, density, dtype)
    pkt = _roundtrip(new, old, enc)
    assert pkt.count == int((new.view(torch.uint8).view(-1, new.element_size())
                             != old.view(torch.uint8).view(-1, new.element_size())).any(1).sum())


@pytest.mark.parametrize("enc", ENCODINGS)
def test_special_values_are_changes(enc):
    old = torch.tensor([0.0, float("nan"), float("inf"), 1.0])
    new = torch.tensor([-0.0, float("nan"), float("-inf"), 1.0])
    new.view(torch.int32)[1] ^= 1  # other NaN payload
    pkt = _roundtrip(new, old, enc)
    assert pkt.count == 3


@pytest.mark.parametrize("enc", ENCODINGS)
@pytest.mark.parametrize("gap", [65534, 65535, 65536, (1 << 20) + 7])
def test_large_gaps(enc, gap):
    old = torch.zeros(gap + 3, dtype=torch.bfloat16)
    new = old.clone()
    new[0] = 1.0
    new[gap] = 2.0
    new[gap + 2] = 3.0
    pkt = _roundtrip(new, old, enc)
    if enc != "int32":
        assert pkt.n_escapes == (1 if gap - 1 >= 65535 else 0)


@pytest.mark.parametrize("enc", ENCODINGS)
def test_empty_and_one(enc):
    for n in (0, 1):
        old = torch.zeros(n)
        new = torch.ones(n)
        _roundtrip(new, old, enc)


@pytest.mark.parametrize("enc", ENCODINGS)
def test_corrupt_truncated_refused(enc):
    new, old = _pair(5003, 0.05, torch.bfloat16)
    raw = encode(new, old, encoding=enc).to_bytes()
    for bad in (raw[:-1], raw[:10], raw[:30] + bytes([raw[30] ^ 1]) + raw[31:],
                raw[:-3] + bytes([raw[-3] ^ 0x40]) + raw[-2:]):
        with pytest.raises(ValueError):
            DeltaPacket.from_bytes(bad)


@pytest.mark.parametrize("enc", ENCODINGS)
def test_wrong_target_unchanged(enc):
    new, old = _pair(5003, 0.05, torch.bfloat16)
    pkt = encode(new, old, encoding=enc)
    wrong_base = old.clone()
    same = (new.view(torch.int16) == old.view(torch.int16)).nonzero()[0, 0]
    wrong_base.view(torch.int16)[same] ^= 1  # an element the packet does not rewrite
    before = _bits(wrong_base)
    with pytest.raises(ValueError):
        apply_(wrong_base, pkt)
    assert torch.equal(_bits(wrong_base), before)
    for t, err in ((old.float(), TypeError), (old[:-1].clone(), ValueError)):
        b = _bits(t)
        with pytest.raises(err):
            apply_(t, pkt)
        assert torch.equal(_bits(t), b)


def test_bad_arguments():
    a = torch.zeros(4)
    with pytest.raises(ValueError, match="encoding"):
        encode(a, a, encoding="lz4")
    with pytest.raises(ValueError, match="old"):
        encode(a, torch.zeros(5))
    with pytest.raises(TypeError, match="old"):
        encode(a, a.double())


def test_zstd_xor_compresses_ulp_steps():
    g = torch.Generator().manual_seed(1)
    old = torch.randn(200_000, generator=g).bfloat16()
    new = old.clone()
    idx = torch.randperm(old.numel(), generator=g)[:2000]
    new.view(torch.int16)[idx] += 1  # one ulp
    sizes = {e: encode(new, old, encoding=e).nbytes() / 2000 for e in ENCODINGS}
    assert sizes["zstd"] < sizes["gap16"] < sizes["int32"]
