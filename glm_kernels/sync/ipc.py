"""Colocated transport: frames through torch.multiprocessing queues.

torch.multiprocessing pickles a CUDA tensor as a CUDA IPC handle, so CUDA frame data goes from
the trainer's GPU memory to the rollout process without passing through the host; CPU frame
data travels through shared memory. The same code path serves both (the CPU one is what the
tests run end to end). A second queue carries full-snapshot requests back to the sender.

CUDA IPC rules (torch.multiprocessing): the sending process must stay alive while a receiver
still uses a frame; torch keeps a sent CUDA block alive until the receiver drops it, and the
receiver drops every frame as soon as the update is committed or refused.
"""
from __future__ import annotations

import queue
from typing import Iterable, Optional

import torch.multiprocessing as mp

from .protocol import Entry, Frame, SyncError, Transport, Update, assemble, pack


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
        Seconds to wait for the rest of an update once its first frame has arrived.

    Example (the receiving process)::

        def rollout(link):
            receiver = sync.Receiver(link, model.state_dict())
            while True:
                receiver.poll()          # apply whatever arrived, in order
                ...                      # generate with receiver.version
    """

    def __init__(self, ctx=None, *, device=None, frame_timeout: float = 60.0):
        ctx = ctx if ctx is not None else mp.get_context("spawn")
        self.device = device
        self.frame_timeout = float(frame_timeout)
        self._frames = ctx.Queue()
        # Written synchronously (no feeder thread): a refusal is visible to the sender's
        # next publish as soon as report() returns.
        self._requests = ctx.SimpleQueue()

    def send(self, version: int, base: Optional[int], entries: Iterable[Entry],
             bucket_bytes: int) -> None:
        for frame in pack(version, base, entries, bucket_bytes, self.device):
            self._frames.put(tuple(frame))

    def full_requested(self) -> bool:
        asked = False
        while not self._requests.empty():   # the sender is the only reader
            self._requests.get()
            asked = True
        return asked

    def _get(self, timeout: Optional[float]) -> Frame:
        try:
            if timeout is not None and timeout <= 0:
                return Frame(*self._frames.get_nowait())
            return Frame(*self._frames.get(timeout=timeout))
        except (OSError, EOFError) as exc:   # frame memory gone with its (dead) sender
            raise SyncError(f"a frame could not be received ({exc!r}); the sending process "
                            "must stay alive until receivers have taken its frames") from exc

    def recv(self, held: int, timeout: Optional[float]) -> Optional[Update]:
        try:
            frames = [self._get(timeout)]
        except queue.Empty:
            return None
        while not frames[-1].last:
            try:
                frames.append(self._get(self.frame_timeout))
            except queue.Empty:
                raise SyncError(f"incomplete update: frame {len(frames)} did not arrive within "
                                f"{self.frame_timeout} s") from None
        return assemble(frames)

    def report(self, version: int, ok: bool) -> None:
        if not ok:
            self._requests.put(version)
