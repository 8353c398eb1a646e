"""Broadcast transport over a torch.distributed process group (NCCL on GPU, gloo on CPU).

Per frame the source rank broadcasts a small int64 header ``[magic, version, frame index,
meta bytes, data bytes, flags]`` (flags: 1 = last frame, 2 = update aborted), then the
sealed meta and the data as uint8 tensors; so a model streams in frames of ``bucket_bytes``
and every rank knows where an update ends even if a meta were corrupt. After the last frame
all ranks ``all_reduce(MAX)`` one flag: a receiver that refused the update sets it, and the
sender's next publish is then a full snapshot.

A publish that fails half-way on the sender (an exception while encoding) broadcasts an
abort header and still takes part in the flag: every receiver discards that update whole
(SyncError) and the lock step stays one ``receive`` per ``publish``. A receiver allocates
what a header says only within bounds (meta up to 64 MiB, data up to ``max_frame_bytes``);
a header outside them is a SyncError -- the group's lock step is then broken (a damaged
or foreign source), recreate the process group.

Lock step: collectives need every rank, so each receiver calls ``receive()`` (or ``poll()``)
exactly once per ``publish`` on the source rank, in the same order.
"""
from __future__ import annotations

from typing import Iterable, Optional

import torch

from .protocol import Entry, Frame, SyncError, Transport, Update, assemble, pack

_MAGIC = 0x474C4D53          # "GLMS"
_LAST, _ABORT = 1, 2
_MAX_META_BYTES = 64 << 20


class BroadcastTransport(Transport):
    """One sender (``src``) and every other rank of ``group`` as receivers.

    Parameters
    ----------
    group : ProcessGroup, default None (the default group, already initialised)
    src : int, default 0
        Global rank of the sender.
    device : where frames live; default ``cuda:<current>`` for NCCL, ``cpu`` otherwise.
    max_frame_bytes : int, default 2 GiB
        The most frame data a receiver allocates for one frame (a Sender's ``bucket_bytes``
        must not exceed it).

    Example (every rank)::

        dist.init_process_group("gloo", ...)        # "nccl" on GPUs
        link = sync.BroadcastTransport(src=0)
        if dist.get_rank() == 0:
            sender = sync.Sender(link, delta=True); sender.publish(model.state_dict())
        else:
            receiver = sync.Receiver(link, model.state_dict()); receiver.receive()
    """
    lockstep = True

    def __init__(self, group=None, *, src: int = 0, device=None, max_frame_bytes: int = 1 << 31):
        from ..delta.packet import check_int
        self.max_frame_bytes = check_int("max_frame_bytes", max_frame_bytes, 1)
        import torch.distributed as dist
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("BroadcastTransport needs an initialised torch.distributed "
                               "process group (dist.init_process_group)")
        self._dist = dist
        self.group = group
        self.src = int(src)
        self.rank = dist.get_rank()
        if device is None:
            nccl = str(dist.get_backend(group)).lower() == "nccl"
            device = torch.device("cuda", torch.cuda.current_device()) if nccl else "cpu"
        self.device = torch.device(device)
        self._full_flag = False

    def _bcast(self, t: torch.Tensor) -> torch.Tensor:
        self._dist.broadcast(t, self.src, group=self.group)
        return t

    def _flag(self, value: bool) -> bool:
        flag = torch.tensor([int(value)], dtype=torch.int64, device=self.device)
        self._dist.all_reduce(flag, op=self._dist.ReduceOp.MAX, group=self.group)
        return bool(flag.item())

    def send(self, version: int, base: Optional[int], entries: Iterable[Entry],
             bucket_bytes: int, epoch: Optional[str] = None) -> None:
        if self.rank != self.src:
            raise RuntimeError(f"rank {self.rank} cannot send: the source is rank {self.src}")
        if bucket_bytes > self.max_frame_bytes:
            raise ValueError(f"bucket_bytes {bucket_bytes} exceeds this transport's "
                             f"max_frame_bytes {self.max_frame_bytes}")
        frames = pack(version, base, entries, bucket_bytes, self.device, epoch)
        index = 0
        while True:
            try:
                frame = next(frames)
            except StopIteration:
                break
            except BaseException:
                # Encoding failed half-way: receivers drop what came and stay in lock step.
                self._header(version, index, 0, 0, _ABORT)
                self._full_flag = self._flag(False)
                raise
            meta = torch.frombuffer(bytearray(frame.meta), dtype=torch.uint8).to(self.device)
            self._header(version, index, meta.numel(), frame.data.numel(),
                         _LAST if frame.last else 0)
            self._bcast(meta)
            if frame.data.numel():
                self._bcast(frame.data)
            index += 1
        self._full_flag = self._flag(False)

    def _header(self, version, index, meta_bytes, data_bytes, flags):
        self._bcast(torch.tensor([_MAGIC, version, index, meta_bytes, data_bytes, flags],
                                 dtype=torch.int64, device=self.device))

    def full_requested(self) -> bool:
        asked, self._full_flag = self._full_flag, False
        return asked

    def recv(self, held: int, timeout: Optional[float]) -> Optional[Update]:
        """Receive one whole update (waits: ``timeout`` does not apply to a collective)."""
        if self.rank == self.src:
            raise RuntimeError(f"rank {self.rank} is the source and cannot receive")
        frames, version = [], None
        while not frames or not frames[-1].last:
            head = self._bcast(torch.empty(6, dtype=torch.int64, device=self.device)).tolist()
            magic, v, index, meta_bytes, data_bytes, flags = head
            if magic != _MAGIC or flags & ~(_LAST | _ABORT):
                raise SyncError(f"malformed frame header {head} (not a glm_kernels sync "
                                f"frame, or another format version): the lock step with "
                                f"rank {self.src} is broken; recreate the process group")
            if flags & _ABORT:
                raise SyncError(f"update v{v} was aborted by its sender after {index} frames; "
                                f"discarded whole")
            if (index != len(frames) or (version is not None and v != version)
                    or not 0 < meta_bytes <= _MAX_META_BYTES
                    or not 0 <= data_bytes <= self.max_frame_bytes):
                raise SyncError(f"frame header {head} refused (expected frame {len(frames)} "
                                f"of v{version if version is not None else v}, meta in "
                                f"(0, {_MAX_META_BYTES}] bytes, data in [0, "
                                f"{self.max_frame_bytes}]): the lock step with rank {self.src} "
                                f"is broken; recreate the process group")
            version = v
            meta = self._bcast(torch.empty(meta_bytes, dtype=torch.uint8, device=self.device))
            data = torch.empty(data_bytes, dtype=torch.uint8, device=self.device)
            if data_bytes:
                self._bcast(data)
            frames.append(Frame(meta.cpu().numpy().tobytes(), data, bool(flags & _LAST)))
        return assemble(frames)

    def report(self, version: int, ok: bool) -> None:
        self._flag(not ok)


class P2PTransport(Transport):
    """Sharded weight sync over torch.distributed: several sender ranks (the trainer group),
    several receiver ranks (engine ranks), each receiver getting only its own pieces.

    Every rank of ``group`` (senders, receivers and any others) builds one with the same
    ``senders`` and ``receivers`` (global ranks). Receivers declare the boxes they hold
    (``Receiver(slices=...)``); at the first publish / receive every rank exchanges them
    (``all_gather_object``), and from then on each sender rank sends each receiver rank, point
    to point, exactly the pieces of its shard that were cut for that receiver's boxes (a
    plain, uncut entry goes to every receiver). Per (sender, receiver) pair, frames go as over
    :class:`BroadcastTransport` (header, sealed meta, data), one frame per entry or fragment,
    then an empty last frame; a sender whose encoding fails sends an abort header instead.

    Lock step: every sender rank calls ``publish`` (collective over the Sender's group) and
    every receiver rank ``receive``/``poll`` once per version, in the same order. After each
    version every rank of ``group`` all-reduces flags (a sender part failed, and one per
    receiver rank: it refused): the senders' next publish re-sends in full the pieces cut
    for the refusing ranks' boxes, every other piece a delta (``resync``); a failed sender
    part leaves the receivers on the previous version and the next publish is a delta on it.

    Parameters
    ----------
    senders, receivers : sequences of global ranks (disjoint)
    group : ProcessGroup, default None (the default group): holds every sender and receiver
    device : where frames live; default ``cuda:<current>`` for NCCL, ``cpu`` otherwise
    max_frame_bytes : int, default 2 GiB (what a receiver allocates for one frame at most)
    """
    lockstep = True
    multi_part = True

    def __init__(self, senders, receivers, group=None, *, device=None,
                 max_frame_bytes: int = 1 << 31):
        from ..delta.packet import check_int
        self.max_frame_bytes = check_int("max_frame_bytes", max_frame_bytes, 1)
        import torch.distributed as dist
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("P2PTransport needs an initialised torch.distributed process "
                               "group (dist.init_process_group)")
        self._dist = dist
        self.senders = [int(r) for r in senders]
        self.receivers = [int(r) for r in receivers]
        if not self.senders or not self.receivers or set(self.senders) & set(self.receivers):
            raise ValueError(f"senders {self.senders} and receivers {self.receivers} must be "
                             f"non-empty and disjoint")
        self.group = group
        self.rank = dist.get_rank()
        if device is None:
            nccl = str(dist.get_backend(group)).lower() == "nccl"
            device = torch.device("cuda", torch.cuda.current_device()) if nccl else "cpu"
        self.device = torch.device(device)
        self._mine: dict = {}
        self._layouts = None
        self._refused: set = set()      # sender side: receiver ranks that refused, unanswered
        #: receiver side: frame data and meta bytes received, all updates
        self.bytes_received = 0
        self.meta_bytes_received = 0

    def declare(self, targets: dict, explicit: bool) -> None:
        self._mine = dict(targets)

    def _exchange(self) -> None:
        if self._layouts is not None:
            return
        world = self._dist.get_world_size(self.group)
        out = [None] * world
        mine = ({n: (list(f), [list(ab) for ab in b]) for n, (f, b) in self._mine.items()}
                if self.rank in self.receivers else None)
        self._dist.all_gather_object(out, (self.rank, mine), group=self.group)
        self._layouts = {}
        for rank, layout_ in out:
            if rank in self.receivers:
                self._layouts[rank] = {n: (tuple(f), tuple(tuple(ab) for ab in b))
                                       for n, (f, b) in (layout_ or {}).items()}

    def targets(self) -> dict:
        self._exchange()
        out: dict = {}
        for layout_ in self._layouts.values():
            for name, target in layout_.items():
                out.setdefault(name, set()).add(target)
        return out

    def _dests(self, entry_name: str):
        from . import layout
        parsed = layout.parse_piece(entry_name)
        if parsed is None:
            return list(self.receivers)
        name, full, target, _ = parsed
        return [r for r in self.receivers if self._layouts[r].get(name, ((), None)) ==
                (tuple(full), target) or (name not in self._layouts[r]
                                          and target == layout.whole_box(full))]

    def _p2p_header(self, dest, version, index, meta_bytes, data_bytes, flags):
        self._dist.send(torch.tensor([_MAGIC, version, index, meta_bytes, data_bytes, flags],
                                     dtype=torch.int64, device=self.device), dest,
                        group=self.group)

    def _p2p_frame(self, dest, version, frame, index):
        meta = torch.frombuffer(bytearray(frame.meta), dtype=torch.uint8).to(self.device)
        self._p2p_header(dest, version, index, meta.numel(),
                         frame.data.numel(), _LAST if frame.last else 0)
        self._dist.send(meta, dest, group=self.group)
        if frame.data.numel():
            self._dist.send(frame.data.to(self.device), dest, group=self.group)

    def send(self, version, base, entries, bucket_bytes, epoch=None) -> None:
        try:
            self.send_part(version, base, entries, bucket_bytes, epoch, 0, 1)
        except BaseException:
            self.commit(version, base, epoch, [None], False, 0)
            raise
        self.commit(version, base, epoch, [None], True, 0)

    def send_part(self, version, base, entries, bucket_bytes, epoch, part, parts):
        from .protocol import make_frame, part_of
        if self.rank not in self.senders:
            raise RuntimeError(f"rank {self.rank} is not one of the senders {self.senders}")
        if bucket_bytes > self.max_frame_bytes:
            raise ValueError(f"bucket_bytes {bucket_bytes} exceeds this transport's "
                             f"max_frame_bytes {self.max_frame_bytes}")
        self._exchange()
        index = {r: 0 for r in self.receivers}
        entries = iter(entries)
        while True:
            try:
                e = next(entries)
            except StopIteration:
                break
            except BaseException:
                for r in self.receivers:      # every receiver drops this version whole
                    self._p2p_header(r, version, index[r], 0, 0, _ABORT)
                raise
            size = e.payload.numel()
            for r in self._dests(e.name):
                at = 0
                while True:
                    take = min(size - at, bucket_bytes)
                    frame = make_frame(version, base, epoch, index[r], False,
                                       [part_of(e, at, take)], [e.payload[at:at + take]],
                                       self.device)
                    self._p2p_frame(r, version, frame, index[r])
                    index[r] += 1
                    at += take
                    if at >= size:
                        break
        for r in self.receivers:
            self._p2p_frame(r, version, make_frame(version, base, epoch, index[r], True, [],
                                                   [], self.device), index[r])
        return None

    def _flags(self, sender_failed: bool, refused: bool):
        """(a sender part failed, the receiver ranks that refused), over every rank."""
        flags = torch.zeros(1 + len(self.receivers), dtype=torch.int64, device=self.device)
        flags[0] = int(sender_failed)
        if refused:
            flags[1 + self.receivers.index(self.rank)] = 1
        self._dist.all_reduce(flags, op=self._dist.ReduceOp.MAX, group=self.group)
        got = flags.tolist()
        return bool(got[0]), {r for r, x in zip(self.receivers, got[1:]) if x}

    def commit(self, version, base, epoch, parts, ok, part, full_for=()) -> bool:
        failed, refused = self._flags(not ok, False)
        self._refused |= refused
        return not failed

    def full_requested(self) -> bool:
        return self.resync_request().asks

    def resync_request(self):
        """The boxes of the receiver ranks that refused since the last call (every sender
        knows every receiver's layout)."""
        from . import resync
        refused, self._refused = self._refused, set()
        if not refused:
            return resync.NOTHING
        return resync.of_layouts((self._layouts or {}).get(r) for r in sorted(refused))

    def _recv_from(self, src):
        """(frames, error text) of one sender's part; always drains it (lock step)."""
        frames = []
        while not frames or not frames[-1].last:
            head = torch.empty(6, dtype=torch.int64, device=self.device)
            self._dist.recv(head, src, group=self.group)
            magic, v, index, meta_bytes, data_bytes, flags = head.tolist()
            if magic != _MAGIC or flags & ~(_LAST | _ABORT):
                raise SyncError(f"malformed frame header {head.tolist()} from rank {src}: the "
                                f"lock step is broken; recreate the process group")
            if flags & _ABORT:
                return None, f"sender rank {src} aborted its part of v{v} after {index} frames"
            if (index != len(frames) or not 0 < meta_bytes <= _MAX_META_BYTES
                    or not 0 <= data_bytes <= self.max_frame_bytes):
                raise SyncError(f"frame header {head.tolist()} from rank {src} refused: the "
                                f"lock step is broken; recreate the process group")
            meta = torch.empty(meta_bytes, dtype=torch.uint8, device=self.device)
            self._dist.recv(meta, src, group=self.group)
            data = torch.empty(data_bytes, dtype=torch.uint8, device=self.device)
            if data_bytes:
                self._dist.recv(data, src, group=self.group)
            self.bytes_received += data_bytes
            self.meta_bytes_received += meta_bytes + head.numel() * 8
            frames.append(Frame(meta.cpu().numpy().tobytes(), data, bool(flags & _LAST)))
        return frames, None

    def recv(self, held, timeout):
        """One version: every sender's part for this rank (waits: a collective)."""
        if self.rank not in self.receivers:
            raise RuntimeError(f"rank {self.rank} is not one of the receivers {self.receivers}")
        self._exchange()
        parts, errors = [], []
        for src in self.senders:
            frames, error = self._recv_from(src)
            if error is not None:
                errors.append(error)
            else:
                parts.append(frames)
        self._aborted = bool(errors)
        if errors:
            raise SyncError("; ".join(errors) + " (the version is dropped whole)")
        updates = [assemble(frames) for frames in parts]
        head = updates[0]
        for u in updates[1:]:
            if (u.version, u.base, u.epoch) != (head.version, head.base, head.epoch):
                raise SyncError(f"sender parts disagree: v{u.version} (base {u.base}, epoch "
                                f"{u.epoch}) and v{head.version} (base {head.base}, epoch "
                                f"{head.epoch})")
        return Update(head.version, head.base, [e for u in updates for e in u.entries],
                      head.epoch)

    def report(self, version: int, ok: bool) -> None:
        # A version dropped because a sender part was aborted needs no resync: the receivers
        # hold the previous version intact and the senders' bases are still on it.
        self._flags(False, not ok and not getattr(self, "_aborted", False))
        self._aborted = False
