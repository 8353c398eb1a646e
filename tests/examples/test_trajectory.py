"""Trajectory manager: a branch continues while re-tokenization reproduces the engine's ids
and forks when it does not; training data keeps the engine's ids and log-probs."""
import pytest

from examples.async_trainer.rollout.trajectory import TrajectoryManager, render


class GreedyTokenizer:
    """Longest-match tokenizer over a fixed piece list: ``"ab"`` is one token, so an engine
    that samples ``"a"`` then ``"b"`` is re-tokenized differently (drift)."""
    PIECES = ["<system>", "<user>", "<assistant>", "<observation>", "ab", "a", "b", "c", " "]

    def __init__(self):
        self.ids = {p: i for i, p in enumerate(self.PIECES)}

    def encode(self, text):
        out, i = [], 0
        while i < len(text):
            piece = max((p for p in self.PIECES if text.startswith(p, i)), key=len)
            out.append(self.ids[piece])
            i += len(piece)
        return out

    def decode(self, ids):
        return "".join(self.PIECES[i] for i in ids)


@pytest.fixture
def tok():
    return GreedyTokenizer()


def _lp(n, base):
    return [-(base + 0.1 * i) for i in range(n)]


def test_no_drift_is_one_branch_with_the_engines_ids(tok):
    tm = TrajectoryManager(tok.encode, tok.decode)
    tm.start("s", [{"role": "user", "content": "c"}])
    p1 = tm.prompt("s")
    assert p1 == tok.encode(render([{"role": "user", "content": "c"}]))
    turn1 = [tok.ids["ab"], tok.ids["c"]]                  # canonical ids: re-encode the same
    tm.add_assistant("s", turn1, _lp(2, 1))
    tm.add_message("s", "observation", "c c")
    p2 = tm.prompt("s")
    assert p2[:len(p1) + 2] == p1 + turn1 and tm.forks == 0
    turn2 = [tok.ids["b"]]
    tm.add_assistant("s", turn2, _lp(1, 2))
    (traj,) = tm.end("s")
    assert traj["branch"] == 0 and traj["parent"] is None
    assert traj["tokens"] == p2 + turn2
    sampled = [t for t, m in zip(traj["tokens"], traj["loss_mask"]) if m]
    assert sampled == turn1 + turn2                          # exactly the engine's ids
    assert [lp for lp, m in zip(traj["rollout_logprobs"], traj["loss_mask"]) if m] \
        == _lp(2, 1) + _lp(1, 2)
    assert all(lp == 0.0 for lp, m in zip(traj["rollout_logprobs"], traj["loss_mask"]) if not m)


def test_drift_forks_and_never_rewrites_the_main_path(tok):
    tm = TrajectoryManager(tok.encode, tok.decode)
    tm.start("s", [{"role": "user", "content": "c"}])
    p1 = tm.prompt("s")
    turn1 = [tok.ids["a"], tok.ids["b"]]                   # decodes to "ab" = one token
    assert tok.encode(tok.decode(turn1)) != turn1
    tm.add_assistant("s", turn1, _lp(2, 1))
    main_before = list(tm.sessions["s"].branches[0].token_ids)
    tm.add_message("s", "observation", "c")
    p2 = tm.prompt("s")
    assert tm.forks == 1
    assert p2 == tok.encode(render(tm.sessions["s"].messages))   # what a chat server sends
    turn2 = [tok.ids["c"]]
    tm.add_assistant("s", turn2, _lp(1, 3))
    main, fork = tm.end("s")
    # The main path keeps the engine's turn-1 ids and log-probs, untouched by the drift.
    assert main["branch"] == 0 and main["tokens"] == main_before == p1 + turn1
    assert [lp for lp, m in zip(main["rollout_logprobs"], main["loss_mask"]) if m] == _lp(2, 1)
    # The fork starts from the re-tokenized history (masked: never sampled in that context)
    # and holds turn 2 as the engine produced it.
    assert fork["parent"] == 0 and fork["fork_at"] == len(p1)
    assert fork["tokens"] == p2 + turn2
    assert fork["loss_mask"] == [0.0] * len(p2) + [1.0]
    assert fork["rollout_logprobs"][-1] == _lp(1, 3)[0]


def test_branches_after_a_fork_continue_and_fork_again(tok):
    tm = TrajectoryManager(tok.encode, tok.decode)
    tm.start("s", [{"role": "system", "content": " "}, {"role": "user", "content": "c"}])
    for turn in range(4):
        tm.prompt("s")
        drift = turn % 2 == 0                              # turns 0 and 2 drift
        ids = [tok.ids["a"], tok.ids["b"]] if drift else [tok.ids["c"]]
        tm.add_assistant("s", ids, _lp(len(ids), turn))
        tm.add_message("s", "observation", "c")
    tm.prompt("s")
    trajs = tm.trajectories("s")
    assert tm.forks == 2 and [t["branch"] for t in trajs] == [0, 1, 2]
    assert [t["parent"] for t in trajs] == [None, 0, 1]
    assert sum(sum(t["loss_mask"]) for t in trajs) == 2 + 1 + 2 + 1   # every sampled id once
    for t in trajs:                                        # every branch is self-consistent
        assert len(t["tokens"]) == len(t["loss_mask"]) == len(t["rollout_logprobs"])
    with pytest.raises(RuntimeError, match="closed"):
        tm.sessions["s"].branches[0].extend([1])


def test_errors(tok):
    tm = TrajectoryManager(tok.encode, tok.decode)
    tm.start("s", [])
    with pytest.raises(ValueError, match="already"):
        tm.start("s", [])
    with pytest.raises(KeyError, match="no session"):
        tm.prompt("t")
    tm.prompt("s")
    with pytest.raises(ValueError, match="log-probs"):
        tm.add_assistant("s", [1, 2], [0.0])
