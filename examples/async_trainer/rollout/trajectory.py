"""Trajectory manager: a per-session tree of token branches that forks on tokenization drift.

A multi-turn session is kept twice: as *messages* (role, text), the way a chat server sees
it, and as *token branches*, the ids the engine actually consumed and produced. Before each
turn the conversation is rendered with the template and re-tokenized. When the result starts
with the active branch's ids, the branch simply continues (the new template/observation ids
are appended, masked). When it does not (*drift*: the engine sampled ``"a" "b"`` and the
tokenizer now reads the text back as ``"ab"``), the active branch is closed as it is and a
new branch forks from it: it starts from the re-tokenized ids (all masked: the engine never
sampled those ids in that context) and takes the following turns.

So training always uses ids the engine produced together with the log-probs it recorded for
them (mask 1), and a drift never rewrites a branch already written (the main path, branch
0, keeps the engine's ids of every turn it holds). Each branch with at least one sampled
token is one training trajectory (:meth:`TrajectoryManager.trajectories`).
"""
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

DEFAULT_ROLES = {"system": "<system>", "user": "<user>", "assistant": "<assistant>",
                 "observation": "<observation>"}


def render(messages: List[dict], roles: Dict[str, str] = DEFAULT_ROLES) -> str:
    """The 4-role template as text, ending with the assistant header (generation prompt)."""
    return "".join(roles[m["role"]] + m["content"] for m in messages) + roles["assistant"]


@dataclass
class Branch:
    branch_id: int
    parent: Optional[int]           # the branch this one forked from (None: the main path)
    fork_at: int                    # first token position where it differs from its parent
    token_ids: List[int] = field(default_factory=list)
    logprobs: List[float] = field(default_factory=list)    # 0.0 where not sampled
    loss_mask: List[float] = field(default_factory=list)   # 1.0 on engine-sampled ids
    closed: bool = False

    def extend(self, ids: List[int], logprobs: Optional[List[float]] = None) -> None:
        if self.closed:
            raise RuntimeError(f"branch {self.branch_id} is closed")
        if logprobs is not None and len(logprobs) != len(ids):
            raise ValueError(f"{len(ids)} ids but {len(logprobs)} log-probs")
        self.token_ids += ids
        self.logprobs += list(logprobs) if logprobs is not None else [0.0] * len(ids)
        self.loss_mask += [1.0 if logprobs is not None else 0.0] * len(ids)


@dataclass
class Session:
    messages: List[dict] = field(default_factory=list)
    branches: List[Branch] = field(default_factory=list)
    active: int = 0
    turns: int = 0


class TrajectoryManager:
    """Sessions keyed by ``session_id``.

    Parameters
    ----------
    encode, decode : callables
        The tokenizer: ``encode(text) -> ids`` and ``decode(ids) -> text``.
    template : callable, default :func:`render`
        ``messages -> text`` of the conversation plus the generation prompt.
    """

    def __init__(self, encode: Callable[[str], List[int]], decode: Callable[[List[int]], str],
                 template: Callable[[List[dict]], str] = render):
        self.encode, self.decode, self.template = encode, decode, template
        self.sessions: Dict[str, Session] = {}
        self.forks = 0                  # drifts seen (one new branch each)
        self.turns = 0                  # prompts built (turns started)

    def start(self, session_id: str, messages: List[dict]) -> None:
        if session_id in self.sessions:
            raise ValueError(f"session {session_id!r} already exists")
        self.sessions[session_id] = Session(messages=[dict(m) for m in messages],
                                            branches=[Branch(0, None, 0)])

    def _session(self, session_id: str) -> Session:
        try:
            return self.sessions[session_id]
        except KeyError:
            raise KeyError(f"no session {session_id!r}") from None

    def prompt(self, session_id: str) -> List[int]:
        """The ids to send to the engine for the next assistant turn; forks on drift."""
        s = self._session(session_id)
        ids = self.encode(self.template(s.messages))
        branch = s.branches[s.active]
        held = branch.token_ids
        self.turns += 1
        s.turns += 1
        if ids[:len(held)] == held:
            branch.extend(ids[len(held):])            # template / observation ids, masked
            return list(branch.token_ids)
        at = next(i for i, (a, b) in enumerate(zip(held + [None], ids + [None])) if a != b)
        branch.closed = True
        new = Branch(len(s.branches), branch.branch_id, at)
        new.extend(ids)                               # re-tokenized history: never sampled
        s.branches.append(new)
        s.active = new.branch_id
        self.forks += 1
        return list(new.token_ids)

    def add_assistant(self, session_id: str, ids: List[int], logprobs: List[float]) -> str:
        """Record what the engine produced for the turn started by :meth:`prompt` (its ids
        and their log-probs, as sampled); the conversation keeps its decoded text."""
        s = self._session(session_id)
        s.branches[s.active].extend(list(ids), list(logprobs))
        text = self.decode(list(ids))
        s.messages.append({"role": "assistant", "content": text})
        return text

    def add_message(self, session_id: str, role: str, content: str) -> None:
        """A user or tool (observation) message; its ids enter at the next :meth:`prompt`."""
        self._session(session_id).messages.append({"role": role, "content": content})

    def trajectories(self, session_id: str) -> List[dict]:
        """One training trajectory per branch holding sampled ids (branch order)."""
        out = []
        for b in self._session(session_id).branches:
            if any(b.loss_mask):
                out.append({"branch": b.branch_id, "parent": b.parent, "fork_at": b.fork_at,
                            "tokens": list(b.token_ids), "rollout_logprobs": list(b.logprobs),
                            "loss_mask": list(b.loss_mask)})
        return out

    def end(self, session_id: str) -> List[dict]:
        """Close the session; returns its trajectories."""
        out = self.trajectories(session_id)
        del self.sessions[session_id]
        return out
