"""delta.verify: apply_'s checks without the write, on every backend (C++ host codec, its numpy
fallback, the Triton kernels): it accepts exactly what apply_ accepts, refuses with apply_'s
own error, and never writes the target."""
import mmap
import struct
import warnings

import numpy as np
import pytest
import torch

import glm_kernels
from glm_kernels.delta import ENCODINGS, DeltaPacket, apply_, encode, verify
from tests._compare import assert_bits_equal
from tests.delta._cases import bits, random_pair
from tests.delta.conftest import path_kwargs







def _same_refusal(target, pkt, path, err, match):
    """verify raises what apply_ raises; neither changes a byte of target."""
    before = bits(target)
    with pytest.raises(err, match=match) as by_verify:
        verify(target, pkt, **path_kwargs(path))
    assert torch.equal(bits(target), before), "verify wrote into the target"
    with pytest.raises(err) as by_apply:
        apply_(target, pkt, **path_kwargs(path))
    assert torch.equal(bits(target), before), "apply_ wrote into a refused target"
    assert (by_verify.type, str(by_verify.value)) == (by_apply.type, str(by_apply.value))


def _reseal(pkt, payload):
    return DeltaPacket(pkt.dtype, pkt.numel, pkt.encoding, pkt.count, pkt.n_escapes,
                       pkt.result_checksum, pkt.base_checksum, bytes(payload))


@pytest.mark.parametrize("enc", ENCODINGS)
def test_verify_accepts_what_apply_accepts_and_writes_nothing(path, enc, monkeypatch):
    new, old = random_pair(5003, 0.05, torch.bfloat16, seed=21)
    new, old = new.to(path[1]), old.to(path[1])
    pkt = DeltaPacket.from_bytes(encode(new, old, encoding=enc).to_bytes())
    target = old.clone()

    def no_scatter(*args, **kwargs):
        raise AssertionError("verify launched the scatter kernel")
    with monkeypatch.context() as m:
        # by name: the kernel module is imported only here (never where Triton is too old)
        m.setattr("glm_kernels.delta._kernels.scatter", no_scatter)
        assert verify(target, pkt, **path_kwargs(path)) is None
    assert_bits_equal(target.cpu(), old.cpu())
    apply_(target, pkt, **path_kwargs(path))
    assert_bits_equal(target.cpu(), new.cpu())
    if pkt.relative:          # already applied: no longer the packet's base
        _same_refusal(target, pkt, path, ValueError, "base")
    else:                     # an absolute packet re-applied to its own result: a no-op
        verify(target, pkt, **path_kwargs(path))


@pytest.mark.parametrize("enc", ENCODINGS)
def test_verify_refuses_wrong_base_and_corrupt_packets(path, enc):
    new, old = random_pair(5003, 0.05, torch.bfloat16, seed=22)
    new, old = new.to(path[1]), old.to(path[1])
    pkt = encode(new, old, encoding=enc)
    wrong = old.clone()
    keep = (new.view(torch.int16) == old.view(torch.int16)).nonzero()[0, 0]
    wrong.view(torch.int16)[keep] ^= 1                   # an element the packet does not touch
    _same_refusal(wrong, pkt, path, ValueError, "base")
    payload = bytearray(pkt.host_payload())
    if enc == "zstd":
        payload[-5] ^= 0xFF                              # a damaged zstd frame
        _same_refusal(old.clone(), _reseal(pkt, payload), path, ValueError, None)
        return
    flipped = bytearray(payload)
    flipped[-1] ^= 0x10                                  # a value byte: result checksum
    _same_refusal(old.clone(), _reseal(pkt, flipped), path, ValueError, "checksum")
    at = 8 * pkt.n_escapes
    past = bytearray(payload)                            # a position past numel
    past[at:at + 4] = struct.pack("<i", 6000) if enc == "int32" else struct.pack("<HH", 65535, 0)
    _same_refusal(old.clone(), _reseal(pkt, past), path, ValueError, "corrupt")


def test_verify_refuses_wrong_targets_like_apply(path):
    new, old = random_pair(501, 0.1, torch.float32, seed=23)
    new, old = new.to(path[1]), old.to(path[1])
    pkt = encode(new, old)
    _same_refusal(old.to(torch.int32), pkt, path, TypeError, "dtype")
    _same_refusal(old[:-1].clone(), pkt, path, ValueError, "elements")
    _same_refusal(torch.zeros(501, 2, device=path[1])[:, 0], pkt, path, ValueError,
                  "contiguous")
    with pytest.raises(TypeError, match="DeltaPacket"):
        verify(old, pkt.to_bytes())


@pytest.mark.parametrize("enc", ["gap16", "zstd"])
def test_host_verify_reads_a_read_only_mapping(tmp_path, enc):
    """The host paths never write: a target in read-only pages (a write would fault)."""
    new, old = random_pair(70001, 0.02, torch.bfloat16, seed=24)
    pkt = encode(new, old, encoding=enc)
    f = tmp_path / "old.bin"
    f.write_bytes(old.view(torch.uint8).numpy().tobytes())
    with open(f, "rb") as fh, glm_kernels.force_backend("torch"):
        mapped = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        try:
            with warnings.catch_warnings():          # torch: "the given NumPy array is not
                warnings.simplefilter("ignore")      # writable" -- that is the point
                target = torch.from_numpy(np.frombuffer(mapped, dtype=np.int16)).view(
                    torch.bfloat16)
            verify(target, pkt)
            del target
        finally:
            mapped.close()
    assert f.read_bytes() == old.view(torch.uint8).numpy().tobytes()
