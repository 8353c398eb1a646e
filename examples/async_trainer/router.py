"""Session-affine router: consistent hashing of ``session_id`` over the live rollout engines.

Every turn of a multi-turn session must reach the engine that holds its KV cache (its prefix
is cached there: a re-prefill elsewhere costs the whole conversation again). A plain
``hash(session) % n`` moves almost every session when an engine leaves or joins; a
consistent-hash ring moves only the sessions of the engine that changed:

* every engine owns ``vnodes`` points on a 64-bit ring (``blake2b(f"{engine}#{i}")``: the
  same on every process and run, unlike Python's salted ``hash``);
* a session goes to the first engine point at or after ``blake2b(session_id)`` (wrapping);
* removing an engine hands each of its arcs to the next point's owner; nobody else moves.
  Adding one takes arcs only for itself.

More virtual nodes give a more even load (the spread of an engine's share falls like
1/sqrt(vnodes)); 128 keeps every engine within about 20% of the mean at 2-8 engines.

The router also counts what the metrics report: requests per engine (``load``) and the
session-affinity hit rate (a request of a session seen before that goes to the same engine
as that session's previous request; a miss follows an engine's departure).
"""
import bisect
import hashlib
from typing import Dict, Hashable, Iterable, List, Optional, Tuple


def _point(key: str) -> int:
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big")


class ConsistentHashRouter:
    """``route(session_id)`` -> engine id, over the engines added and not removed.

    Parameters
    ----------
    engines : iterable of hashable, optional
        Engine ids to start with (their ``str()`` is hashed: ids must differ as strings).
    vnodes : int, default 128
        Points per engine on the ring.
    """

    def __init__(self, engines: Iterable[Hashable] = (), vnodes: int = 128):
        if vnodes < 1:
            raise ValueError(f"vnodes must be >= 1, got {vnodes}")
        self.vnodes = vnodes
        self._points: List[int] = []
        self._owner: List[Hashable] = []
        self._engines: Dict[Hashable, None] = {}
        self.load: Dict[Hashable, int] = {}          # requests routed per engine (all time)
        self._last: Dict[str, Hashable] = {}         # session -> engine of its last request
        self.hits = 0                                # repeat requests on the same engine
        self.misses = 0                              # repeat requests that had to move
        for e in engines:
            self.add(e)

    @property
    def engines(self) -> List[Hashable]:
        return list(self._engines)

    def __len__(self) -> int:
        return len(self._engines)

    def add(self, engine: Hashable) -> None:
        if engine in self._engines:
            raise ValueError(f"engine {engine!r} is already on the ring")
        if any(str(engine) == str(e) for e in self._engines):
            raise ValueError(f"engine {engine!r} hashes like an engine already on the ring")
        self._engines[engine] = None
        self.load.setdefault(engine, 0)
        for i in range(self.vnodes):
            p = _point(f"{engine}#{i}")
            at = bisect.bisect_left(self._points, p)
            self._points.insert(at, p)
            self._owner.insert(at, engine)

    def remove(self, engine: Hashable) -> None:
        if engine not in self._engines:
            raise KeyError(f"engine {engine!r} is not on the ring")
        del self._engines[engine]
        keep = [i for i, o in enumerate(self._owner) if o != engine]
        self._points = [self._points[i] for i in keep]
        self._owner = [self._owner[i] for i in keep]

    def lookup(self, session_id) -> Hashable:
        """The engine that owns ``session_id`` now (no counting)."""
        if not self._points:
            raise LookupError("no live engine to route to")
        at = bisect.bisect_left(self._points, _point(str(session_id)))
        return self._owner[at % len(self._points)]

    def route(self, session_id) -> Hashable:
        """The engine for this request of ``session_id``; counts load and affinity."""
        engine = self.lookup(session_id)
        key = str(session_id)
        last = self._last.get(key)
        if last is not None:
            if last == engine:
                self.hits += 1
            else:
                self.misses += 1
        self._last[key] = engine
        self.load[engine] = self.load.get(engine, 0) + 1
        return engine

    def end_session(self, session_id) -> None:
        """Forget a finished session (keeps the affinity table bounded)."""
        self._last.pop(str(session_id), None)

    def affinity_hit_rate(self) -> Optional[float]:
        """Repeat requests that reached the same engine as the session's previous one; None
        before any repeat request."""
        n = self.hits + self.misses
        return self.hits / n if n else None

    def shares(self, sessions: Iterable) -> Dict[Hashable, float]:
        """Fraction of ``sessions`` each live engine owns (no counting): for tests and logs."""
        counts: Dict[Hashable, int] = {e: 0 for e in self._engines}
        n = 0
        for s in sessions:
            counts[self.lookup(s)] += 1
            n += 1
        return {e: c / max(n, 1) for e, c in counts.items()}

    def snapshot(self) -> Tuple[Dict[str, int], Optional[float]]:
        """(load per engine as ``{str(engine): requests}``, affinity hit rate)."""
        return {str(e): n for e, n in self.load.items()}, self.affinity_hit_rate()
