"""The Triton path of the delta codec (the interpreter on CPU, compiled kernels on a GPU)
against the host codec: identical payload bytes, checksums and results, every output slot
written (poisoned allocations), multi-program scans, escapes across program boundaries."""
import pytest
import torch

import glm_kernels
from glm_kernels.delta import ENCODINGS, DeltaKernelConfig, DeltaPacket, apply_, checksum, encode
from glm_kernels.delta import _device, packet as packet_mod
from tests._compare import assert_bits_equal
from tests.conftest import DEVICE, KERNEL_BACKEND
from tests.delta._cases import DENSITIES, DTYPES, bits, changed_count, random_pair

# Small tiles so that a few thousand elements already span several programs.
SMALL = DeltaKernelConfig(block=1024, apply_block=1024)


def _long_tensor_config(block):
    """Large programs keep the interpreter fast on long tensors; compiled kernels use the
    GPU tile (a 64K-element program would not fit in registers)."""
    return DeltaKernelConfig(block=block if KERNEL_BACKEND == "interpret" else 4096,
                             apply_block=32)


def _host_packet(new, old, enc):
    with glm_kernels.force_backend("torch"):
        return encode(new.cpu(), old.cpu(), encoding=enc)


def _kernel_roundtrip(new, old, enc, cfg=SMALL):
    """Encode with the kernels, compare with the host packet, apply with the kernels."""
    new, old = new.to(DEVICE), old.to(DEVICE)
    pkt = encode(new, old, encoding=enc, config=cfg)
    host = _host_packet(new, old, enc)
    assert (pkt.count, pkt.n_escapes) == (host.count, host.n_escapes)
    assert pkt.result_checksum == host.result_checksum
    assert pkt.base_checksum == host.base_checksum
    if enc != "zstd":       # zstd frames may differ with threading; their contents may not
        assert bytes(pkt.host_payload()) == bytes(host.host_payload())
    else:
        a = packet_mod.parse_payload(pkt)
        b = packet_mod.parse_payload(host)
        for field in ("positions", "escapes", "values"):
            assert bytes(getattr(a, field)) == bytes(getattr(b, field)), field
    target = old.clone()
    apply_(target, DeltaPacket.from_bytes(pkt.to_bytes()), config=cfg)
    assert_bits_equal(target.cpu(), new.cpu())
    return pkt


@pytest.mark.parametrize("enc", ENCODINGS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("density", DENSITIES)
def test_kernels_match_host(kernel_backend, enc, dtype, density):
    new, old = random_pair(3001, density, dtype, 
                          seed=ENCODINGS.index(enc) + 7 * DTYPES.index(dtype))
    pkt = _kernel_roundtrip(new, old, enc)
    assert pkt.count == changed_count(new, old)


@pytest.mark.parametrize("enc", ENCODINGS)
def test_special_values(kernel_backend, enc):
    old = torch.tensor([0.0, float("nan"), float("inf"), 1.0, -0.0])
    new = torch.tensor([-0.0, float("nan"), float("-inf"), 1.0, -0.0])
    new.view(torch.int32)[1] ^= 1
    assert _kernel_roundtrip(new, old, enc).count == 3


@pytest.mark.parametrize("enc,gap", [("gap16", 65534), ("gap16", 65535), ("zstd", 65535),
                                     ("zstd", 65536), ("gap16", (1 << 20) + 7)])
def test_large_gaps(kernel_backend, enc, gap):
    old = torch.zeros(gap + 5, dtype=torch.bfloat16)
    new = old.clone()
    new[0], new[gap + 1], new[gap + 3] = 1.0, 2.0, 3.0
    pkt = _kernel_roundtrip(new, old, enc, _long_tensor_config(65536))
    assert pkt.n_escapes == (1 if gap >= 65535 else 0)


def test_escapes_across_many_programs(kernel_backend):
    """Several escapes, changes ending and starting programs, empty programs in between."""
    n = 300_003
    old = torch.zeros(n, dtype=torch.float16)
    new = old.clone()
    at = torch.tensor([0, 1, 16383, 16384, 70000, 70001, 140000, 140001 + 65535, n - 1])
    new[at] = torch.arange(1, at.numel() + 1, dtype=torch.float16)
    for enc in ("gap16", "zstd"):
        pkt = _kernel_roundtrip(new, old, enc, _long_tensor_config(16384))
        assert pkt.n_escapes == 3                              # gaps 69998, 65535, 94465


@pytest.mark.parametrize("enc", ENCODINGS)
@pytest.mark.parametrize("n", [0, 1, 33])
def test_empty_one_and_odd(kernel_backend, enc, n):
    new, old = random_pair(n, 0.5, torch.bfloat16, seed=n)
    _kernel_roundtrip(new, old, enc, DeltaKernelConfig(block=32, apply_block=32))


@pytest.mark.parametrize("enc", ENCODINGS)
@pytest.mark.parametrize("fill", [0x00, 0xFF])
def test_poisoned_outputs_fully_written(kernel_backend, monkeypatch, enc, fill):
    """Allocations start as 0x00 or 0xFF: any slot the kernels skip shows up in the bytes."""
    def poisoned(n, dtype, device):
        assert dtype == torch.uint8
        return torch.full((n,), fill, dtype=dtype, device=device)
    monkeypatch.setattr(_device, "_empty", poisoned)
    for dtype in (torch.bfloat16, torch.int64):
        new, old = random_pair(2500, 0.3, dtype, seed=fill)
        _kernel_roundtrip(new, old, enc)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_checksum_kernel_matches_host(kernel_backend, dtype):
    new, _ = random_pair(3001, 0.0, dtype, seed=5)
    with glm_kernels.force_backend("torch"):
        host = checksum(new)
    assert checksum(new.to(DEVICE), config=SMALL) == host
    assert checksum(new[:0].to(DEVICE)) == checksum(new[:0])


@pytest.mark.parametrize("enc", ENCODINGS)
def test_kernel_apply_refuses_and_leaves_target(kernel_backend, enc):
    new, old = random_pair(3001, 0.05, torch.bfloat16, seed=9)
    new, old = new.to(DEVICE), old.to(DEVICE)
    pkt = encode(new, old, encoding=enc, config=SMALL)
    wrong = old.clone()
    keep = (new.view(torch.int16) == old.view(torch.int16)).nonzero()[0, 0]
    wrong.view(torch.int16)[keep] ^= 4
    before = bits(wrong)
    with pytest.raises(ValueError, match="base"):
        apply_(wrong, pkt, config=SMALL)
    assert torch.equal(bits(wrong), before)
    if enc != "zstd":      # structurally broken payloads: caught before the checksum pass
        payload = bytearray(pkt.host_payload())
        at = 8 * pkt.n_escapes
        payload[at:at + 2] = b"\xff\xff"                  # an escape marker with no value
        if enc == "int32":
            payload[at:at + 4] = b"\xff\xff\xff\x7f"      # position 2^31 - 1 > numel
        bad = DeltaPacket(pkt.dtype, pkt.numel, enc, pkt.count, pkt.n_escapes,
                          pkt.result_checksum, b"", bytes(payload))
        target = old.clone()
        with pytest.raises(ValueError, match="corrupt"):
            apply_(target, bad, config=SMALL)
        assert torch.equal(bits(target), bits(old))


def test_config_validation():
    with pytest.raises(ValueError, match="block"):
        DeltaKernelConfig(block=1000)
    with pytest.raises(ValueError, match="block"):
        DeltaKernelConfig(block=1 << 17)
    with pytest.raises(ValueError, match="num_warps"):
        DeltaKernelConfig(num_warps=3)
    assert _device.default_config(torch.device("cuda")) == DeltaKernelConfig()
    assert _device.default_config(torch.device("cuda"), 8).block == 2048


def test_kernel_backend_is_selected(kernel_backend):
    x = torch.zeros(4, device=DEVICE)
    assert glm_kernels.select_backend("delta.encode", x) == KERNEL_BACKEND


@pytest.mark.gpu
@pytest.mark.parametrize("enc", ENCODINGS)
def test_gpu_large_roundtrip(enc):
    """On a GPU: 2^24 bf16 elements at 1 % density, default tiles."""
    new, old = random_pair(1 << 24, 0.01, torch.bfloat16, seed=11)
    _kernel_roundtrip(new, old, enc, _device.default_config(torch.device("cuda")))


@pytest.mark.parametrize("enc", ENCODINGS)
def test_kernel_old_checksum_matches_host(kernel_backend, enc):
    new, old = random_pair(3001, 0.05, torch.float16, seed=13)
    with glm_kernels.force_backend("torch"):
        host = encode(new, old, encoding=enc)
        old_ck = checksum(old)
    pkt = encode(new.to(DEVICE), old.to(DEVICE), encoding=enc, old_checksum=old_ck, config=SMALL)
    assert (pkt.result_checksum, pkt.base_checksum) == (host.result_checksum, host.base_checksum)
    target = old.to(DEVICE)
    apply_(target, pkt, config=SMALL)
    assert_bits_equal(target.cpu(), new)
