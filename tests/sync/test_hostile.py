"""Weight sync against hostile input and faults (issue 17): malformed manifests, path
traversal and symlinks in the disk transport, unpickling on the IPC queue, two publishers,
a restarted sender, updates that die half-way, tied receiver tensors, bad arguments."""
import json
import os
import threading
import time

import pytest
import torch
import torch.multiprocessing as mp

from glm_kernels import sync
from glm_kernels.sync import disk as disk_mod
from glm_kernels.sync import sender as sender_mod
from glm_kernels.sync.disk import MANIFEST, REQUEST
from glm_kernels.sync.protocol import MAGIC, _SEAL, Frame, assemble, digest, full_entry
from tests.sync._helpers import blank_like, make_state, needs_zstd, plain_bytes, sparse_step


def _manifest(path):
    with open(os.path.join(path, MANIFEST)) as f:
        return json.load(f)


def _write_manifest(path, manifest_or_text):
    text = manifest_or_text if isinstance(manifest_or_text, str) else json.dumps(manifest_or_text)
    with open(os.path.join(path, MANIFEST), "w") as f:
        f.write(text)


def _disk_pair(path, **kw):
    state = make_state()
    sender = sync.Sender(sync.DiskTransport(path, **kw), bucket_bytes=1500)
    params = blank_like(state)
    receiver = sync.Receiver(sync.DiskTransport(path, **kw), params)
    return state, sender, receiver, params


def _poll_within(receiver, seconds=5.0):
    """poll() in a thread: (returned or raised, the exception); fails if it does not return."""
    out = {}

    def run():
        try:
            out["v"] = receiver.poll()
        except BaseException as exc:       # noqa: BLE001 - handed to the test
            out["exc"] = exc
    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"Receiver.poll() did not return within {seconds} s"
    return out


# ------------------------------------------------------------------ malformed manifests
def _malformed(good):
    rec = good["versions"][0]
    return {
        "not json": "{not json",
        "record without base": {**good, "versions": [{k: v for k, v in rec.items()
                                                      if k != "base"}]},
        "files null": {**good, "versions": [{**rec, "files": None}]},
        "latest 1e12": {**good, "latest": 1e12},
        "latest ahead": {**good, "latest": 10 ** 12},
        "versions dict": {**good, "versions": {}},
        "record a list": {**good, "versions": [[1, None]]},
        "version a string": {**good, "versions": [{**rec, "v": "1"}]},
        "format 9": {**good, "format": 9},
        "top-level list": "[1, 2]",
    }


@pytest.mark.parametrize("case", ["not json", "record without base", "files null",
                                  "latest 1e12", "latest ahead", "versions dict",
                                  "record a list", "version a string", "format 9",
                                  "top-level list"])
def test_malformed_manifest_one_clear_error_then_recovery(tmp_path, case):
    state, sender, receiver, params = _disk_pair(tmp_path)
    sender.publish(state)
    assert receiver.poll() == 1
    good = _manifest(tmp_path)
    _write_manifest(tmp_path, _malformed(good)[case])
    before = plain_bytes(params)
    started = time.monotonic()
    out = _poll_within(receiver)
    assert isinstance(out.get("exc"), sync.SyncError), out
    assert "manifest" in str(out["exc"]) and "updates refused" not in str(out["exc"])
    assert time.monotonic() - started < 2.0
    assert plain_bytes(params) == before and receiver.version == 1
    assert len(receiver.transport._refused) <= 1
    sparse_step(state, 2)
    assert sender.publish(state) == 2 and sender.last_stats.full     # the sender recovers
    assert receiver.poll() == 2
    assert plain_bytes(params) == plain_bytes(state)


def test_refusal_log_bounded(tmp_path):
    """Many refusals in one poll: the error names 8 and counts the rest."""
    link = sync.LocalTransport()
    state = {"w": torch.arange(10, dtype=torch.int32)}
    sender = sync.Sender(link)
    params = {"w": torch.zeros(10, dtype=torch.int32)}
    receiver = sync.Receiver(link, params)
    sender.publish(state)
    receiver.poll()
    params["w"][0] = 77                                   # drift: every delta is refused
    for i in range(30):
        state["w"][1 + i % 9] += 1
        sender.publish(state)
    with pytest.raises(sync.SyncError, match="30 updates refused.*and 22 more") as info:
        receiver.poll()
    assert len(str(info.value)) < 8000


# ------------------------------------------------------------------ traversal, symlinks
def _outside_full(tmp_path, state):
    """A valid full snapshot of ``state`` written outside the directory under test."""
    other = tmp_path / "other"
    link = sync.DiskTransport(other)
    sync.Sender(link).publish(state)
    link.close()
    name = _manifest(other)["versions"][0]["files"][0]
    return other, name


@pytest.mark.parametrize("how", ["dotdot", "absolute", "separator"])
def test_manifest_paths_outside_the_directory_refused(tmp_path, how):
    d = tmp_path / "d"
    state, sender, receiver, params = _disk_pair(d)
    sender.publish(state)
    assert receiver.poll() == 1
    forged = make_state(seed=5)
    other, name = _outside_full(tmp_path, forged)
    target = {"dotdot": f"../other/{name}", "absolute": str(other / name),
              "separator": f"sub/{name}"}[how]
    if how == "separator":
        os.makedirs(d / "sub")
        os.replace(other / name, d / "sub" / name)
    manifest = _manifest(d)
    manifest["versions"].append({"v": 2, "base": None, "files": [target]})
    manifest["latest"] = 2
    _write_manifest(d, manifest)
    before = plain_bytes(params)
    with pytest.raises(sync.SyncError, match="not a weight file name"):
        receiver.poll()
    assert plain_bytes(params) == before and receiver.version == 1


def test_retention_never_deletes_outside_the_directory(tmp_path):
    d = tmp_path / "d"
    canary = tmp_path / "canary.safetensors"
    canary.write_bytes(b"canary")
    state, sender, receiver, params = _disk_pair(d, keep_full=1, full_every=1)
    sender.publish(state)
    manifest = _manifest(d)
    manifest["versions"][0]["files"].append("../canary.safetensors")
    _write_manifest(d, manifest)
    for step in range(1, 4):
        sparse_step(state, step)
        sender.publish(state)                      # full every time: v1 leaves the manifest
    assert canary.read_bytes() == b"canary"
    assert receiver.poll() == 4 and plain_bytes(params) == plain_bytes(state)


def test_symlinked_weight_file_refused(tmp_path):
    d = tmp_path / "d"
    state, sender, receiver, params = _disk_pair(d)
    sender.publish(state)
    name = _manifest(d)["versions"][0]["files"][0]
    outside = tmp_path / "elsewhere.safetensors"
    os.replace(d / name, outside)
    os.symlink(outside, d / name)
    with pytest.raises(sync.SyncError, match="without following links"):
        receiver.receive(timeout=0)
    assert receiver.version == 0


def test_symlinked_manifest_refused(tmp_path):
    d = tmp_path / "d"
    state, sender, receiver, params = _disk_pair(d)
    sender.publish(state)
    outside = tmp_path / "m.json"
    os.replace(d / MANIFEST, outside)
    os.symlink(outside, d / MANIFEST)
    out = _poll_within(receiver)
    assert isinstance(out.get("exc"), sync.SyncError) and "manifest" in str(out["exc"])


def test_planted_symlinks_are_never_written_through(tmp_path):
    """Symlinks at FULL_REQUESTED and at the names the old sender used for its temporary
    files (``.tmp-<pid>-<name>``) pointing at a canary outside: nothing writes through."""
    d = tmp_path / "d"
    os.makedirs(d)
    canary = tmp_path / "canary"
    canary.write_bytes(b"keep me")
    pid = os.getpid()
    for name in (f".tmp-{pid}-{MANIFEST}", f".tmp-{pid}-v00000001-full-0000.safetensors",
                 f".tmp-{pid}-v00000002-delta-0000.safetensors"):
        os.symlink(canary, d / name)
    state, sender, receiver, params = _disk_pair(d)
    sender.publish(state)
    assert receiver.poll() == 1
    receiver.params["layer.0.w"].view(-1).view(torch.uint8)[0] ^= 1      # drift -> refusal
    sparse_step(state, 2)
    sender.publish(state)
    os.symlink(canary, d / REQUEST)                    # planted before the refusal's request
    with pytest.raises(sync.SyncError):
        receiver.poll()                                # writes FULL_REQUESTED
    assert canary.read_bytes() == b"keep me"
    assert os.path.isfile(d / REQUEST) and not os.path.islink(d / REQUEST)
    sparse_step(state, 3)
    sender.publish(state)
    assert sender.last_stats.full and receiver.poll() == 3
    assert canary.read_bytes() == b"keep me"


def test_temp_names_are_random_and_exclusive(tmp_path, monkeypatch):
    seen = []
    real_open = os.open

    def spy(path, flags, *a, **k):
        if ".tmp-" in str(path):
            seen.append((os.path.basename(str(path)), flags))
        return real_open(path, flags, *a, **k)
    monkeypatch.setattr(disk_mod.os, "open", spy)
    state, sender, receiver, params = _disk_pair(tmp_path)
    sender.publish(state)
    assert seen
    for name, flags in seen:
        assert str(os.getpid()) not in name.split("-")[1]
        assert flags & os.O_EXCL and flags & os.O_NOFOLLOW and flags & os.O_CREAT


# ------------------------------------------------------------------ publishers
def test_second_publisher_refused(tmp_path):
    state, a, receiver, params = _disk_pair(tmp_path)
    b = sync.Sender(sync.DiskTransport(tmp_path), bucket_bytes=1500)
    a.publish(state)
    other = make_state(seed=9)
    with pytest.raises(sync.SyncError, match="another publisher"):
        b.publish(other)
    assert receiver.poll() == 1 and plain_bytes(params) == plain_bytes(state)


def test_interleaved_publishers_without_flock_detected(tmp_path, monkeypatch):
    """Controlled ordering: publisher B writes a whole v2 while A is between its files and
    its manifest (where flock does not reach): A refuses instead of mixing histories, and
    the receiver's v2 is B's, whole."""
    monkeypatch.setattr(disk_mod.DiskTransport, "_take_lock", lambda self: None)
    state = make_state()
    a = sync.Sender(sync.DiskTransport(tmp_path), bucket_bytes=1500)
    a.publish(state)
    b = sync.Sender(sync.DiskTransport(tmp_path), bucket_bytes=1500, version=1)
    b_state = make_state(seed=4)
    real_encode = sender_mod.encode
    calls = []

    def encode_then_b_publishes(*args, **kw):
        calls.append(1)
        if len(calls) == 2:
            b.publish(b_state, full=True)
        return real_encode(*args, **kw)
    monkeypatch.setattr(sender_mod, "encode", encode_then_b_publishes)
    sparse_step(state, 2)
    with pytest.raises(sync.SyncError, match="another publisher wrote v2"):
        a.publish(state)
    monkeypatch.setattr(sender_mod, "encode", real_encode)
    params = blank_like(state)
    receiver = sync.Receiver(sync.DiskTransport(tmp_path), params)
    assert receiver.poll() == 2 and plain_bytes(params) == plain_bytes(b_state)


# ------------------------------------------------------------------ restarted sender
def test_restarted_sender_full_snapshot_accepted_at_once():
    link = sync.LocalTransport()
    state = make_state()
    params = blank_like(state)
    receiver = sync.Receiver(link, params)
    old = sync.Sender(link)
    for step in range(5):
        sparse_step(state, step + 1)
        old.publish(state)
    assert receiver.poll() == 5
    old.publish(state, full=True)
    stale_full = link.updates.popleft()
    new_state = make_state(seed=3)
    new = sync.Sender(link)                          # restarted trainer: numbering from 1
    assert new.publish(new_state) == 1
    assert receiver.poll() == 1 and receiver.epoch == new.epoch
    assert plain_bytes(params) == plain_bytes(new_state)
    link.updates.append(stale_full)                  # the old sender's full, arriving late
    with pytest.raises(sync.VersionError, match="has left"):
        receiver.poll()
    sparse_step(new_state, 2)
    new.publish(new_state)
    assert receiver.poll() == 2 and plain_bytes(params) == plain_bytes(new_state)


def test_delta_from_another_epoch_refused():
    link = sync.LocalTransport()
    state = make_state()
    receiver = sync.Receiver(link, blank_like(state))
    a, b = sync.Sender(link), sync.Sender(sync.LocalTransport())
    a.publish(state)
    b.publish(state)
    receiver.poll()
    sparse_step(state, 2)
    b.publish(state)                                 # b's v2: a delta on b's v1
    link.updates.append(b.transport.updates.pop())
    with pytest.raises(sync.VersionError, match="different sender"):
        receiver.poll()


def test_old_format_frames_refused_clearly():
    body = json.dumps({"v": 1, "base": None, "i": 0, "last": True, "parts": []}).encode()
    meta = _SEAL.pack(MAGIC, 1, len(body), digest(body)) + body
    with pytest.raises(sync.SyncError, match="format version 1.*upgrade"):
        assemble([Frame(meta, torch.empty(0, dtype=torch.uint8), True)])


def test_manifest_format_1_still_read(tmp_path):
    link = sync.DiskTransport(tmp_path)
    state = make_state()
    link.send(1, None, (full_entry(k, v) for k, v in state.items()), 1 << 20)   # no epoch
    m = _manifest(tmp_path)
    m["format"] = 1
    for r in m["versions"]:
        r.pop("e")
    _write_manifest(tmp_path, m)
    params = blank_like(state)
    assert sync.Receiver(sync.DiskTransport(tmp_path), params).poll() == 1
    assert plain_bytes(params) == plain_bytes(state)


# ------------------------------------------------------------------ IPC
class _RunsCode:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (exec, (f"open({self.path!r}, 'w').write('ran')",))


def _ipc():
    return sync.IpcTransport(mp.get_context("spawn"), frame_timeout=0.5)


def test_ipc_frames_are_not_unpickled_freely(tmp_path):
    link = _ipc()
    state = make_state()
    params = blank_like(state)
    receiver = sync.Receiver(link, params)
    canary = tmp_path / "ran"
    link._frames.put(_RunsCode(str(canary)))
    link._frames.put((b"meta", "not a tensor", True))
    link._frames.put((b"meta", torch.zeros(3), True))               # float32, not uint8
    for _ in range(3):                  # receive(): the queue's feeder thread delivers late
        with pytest.raises(sync.SyncError, match="IPC frame refused"):
            receiver.receive(timeout=5)
    assert not canary.exists() and receiver.version == 0
    link._requests.put(_RunsCode(str(canary)))                      # the sender's side too
    assert link.full_requested() is True                # the 3 refusals' requests; no code
    time.sleep(0.05)
    assert not canary.exists()
    sender = sync.Sender(link, bucket_bytes=1500)
    sender.publish(state)
    assert receiver.receive(timeout=5) == 1 and plain_bytes(params) == plain_bytes(state)


def test_ipc_partial_update_discarded_whole(monkeypatch):
    """A publish that raises after some frames went out: its frames are dropped whole when
    the next update starts, and the next full snapshot applies (it used to be glued to the
    partial one and refused with it)."""
    link = _ipc()
    state = make_state()
    params = blank_like(state)
    receiver = sync.Receiver(link, params)
    sender = sync.Sender(link, bucket_bytes=300)
    sender.publish(state)
    assert receiver.receive(timeout=5) == 1
    real_encode = sender_mod.encode
    calls = []

    def dies_on_third(*a, **k):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("trainer died mid-update")
        return real_encode(*a, **k)
    monkeypatch.setattr(sender_mod, "encode", dies_on_third)
    sparse_step(state, 3)
    with pytest.raises(RuntimeError, match="mid-update"):
        sender.publish(state)
    monkeypatch.setattr(sender_mod, "encode", real_encode)
    sparse_step(state, 4)
    assert sender.publish(state) == 3 and sender.last_stats.full
    assert receiver.receive(timeout=5) == 3
    assert link.discarded > 0
    assert plain_bytes(params) == plain_bytes(state)


# ------------------------------------------------------------------ gloo headers
def _fake_broadcast(headers):
    link = object.__new__(sync.BroadcastTransport)
    link.rank, link.src, link.device, link.max_frame_bytes = 1, 0, torch.device("cpu"), 1 << 20
    feed = iter(headers)

    def bcast(t):
        h = next(feed)
        assert t.numel() == len(h), "the receiver allocated what the header said"
        t.copy_(torch.tensor(h, dtype=t.dtype))
        return t
    link._bcast = bcast
    return link


@pytest.mark.parametrize("header,match", [
    ([0x474C4D53, 1, 0, -5, 10, 1], "refused"),
    ([0x474C4D53, 1, 0, 10, -1, 1], "refused"),
    ([0x474C4D53, 1, 0, 10, 1 << 40, 1], "refused"),
    ([0x474C4D53, 1, 0, 1 << 40, 0, 1], "refused"),
    ([0, 1, 0, 10, 10, 1], "malformed frame header"),
    ([0x474C4D53, 1, 0, 0, 0, 2], "aborted by its sender"),
])
def test_gloo_header_sizes_bounded(header, match):
    with pytest.raises(sync.SyncError, match=match):
        _fake_broadcast([header]).recv(0, None)


# ------------------------------------------------------------------ tied receiver tensors
def test_tied_params_given_different_bytes_refused():
    link = sync.LocalTransport()
    shared = torch.zeros(8)
    receiver = sync.Receiver(link, {"embed": shared, "lm_head": shared})
    sender = sync.Sender(link)
    with pytest.raises(sync.SyncError, match="tied"):
        sender.publish({"embed": torch.ones(8), "lm_head": torch.full((8,), 2.0)})
        receiver.poll()
    assert torch.equal(shared, torch.zeros(8)) and receiver.version == 0
    sender.publish({"embed": torch.ones(8), "lm_head": torch.ones(8)})
    assert receiver.poll() == 2 and torch.equal(shared, torch.ones(8))


def test_overlapping_views_given_different_bytes_refused():
    link = sync.LocalTransport()
    fused = torch.zeros(4, 3)
    receiver = sync.Receiver(link, {"qkv": fused, "q": fused[:2]})
    sender = sync.Sender(link)
    sender.publish({"qkv": torch.ones(4, 3), "q": torch.full((2, 3), 5.0)})
    with pytest.raises(sync.SyncError, match="share memory"):
        receiver.poll()
    assert torch.equal(fused, torch.zeros(4, 3))


# ------------------------------------------------------------------ arguments
@pytest.mark.parametrize("make,err,match", [
    (lambda: sync.Sender(sync.LocalTransport(), zstd_level="x"), TypeError, "zstd_level"),
    (lambda: sync.Sender(sync.LocalTransport(), zstd_level=100), ValueError, "zstd_level"),
    (lambda p: sync.DiskTransport(p, poll_interval=-1), ValueError, "poll_interval"),
    (lambda p: sync.DiskTransport(p, poll_interval="fast"), TypeError, "poll_interval"),
    (lambda p: sync.DiskTransport(p, poll_interval=float("nan")), ValueError, "poll_interval"),
    (lambda p: sync.DiskTransport(p, full_every="10"), TypeError, "full_every"),
    (lambda p: sync.DiskTransport(p, keep_full=1.5), TypeError, "keep_full"),
    (lambda: sync.IpcTransport(frame_timeout=-5), ValueError, "frame_timeout"),
    (lambda: sync.IpcTransport(frame_timeout="soon"), TypeError, "frame_timeout"),
])
def test_sync_arguments_named(tmp_path, make, err, match):
    with pytest.raises(err, match=match):
        make(tmp_path) if make.__code__.co_argcount else make()


def test_receive_timeout_named():
    receiver = sync.Receiver(sync.LocalTransport(), {"w": torch.zeros(2)})
    with pytest.raises(ValueError, match="timeout"):
        receiver.receive(timeout=-1)


def test_missing_zstandard_named_at_construction(monkeypatch, caplog):
    """zstandard is optional: an explicit encoding="zstd" says what to install when the
    Sender is built, not at its first delta; the default falls back to gap16, logged."""
    import sys
    from glm_kernels import _dispatch
    monkeypatch.setitem(sys.modules, "zstandard", None)
    monkeypatch.setattr(_dispatch, "_warned", set())
    with pytest.raises(ImportError, match="pip install zstandard"):
        sync.Sender(sync.LocalTransport(), encoding="zstd")
    link = sync.LocalTransport()
    with caplog.at_level("WARNING"):
        sender = sync.Sender(link)
    assert sender.encoding == "gap16" and "gap16" in caplog.text
    receiver = sync.Receiver(link, {"w": torch.zeros(4)})
    sender.publish({"w": torch.ones(4)})
    sender.publish({"w": torch.arange(4.0)})
    assert receiver.poll() == 2 and sync.Sender(link, delta=False).delta is False


def test_ipc_frame_tensor_kinds_refused():
    """Only a dense 1-D contiguous uint8 tensor is a frame's data (a sparse or strided one
    would reach assemble's slicing)."""
    link = _ipc()
    receiver = sync.Receiver(link, {"w": torch.zeros(4)})
    link._frames.put((b"m", torch.zeros(4, dtype=torch.uint8)[::2], True))
    link._frames.put((b"m", torch.zeros(2, 2, dtype=torch.uint8), True))
    for _ in range(2):
        with pytest.raises(sync.SyncError, match="IPC frame refused"):
            receiver.receive(timeout=5)
    assert receiver.version == 0


def test_ipc_restarted_sender_followed_at_once():
    link = _ipc()
    state = make_state()
    params = blank_like(state)
    receiver = sync.Receiver(link, params)
    old = sync.Sender(link, bucket_bytes=1500)
    for step in range(3):
        sparse_step(state, step + 1)
        old.publish(state)
        assert receiver.receive(timeout=5) == step + 1
    fresh_state = make_state(seed=8)
    assert sync.Sender(link, bucket_bytes=1500).publish(fresh_state) == 1
    assert receiver.receive(timeout=5) == 1
    assert plain_bytes(params) == plain_bytes(fresh_state)


@needs_zstd
def test_zstd_delta_at_a_receiver_without_zstandard_is_a_refusal(monkeypatch):
    """A receiver without the optional package refuses a zstd delta like any other (one
    SyncError, full snapshot requested) instead of letting ImportError escape poll()."""
    import sys
    link = sync.LocalTransport()
    sender = sync.Sender(link, encoding="zstd")
    params = {"w": torch.zeros(64)}
    receiver = sync.Receiver(link, params)
    sender.publish({"w": torch.ones(64)})
    assert receiver.poll() == 1
    sender.publish({"w": torch.arange(64.0)})
    monkeypatch.setitem(sys.modules, "zstandard", None)
    with pytest.raises(sync.SyncError, match="zstandard"):
        receiver.poll()
    assert torch.equal(params["w"], torch.ones(64))
    monkeypatch.delitem(sys.modules, "zstandard")
    sender.publish({"w": torch.arange(64.0)})
    assert sender.last_stats.full and receiver.poll() == 3


def test_apply_update_checks_versions_and_epoch_fields():
    receiver = sync.Receiver(sync.LocalTransport(), {"w": torch.zeros(2)})
    for update in (sync.Update(-3, None, [], "ab12"), sync.Update(2, 2, []),
                   sync.Update(True, None, []), sync.Update(1, None, [], "../x")):
        with pytest.raises(sync.SyncError):
            receiver.apply_update(update)
    assert receiver.version == 0


def test_refusal_on_a_read_only_directory_is_still_one_sync_error(tmp_path, monkeypatch):
    state, sender, receiver, params = _disk_pair(tmp_path)
    sender.publish(state)
    receiver.poll()
    _write_manifest(tmp_path, "{not json")

    def read_only(*a, **k):
        raise PermissionError("read-only file system")
    monkeypatch.setattr(receiver.transport, "_atomic_write", read_only)
    out = _poll_within(receiver)
    assert isinstance(out.get("exc"), sync.SyncError) and "manifest" in str(out["exc"])


def test_disk_directory_restarted_from_scratch_followed(tmp_path):
    """The directory was wiped and a new trainer numbers from 1 again: a receiver holding v3
    takes the new epoch's full snapshot at once."""
    import shutil
    d = tmp_path / "d"
    state, sender, receiver, params = _disk_pair(d)
    for step in range(3):
        sparse_step(state, step + 1)
        sender.publish(state)
    assert receiver.poll() == 3
    sender.transport.close()
    shutil.rmtree(d)
    fresh = make_state(seed=6)
    assert sync.Sender(sync.DiskTransport(d), bucket_bytes=1500).publish(fresh) == 1
    assert receiver.poll() == 1 and plain_bytes(params) == plain_bytes(fresh)
