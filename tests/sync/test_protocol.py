"""Frames: any bucket size cuts and rebuilds the entries exactly; seals catch damage."""
import doctest

import pytest
import torch

from glm_kernels import sync
from glm_kernels.sync import protocol
from glm_kernels.sync.protocol import (SyncError, assemble, full_entry, open_meta, pack,
                                       seal_meta)


def _entries():
    g = torch.Generator().manual_seed(3)
    return [full_entry("a", torch.randn(13, generator=g)),
            full_entry("empty", torch.empty(0, 4, dtype=torch.bfloat16)),
            full_entry("b", torch.randint(0, 9, (5,), generator=g)),
            full_entry("one", torch.tensor([True]))]


@pytest.mark.parametrize("bucket", [1, 3, 8, 52, 53, 60, 100, 1 << 20])
def test_pack_assemble_roundtrip(bucket):
    entries = _entries()
    total = sum(e.payload.numel() for e in entries)
    frames = list(pack(7, 6, iter(entries), bucket))
    assert all(f.data.numel() <= bucket for f in frames)
    assert sum(f.data.numel() for f in frames) == total
    assert [f.last for f in frames] == [False] * (len(frames) - 1) + [True]
    assert len(frames) == max(1, -(-total // bucket))
    update = assemble(frames)
    assert (update.version, update.base) == (7, 6)
    assert len(update.entries) == len(entries)
    for got, want in zip(update.entries, entries):      # zip(strict=) needs Python 3.10
        assert (got.name, got.kind, got.dtype, got.shape, got.checksum) == \
               (want.name, want.kind, want.dtype, want.shape, want.checksum)
        assert torch.equal(got.payload, want.payload)


def test_empty_update_is_one_frame():
    frames = list(pack(1, None, iter([]), 16))
    assert len(frames) == 1 and frames[0].last
    assert assemble(frames).entries == []
    with pytest.raises(SyncError, match="no frames"):
        assemble([])


def test_seal_detects_damage():
    sealed = seal_meta({"v": 1, "base": None, "i": 0, "last": True, "parts": []})
    assert open_meta(sealed)["v"] == 1
    for cut in (3, len(sealed) - 1):
        with pytest.raises(SyncError, match="truncated|corrupt"):
            open_meta(sealed[:cut])
    with pytest.raises(SyncError, match="magic"):
        open_meta(b"XXXX" + sealed[4:])
    with pytest.raises(ValueError, match="bucket_bytes"):
        list(pack(1, None, iter([]), 0))


def test_frames_of_two_updates_do_not_mix():
    one = list(pack(1, None, iter(_entries()), 20))
    two = list(pack(2, 1, iter(_entries()), 20))
    with pytest.raises(SyncError, match="out of sequence"):
        assemble(one[:1] + two[1:])


@pytest.mark.parametrize("module", ["sender", "receiver"])
def test_docstring_examples(module):
    import importlib
    mod = importlib.import_module(f"glm_kernels.sync.{module}")
    failures, attempted = doctest.testmod(mod, optionflags=doctest.ELLIPSIS)
    assert attempted > 0 and failures == 0


def test_poll_applies_full_snapshot_after_refusals():
    link = sync.LocalTransport()
    state = {"w": torch.arange(20, dtype=torch.int32)}
    sender = sync.Sender(link)
    params = {"w": torch.zeros(20, dtype=torch.int32)}
    receiver = sync.Receiver(link, params)
    sender.publish(state)
    receiver.poll()
    params["w"][0] = 99                                   # drift
    for i in (1, 2):
        state["w"][5 + i] += 1
        sender.publish(state)                             # two deltas, both refused
    state["w"][9] += 1
    sender.publish(state, full=True)
    with pytest.raises(SyncError, match="2 updates refused, now holding v4"):
        receiver.poll()
    assert receiver.version == 4 and torch.equal(params["w"], state["w"])
    assert protocol.FORMAT_VERSION == 2


def test_docs_first_example_runs():
    """docs/sync.md's first python block is runnable as written."""
    import os
    import re
    text = open(os.path.join(os.path.dirname(__file__), "..", "..", "docs", "sync.md")).read()
    block = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    namespace = {}
    exec(compile(block, "docs/sync.md", "exec"), namespace)
    stats = namespace["sender"].last_stats
    assert not stats.full and stats.changed == 44 and stats.delta_tensors == 2


def test_digest_tree_above_one_chunk_detects_any_flip():
    from glm_kernels.sync.protocol import _CHUNK, digest
    data = torch.randint(0, 256, (2 * _CHUNK + 5,), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(1))
    ref = digest(data)
    assert digest(data.numpy().tobytes()) == ref          # tensor and bytes agree
    for pos in (0, _CHUNK - 1, _CHUNK, 2 * _CHUNK + 4):
        flipped = data.clone()
        flipped[pos] ^= 1
        assert digest(flipped) != ref
    assert digest(data[:-1]) != ref


def test_sealed_but_malformed_meta_refused():
    good = list(pack(1, None, iter(_entries()), 1 << 10))
    for meta in ({"v": 1, "base": None, "i": 0, "last": True},                 # no parts
                 {"v": 1, "base": None, "i": 0, "last": True,
                  "parts": [{"n": "a", "k": "full", "dt": "float32", "sh": [1], "ck": "00",
                             "size": 4, "at": 0, "len": -4}]}):
        with pytest.raises(SyncError, match="malformed|bad fragment"):
            assemble([good[0]._replace(meta=seal_meta(meta))])
