"""Weight sync against hostile input, second round (issue 25): sizes a file claims (overlapping
safetensors offsets), files that are not files (FIFOs, planted directories), deep JSON
nesting, forged versions past int64, and a seeded fuzz harness over those mutation kinds.
Every case must end in one clear SyncError within a timeout, with the receiver's tensors
unchanged, and the next valid publish must go through."""
import glob
import json
import os
import random
import struct
import threading

import pytest
import torch

from glm_kernels import sync
from glm_kernels import _safetensors as st
from glm_kernels.sync.disk import LOCK, MANIFEST, REQUEST
from glm_kernels.sync.protocol import (_SEAL, FORMAT_VERSION, MAGIC, MAX_VERSION, Frame,
                                      assemble, digest, pack)
from tests._bounded import peak_rss_growth
from tests.sync._helpers import blank_like, make_state, plain_bytes, sparse_step
from tests.sync.test_hostile import _disk_pair, _poll_within, _write_manifest


def _weight_files(path):
    return sorted(glob.glob(os.path.join(path, "v*.safetensors")))


def _rewrite_header(file, edit):
    """Apply ``edit(header dict)`` to a safetensors file's JSON header (data section kept)."""
    with open(file, "rb") as f:
        raw = f.read()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    edit(header)
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    with open(file, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob + raw[8 + n:])


def _unblock(fifo):
    """Open a FIFO's write end (non-blocking) and close it: a reader stuck in open() or
    read() on it returns, so a failing test leaves no thread blocked forever."""
    try:
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    except OSError:
        pass


def _within(call, seconds, fifo, what):
    """``call()`` in a thread: {"v": its result} or {"exc": what it raised}. Fails unless it
    returns within ``seconds``; the ``fifo`` path is unblocked first either way."""
    out = {}

    def run():
        try:
            out["v"] = call()
        except Exception as exc:            # noqa: BLE001 - handed to the test
            out["exc"] = exc
    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    _unblock(fifo)
    assert not t.is_alive(), f"{what} blocked"
    return out


# ------------------------------------------------------------------ sizes a file claims
def test_overlapping_offsets_refused_before_reading_any_tensor(tmp_path):
    """A 4 MiB file whose header names 64 tensors all at [0, 4 MiB) read as 256 MiB before the
    fix; now the header is refused whole and peak memory stays near the file size."""
    setup = f"""
import os, glob, json, struct, torch
from glm_kernels import sync
d = {str(tmp_path)!r}
sender = sync.Sender(sync.DiskTransport(d), delta=False)
sender.publish({{"w": torch.zeros(4 << 20, dtype=torch.uint8)}})
(file,) = glob.glob(os.path.join(d, "v*.safetensors"))
raw = open(file, "rb").read()
n = struct.unpack("<Q", raw[:8])[0]
header = json.loads(raw[8:8 + n])
for i in range(63):
    header[f"x{{i}}"] = dict(header["w"])
blob = json.dumps(header).encode()
blob += b" " * (-len(blob) % 8)
open(file, "wb").write(struct.pack("<Q", len(blob)) + blob + raw[8 + n:])
receiver = sync.Receiver(sync.DiskTransport(d), {{"w": torch.ones(4 << 20, dtype=torch.uint8)}})
"""
    code = """
try:
    receiver.poll()
    print("ACCEPTED")
except sync.SyncError as exc:
    print("REFUSED", exc)
assert bool((receiver.params["w"] == 1).all())
"""
    growth, out = peak_rss_growth(setup, code)
    assert "REFUSED" in out and "overlap" in out, out
    assert growth < 32 << 20, f"refusing the file grew peak memory by {growth >> 20} MiB"


@pytest.mark.parametrize("offsets,match", [
    ([-16, 0], "data_offsets"), ([0, 1 << 40], "data_offsets"), ([24, 44], "data_offsets"),
    ("overlap", "overlap"), ([1.0, 21.0], "malformed data_offsets")])
def test_apply_safetensors_validates_the_header_before_writing(tmp_path, offsets, match):
    """``data_offsets [-16, 0]`` used to aim the write into the JSON header."""
    from glm_kernels.delta import apply_safetensors_, encode
    path = str(tmp_path / "w.safetensors")
    old, new = torch.zeros(5), torch.tensor([0.0, 1.0, 0.0, 2.0, 0.0])
    st.write(path, {"a": old, "b": torch.zeros(3)}, {})

    def edit(h):
        if offsets == "overlap":
            h["b"] = {"dtype": "F32", "shape": [3], "data_offsets": [4, 16]}
        else:
            h["a"]["data_offsets"] = offsets
            h["a"]["shape"] = [5] if not isinstance(offsets[0], int) else \
                [max(0, (offsets[1] - offsets[0]) // 4)]
    _rewrite_header(path, edit)
    before = open(path, "rb").read()
    with pytest.raises(ValueError, match=match):
        apply_safetensors_(path, "a", encode(new, old))
    assert open(path, "rb").read() == before


def test_apply_safetensors_refuses_a_fifo_without_blocking(tmp_path):
    from glm_kernels.delta import apply_safetensors_, encode
    fifo = str(tmp_path / "w.safetensors")
    os.mkfifo(fifo)
    packet = encode(torch.ones(3), torch.zeros(3))
    out = _within(lambda: apply_safetensors_(fifo, "a", packet), 10, fifo,
                  "apply_safetensors_ on a FIFO")
    assert isinstance(out.get("exc"), ValueError) and "not a regular file" in str(out["exc"])


# ------------------------------------------------------------------ files that are not files
def test_fifo_at_the_manifest_or_a_weight_file_never_blocks_poll(tmp_path):
    state, sender, receiver, params = _disk_pair(tmp_path)
    sender.publish(state)
    files = _weight_files(tmp_path)
    os.remove(files[0])
    os.mkfifo(files[0])
    try:
        out = _poll_within(receiver, 10)
    finally:
        _unblock(files[0])
    assert isinstance(out.get("exc"), sync.SyncError) and "not a regular file" in str(out["exc"])
    assert receiver.version == 0
    manifest = os.path.join(tmp_path, MANIFEST)
    os.remove(manifest)
    os.mkfifo(manifest)
    try:
        out = _poll_within(receiver, 10)
    finally:
        _unblock(manifest)
    assert isinstance(out.get("exc"), sync.TransportError), out
    assert "not a regular file" in str(out["exc"])


@pytest.mark.parametrize("name", [MANIFEST, REQUEST, LOCK])
@pytest.mark.parametrize("kind", ["directory", "fifo"])
def test_planted_control_names_one_clear_error_then_the_next_publish_recovers(
        tmp_path, name, kind):
    state, sender, receiver, params = _disk_pair(tmp_path)
    assert sender.publish(state) == 1 and receiver.poll() == 1
    sender.transport.close()                  # a restarted trainer meets the planted name
    sender = sync.Sender(sync.DiskTransport(tmp_path), version=1, bucket_bytes=1500)
    where = os.path.join(tmp_path, name)
    if os.path.exists(where):
        os.remove(where)
    if kind == "directory":
        os.mkdir(where)
        open(os.path.join(where, "keep"), "w").close()     # not empty: never deleted
    else:
        os.mkfifo(where)
    sparse_step(state, 1)
    out = _within(lambda: sender.publish(state), 20, where,
                  f"publish with a planted {kind} at {name}")
    assert isinstance(out.get("exc"), sync.SyncError), out
    assert name in str(out["exc"]) and "moved aside" in str(out["exc"])
    assert glob.glob(os.path.join(tmp_path, f".planted-*-{name}"))      # kept, not deleted
    version = sender.publish(state)
    assert receiver.poll() == version and plain_bytes(params) == plain_bytes(state)


# ------------------------------------------------------------------ nesting
def test_deeply_nested_manifest_is_one_sync_error_and_the_sender_recovers(tmp_path):
    state, sender, receiver, params = _disk_pair(tmp_path)
    sender.publish(state)
    _write_manifest(tmp_path, "[" * 100_000)
    out = _poll_within(receiver)
    assert isinstance(out.get("exc"), sync.TransportError), out
    assert "nested" in str(out["exc"])
    sparse_step(state, 2)
    version = sender.publish(state)          # a fresh manifest, started by a full snapshot
    assert sender.last_stats.full
    assert receiver.poll() == version and plain_bytes(params) == plain_bytes(state)


@pytest.mark.parametrize("where", ["header", "glm_sync"])
def test_deeply_nested_file_metadata_is_refused(tmp_path, where):
    state, sender, receiver, params = _disk_pair(tmp_path)
    sender.publish(state)
    deep = "[" * 100_000 + "]" * 100_000

    def edit(h):
        if where == "glm_sync":
            h["__metadata__"]["glm_sync"] = deep
        else:
            h["__metadata__"]["deep"] = "x"
            h["z"] = json.loads("[" * 50 + "]" * 50)
    for file in _weight_files(tmp_path):
        _rewrite_header(file, edit)
    if where == "header":        # json.dumps cannot write 100,000 levels: splice them in
        for file in _weight_files(tmp_path):
            raw = open(file, "rb").read()
            n = struct.unpack("<Q", raw[:8])[0]
            blob = raw[8:8 + n].replace(b"[" * 50 + b"]" * 50, deep.encode())
            blob += b" " * (-len(blob) % 8)
            open(file, "wb").write(struct.pack("<Q", len(blob)) + blob + raw[8 + n:])
    before = plain_bytes(params)
    out = _poll_within(receiver)
    assert isinstance(out.get("exc"), sync.SyncError) and "nested" in str(out["exc"]), out
    assert plain_bytes(params) == before


def test_deeply_nested_frame_meta_is_one_sync_error():
    """A sealed meta (anyone can seal: the digest is not keyed) of 100,000 nested lists used
    to escape as a RecursionError."""
    body = b"[" * 100_000 + b"]" * 100_000
    forged = _SEAL.pack(MAGIC, FORMAT_VERSION, len(body), digest(body)) + body
    with pytest.raises(sync.SyncError, match="nested"):
        assemble([Frame(forged, torch.empty(0, dtype=torch.uint8), True)])


# ------------------------------------------------------------------ versions past int64
def test_forged_huge_version_on_frames_refused_and_the_next_accepted():
    link = sync.LocalTransport()
    state = make_state()
    sender = sync.Sender(link)
    params = blank_like(state)
    receiver = sync.Receiver(link, params)
    assert sender.publish(state) == 1 and receiver.poll() == 1
    forged = make_state(seed=3)
    entries = [sync.protocol.full_entry(n, t) for n, t in forged.items()]
    link.updates.append(list(pack(10 ** 21, None, entries, 1 << 20, epoch=sender.epoch)))
    with pytest.raises(sync.SyncError, match="version"):
        receiver.poll()
    assert receiver.version == 1 and plain_bytes(params) == plain_bytes(state)
    sparse_step(state, 1)
    assert sender.publish(state) == 2 and receiver.poll() == 2
    assert plain_bytes(params) == plain_bytes(state)


def test_forged_huge_version_on_disk_refused_and_the_sender_goes_on(tmp_path):
    """Before: the forged 20-digit version's weights were applied and every later publish
    failed ("not newer")."""
    state, sender, receiver, params = _disk_pair(tmp_path)
    assert sender.publish(state) == 1 and receiver.poll() == 1
    forged_v = 10 ** 20 - 1                          # 20 digits: > 2**63 - 1
    assert forged_v > MAX_VERSION
    manifest = json.load(open(os.path.join(tmp_path, MANIFEST)))
    rec = dict(manifest["versions"][-1])
    renamed = []
    for name in rec["files"]:
        new_name = "v" + str(forged_v) + name[name.index("-"):]
        src, dst = os.path.join(tmp_path, name), os.path.join(tmp_path, new_name)
        with open(src, "rb") as f, open(dst, "wb") as g:
            g.write(f.read())

        def edit(h):
            meta = json.loads(h["__metadata__"]["glm_sync"])
            meta["v"] = forged_v
            h["__metadata__"]["glm_sync"] = json.dumps(meta)
        _rewrite_header(dst, edit)
        renamed.append(new_name)
    rec.update(v=forged_v, files=renamed)
    manifest["versions"].append(rec)
    manifest["latest"] = forged_v
    _write_manifest(tmp_path, manifest)
    out = _poll_within(receiver)
    assert isinstance(out.get("exc"), sync.TransportError) and "version" in str(out["exc"])
    assert receiver.version == 1
    sparse_step(state, 1)
    version = sender.publish(state)
    assert version == 2 and receiver.poll() == 2
    assert plain_bytes(params) == plain_bytes(state)


def test_versions_past_int64_refused_as_arguments():
    with pytest.raises(ValueError, match="version"):
        sync.Sender(sync.LocalTransport(), version=MAX_VERSION)
    with pytest.raises(ValueError, match="version"):
        sync.Receiver(sync.LocalTransport(), {"w": torch.zeros(1)}, version=MAX_VERSION + 1)


# ------------------------------------------------------------------ fuzz harness
def _file_mutant(kind, rng, file):
    """Rewrite one weight file's header with a mutation of ``kind``."""
    def edit(h):
        names = [k for k in h if k != "__metadata__"]
        if kind == "offset overlap":          # a second name over a tensor's bytes
            begin, end = h[rng.choice(names)]["data_offsets"]
            if begin == end:
                begin, end = 0, 8
            h["overlap"] = {"dtype": "U8", "shape": [end - begin], "data_offsets": [begin, end]}
        elif kind == "offset range":
            name = rng.choice(names)
            begin = rng.choice([-8, -1, 1 << 40, (1 << 64) - 8])
            h[name] = dict(h[name], data_offsets=[begin, begin + 8])
        elif kind == "huge version":
            meta = json.loads(h["__metadata__"]["glm_sync"])
            meta["v"] = rng.choice([MAX_VERSION + 1, 10 ** 20, 10 ** 40])
            h["__metadata__"]["glm_sync"] = json.dumps(meta)
        else:                                    # nesting
            depth = rng.choice([40, 1000, 100_000])
            h["__metadata__"]["glm_sync"] = "[" * depth + "]" * depth
    _rewrite_header(file, edit)


def _manifest_mutant(kind, rng, path):
    if kind == "nesting":
        depth = rng.choice([40, 1000, 100_000])
        _write_manifest(path, "{\"versions\":" + "[" * depth + "]" * depth + "}")
        return
    manifest = json.load(open(os.path.join(path, MANIFEST)))
    v = rng.choice([MAX_VERSION + 1, 10 ** 20, 10 ** 25])
    manifest["versions"][-1]["v"] = v
    manifest["latest"] = v
    _write_manifest(path, manifest)


@pytest.mark.parametrize("seed", range(3))
def test_fuzz_hostile_disk_inputs_refused_cleanly_then_recovered(tmp_path, seed):
    """Seeded: every mutant of a published version (offset overlaps and ranges, nesting, huge
    versions; in a weight file or the manifest) ends in SyncError within the timeout with the
    receiver unchanged, and the sender's next publish is received bit for bit."""
    rng = random.Random(f"issue25-{seed}")
    state, sender, receiver, params = _disk_pair(tmp_path / "d")
    sender.publish(state)
    assert receiver.poll() == 1
    for step in range(6):
        sparse_step(state, step + 2, seed=seed)
        sender.publish(state)
        before, held = plain_bytes(params), receiver.version
        kind = rng.choice(["offset overlap", "offset range", "nesting", "huge version"])
        if rng.random() < 0.5 and kind in ("nesting", "huge version"):
            _manifest_mutant(kind, rng, tmp_path / "d")
        else:
            newest = json.load(open(tmp_path / "d" / MANIFEST))["versions"][-1]["files"]
            _file_mutant(kind, rng, str(tmp_path / "d" / rng.choice(newest)))
        out = _poll_within(receiver)
        assert isinstance(out.get("exc"), sync.SyncError), (kind, out)
        assert receiver.version == held and plain_bytes(params) == before, kind
        sparse_step(state, step + 50, seed=seed)
        version = sender.publish(state)
        assert receiver.poll() == version, kind
        assert plain_bytes(params) == plain_bytes(state), kind


# ------------------------------------------------------------------ resync requests
def _layout_request(path, doc: bytes, name_id=None):
    from glm_kernels.sync import resync
    lid = name_id or resync.layout_id(doc)
    where = os.path.join(path, resync.request_name(lid, "0123456789abcdef"))
    with open(where, "wb") as f:
        f.write(doc)
    return where


@pytest.mark.parametrize("kind", ["malformed", "oversized", "symlink", "id mismatch",
                                  "box outside", "unpublished name", "directory", "fifo",
                                  "too many"])
def test_bad_resync_request_is_a_full_snapshot_with_a_warning(tmp_path, kind, caplog):
    """A request file the sender cannot trust (unparsable, over 16 MiB, a symlink, a body
    that is not the layout its name names, a box outside its tensor, a tensor nobody
    publishes, a directory or FIFO, more than 1024 of them) asks for everything: the next
    publish is a full snapshot, logged, never an exception; the file is removed (a
    directory or FIFO moved aside, a symlink's target untouched) and the publish after
    is a delta again."""
    import logging
    from glm_kernels.sync import resync
    state = {"w": torch.randn(12, 4), "b": torch.randn(3)}
    sender = sync.Sender(sync.DiskTransport(tmp_path, full_every=100), encoding="gap16",
                         slices={"w": (0, 0, 12, (12, 4))}, bucket_bytes=256)
    receiver = sync.Receiver(sync.DiskTransport(tmp_path), {"w": torch.zeros(6, 4),
                                                            "b": torch.zeros(3)},
                             slices={"w": (0, 6, 12, (12, 4))})
    sender.publish(state)
    assert receiver.poll() == 1
    good = resync.layout_doc(receiver.targets)
    canary = tmp_path.parent / f"canary-{kind}"
    canary.write_bytes(good)
    if kind == "malformed":
        where = _layout_request(tmp_path, b"{not json")
    elif kind == "oversized":
        where = _layout_request(tmp_path, b"", "ab" * 8)
        os.truncate(where, resync.MAX_LAYOUT_BYTES + 1)
    elif kind == "symlink":
        where = os.path.join(tmp_path, resync.request_name(resync.layout_id(good), "ab" * 8))
        os.symlink(canary, where)
    elif kind == "id mismatch":
        where = _layout_request(tmp_path, good, "cd" * 8)
    elif kind == "box outside":
        where = _layout_request(tmp_path, good.replace(b"[6,12]", b"[6,13]"))
    elif kind == "unpublished name":
        where = _layout_request(tmp_path, good.replace(b'"w"', b'"nope"'))
    elif kind in ("directory", "fifo"):
        where = os.path.join(tmp_path, resync.request_name("ab" * 8, "ab" * 8))
        os.mkdir(where) if kind == "directory" else os.mkfifo(where)
    else:                                                    # too many
        first = _layout_request(tmp_path, good)
        for i in range(resync.MAX_REQUESTS):
            where = os.path.join(tmp_path, resync.request_name(resync.layout_id(good),
                                                               f"{i:016x}"))
            os.link(first, where)
    sparse_step(state, 1)
    with caplog.at_level(logging.WARNING, logger="glm_kernels.sync"):
        out = _within(lambda: sender.publish(state), 20, where, f"publish with a {kind} request")
    assert out.get("v") == 2, out
    assert sender.last_stats.full, kind
    why = {"malformed": "malformed JSON", "oversized": "more than the", "symlink": "links",
           "id mismatch": "not the layout its name names", "box outside": "outside [12, 4]",
           "unpublished name": "not a published tensor", "directory": "a directory",
           "fifo": "a FIFO", "too many": "more than 1024"}[kind]
    assert any(why in r.getMessage() and "full snapshot" in r.getMessage()
               for r in caplog.records), caplog.text
    assert glob.glob(os.path.join(tmp_path, "FULL_REQUESTED*")) == [], kind
    if kind in ("directory", "fifo"):
        assert glob.glob(os.path.join(tmp_path, ".planted-*-FULL_REQUESTED-*")), kind
    assert canary.read_bytes() == good
    assert receiver.poll() == 2 and torch.equal(receiver.params["w"], state["w"][6:])
    sparse_step(state, 2)
    assert sender.publish(state) == 3
    assert sender.last_stats.delta_tensors == sender.last_stats.tensors, kind
    assert receiver.poll() == 3 and torch.equal(receiver.params["b"], state["b"])
