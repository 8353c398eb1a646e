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
