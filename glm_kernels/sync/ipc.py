"""Colocated transport: frames through torch.multiprocessing queues.

torch.multiprocessing pickles a CUDA tensor as a CUDA IPC handle, so CUDA frame data goes from
the trainer's GPU memory to the rollout process without passing through the host; CPU frame
data travels through shared memory. The same code path serves both (the CPU one is what the
tests run end to end). A second queue carries full-snapshot requests back to the sender.

CUDA IPC rules (torch.multiprocessing): the sending process must stay alive while a receiver
still uses a frame; torch keeps a sent CUDA block alive until the receiver drops it, and the
receiver drops every frame as soon as the update is committed or refused.

Trust boundary: both queues are read with a restricted unpickler. A frame is accepted only
as a pickled ``(bytes, uint8 tensor, bool)`` whose pickle names nothing but torch's tensor /
storage rebuild functions (``torch.multiprocessing.reductions.rebuild_*``, ``torch.Tensor``,
``torch.Size``, ``torch.uint8``, torch storage classes, ``multiprocessing``'s fd handle), and
a full-snapshot request only as a pickled int: anything else is refused as a SyncError before
any of it is built, so bytes written to the queue's pipe cannot run code in the receiver.
What remains trusted: such a pickle still makes the receiver map the shared memory (or
CUDA IPC handle) it names, as any torch.multiprocessing queue does; the IPC transport is for
colocated processes of one user (a peer that can write to the pipe can already read the
processes' memory). The frames' contents are then checked like any transport's (seals,
checksums, versions).
"""
from __future__ import annotations

import io
import pickle
import queue
import time
from typing import Iterable, Optional

import torch
import torch.multiprocessing as mp

from .. import _checks
from .protocol import (Entry, Frame, SyncError, Transport, Update, assemble, frame_key, pack)

# (module, name) a frame's pickle may name: torch's own tensor sharing, nothing else.
_ALLOWED = {("torch", "Tensor"), ("torch", "Size"), ("torch", "uint8"),
            ("torch.storage", "UntypedStorage"), ("torch.storage", "TypedStorage"),
            ("torch", "UntypedStorage"), ("torch", "TypedStorage"), ("torch", "device"),
            ("torch.cuda", "UntypedStorage"), ("torch.cuda", "ByteStorage"),
            ("multiprocessing.resource_sharer", "DupFd")}
_REBUILD = "torch.multiprocessing.reductions"
_REBUILD_FNS = {"rebuild_tensor", "rebuild_cuda_tensor", "rebuild_typed_storage",
                "rebuild_typed_storage_child", "rebuild_storage_fd", "rebuild_storage_filename",
                "rebuild_storage_empty"}
_MAX_REQUEST_BYTES = 64


class _FrameUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if (module, name) in _ALLOWED or (module == _REBUILD and name in _REBUILD_FNS):
            return super().find_class(module, name)
        raise SyncError(f"IPC frame refused: its pickle names {module}.{name}, which is not "
                        f"part of a frame (only torch tensor sharing is unpickled)")


class _PlainUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        raise SyncError(f"IPC request refused: its pickle names {module}.{name}")


def _loads_frame(raw: bytes) -> Frame:
    try:
        obj = _FrameUnpickler(io.BytesIO(raw)).load()
    except SyncError:
        raise
    except Exception as exc:       # truncated / malformed pickle, rebuild of a bad handle
        raise SyncError(f"IPC frame refused: unreadable ({type(exc).__name__}: {exc}); if its "
                        f"sender exited: the sending process must stay alive until receivers "
                        f"have taken its frames") from None
    if not (isinstance(obj, tuple) and len(obj) == 3 and isinstance(obj[0], bytes)
            and type(obj[1]) is torch.Tensor and obj[1].layout == torch.strided
            and obj[1].dtype == torch.uint8 and obj[1].dim() == 1
            and obj[1].is_contiguous() and isinstance(obj[2], bool)):
        raise SyncError(f"IPC frame refused: expected (bytes, 1-D contiguous uint8 tensor, "
                        f"bool), got {type(obj).__name__}")
    return Frame(*obj)


def _get_raw(q, timeout: Optional[float]) -> bytes:
    """The next message of a multiprocessing ``Queue`` as raw bytes (``Queue.get`` without
    its unpickling; same locking). queue.Empty when nothing came within ``timeout``."""
    if timeout is None:
        with q._rlock:
            raw = q._recv_bytes()
        q._sem.release()
        return raw
    deadline = time.monotonic() + max(0.0, timeout)
    if not q._rlock.acquire(True, max(0.0, timeout)):
        raise queue.Empty
    try:
        if not q._poll(max(0.0, deadline - time.monotonic())):
            raise queue.Empty
        raw = q._recv_bytes()
        q._sem.release()
    finally:
        q._rlock.release()
    return raw


class IpcTransport(Transport):
    """One sender process, one receiver process, colocated (same host, same GPU or not).

    A queue has one consumer: give each rollout process its own transport (and Sender), or
    use a ``BroadcastTransport`` to reach several receivers with one encode.

    Parameters
    ----------
    ctx : a multiprocessing context, default ``torch.multiprocessing.get_context("spawn")``
        (CUDA needs ``spawn``). Create the transport in the parent and pass it to the child
        process as an argument; the same object is the sending and the receiving end.
    device : where frame data is placed, default None = the device of the published tensors.
        Use ``"cuda"`` to stage CPU-held weights on the GPU for a GPU rollout engine.
    frame_timeout : float, default 60
        Seconds (> 0) to wait for the rest of an update once its first frame has arrived.

    Every frame names its update (sender epoch, version, frame index): when a publish dies
    half-way, the receiver discards its frames whole as soon as the next update's first
    frame arrives, instead of gluing the two into one refused update.

    Example (the receiving process)::

        def rollout(link):
            receiver = sync.Receiver(link, model.state_dict())
            while True:
                receiver.poll()          # apply whatever arrived, in order
                ...                      # generate with receiver.version
    """

    def __init__(self, ctx=None, *, device=None, frame_timeout: float = 60.0):
        from .. import _dispatch
        ctx = ctx if ctx is not None else mp.get_context("spawn")
        self.device = device
        self.frame_timeout = _checks.check_finite_number("frame_timeout", frame_timeout,
                                                           positive=True)
        self.discarded = 0          # frames of partial updates dropped (receiver side)
        self._frames = ctx.Queue()
        # Written synchronously (no feeder thread): a refusal is visible to the sender's
        # next publish as soon as report() returns.
        self._requests = ctx.SimpleQueue()

    def send(self, version: int, base: Optional[int], entries: Iterable[Entry],
             bucket_bytes: int, epoch: Optional[str] = None) -> None:
        for frame in pack(version, base, entries, bucket_bytes, self.device, epoch):
            self._frames.put((bytes(frame.meta), frame.data, bool(frame.last)))

    def full_requested(self) -> bool:
        asked = False
        while not self._requests.empty():   # the sender is the only reader
            with self._requests._rlock:
                raw = self._requests._reader.recv_bytes()
            if len(raw) <= _MAX_REQUEST_BYTES:
                try:
                    asked = isinstance(_PlainUnpickler(io.BytesIO(raw)).load(), int) or asked
                except Exception:       # not a request: ignored (the sender keeps going)
                    pass
        return asked

    def _get(self, timeout: Optional[float]) -> Frame:
        try:
            raw = _get_raw(self._frames, timeout)
        except (OSError, EOFError) as exc:
            raise SyncError(f"a frame could not be received ({exc!r})") from exc
        return _loads_frame(raw)

    def recv(self, held: int, timeout: Optional[float]) -> Optional[Update]:
        """Frames of the next whole update. Frames of an update that never finished (its
        sender died or raised half-way) are discarded when the next update's first frame
        arrives; a frame that continues no update is discarded."""
        frames, key = [], None
        while True:
            try:
                frame = self._get(timeout if not frames else self.frame_timeout)
            except queue.Empty:
                if not frames:
                    return None
                raise SyncError(f"incomplete update: frame {len(frames)} did not arrive within "
                                f"{self.frame_timeout} s") from None
            this = frame_key(frame.meta)
            if this is not None:
                if frames and key is not None and this[2] == 0:
                    self.discarded += len(frames)       # a new update started: drop the partial
                    frames = []
                if not frames and this[2] != 0:
                    self.discarded += 1                 # the tail of an update already dropped
                    continue
                if frames and key is not None and (this[0], this[1]) != (key[0], key[1]):
                    self.discarded += len(frames) + 1
                    frames, key = [], None
                    continue
                if not frames:
                    key = this
            frames.append(frame)
            if frame.last:
                return assemble(frames)

    def report(self, version: int, ok: bool) -> None:
        if not ok:
            self._requests.put(version)
