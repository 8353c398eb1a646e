"""Sender/Receiver through the in-process transport: end to end, and every refusal leaves all
receiver tensors byte-identical to before."""
import pytest
import torch

from glm_kernels import sync
from glm_kernels.delta import encode
from glm_kernels.sync.protocol import Frame, delta_entry, open_meta, seal_meta
from tests.sync._helpers import (STEPS, blank_like, damage, make_state, needs_zstd, raw_bytes,
                                 sparse_step)


def assert_same_bytes(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"tensor {k!r} differs"


def _pair(delta=True, encoding=None, bucket_bytes=700):
    link = sync.LocalTransport()
    state = make_state()
    sender = sync.Sender(link, delta=delta, encoding=encoding, bucket_bytes=bucket_bytes)
    params = blank_like(state)
    receiver = sync.Receiver(link, params)
    return link, state, sender, receiver, params


@pytest.mark.parametrize("delta,encoding", [pytest.param(True, "zstd", marks=needs_zstd),
                                            (True, "gap16"), (True, "int32"), (False, "zstd")])
def test_twenty_steps_bit_exact(delta, encoding):
    link, state, sender, receiver, params = _pair(delta, encoding)
    for step in range(STEPS + 1):
        if step:
            sparse_step(state, step)
        assert sender.publish(state) == step + 1
        assert receiver.poll() == step + 1
        assert_same_bytes(raw_bytes(params), raw_bytes(state))
        stats = sender.last_stats
        assert stats.full == (step == 0 or not delta)
        assert stats.delta_tensors == (0 if stats.full else len(state))
    assert not link.updates


def test_delta_bytes_small_and_changed_count_exact():
    link, state, sender, receiver, params = _pair(bucket_bytes=1 << 20)
    sender.publish(state)
    full_bytes = sender.last_stats.payload_bytes
    before = raw_bytes(state)
    sparse_step(state, 1)   # density 0.002
    changed = sum(int((before[k].view(-1, state[k].element_size()) !=
                       raw_bytes(state)[k].view(-1, state[k].element_size())).any(1).sum())
                  for k in state)
    sender.publish(state)
    assert sender.last_stats.changed == changed
    assert sender.last_stats.payload_bytes < full_bytes / 3
    receiver.poll()
    assert_same_bytes(raw_bytes(params), raw_bytes(state))


def test_publish_subset_and_new_name():
    link = sync.LocalTransport()
    sender = sync.Sender(link)
    a, b = torch.arange(10.0), torch.arange(7, dtype=torch.int64)
    params = {"a": torch.zeros(10), "b": torch.zeros(7, dtype=torch.int64)}
    receiver = sync.Receiver(link, params)
    sender.publish({"a": a})
    a[3] = -1.0
    sender.publish({"a": a, "b": b})          # "b" is new: sent full inside a delta update
    assert sender.last_stats.delta_tensors == 1 and not sender.last_stats.full
    assert receiver.poll() == 2
    assert torch.equal(params["a"], a) and torch.equal(params["b"], b)
    sender.publish({"a": a}, full=True)       # a full snapshot re-sends "b" too
    assert sender.last_stats.tensors == 2


def _published_pair(n_steps=2, bucket_bytes=200):
    link, state, sender, receiver, params = _pair(bucket_bytes=bucket_bytes)
    for step in range(n_steps):
        if step:
            sparse_step(state, step + 2)
        sender.publish(state)
        receiver.poll()
    sparse_step(state, 7)   # density 0.3: every tensor changes
    sender.publish(state)
    return link, state, sender, receiver, params


def _refused(receiver, params, match):
    before = raw_bytes(params)
    version = receiver.version
    with pytest.raises(sync.SyncError, match=match):
        receiver.receive(timeout=0)
    assert receiver.version == version
    assert_same_bytes(raw_bytes(params), before)


def _tamper(link, frame_index, fn):
    frames = link.updates[-1]
    f = frames[frame_index]
    frames[frame_index] = Frame(*fn(f))


def test_corrupt_payload_byte_in_last_frame_refuses_whole_update():
    link, state, sender, receiver, params = _published_pair()
    assert len(link.updates[-1]) > 2

    def flip(f):
        data = f.data.clone()
        data[-1] ^= 0x10
        return f.meta, data, f.last
    _tamper(link, -1, flip)   # earlier frames (other tensors) are intact: still nothing written
    _refused(receiver, params, "checksum|corrupt")


def test_truncated_frame_refused():
    link, state, sender, receiver, params = _published_pair()
    _tamper(link, 0, lambda f: (f.meta, f.data[:-3], f.last))
    _refused(receiver, params, "truncated or padded")


def test_missing_frame_refused():
    link, state, sender, receiver, params = _published_pair()
    assert len(link.updates[-1]) > 2
    del link.updates[-1][1]
    _refused(receiver, params, "out of sequence")


def test_corrupt_meta_refused():
    link, state, sender, receiver, params = _published_pair()

    def flip_meta(f):
        meta = bytearray(f.meta)
        meta[-2] ^= 1
        return bytes(meta), f.data, f.last
    _tamper(link, 0, flip_meta)
    _refused(receiver, params, "corrupt frame meta")


def _rewrite_parts(link, fn):
    """Re-seal every frame's meta after ``fn(part)`` edits its parts (a consistent lie)."""
    frames = link.updates[-1]
    for i, f in enumerate(frames):
        meta = open_meta(f.meta)
        for p in meta["parts"]:
            fn(p)
        frames[i] = Frame(seal_meta(meta), f.data, f.last)


@pytest.mark.parametrize("name,field,value,match", [
    ("layer.1.w", "dt", "float16", "dtype torch.float16"),
    ("layer.0.norm", "sh", [102], r"shape \(102,\)"),
    ("step", "n", "layer.9.w", "unknown name"),
])
def test_mismatched_entry_refused(name, field, value, match):
    """Wrong dtype, wrong numel, unknown name: the meta is re-sealed, so only the receiver's
    own comparison with its tensors can catch it."""
    link, state, sender, receiver, params = _published_pair()
    _rewrite_parts(link, lambda p: p.update({field: value}) if p["n"] == name else None)
    _refused(receiver, params, match)


def test_packet_for_other_numel_refused():
    """A well-formed packet for a 6-element tensor under a 5-element entry."""
    link, state, sender, receiver, params = _published_pair()
    pkt = encode(torch.arange(6, dtype=torch.int64), torch.zeros(6, dtype=torch.int64))
    update = sync.Update(receiver.version + 1, receiver.version,
                         [delta_entry("step", (5,), pkt)])
    before = raw_bytes(params)
    with pytest.raises(sync.SyncError, match="6"):
        receiver.apply_update(update)
    assert_same_bytes(raw_bytes(params), before)


def test_out_of_order_and_skipped_versions_refused():
    link, state, sender, receiver, params = _pair()
    sender.publish(state)
    v1 = list(link.updates[0])
    receiver.poll()
    for step in (1, 2):
        sparse_step(state, step + 2)
        sender.publish(state)
    v2, v3 = link.updates
    link.updates.clear()
    link.updates.append(v3)                        # skipped v2: delta on 2, holding 1
    _refused(receiver, params, "delta on v2; this receiver holds v1")
    link.updates.append(v2)
    assert receiver.poll() == 2
    link.updates.append(v2)                        # replay
    _refused(receiver, params, "delta on v1; this receiver holds v2")
    link.updates.append(v1)                        # the same sender's full v1, arriving late
    _refused(receiver, params, "not newer")


def test_refusal_requests_full_resync():
    link, state, sender, receiver, params = _pair()
    sender.publish(state)
    receiver.poll()
    damage(params["layer.0.w"])                     # receiver drifted from v1
    sparse_step(state, 3)
    sender.publish(state)
    _refused(receiver, params, "delta refused")    # result checksum does not match
    sparse_step(state, 4)
    sender.publish(state)
    assert sender.last_stats.full                   # the refusal asked for it
    assert receiver.poll() == 3
    assert_same_bytes(raw_bytes(params), raw_bytes(state))


def test_sender_failure_forces_full_next():
    class Broken(sync.LocalTransport):
        fail = False

        def send(self, *a, **k):
            if self.fail:
                raise OSError("link down")
            super().send(*a, **k)
    link = Broken()
    state = make_state()
    sender = sync.Sender(link)
    params = blank_like(state)
    receiver = sync.Receiver(link, params)
    sender.publish(state)
    link.fail = True
    sparse_step(state, 1)
    with pytest.raises(OSError):
        sender.publish(state)
    link.fail = False
    assert sender.publish(state) == 3 and sender.last_stats.full
    assert receiver.poll() == 3
    assert_same_bytes(raw_bytes(params), raw_bytes(state))


def test_bad_arguments():
    link = sync.LocalTransport()
    with pytest.raises(ValueError, match="encoding"):
        sync.Sender(link, encoding="lz4")
    with pytest.raises(ValueError, match="bucket_bytes"):
        sync.Sender(link, bucket_bytes=0)
    with pytest.raises(TypeError, match="transport"):
        sync.Sender(object())
    sender = sync.Sender(link)
    with pytest.raises(ValueError, match="empty"):
        sender.publish({})
    with pytest.raises(TypeError, match=r"named_tensors\['x'\]"):
        sender.publish({"x": [1, 2]})
    with pytest.raises(TypeError, match=r"named_tensors\['c'\].*complex64"):
        sender.publish({"c": torch.zeros(2, dtype=torch.complex64)})
    with pytest.raises(ValueError, match=r"params\['w'\] must be contiguous"):
        sync.Receiver(link, {"w": torch.zeros(4, 4).t()})
    with pytest.raises(TypeError, match="params"):
        sync.Receiver(link, {})
    assert sender.version == 0 and not link.updates


def test_non_contiguous_sender_tensor_and_shared_storage():
    link = sync.LocalTransport()
    sender = sync.Sender(link)
    base = torch.randn(6, 4)
    named = {"t": base.t(), "tied": base, "tied2": base}
    params = {"t": torch.zeros(4, 6), "tied": torch.zeros(6, 4), "tied2": torch.zeros(6, 4)}
    receiver = sync.Receiver(link, params)
    sender.publish(named)
    base[1, 2] = 5.0
    sender.publish(named)
    receiver.poll()
    for k in named:
        assert torch.equal(params[k], named[k])


def test_receiver_writes_into_module_parameters():
    torch.manual_seed(0)
    trainer, rollout = torch.nn.Linear(7, 5), torch.nn.Linear(7, 5)
    link = sync.LocalTransport()
    sender = sync.Sender(link)
    receiver = sync.Receiver(link, dict(rollout.named_parameters()))
    sender.publish(trainer.state_dict())
    with torch.no_grad():
        trainer.weight[2, 3] += 1.0
    sender.publish(trainer.state_dict())
    assert receiver.poll() == 2
    for name, p in rollout.named_parameters():
        assert p.requires_grad and torch.equal(p, trainer.state_dict()[name])
