"""Sharded IPC (``IpcTransport.sharded``): the gloo worlds of test_sharded_dist.py over
queues instead of point-to-point sends. 2 trainer processes (a Sender group, uneven Shard(0)
cuts) publish to a TP-1 engine and an uneven TP-2 engine, bf16 + fp32 + int64 + an FP8
weight: three delta steps bitwise, each engine rank receiving only its own pieces; a trainer
part dying mid-version (every engine keeps the previous version, the next publish applies);
an engine rank refusing (its boxes re-sent in full by the next publish, bitwise after)."""
import functools
import pickle
import threading

import pytest
import torch
import torch.multiprocessing as mp

from glm_kernels import sync
from tests._gloo import run_ranks
from tests.sync import _sharded
from tests.sync.test_sharded_dist import _check_engine, _check_trainers


def test_ipc_sharded_two_trainers_to_tp1_and_tp2_engines(tmp_path):
    trainers = 2
    links = sync.IpcTransport.sharded(trainers, 3, frame_timeout=60)
    verdicts = run_ranks(functools.partial(_sharded.world_body, trainers, ipc=links),
                         trainers + 3, tmp_path, "sharded IPC sync")
    for rank, verdict in enumerate(verdicts):
        if rank < trainers:
            assert _check_trainers(verdict["ipc"], rank, "ipc") > 0, rank
        else:
            part = None if rank == trainers else rank - trainers - 1
            pieces_sent = [sum(verdicts[t]["ipc"][step][4] for t in range(trainers))
                           for step in range(4)]
            _check_engine(verdict["ipc"], part, "ipc", trainers, pieces_sent)


def test_ipc_sharded_ends_named():
    links = sync.IpcTransport.sharded(2, 1, mp.get_context("spawn"))
    with pytest.raises(ValueError, match="sender"):
        links.sender(2)
    with pytest.raises(ValueError, match="receiver"):
        links.receiver(-1)
    with pytest.raises(ValueError, match="senders"):
        sync.IpcTransport.sharded(0, 1)
    with pytest.raises(RuntimeError, match="not one of the receivers"):
        links.sender(0).recv(0, 0)


def test_ipc_sharded_back_queue_untrusted(caplog):
    """What the receivers send back is bounded and plain: a pickle naming code, a layout with
    a box outside its shape and a message from an unknown receiver are skipped (logged); an
    oversized message breaks the queue (a SyncError, nothing read into memory)."""
    class RunsCode:
        def __reduce__(self):
            return (exec, ("raise SystemExit('ran')",))
    links = sync.IpcTransport.sharded(1, 1)
    sender, receiver = links.sender(0), links.receiver(0)
    back = links.back[0]
    back.put(RunsCode())
    back.put(("layout", 1, b'{"targets":{"w":[[4],[[0,9]]]}}', None))
    back.put(("layout", 7, b'{"targets":{}}', None))
    receiver.declare({"w": ((4,), ((0, 2),))}, explicit=True)
    assert sender.targets() == {"w": {((4,), ((0, 2),))}}
    assert caplog.text.count("skipped a message") == 3
    big = pickle.dumps(("verdict", 1, b"x" * (17 << 20), False))

    def write():            # a pipe holds 64 KiB: the writer blocks until the reader quits
        try:
            back._writer.send_bytes(big)
        except OSError:
            pass
    threading.Thread(target=write, daemon=True).start()
    with pytest.raises(sync.SyncError, match="broken"):
        sender._next_back()


def test_ipc_sharded_frames_bounded():
    """A frame whose data exceeds max_frame_bytes, or an unreadable frame, is a refusal of
    the version (resync asked) after the part is drained: the next version still applies."""
    links = sync.IpcTransport.sharded(1, 1, frame_timeout=2, max_frame_bytes=64)
    end = links.receiver(0)
    q = links.frames[(0, 1)]
    q.put((b"meta", torch.zeros(65, dtype=torch.uint8), True, False))
    with pytest.raises(sync.SyncError, match="max_frame_bytes"):
        end.recv(0, 0)
    assert not end._aborted
    q.put((b"meta", torch.zeros(3), False, False))               # float32: refused
    q.put((b"meta", torch.zeros(0, dtype=torch.uint8), True, False))
    with pytest.raises(sync.SyncError, match="IPC frame refused"):
        end.recv(0, 0)
    assert end.bytes_received == 0
