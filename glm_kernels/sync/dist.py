"""Broadcast transport over a torch.distributed process group (NCCL on GPU, gloo on CPU).

Per frame the source rank broadcasts a small int64 header ``[meta bytes, data bytes, last]``,
then the sealed meta and the data as uint8 tensors; so a model streams in frames of
``bucket_bytes`` and every rank knows where an update ends even if a meta were corrupt. After
the last frame all ranks ``all_reduce(MAX)`` one flag: a receiver that refused the update sets
it, and the sender's next publish is then a full snapshot.

Lock step: collectives need every rank, so each receiver calls ``receive()`` (or ``poll()``)
exactly once per ``publish`` on the source rank, in the same order.
"""
from __future__ import annotations

from typing import Iterable, Optional

import torch

from .protocol import Entry, Frame, Transport, Update, assemble, pack


class BroadcastTransport(Transport):
    """One sender (``src``) and every other rank of ``group`` as receivers.

    Parameters
    ----------
    group : ProcessGroup, default None (the default group, already initialised)
    src : int, default 0
        Global rank of the sender.
    device : where frames live; default ``cuda:<current>`` for NCCL, ``cpu`` otherwise.

    Example (every rank)::

        dist.init_process_group("gloo", ...)        # "nccl" on GPUs
        link = sync.BroadcastTransport(src=0)
        if dist.get_rank() == 0:
            sender = sync.Sender(link, delta=True); sender.publish(model.state_dict())
        else:
            receiver = sync.Receiver(link, model.state_dict()); receiver.receive()
    """
    lockstep = True

    def __init__(self, group=None, *, src: int = 0, device=None):
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
             bucket_bytes: int) -> None:
        if self.rank != self.src:
            raise RuntimeError(f"rank {self.rank} cannot send: the source is rank {self.src}")
        for frame in pack(version, base, entries, bucket_bytes, self.device):
            meta = torch.frombuffer(bytearray(frame.meta), dtype=torch.uint8).to(self.device)
            self._bcast(torch.tensor([meta.numel(), frame.data.numel(), int(frame.last)],
                                     dtype=torch.int64, device=self.device))
            self._bcast(meta)
            if frame.data.numel():
                self._bcast(frame.data)
        self._full_flag = self._flag(False)

    def full_requested(self) -> bool:
        asked, self._full_flag = self._full_flag, False
        return asked

    def recv(self, held: int, timeout: Optional[float]) -> Optional[Update]:
        """Receive one whole update (waits: ``timeout`` does not apply to a collective)."""
        if self.rank == self.src:
            raise RuntimeError(f"rank {self.rank} is the source and cannot receive")
        frames = []
        while not frames or not frames[-1].last:
            head = self._bcast(torch.empty(3, dtype=torch.int64, device=self.device)).tolist()
            meta = self._bcast(torch.empty(head[0], dtype=torch.uint8, device=self.device))
            data = torch.empty(head[1], dtype=torch.uint8, device=self.device)
            if head[1]:
                self._bcast(data)
            frames.append(Frame(meta.cpu().numpy().tobytes(), data, bool(head[2])))
        return assemble(frames)

    def report(self, version: int, ok: bool) -> None:
        self._flag(not ok)
