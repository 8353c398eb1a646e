"""Disk transport: safetensors files, atomic publish, retention, resync, damaged files."""
import json
import os
import threading

import pytest
import torch
from safetensors.torch import load_file

from glm_kernels import sync
from glm_kernels.sync.disk import MANIFEST, REQUEST
from tests.sync._helpers import (STEPS, blank_like, damage, make_state, plain_bytes,
                                 sparse_step)


def _pair(path, **kw):
    state = make_state()
    sender = sync.Sender(sync.DiskTransport(path, **kw), delta=True, bucket_bytes=1500)
    params = blank_like(state)
    receiver = sync.Receiver(sync.DiskTransport(path, **kw), params)
    return state, sender, receiver, params


def _manifest(path):
    with open(os.path.join(path, MANIFEST)) as f:
        return json.load(f)


def test_twenty_steps_bit_exact_with_retention(tmp_path):
    state, sender, receiver, params = _pair(tmp_path, full_every=6, keep_full=2)
    for step in range(STEPS + 1):
        if step:
            sparse_step(state, step)
        version = sender.publish(state)
        assert sender.last_stats.full == (step % 6 == 0)
        assert receiver.receive(timeout=0) == version
        assert plain_bytes(params) == plain_bytes(state)
        assert receiver.receive(timeout=0) is None
    manifest = _manifest(tmp_path)
    kept = [r["v"] for r in manifest["versions"]]
    assert manifest["latest"] == STEPS + 1 and kept == list(range(13, STEPS + 2))
    on_disk = sorted(f for f in os.listdir(tmp_path) if f.endswith(".safetensors"))
    assert on_disk == sorted(f for r in manifest["versions"] for f in r["files"])
    assert not [f for f in os.listdir(tmp_path) if f.startswith(".tmp")]


def test_full_snapshot_is_a_plain_safetensors_checkpoint(tmp_path):
    state, sender, receiver, params = _pair(tmp_path)
    sender.publish(state)
    loaded = {}
    for name in _manifest(tmp_path)["versions"][0]["files"]:
        loaded.update(load_file(os.path.join(tmp_path, name)))
    assert loaded.keys() == state.keys()
    assert plain_bytes(loaded) == plain_bytes(state)


def test_late_reader_takes_delta_chain_or_latest_full(tmp_path):
    state, sender, receiver, params = _pair(tmp_path, full_every=4, keep_full=1)
    sender.publish(state)
    assert receiver.receive(timeout=0) == 1
    for step in range(1, 3):
        sparse_step(state, step)
        sender.publish(state)                       # v2, v3: deltas on 1, 2
    assert receiver.poll() == 3                     # followed the chain
    assert plain_bytes(params) == plain_bytes(state)
    for step in range(3, 8):
        sparse_step(state, step)
        sender.publish(state)                       # v4..v8; v5 is full, v1-v4 deleted
    assert [r["v"] for r in _manifest(tmp_path)["versions"]] == [5, 6, 7, 8]
    assert receiver.receive(timeout=0) == 5         # no delta on v3 left: the full v5
    assert receiver.poll() == 8
    assert plain_bytes(params) == plain_bytes(state)


def test_reader_never_sees_a_half_written_version(tmp_path):
    """A reader polling in a thread while the writer publishes always lands on a whole
    version: its bytes equal one of the published states."""
    state, sender, receiver, params = _pair(tmp_path, full_every=3)
    published = {}
    errors = []
    done = threading.Event()

    def read():
        while not done.is_set() or receiver.version < len(published):
            try:
                v = receiver.receive(timeout=0.01)
            except sync.SyncError as exc:   # must never happen
                errors.append(str(exc))
                return
            if v is not None and plain_bytes(params) != published[v]:
                errors.append(f"v{v} differs")
    t = threading.Thread(target=read)
    for step in range(12):
        if step:
            sparse_step(state, step)
        published[step + 1] = plain_bytes(state)   # recorded before the manifest names it
        sender.publish(state)
        if step == 0:
            t.start()
    done.set()
    t.join(timeout=60)
    assert not errors and receiver.version == 12


def _damage_file(path, version, offset_from_end):
    name = [r for r in _manifest(path)["versions"] if r["v"] == version][0]["files"][-1]
    with open(os.path.join(path, name), "r+b") as f:
        f.seek(-offset_from_end, os.SEEK_END)
        b = f.read(1)
        f.seek(-offset_from_end, os.SEEK_END)
        f.write(bytes([b[0] ^ 0x40]))


@pytest.mark.parametrize("how", ["flip", "truncate"])
def test_damaged_delta_file_refused_then_full_resync(tmp_path, how):
    state, sender, receiver, params = _pair(tmp_path)
    sender.publish(state)
    receiver.poll()
    sparse_step(state, 3)
    sender.publish(state)
    last = _manifest(tmp_path)["versions"][-1]["files"]
    if how == "flip":
        _damage_file(tmp_path, 2, 5)
    else:
        p = os.path.join(tmp_path, last[-1])
        os.truncate(p, os.path.getsize(p) - 7)
    before = plain_bytes(params)
    with pytest.raises(sync.SyncError):
        receiver.receive(timeout=0)
    assert plain_bytes(params) == before and receiver.version == 1
    assert os.path.exists(os.path.join(tmp_path, REQUEST))
    assert receiver.receive(timeout=0) is None      # the refused v2 is not retried
    sparse_step(state, 4)
    sender.publish(state)
    assert sender.last_stats.full and not os.path.exists(os.path.join(tmp_path, REQUEST))
    assert receiver.poll() == 3
    assert plain_bytes(params) == plain_bytes(state)


def test_drifted_receiver_refuses(tmp_path):
    state, sender, receiver, params = _pair(tmp_path)
    sender.publish(state)
    receiver.poll()
    damage(params["layer.0.w"])
    sparse_step(state, 2)
    sender.publish(state)
    before = plain_bytes(params)
    with pytest.raises(sync.SyncError, match="delta refused"):
        receiver.poll()
    assert plain_bytes(params) == before


def test_restarted_sender_continues_versions(tmp_path):
    state, sender, receiver, params = _pair(tmp_path)
    sender.publish(state)
    sender.publish(state)
    assert receiver.poll() == 2
    sender.transport.close()                        # the old trainer process is gone
    link = sync.DiskTransport(tmp_path)
    again = sync.Sender(link, version=link.latest_version())
    sparse_step(state, 5)
    assert again.publish(state) == 3 and again.last_stats.full
    assert receiver.poll() == 3
    assert plain_bytes(params) == plain_bytes(state)


def test_restarted_sender_numbering_again_followed_at_once(tmp_path):
    """Issue 25: a restarted sender (new epoch, version 0) used to be refused ("not newer")
    until its numbers passed the directory's: now its first full snapshot starts a new history
    and the receiver takes it at once, then its deltas."""
    state, sender, receiver, params = _pair(tmp_path)
    for step in range(5):
        sparse_step(state, step + 1)
        sender.publish(state)
    assert receiver.poll() == 5
    sender.transport.close()
    fresh = sync.Sender(sync.DiskTransport(tmp_path))
    sparse_step(state, 9)
    assert fresh.publish(state) == 1 and fresh.last_stats.full
    assert receiver.poll() == 1 and plain_bytes(params) == plain_bytes(state)
    sparse_step(state, 10)
    assert fresh.publish(state) == 2 and not fresh.last_stats.full
    assert receiver.poll() == 2 and plain_bytes(params) == plain_bytes(state)
    manifest = fresh.transport.read_manifest()
    assert [r["v"] for r in manifest["versions"]] == [1, 2]
    assert {r["e"] for r in manifest["versions"]} == {fresh.epoch}
    on_disk = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    assert on_disk == sorted(n for r in manifest["versions"] for n in r["files"])
    # the same epoch cannot rewind its own history
    with pytest.raises(ValueError, match="not newer"):
        fresh.transport.send(1, None, [], 1 << 20, epoch=fresh.epoch)


def test_timeout_returns_none(tmp_path):
    receiver = sync.Receiver(sync.DiskTransport(tmp_path), {"w": torch.zeros(3)})
    assert receiver.receive(timeout=0.05) is None and receiver.version == 0
