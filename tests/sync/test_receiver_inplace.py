"""The receiver verifies every entry of an update, then writes them all in place: a bad packet
anywhere refuses the whole update with every tensor unchanged, no tensor-sized copy is made,
tied tensors are written once, and a failure during the writes is never mistaken for a
version."""
import tracemalloc

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import glm_kernels
from glm_kernels import sync
from glm_kernels.delta import DeltaPacket, encode
from glm_kernels.sync import receiver as receiver_mod
from glm_kernels.sync.protocol import Update, delta_entry
from tests.sync._helpers import (ENC, ZSTD, blank_like, damage, make_state, raw_bytes,
                                 sparse_step)


def assert_same_bytes(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"tensor {k!r} differs"


class TamperTransport(sync.LocalTransport):
    """A LocalTransport whose next update passes its entries through ``tamper`` first."""
    tamper = None

    def send(self, version, base, entries, bucket_bytes, epoch=None):
        if self.tamper is not None:
            entries, self.tamper = [self.tamper(e) for e in entries], None
        super().send(version, base, entries, bucket_bytes, epoch)


def _synced(bucket_bytes=300, encoding=None):
    link = TamperTransport()
    state = make_state()
    sender = sync.Sender(link, encoding=encoding, bucket_bytes=bucket_bytes)
    params = blank_like(state)
    receiver = sync.Receiver(link, params)
    sender.publish(state)
    assert receiver.poll() == 1
    sparse_step(state, 7)            # density 0.3: every tensor changes
    return link, state, sender, receiver, params


def _resealed_bad_value(entry):
    """The entry's packet with its last payload byte flipped (a value byte, or the zstd
    frame's), resealed: its payload digest is valid, so only the codec's checks of the
    packet against the tensor can catch it."""
    pkt = DeltaPacket.from_bytes(entry.payload.numpy().tobytes())
    payload = bytearray(pkt.host_payload())
    payload[-1] ^= 0x10
    bad = DeltaPacket(pkt.dtype, pkt.numel, pkt.encoding, pkt.count, pkt.n_escapes,
                      pkt.result_checksum, pkt.base_checksum, bytes(payload))
    return delta_entry(entry.name, entry.shape, bad)


@pytest.mark.parametrize("encoding", [ZSTD, "gap16"])
@pytest.mark.parametrize("where", ["layer.1.w", "step"])     # middle, last delta entry
def test_poisoned_packet_refuses_the_whole_update(encoding, where):
    link, state, sender, receiver, params = _synced(encoding=encoding)
    link.tamper = lambda e: _resealed_bad_value(e) if e.name == where else e
    sender.publish(state)
    names = [p["n"] for f in link.updates[-1] for p in sync.protocol.open_meta(f.meta)["parts"]]
    assert names.index(where) > 0 and len(set(names)) == len(state)   # entries before it
    before = raw_bytes(params)
    with pytest.raises(sync.SyncError, match=f"{where}.*delta refused"):
        receiver.receive(timeout=0)
    assert receiver.version == 1
    assert_same_bytes(raw_bytes(params), before)
    assert sender.publish(state) == 3 and sender.last_stats.full     # the resync
    assert receiver.poll() == 3
    assert_same_bytes(raw_bytes(params), raw_bytes(state))


def test_one_drifted_tensor_refuses_the_whole_update():
    link, state, sender, receiver, params = _synced()
    damage(params["layer.0.norm"])       # this receiver's copy no longer is the base
    sender.publish(state)
    before = raw_bytes(params)
    with pytest.raises(sync.SyncError, match="layer.0.norm.*base"):
        receiver.receive(timeout=0)
    assert_same_bytes(raw_bytes(params), before)


def test_two_entries_for_one_tensor_refused():
    """Each delta is verified against the bytes held before the update, so a second delta
    for the same tensor would be verified against the wrong base: refused up front."""
    state = make_state()
    params = {k: v.clone() for k, v in state.items()}
    receiver = sync.Receiver(sync.LocalTransport(), params, version=1)
    w = state["layer.0.w"]
    w1 = w.clone(); w1.view(torch.int16)[3] += 1
    w2 = w1.clone(); w2.view(torch.int16)[5] += 1
    entries = [delta_entry("layer.0.w", w.shape, encode(w1, w, encoding=ENC)),
               delta_entry("layer.0.w", w.shape, encode(w2, w1, encoding=ENC))]
    before = raw_bytes(params)
    with pytest.raises(sync.SyncError, match="twice"):
        receiver.apply_update(Update(2, 1, entries))
    assert_same_bytes(raw_bytes(params), before)


def _largest_torch_allocation(fn):
    """Bytes of the largest single torch CPU allocation made while ``fn`` runs."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return max([e.self_cpu_memory_usage for e in prof.events()] + [0])


def _python_peak(fn):
    """Peak bytes of numpy/Python allocations while ``fn`` runs (numpy reports its buffers
    to tracemalloc; torch's allocator does not, hence the profiler above)."""
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("encoding", [ZSTD, "gap16"])
def test_no_tensor_sized_copy_while_applying_deltas(encoding):
    """Three 1 MiB tensors, 0.1 % of elements change: the receiver's allocations while it
    verifies and applies an update stay far below one tensor (the old receiver cloned every
    delta tensor: one 1 MiB torch allocation each, which the profiler check catches)."""
    g = torch.Generator().manual_seed(5)
    state = {f"w{i}": torch.randn(1 << 19, generator=g).bfloat16() for i in range(3)}
    tensor_bytes = (1 << 19) * 2
    link = sync.LocalTransport()
    sender = sync.Sender(link, encoding=encoding, bucket_bytes=1 << 16)
    params = {k: torch.empty_like(v) for k, v in state.items()}
    receiver = sync.Receiver(link, params)
    sender.publish(state)
    receiver.poll()
    peaks = []
    with glm_kernels.force_backend("torch"):
        for measure in (_largest_torch_allocation, _python_peak):
            for t in state.values():
                t.view(torch.int16)[len(peaks)::997] += 1
            sender.publish(state)
            assert not sender.last_stats.full and sender.last_stats.delta_tensors == 3
            peaks.append(measure(receiver.poll))
            assert receiver.version == sender.version
            assert_same_bytes(raw_bytes(params), raw_bytes(state))
    assert peaks[0] < tensor_bytes // 8, f"a {peaks[0]}-byte torch allocation"
    assert peaks[1] < tensor_bytes // 8, f"numpy/Python peak {peaks[1]} bytes"


def test_tied_tensors_written_once():
    """Two names for one receiver tensor (tied weights): the sender's identical packets are
    verified against the same bytes and applied once (a base-relative packet applied twice
    would find the wrong base)."""
    link = sync.LocalTransport()
    sender = sync.Sender(link, encoding=ENC)
    shared = torch.randn(64, 9).bfloat16()
    state = {"embed": shared, "lm_head": shared, "norm": torch.randn(9)}
    tied = torch.empty_like(shared)
    params = {"embed": tied, "lm_head": tied, "norm": torch.empty(9)}
    receiver = sync.Receiver(link, params)
    sender.publish(state)
    shared.view(torch.int16)[::5] += 1
    sender.publish(state)
    assert receiver.poll() == 2 and sender.last_stats.delta_tensors == 3
    assert torch.equal(tied, shared)


def test_tied_tensors_with_different_deltas_refused():
    w = torch.randn(40).bfloat16()
    tied = w.clone()
    receiver = sync.Receiver(sync.LocalTransport(), {"a": tied, "b": tied}, version=1)
    wa, wb = w.clone(), w.clone()
    wa.view(torch.int16)[1] += 1
    wb.view(torch.int16)[2] += 1
    entries = [delta_entry("a", w.shape, encode(wa, w, encoding=ENC)),
               delta_entry("b", w.shape, encode(wb, w, encoding=ENC))]
    with pytest.raises(sync.SyncError, match="share memory"):
        receiver.apply_update(Update(2, 1, entries))
    assert torch.equal(tied.view(torch.int16), w.view(torch.int16))


def test_failure_while_writing_drops_to_version_zero(monkeypatch):
    """Past every check only the machine can fail (here: a simulated device OOM in the second
    apply). The receiver then holds a mix of two versions: it says so, drops to version 0,
    refuses the next delta and recovers from the full snapshot its refusal asked for."""
    link, state, sender, receiver, params = _synced(bucket_bytes=1 << 20)
    real_apply, calls = receiver_mod.apply_, []

    def flaky_apply(target, packet):
        calls.append(packet)
        if len(calls) == 2:
            raise torch.OutOfMemoryError("simulated: out of memory")
        return real_apply(target, packet)
    monkeypatch.setattr(receiver_mod, "apply_", flaky_apply)
    sender.publish(state)
    with pytest.raises(sync.SyncError, match="failed while writing.*OutOfMemoryError"):
        receiver.receive(timeout=0)
    assert receiver.version == 0
    monkeypatch.setattr(receiver_mod, "apply_", real_apply)
    sparse_step(state, 8)
    assert sender.publish(state) == 3 and sender.last_stats.full     # refusal asked for it
    assert receiver.poll() == 3
    assert_same_bytes(raw_bytes(params), raw_bytes(state))
    sparse_step(state, 9)
    sender.publish(state)                                            # deltas resume
    assert receiver.poll() == 4 and not sender.last_stats.full
    assert_same_bytes(raw_bytes(params), raw_bytes(state))
