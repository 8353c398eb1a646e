"""In-process transport: sender and receiver in one process (tests, examples, debugging)."""
from __future__ import annotations

import collections
from typing import Deque, Iterable, List, Optional

from .protocol import Entry, Frame, Transport, Update, assemble, pack


class LocalTransport(Transport):
    """Frames kept in a queue in memory; the full framing and checking path runs as over a wire.

    ``updates`` holds the frames of every update not yet received (tests may tamper with
    them). ``recv`` never waits: nothing can arrive while the one thread is waiting.
    """

    def __init__(self, device=None):
        self.device = device
        self.updates: Deque[List[Frame]] = collections.deque()
        self._full_asked = False

    def send(self, version: int, base: Optional[int], entries: Iterable[Entry],
             bucket_bytes: int, epoch: Optional[str] = None) -> None:
        # Packed completely before anything is queued: a publish that fails half-way
        # leaves nothing behind.
        self.updates.append(list(pack(version, base, entries, bucket_bytes, self.device, epoch)))

    def declare(self, targets: dict, explicit: bool) -> None:
        """The (one) receiver's boxes, handed to the sender in this process."""
        self._targets = dict(targets)

    def targets(self) -> dict:
        return {n: {t} for n, t in getattr(self, "_targets", {}).items()}

    def full_requested(self) -> bool:
        asked, self._full_asked = self._full_asked, False
        return asked

    def recv(self, held: int, timeout: Optional[float]) -> Optional[Update]:
        return assemble(self.updates.popleft()) if self.updates else None

    def report(self, version: int, ok: bool) -> None:
        self._full_asked = self._full_asked or not ok
