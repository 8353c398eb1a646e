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

Sessions are sticky: the router keeps each live session's engine (:meth:`start` places a
new one, :meth:`route` sends its later turns there) until the session ends or its engine
leaves; only then does it move (to the ring's owner of its id). A replacement joining the
ring therefore never pulls a live session off a live engine, whose prefix cache holds it.

Placing a new session is consistent hashing with bounded loads (Mirrokni, Thorup and
Zadeh): from the session's point the ring is walked to the first engine that has a free
slot (``free``), so a new session never waits behind a busy engine while another is idle;
with no engine free it goes to the point's owner. The router counts requests per engine
(``load``) and turns that had to move because their engine left (``moved``).
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
        self._table: Dict[str, Hashable] = {}        # live session -> its engine
        self.moved = 0                               # turns moved off an engine that left
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

    def start(self, session_id, free: Optional[Iterable[Hashable]] = None) -> Hashable:
        """Place a new session and count its first request: the first engine in ``free``
        clockwise from the session's point (all engines when ``free`` is None), or the
        point's owner when none is free."""
        if not self._points:
            raise LookupError("no live engine to route to")
        free = set(self._engines) if free is None else set(free)
        at = bisect.bisect_left(self._points, _point(str(session_id)))
        engine = self._owner[at % len(self._points)]
        if free and engine not in free:
            for step in range(1, len(self._points)):
                owner = self._owner[(at + step) % len(self._points)]
                if owner in free:
                    engine = owner
                    break
        self._table[str(session_id)] = engine
        self.load[engine] = self.load.get(engine, 0) + 1
        return engine

    def route(self, session_id) -> Tuple[Hashable, bool]:
        """(engine, moved) for a later turn of ``session_id``: its engine while that lives;
        otherwise the ring's owner of its id now (``moved`` True, counted). An unknown
        session is placed as by :meth:`start`."""
        key = str(session_id)
        engine = self._table.get(key)
        if engine is None:
            return self.start(session_id), False
        moved = engine not in self._engines
        if moved:
            engine = self.lookup(session_id)
            self._table[key] = engine
            self.moved += 1
        self.load[engine] = self.load.get(engine, 0) + 1
        return engine, moved

    def engine_of(self, session_id) -> Optional[Hashable]:
        """The engine a live session is on (None: not placed, or ended)."""
        return self._table.get(str(session_id))

    def end_session(self, session_id) -> None:
        """Forget a finished session (keeps the table bounded)."""
        self._table.pop(str(session_id), None)

    def shares(self, sessions: Iterable) -> Dict[Hashable, float]:
        """Fraction of ``sessions`` each live engine owns (no counting): for tests and logs."""
        counts: Dict[Hashable, int] = {e: 0 for e in self._engines}
        n = 0
        for s in sessions:
            counts[self.lookup(s)] += 1
            n += 1
        return {e: c / max(n, 1) for e, c in counts.items()}

    def snapshot(self) -> Dict[str, int]:
        """Load per engine as ``{str(engine): requests}``."""
        return {str(e): n for e, n in self.load.items()}
