"""slime delta weight sync with the device diff (glm_kernels.integrations.slime_delta).

slime is not installed here, so a stand-in of the one class the plug-in subclasses is put in
``sys.modules``: it has the attributes slime's ``UpdateWeightFromDiskDelta`` has at THUDM/slime
624b824 and, as ``_encode_delta``, a plain numpy diff that writes the two documented formats
(xor: zstd(new ^ old); overwrite: zstd(u32 count, u32 byte positions, new bytes)). The plug-in
must produce the same deltas, checksums and counts, and an engine-side apply of its files must
rebuild the new weights.
"""
import sys
import types
import zlib

import numpy as np
import pytest
import torch

zstandard = pytest.importorskip("zstandard")

from glm_kernels.integrations.slime import delta as slime_delta  # noqa: E402

from tests.conftest import DEVICE  # noqa: E402

MODULE = "slime.backends.megatron_utils.update_weight.update_weight_from_disk_delta"


def adler32_checksum(algorithm, buf):
    assert algorithm == "adler32"
    return f"{zlib.adler32(memoryview(np.ascontiguousarray(buf))):08x}"


class StandInUpdater:
    """The attributes and the numpy diff of slime's delta updater, nothing else."""

    def __init__(self, baseline, encoding, tmp_path):
        self.delta_dir = str(tmp_path)
        self.delta_encoding = encoding
        self.checksum_algorithm = "adler32"
        # slime seeds read-only views of the checkpoint file's bytes
        self._snapshot = {k: np.frombuffer(v.contiguous().view(torch.uint8).numpy().tobytes(),
                                           np.uint8) for k, v in baseline.items()}
        self._is_pp_src_rank = True
        self.weight_version = 0
        self.tensors = {}

    def _iter_hf_tensors(self):
        yield from self.tensors.items()

    def _encode_delta(self):
        self._delta, self._checksums = {}, {}
        self.changed_bytes = self.total_bytes = 0
        for name, tensor in self._iter_hf_tensors():
            new = tensor.detach().contiguous().view(torch.uint8).reshape(-1).cpu().numpy().copy()
            old = self._snapshot[name]
            changed = new != old
            self.total_bytes += new.size
            if changed.any():
                if self.delta_encoding == "xor":
                    raw = new ^ old
                else:
                    pos = np.flatnonzero(changed).astype("<u4")
                    raw = np.concatenate([np.array([pos.size], "<u4").view(np.uint8),
                                          pos.view(np.uint8), new[changed]])
                self._delta[name] = np.frombuffer(
                    zstandard.ZstdCompressor(level=1).compress(raw), np.uint8)
                self._checksums[name] = adler32_checksum("adler32", new)
                self.changed_bytes += int(changed.sum())
            self._snapshot[name] = new


@pytest.fixture
def fake_slime(monkeypatch):
    names = ["slime", "slime.backends", "slime.backends.megatron_utils",
             "slime.backends.megatron_utils.update_weight", MODULE, "slime.utils",
             "slime.utils.disk_delta"]
    mods = {n: types.ModuleType(n) for n in names}
    mods[MODULE].UpdateWeightFromDiskDelta = StandInUpdater
    mods["slime.utils.disk_delta"].checksum = adler32_checksum
    mods["slime.utils.disk_delta"].NUM_WORKERS = 2
    for n, m in mods.items():
        monkeypatch.setitem(sys.modules, n, m)
    return mods[MODULE]


def engine_apply(base: np.ndarray, blob: np.ndarray, encoding: str) -> np.ndarray:
    """What a rollout host does with one tensor's delta (independent of the plug-in)."""
    raw = np.frombuffer(zstandard.ZstdDecompressor().decompress(blob.tobytes()), np.uint8)
    out = base.copy()
    if encoding == "xor":
        out ^= raw
    else:
        count = int(raw[:4].view("<u4")[0])
        out[raw[4:4 + 4 * count].view("<u4")] = raw[4 + 4 * count:]
    return out


def model_weights(seed):
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(37, 19, generator=g).bfloat16(),      # odd sizes
        "layers.0.q_b.weight": torch.randn(4099, generator=g).bfloat16(),
        "layers.0.norm.weight": torch.randn(33, generator=g),              # fp32
        "layers.0.scale": torch.randint(-128, 127, (70,), generator=g, dtype=torch.int8),
        "lm_head.weight": torch.randn(1, generator=g).bfloat16(),
        "frozen.weight": torch.randn(50, generator=g).bfloat16(),          # never changes
    }


def optimizer_step(weights, seed, fraction=0.05):
    """Sparse one-ulp-ish moves on the trainable tensors, as a small-lr step makes."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, w in weights.items():
        w = w.clone()
        if name != "frozen.weight":
            bits = w.view({1: torch.int8, 2: torch.int16, 4: torch.int32}[w.element_size()])
            hit = torch.rand(bits.shape, generator=g) < fraction
            bits[hit] += torch.randint(1, 3, (int(hit.sum()),), generator=g).to(bits.dtype)
        out[name] = w
    return out


@pytest.mark.parametrize("encoding", ["xor", "overwrite"])
@pytest.mark.parametrize("device_snapshot", [False, True])
def test_matches_slime_format_over_a_chain_of_syncs(fake_slime, tmp_path, encoding,
                                                    device_snapshot, kernel_backend,
                                                    monkeypatch):
    # device snapshots live on DEVICE (CPU tensors under the interpreter here); 0 bytes of
    # budget forces the host diff after a full copy
    monkeypatch.setenv(slime_delta.ENV_DEVICE_BYTES, str(1 << 30) if device_snapshot else "0")
    patched_cls = slime_delta.install(types.SimpleNamespace(update_weight_mode="delta"))
    assert fake_slime.UpdateWeightFromDiskDelta is patched_cls
    assert slime_delta.install() is patched_cls                     # idempotent
    weights = model_weights(0)
    ours = patched_cls(weights, encoding, tmp_path / "ours")
    theirs = StandInUpdater(weights, encoding, tmp_path / "theirs")
    engine = {k: v.contiguous().view(torch.uint8).reshape(-1).numpy().copy()
              for k, v in weights.items()}
    for step in range(1, 4):
        weights = optimizer_step(weights, step)
        ours.tensors = {k: v.to(DEVICE) for k, v in weights.items()}
        theirs.tensors = dict(weights)
        ours.weight_version = theirs.weight_version = step
        ours._encode_delta()
        theirs._encode_delta()
        assert (ours.changed_bytes, ours.total_bytes) == (theirs.changed_bytes,
                                                          theirs.total_bytes)
        assert ours.changed_bytes > 0 and "frozen.weight" not in ours._delta
        assert sorted(ours._delta) == sorted(theirs._delta)
        assert ours._checksums == theirs._checksums
        for name, blob in ours._delta.items():
            dec = zstandard.ZstdDecompressor()
            assert dec.decompress(blob.tobytes()) == dec.decompress(theirs._delta[name].tobytes())
            engine[name] = engine_apply(engine[name], blob, encoding)
        for name, w in weights.items():
            new_bytes = w.contiguous().view(torch.uint8).reshape(-1).numpy()
            np.testing.assert_array_equal(engine[name], new_bytes, err_msg=name)
            np.testing.assert_array_equal(ours._snapshot[name], new_bytes, err_msg=name)
        if device_snapshot:       # int32 position + value per changed element only
            assert 0 < ours.copied_out_bytes < ours.total_bytes
        else:
            assert ours.copied_out_bytes == ours.total_bytes


@pytest.mark.parametrize("device_snapshot", [False, True])
def test_failed_sync_rolls_back_every_snapshot(fake_slime, tmp_path, monkeypatch,
                                               kernel_backend, device_snapshot):
    """A sync that fails on its third tensor (device: a diff that misses a change, caught by
    the kernel's hash of the new tensor vs the snapshot's advanced checksum; host: the digest
    raising) restores the snapshots of the tensors before it, so the retry diffs against
    what the engines hold and publishes the whole step."""
    monkeypatch.setenv(slime_delta.ENV_DEVICE_BYTES, str(1 << 30) if device_snapshot else "0")
    cls = slime_delta.install()
    weights = model_weights(1)
    ours = cls(weights, "xor", tmp_path)
    before = {k: v.copy() for k, v in ours._snapshot.items()}
    ours.tensors = {k: v.to(DEVICE) for k, v in optimizer_step(weights, 7, 0.2).items()}
    calls = []
    if device_snapshot:
        real = slime_delta._element_changes

        def drop_last_change(new, base):
            positions, values, sums = real(new, base)
            calls.append(positions.size)
            if len(calls) == 3:
                return positions[:-1], values[:-1], sums
            return positions, values, sums
        monkeypatch.setattr(slime_delta, "_element_changes", drop_last_change)
        error, match = RuntimeError, "does not match the new tensor"
        heal = lambda: monkeypatch.setattr(slime_delta, "_element_changes", real)  # noqa: E731
    else:
        def failing_checksum(algorithm, buf):
            calls.append(1)
            if len(calls) == 3:
                raise OSError("digest failed")
            return adler32_checksum(algorithm, buf)
        disk_delta = sys.modules["slime.utils.disk_delta"]
        monkeypatch.setattr(disk_delta, "checksum", failing_checksum)
        error, match = OSError, "digest failed"
        heal = lambda: monkeypatch.setattr(disk_delta, "checksum", adler32_checksum)  # noqa
    with pytest.raises(error, match=match):
        ours._encode_delta()
    assert len(calls) >= 3
    for name, snap in before.items():
        np.testing.assert_array_equal(ours._snapshot[name], snap, err_msg=name)
    assert not ours._glm_kernels_diff.device and not ours._glm_kernels_diff.sums
    heal()
    ours._encode_delta()
    theirs = StandInUpdater(weights, "xor", tmp_path / "theirs")
    theirs.tensors = {k: v.cpu() for k, v in ours.tensors.items()}
    theirs._encode_delta()
    assert ours._checksums == theirs._checksums and ours.changed_bytes == theirs.changed_bytes


def test_refusals(fake_slime, tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="--update-weight-mode delta"):
        slime_delta.install(types.SimpleNamespace(update_weight_mode="full"))
    cls = slime_delta.install()
    weights = model_weights(2)
    ours = cls(weights, "xor", tmp_path)
    ours.tensors = {"not.in.baseline": torch.zeros(4)}
    with pytest.raises(KeyError, match="no baseline snapshot"):
        ours._encode_delta()
    ours.tensors = {"embed.weight": torch.zeros(5).bfloat16()}
    with pytest.raises(ValueError, match="has 10 bytes but its snapshot has"):
        ours._encode_delta()
    ours.delta_encoding = "rle"
    ours.tensors = {}
    with pytest.raises(ValueError, match="'xor' or 'overwrite'"):
        ours._encode_delta()
    for bad in ("lots", "-5", "150%", "x%"):
        monkeypatch.setenv(slime_delta.ENV_DEVICE_BYTES, bad)
        state = slime_delta.DeviceSnapshotDiff({"w": np.zeros(4, np.uint8)})
        with pytest.raises(ValueError, match="byte count or a percentage"):
            state.diff("w", torch.ones(4, dtype=torch.int8))
    with pytest.raises(ValueError, match="a percentage needs CUDA tensors"):
        slime_delta.device_budget("10%", torch.device("cpu"))
    big = slime_delta.ByteChanges((1 << 32) + 1, 0, np.zeros(0, np.int64),
                                  np.zeros(0, np.uint8), np.zeros(0, np.uint8))
    with pytest.raises(ValueError, match="needs xor"):
        slime_delta.overwrite_payload(big)


def test_device_budget_setting():
    """No automatic default (the snapshots outlive the sync into training steps): unset means
    the host path; a byte count is taken as is."""
    cpu = torch.device("cpu")
    assert slime_delta.device_budget(None, cpu) == 0
    assert slime_delta.device_budget("  ", cpu) == 0
    assert slime_delta.device_budget("8000000000", cpu) == 8_000_000_000
    assert slime_delta.device_budget(" 0 ", cpu) == 0


def test_byte_granularity_keeps_unchanged_bytes_out(kernel_backend):
    """A bf16 element whose low byte moved contributes one byte, as slime's byte diff, on
    the device path (sparse) and the host path (dense) alike."""
    old = torch.tensor([1.0, 2.0, 3.0]).bfloat16()
    new = old.clone()
    new.view(torch.int16)[1] += 1
    moved = new.view(torch.uint8)[2].item()
    for budget in (1 << 20, 0):
        state = slime_delta.DeviceSnapshotDiff({"w": old.view(torch.uint8).numpy().copy()},
                                               device_bytes=budget)
        changes = state.diff("w", new.to(DEVICE))
        assert changes.count == 1 and changes.nbytes == 6
        assert slime_delta.xor_payload(changes).nonzero()[0].tolist() == [2]
        raw = slime_delta.overwrite_payload(changes)
        assert raw.tolist() == [1, 0, 0, 0, 2, 0, 0, 0, moved]
        assert state.host["w"].tolist() == new.view(torch.uint8).tolist()


@pytest.mark.gpu
def test_percent_budget_is_a_share_of_device_memory():
    device = torch.device("cuda")
    total = torch.cuda.mem_get_info(device)[1]
    assert slime_delta.device_budget("10%", device) == int(total * 0.1)
    assert slime_delta.device_budget("0%", device) == 0


def test_written_frames_declare_their_size_and_read_delta_bounds_bombs(fake_slime, tmp_path,
                                                                      monkeypatch):
    """Issue 17: every file this module writes declares its content size (so a reader can
    bound it before decompressing), and ``read_delta`` refuses a frame that declares more
    than the tensor allows, or nothing, without allocating it."""
    import tracemalloc

    monkeypatch.setenv(slime_delta.ENV_DEVICE_BYTES, "0")
    weights = model_weights(0)
    for encoding in ("xor", "overwrite"):
        ours = slime_delta.install()(weights, encoding, tmp_path / encoding)
        new = optimizer_step(weights, 1)
        ours.tensors, ours.weight_version = dict(new), 1
        ours._encode_delta()
        for name, blob in ours._delta.items():
            nbytes = weights[name].numel() * weights[name].element_size()
            raw = slime_delta.read_delta(blob, nbytes, encoding)
            assert zstandard.frame_content_size(blob.tobytes()) == raw.size
            base = weights[name].contiguous().view(torch.uint8).reshape(-1).numpy()
            np.testing.assert_array_equal(
                engine_apply(base, blob, encoding),
                new[name].contiguous().view(torch.uint8).reshape(-1).numpy())
    zc = zstandard.ZstdCompressor(level=1)
    bomb = zc.compress(bytes(64 << 20))
    obj = zc.compressobj()
    undeclared = obj.compress(bytes(64 << 20)) + obj.flush()
    tracemalloc.start()
    try:
        for blob, encoding in ((bomb, "xor"), (bomb, "overwrite"), (undeclared, "xor")):
            with pytest.raises(ValueError, match="refused before decompressing"):
                slime_delta.read_delta(blob, 1000, encoding)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20, peak
    with pytest.raises(ValueError, match="encoding"):
        slime_delta.read_delta(bomb, 1000, "lz4")
