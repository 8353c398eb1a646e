"""Colocated transport: frames through torch.multiprocessing queues.

torch.multiprocessing pickles a CUDA tensor as a CUDA IPC handle, so CUDA frame data goes from
the trainer's GPU memory to the rollout process without passing through the host; CPU frame
data travels through shared memory. The same code path serves both (the CPU one is what the
tests run end to end). A second queue carries full-snapshot requests back to the sender.

``IpcTransport`` links one trainer process to one rollout process. Several trainer processes
publishing the parts of one version to sliced rollout processes (tensor parallel) use
:meth:`IpcTransport.sharded`: :class:`IpcLinks` holds a queue per (sender, receiver) pair and
one back to each sender, and each process's :class:`IpcEnd` is a ``P2PTransport`` whose
point-to-point sends, all-gather of layouts and per-version flags go over those queues, so
the cutting, the abort of a failed part and the resync of a refusing receiver are P2P's own.

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
import logging
import pickle
import queue
import time
from typing import Iterable, Optional

import torch
import torch.multiprocessing as mp

from .. import _checks
from . import resync
from .dist import P2PTransport
from .protocol import (MAX_META_BYTES, Entry, Frame, SyncError, Transport, Update, assemble,
                       frame_key, pack, seal_meta)

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
# A frame's pickle holds its sealed meta and a shared-memory / CUDA IPC handle, never data.
_MAX_FRAME_PICKLE = MAX_META_BYTES + (64 << 10)
# A message back to a sharded sender: a receiver's layout document, or a verdict.
_MAX_BACK_BYTES = resync.MAX_LAYOUT_BYTES + 1024

logger = logging.getLogger(__name__)


class _FrameUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if (module, name) in _ALLOWED or (module == _REBUILD and name in _REBUILD_FNS):
            return super().find_class(module, name)
        raise SyncError(f"IPC frame refused: its pickle names {module}.{name}, which is not "
                        f"part of a frame (only torch tensor sharing is unpickled)")


class _PlainUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        raise SyncError(f"IPC request refused: its pickle names {module}.{name}")


def _loads_frame(raw: bytes, aborts: bool = False):
    """A Frame; with ``aborts`` (a sharded link's message, one more bool: the sender's part
    was aborted) a (Frame, aborted) pair."""
    try:
        obj = _FrameUnpickler(io.BytesIO(raw)).load()
    except SyncError:
        raise
    except Exception as exc:       # truncated / malformed pickle, rebuild of a bad handle
        raise SyncError(f"IPC frame refused: unreadable ({type(exc).__name__}: {exc}); if its "
                        f"sender exited: the sending process must stay alive until receivers "
                        f"have taken its frames") from None
    n = 4 if aborts else 3
    if not (isinstance(obj, tuple) and len(obj) == n and isinstance(obj[0], bytes)
            and type(obj[1]) is torch.Tensor and obj[1].layout == torch.strided
            and obj[1].dtype == torch.uint8 and obj[1].dim() == 1
            and obj[1].is_contiguous() and all(isinstance(x, bool) for x in obj[2:])):
        raise SyncError(f"IPC frame refused: expected (bytes, 1-D contiguous uint8 tensor, "
                        f"{', '.join(['bool'] * (n - 2))}), got {type(obj).__name__}")
    return (Frame(*obj[:3]), obj[3]) if aborts else Frame(*obj)


def _get_raw(q, timeout: Optional[float], maxlength: Optional[int] = None) -> bytes:
    """The next message of a multiprocessing ``Queue`` as raw bytes (``Queue.get`` without
    its unpickling; same locking). queue.Empty when nothing came within ``timeout``.
    ``maxlength``: a longer message is an OSError before its body is read (and the queue is
    closed: its stream cannot be resynchronised)."""
    if timeout is None:
        with q._rlock:
            raw = q._recv_bytes(maxlength)
        q._sem.release()
        return raw
    deadline = time.monotonic() + max(0.0, timeout)
    if not q._rlock.acquire(True, max(0.0, timeout)):
        raise queue.Empty
    try:
        if not q._poll(max(0.0, deadline - time.monotonic())):
            raise queue.Empty
        raw = q._recv_bytes(maxlength)
        q._sem.release()
    finally:
        q._rlock.release()
    return raw


class IpcTransport(Transport):
    """One sender process, one receiver process, colocated (same host, same GPU or not).

    A queue has one consumer: give each rollout process its own transport (and Sender), or
    use a ``BroadcastTransport`` to reach several receivers with one encode. Several trainer
    processes, or sliced (tensor-parallel) rollout processes: :meth:`sharded`.

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

    @staticmethod
    def sharded(senders: int, receivers: int, ctx=None, *, device=None,
                frame_timeout: float = 60.0, max_frame_bytes: int = 1 << 31) -> "IpcLinks":
        """Several trainer processes publishing parts of one version to several (sliced)
        rollout processes, lock step, as :class:`~glm_kernels.sync.P2PTransport` over
        queues: see :class:`IpcLinks`."""
        return IpcLinks(senders, receivers, ctx, device=device, frame_timeout=frame_timeout,
                        max_frame_bytes=max_frame_bytes)

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


class IpcLinks:
    """The queues between ``senders`` trainer processes and ``receivers`` rollout processes of
    one host (:meth:`IpcTransport.sharded`): create it in the parent, pass it (or its ends) to
    the children as ``Process`` arguments, and give each process its own end,
    ``links.sender(group rank)`` or ``links.receiver(j)``.

    The ends behave as :class:`~glm_kernels.sync.P2PTransport`'s ranks: every trainer process
    publishes its shard (a ``Sender`` over its end with ``group=`` the trainer group), every
    rollout process declares its boxes (``Receiver(end, params, slices=..., group=...)``) and
    takes only the pieces cut for them; a failed trainer part makes every receiver drop the
    version whole; a receiver that refused gets its boxes re-sent in full by the next publish.
    Lock step: every receiver calls ``receive``/``poll`` once per publish (it waits for the
    version), and every sender's ``publish`` waits for every receiver's verdict.

    Queues: frames from each sender to each receiver on a queue of their own (FIFO per pair
    stands in for P2P's point-to-point order), and one queue back to each sender carrying
    the receivers' layouts (at ``Receiver`` construction) and verdicts (after each version).
    Everything read is untrusted as on :class:`IpcTransport`: a frame's pickle is bounded
    and restricted to torch's tensor sharing, its data to ``max_frame_bytes``; a message back
    is bounded, built from plain types only, and a layout must parse (``resync.parse_layout``).
    """

    def __init__(self, senders: int, receivers: int, ctx=None, *, device=None,
                 frame_timeout: float = 60.0, max_frame_bytes: int = 1 << 31):
        from ..delta.packet import check_int
        check_int("senders", senders, 1)
        check_int("receivers", receivers, 1)
        self.max_frame_bytes = check_int("max_frame_bytes", max_frame_bytes, 1)
        self.frame_timeout = _checks.check_finite_number("frame_timeout", frame_timeout,
                                                           positive=True)
        ctx = ctx if ctx is not None else mp.get_context("spawn")
        self.device = device
        # ids as P2P's ranks: senders first, receivers after, disjoint
        self.senders = list(range(senders))
        self.receivers = list(range(senders, senders + receivers))
        self.frames = {(s, r): ctx.Queue() for s in self.senders for r in self.receivers}
        self.back = {s: ctx.Queue() for s in self.senders}

    def sender(self, rank: int) -> "IpcEnd":
        """The end of trainer process ``rank`` (its rank in the Sender's group)."""
        return IpcEnd(self, self._index("sender", rank, len(self.senders)))

    def receiver(self, index: int) -> "IpcEnd":
        """The end of rollout process ``index`` (0 .. receivers - 1)."""
        return IpcEnd(self, len(self.senders) + self._index("receiver", index,
                                                             len(self.receivers)))

    @staticmethod
    def _index(what, i, n) -> int:
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < n:
            raise ValueError(f"{what} must be an int in [0, {n}), got {i!r:.40}")
        return i


class IpcEnd(P2PTransport):
    """One process's end of an :class:`IpcLinks`: P2PTransport's sending, cutting, receiving
    and resync logic, with its point-to-point sends, all-gather and flags on queues."""

    def __init__(self, links: IpcLinks, rank: int):       # no process group to join
        self._links = links
        self.senders, self.receivers = links.senders, links.receivers
        self.rank, self.device = rank, links.device
        self.max_frame_bytes, self.frame_timeout = links.max_frame_bytes, links.frame_timeout
        self._mine: dict = {}
        self._layouts = None
        self._refused: set = set()
        self._aborted = False
        self._seen = None       # receiver side: the version being received, for the verdict
        self._bad = None        # receiver side: a frame refused while draining a part
        self._version = None    # sender side: the version whose verdicts commit waits for
        self.bytes_received = 0
        self.meta_bytes_received = 0

    # ---- back queue: layouts and verdicts (untrusted)
    def _put_back(self, message) -> None:
        for s in self.senders:
            self._links.back[s].put(message)

    def _next_back(self):
        """The next well-formed message on this sender's back queue (ill-formed ones are
        logged and skipped: a peer that can write the pipe cannot stop a publish with one)."""
        while True:
            try:
                raw = _get_raw(self._links.back[self.rank], None, _MAX_BACK_BYTES)
            except (OSError, EOFError) as exc:
                raise SyncError(f"the receivers' queue to sender {self.rank} is broken "
                                f"({exc!r}, e.g. a message over {_MAX_BACK_BYTES} bytes); "
                                f"recreate the links") from exc
            try:
                msg = _PlainUnpickler(io.BytesIO(raw)).load()
                if not (isinstance(msg, tuple) and len(msg) == 4 and type(msg[1]) is int
                        and msg[1] in self.receivers):
                    raise SyncError(f"not a (kind, receiver, ., .) tuple: {msg!r:.80}")
                kind, who, a, b = msg
                if kind == "layout" and isinstance(a, bytes) and b is None:
                    return kind, who, resync.parse_layout(a, f"layout of receiver {who}")
                if (kind == "verdict" and (a is None or type(a) is int)
                        and isinstance(b, bool)):
                    return kind, who, a, b
                raise SyncError(f"unknown message {kind!r:.40}")
            except Exception as exc:        # noqa: BLE001 (anything a forged pickle raises)
                logger.warning("glm_kernels.sync: IPC sender %d skipped a message from the "
                               "receivers: %s", self.rank, exc)

    def declare(self, targets: dict, explicit: bool) -> None:
        self._mine = dict(targets)
        if self.rank in self.receivers:
            self._exchange()            # the senders cut by it from their first publish

    def _exchange(self) -> None:
        if self._layouts is not None:
            return
        if self.rank in self.receivers:
            self._put_back(("layout", self.rank, resync.layout_doc(self._mine), None))
            self._layouts = {}
            return
        layouts = {}
        while len(layouts) < len(self.receivers):
            got = self._next_back()
            if got[0] == "layout":
                layouts.setdefault(got[1], got[2])     # a repeat (a re-made Receiver): first
        self._layouts = layouts

    # ---- frames, sender side
    def _put(self, dest, meta: bytes, data, last: bool, aborted: bool) -> None:
        self._links.frames[(self.rank, dest)].put((bytes(meta), data, last, aborted))

    def _p2p_frame(self, dest, version, frame, index):
        data = frame.data if self.device is None else frame.data.to(self.device)
        self._put(dest, frame.meta, data, bool(frame.last), False)

    def _p2p_header(self, dest, version, index, meta_bytes, data_bytes, flags):
        # only P2P's abort: the receivers learn which version was dropped
        self._put(dest, seal_meta({"v": version, "i": index}),
                  torch.empty(0, dtype=torch.uint8), True, True)

    def _flags(self, sender_failed: bool, refused: bool):
        if self.rank in self.receivers:
            self._put_back(("verdict", self.rank, self._seen, bool(refused)))
            return False, set()
        waiting, refusing = set(self.receivers), set()
        version = self._version
        while waiting:
            got = self._next_back()
            if got[0] != "verdict" or got[1] not in waiting:
                continue
            if got[2] is not None and version is not None and got[2] < version:
                continue                # a verdict on an older version (a lost lock step)
            waiting.discard(got[1])
            if got[3]:
                refusing.add(got[1])
        return sender_failed, refusing

    def commit(self, version, base, epoch, parts, ok, part, full_for=()) -> bool:
        self._version = version
        return super().commit(version, base, epoch, parts, ok, part, full_for)

    # ---- frames, receiver side
    def _recv_from(self, src):
        """(frames, abort text) of sender ``src``'s part, drained to its last frame. A frame
        refused on reading ends in :attr:`_bad` (raised by :meth:`recv` after every part is
        drained, so the queues stay in lock step)."""
        q = self._links.frames[(src, self.rank)]
        frames, bad = [], None
        while True:
            first = not frames and bad is None
            try:
                raw = _get_raw(q, None if first else self.frame_timeout, _MAX_FRAME_PICKLE)
                frame, aborted = _loads_frame(raw, aborts=True)
            except queue.Empty:
                if bad is not None:         # the refused frame was the last one
                    self._bad = self._bad or bad
                    return None, str(bad)
                raise SyncError(f"incomplete part from sender {src}: frame {len(frames)} did "
                                f"not arrive within {self.frame_timeout} s (its process "
                                f"died?); the lock step is broken, recreate the links") from None
            except (OSError, EOFError) as exc:
                raise SyncError(f"the queue from sender {src} is broken ({exc!r}); recreate "
                                f"the links") from exc
            except SyncError as exc:
                bad = bad or exc
                continue
            if first:
                key = frame_key(frame.meta)
                self._seen = key[1] if key is not None and type(key[1]) is int else None
            if frame.data.numel() > self.max_frame_bytes:
                bad = bad or SyncError(f"frame of {frame.data.numel()} bytes from sender {src} "
                                       f"refused (max_frame_bytes {self.max_frame_bytes})")
            elif not aborted and bad is None:
                self.bytes_received += frame.data.numel()
                self.meta_bytes_received += len(frame.meta)
                frames.append(frame)
            if aborted:
                return None, (f"sender {src} aborted its part of v{self._seen} after "
                              f"{len(frames)} frames")
            if frame.last:
                if bad is not None:
                    self._bad = self._bad or bad
                    return None, str(bad)
                return frames, None

    def recv(self, held, timeout):
        """One version: every sender's part for this end (waits for it: lock step)."""
        self._bad, self._seen = None, None
        try:
            return super().recv(held, timeout)
        except SyncError:
            if self._bad is None:
                raise
            self._aborted = False       # a frame refused here: a refusal, resync asked
            raise self._bad from None
