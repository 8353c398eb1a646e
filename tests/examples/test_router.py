"""Consistent-hash session router: load balance, minimal movement when an engine leaves or
joins, sticky sessions, bounded-load placement of new sessions."""
import random

import pytest

from examples.async_trainer.rollout.router import ConsistentHashRouter


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


def test_sessions_stay_on_their_engine_until_it_leaves():
    router = ConsistentHashRouter(["e0", "e1", "e2"])
    sessions = _sessions(300, seed=3)
    placed = {s: router.start(s) for s in sessions}
    assert all(placed[s] == router.lookup(s) for s in sessions)    # all free: the ring's owner
    router.add("e3")                          # a replacement joins: no live session moves
    for _ in range(2):
        assert all(router.route(s) == (placed[s], False) for s in sessions)
    assert router.moved == 0 and sum(router.load.values()) == 3 * len(sessions)
    router.remove("e1")
    owned = [s for s in sessions if placed[s] == "e1"]
    for s in sessions:
        engine, moved = router.route(s)
        assert moved == (s in owned) and engine != "e1"
        assert engine == (router.lookup(s) if moved else placed[s])
    assert router.moved == len(owned)         # exactly the sessions that had to move
    assert router.snapshot()["e1"] == 3 * len(owned)    # the departed engine's history is kept
    router.end_session(sessions[0])
    assert router.engine_of(sessions[0]) is None


def test_a_new_session_goes_to_a_free_engine_bounded_load():
    router = ConsistentHashRouter(["e0", "e1", "e2"])
    sessions = _sessions(200, seed=4)
    for s in sessions:                         # only e1 free: every new session lands there
        assert router.start(s, free={"e1"}) == "e1"
    # Two free: each session takes the first of them clockwise from its point, so both
    # get a share, and a session whose owner is free stays with its owner.
    got = {s: router.start(s, free={"e0", "e2"}) for s in sessions}
    assert set(got.values()) == {"e0", "e2"}
    assert all(got[s] == router.lookup(s) for s in sessions if router.lookup(s) != "e1")
    assert router.start(sessions[0], free=set()) == router.lookup(sessions[0])   # none free


def test_errors():
    router = ConsistentHashRouter()
    with pytest.raises(LookupError, match="no live engine"):
        router.start("s")
    router.add(1)
    with pytest.raises(ValueError, match="already"):
        router.add(1)
    with pytest.raises(ValueError, match="hashes like"):
        router.add("1")
    with pytest.raises(KeyError):
        router.remove(2)
    with pytest.raises(ValueError, match="vnodes"):
        ConsistentHashRouter(vnodes=0)
