"""Consistent-hash session router: load balance, minimal movement when an engine leaves or
joins, session affinity accounting."""
import random

import pytest

from examples.async_trainer.router import ConsistentHashRouter


def _sessions(n, seed=0):
    rng = random.Random(seed)
    return [f"s{rng.getrandbits(48):x}" for _ in range(n)]


@pytest.mark.parametrize("n_engines", [2, 3, 5, 8])
def test_load_balance_over_many_sessions(n_engines):
    router = ConsistentHashRouter(range(n_engines), vnodes=128)
    shares = router.shares(_sessions(20_000))
    assert set(shares) == set(range(n_engines))
    mean = 1.0 / n_engines
    assert max(abs(s - mean) / mean for s in shares.values()) < 0.25, shares
    # One virtual node per engine is visibly worse (why vnodes exist).
    coarse = ConsistentHashRouter(range(n_engines), vnodes=1).shares(_sessions(20_000))
    spread = max(coarse.values()) - min(coarse.values())
    assert spread > max(shares.values()) - min(shares.values())


def test_only_the_leaving_engines_sessions_move():
    sessions = _sessions(5_000, seed=1)
    router = ConsistentHashRouter(["e0", "e1", "e2", "e3"])
    before = {s: router.lookup(s) for s in sessions}
    router.remove("e2")
    after = {s: router.lookup(s) for s in sessions}
    moved = [s for s in sessions if before[s] != after[s]]
    assert moved and all(before[s] == "e2" for s in moved)          # only e2's sessions move
    assert all(after[s] != "e2" for s in sessions)
    assert len(moved) == sum(1 for s in sessions if before[s] == "e2")
    # They spread over the survivors, not onto one of them.
    assert len({after[s] for s in moved}) == 3
    # A replacement joining takes sessions only for itself.
    router.add("e4")
    joined = {s: router.lookup(s) for s in sessions}
    assert all(joined[s] in (after[s], "e4") for s in sessions)
    assert 0.15 < sum(1 for s in sessions if joined[s] == "e4") / len(sessions) < 0.35


def test_routing_is_deterministic_across_instances_and_order():
    a = ConsistentHashRouter(["x", "y", "z"])
    b = ConsistentHashRouter(["z", "x", "y"])
    assert all(a.lookup(s) == b.lookup(s) for s in _sessions(500, seed=2))


def test_affinity_hit_rate_and_load():
    router = ConsistentHashRouter([0, 1, 2])
    sessions = _sessions(300, seed=3)
    assert router.affinity_hit_rate() is None
    for turn in range(3):                       # three turns per session, nothing changes
        for s in sessions:
            router.route(s)
    assert router.hits == 2 * len(sessions) and router.misses == 0
    assert router.affinity_hit_rate() == 1.0
    assert sum(router.load.values()) == 3 * len(sessions)
    gone = 1
    owned = [s for s in sessions if router.lookup(s) == gone]
    router.remove(gone)
    for s in sessions:
        router.route(s)
    assert router.misses == len(owned)          # exactly the sessions that had to move
    load, rate = router.snapshot()
    assert rate == pytest.approx(router.hits / (router.hits + router.misses))
    assert load[str(gone)] == 3 * len(owned)    # the departed engine's history is kept
    router.end_session(sessions[0])
    router.route(sessions[0])                   # a new session: neither hit nor miss
    assert router.hits + router.misses == 3 * len(sessions)


def test_errors():
    router = ConsistentHashRouter()
    with pytest.raises(LookupError, match="no live engine"):
        router.route("s")
    router.add(1)
    with pytest.raises(ValueError, match="already"):
        router.add(1)
    with pytest.raises(ValueError, match="hashes like"):
        router.add("1")
    with pytest.raises(KeyError):
        router.remove(2)
    with pytest.raises(ValueError, match="vnodes"):
        ConsistentHashRouter(vnodes=0)
