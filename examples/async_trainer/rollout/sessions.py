"""Multi-turn sessions as the recipe runs them: every turn is one request to an engine
(through the router, keyed by the session id), and the environment runs between turns on
this side (the tool's lookup, the ToRA sandbox and the trajectory manager).

A session is one request's conversations: its prompts, each repeated ``group_size`` times
(one row each; the rows of a prompt share its prefix). ``next_turn()`` gives the next request
(None when every row is done), ``feed(result, version)`` takes the engine's answer and runs
the environment, ``samples()`` gives one sample per row in the format of
``rollout.local.generate``. A sample's ``version`` is the oldest weight version any of its turns
was generated with (what its staleness is measured from). Every request after the first
carries that version (``version``): an engine in batch-invariant mode runs the whole session
on those weights (``rollout/engines.py``), so that the trainer's recompute with one version matches
every turn bitwise; other engines ignore it.

* ``reverse``: one turn (the answer).
* ``tool``: turn 1 is the one-token tool call; the environment appends the observation span
  to the rows that called; turn 2 is the answer. A row that did not call has failed.
* ``tora``: turn 1 is the code block; a row that closed it gets its program run in the sandbox
  and the output as an observation message; the trajectory manager re-tokenizes the
  conversation (forking a branch on drift); turn 2 is the answer on those ids.
"""
from abc import ABC, abstractmethod
from typing import Dict, List, Optional

import torch

from .. import kernels
from ..env import task, tora_task, vocab
from .trajectory import TrajectoryManager


def _sampled(res: dict):
    """A row's sampled ids and log-probs of one turn (mask 1 where it sampled)."""
    keep = [j for j, m in enumerate(res["mask"]) if m]
    return [res["ids"][j] for j in keep], [res["logprobs"][j] for j in keep]


class Session(ABC):
    """The common part: rows, turns, the weight versions; a task says its turns
    (``_first_turn``, ``_after``: the environment and the next turn) and its samples."""

    def __init__(self, cfg, session_id: str, prompts: List[List[int]], group_size: int):
        kinds = {task.task_of(p) for p in prompts}
        if len(kinds) != 1:
            raise ValueError(f"a session's prompts must share one task, got {sorted(kinds)}")
        self.cfg, self.session_id, self.task = cfg, session_id, kinds.pop()
        self.rows = [list(p) for p in prompts for _ in range(group_size)]
        self.prompt_len = len(self.rows[0])
        self.turns = 0                     # turns answered
        self.version: Optional[int] = None
        self._next: Optional[dict] = self._first_turn()

    def next_turn(self) -> Optional[dict]:
        """The next request (``rows``, ``steps``, ``stops``, ``end``, and ``version``: the
        weight version of the earlier turns, None before the first), None when done."""
        return None if self._next is None else dict(self._next, version=self.version)

    @property
    def done(self) -> bool:
        return self._next is None

    def feed(self, result: dict, version: int = 0) -> None:
        """The engine's answer to :meth:`next_turn`; runs the environment for the next."""
        self.version = version if self.version is None else min(self.version, version)
        self.turns += 1
        self._next = self._after(result["rows"])

    def _packet(self, routing, tokens: List[int]) -> bytes:
        """The routing of positions 0 .. len(tokens)-2 as a wire packet."""
        return kernels.encode_routing(routing[:, :len(tokens) - 1], self.cfg.n_experts)

    def _sample(self, tokens, lps, mask, routing, rew=None) -> dict:
        p = self.prompt_len
        return {"tokens": tokens, "prompt_len": p, "rollout_logprobs": lps, "loss_mask": mask,
                "task": self.task, "reward": task.reward(self.cfg, tokens, p) if rew is None
                else rew, "routing": self._packet(routing, tokens),
                "version": self.version if self.version is not None else 0}

    @abstractmethod
    def _first_turn(self) -> dict:
        """The first request (and the task's per-session state)."""

    @abstractmethod
    def _after(self, rows: Dict[int, dict]) -> Optional[dict]:
        """Record a turn's rows, run the environment; the next request or None."""

    @abstractmethod
    def samples(self) -> List[dict]:
        """One sample per row, prompt-major, once the session is done."""


class ReverseSession(Session):
    def _first_turn(self):
        return {"rows": list(enumerate(self.rows)), "steps": self.cfg.num_digits + 1,
                "stops": [vocab.EOS], "end": True}

    def _after(self, rows):
        self.answers = rows
        return None

    def samples(self):
        return [self._sample(self.rows[i] + r["ids"], r["logprobs"], r["mask"], r["routing"])
                for i, r in sorted(self.answers.items())]


class ToolSession(Session):
    """The tool protocol: the first assistant token must be the call (a one-token turn); the
    environment answers the rows that called; a row that did not has failed."""

    def _first_turn(self):
        self.calls: Dict[int, dict] = {}
        self.answers: Dict[int, dict] = {}
        return {"rows": list(enumerate(self.rows)), "steps": 1, "stops": [], "end": False}

    def _after(self, rows):
        if self.turns == 2:
            self.answers = rows
            return None
        self.calls = rows
        called = [(i, self.rows[i] + r["ids"] + task.observation_span(self.cfg, self.rows[i]))
                  for i, r in sorted(rows.items()) if r["ids"][0] == vocab.TOOL_CALL]
        if not called:
            return None
        return {"rows": called, "steps": self.cfg.num_digits + 1, "stops": [vocab.EOS],
                "end": True}

    def samples(self):
        span = self.cfg.num_digits + 2
        out = []
        for i, call in sorted(self.calls.items()):
            ans = self.answers.get(i)
            if ans is None:                  # no tool call: failed after one token
                out.append(self._sample(self.rows[i] + call["ids"], call["logprobs"],
                                        call["mask"], call["routing"]))
                continue
            tokens = self.rows[i] + call["ids"] + task.observation_span(self.cfg, self.rows[i]) \
                + ans["ids"]
            out.append(self._sample(tokens, call["logprobs"] + [0.0] * span + ans["logprobs"],
                                    call["mask"] + [0.0] * span + ans["mask"], ans["routing"]))
        return out


class ToraSession(Session):
    """The code turn (``CODE_TURN`` tokens at most, up to ``)\\n```` or ``<eos>``), the
    sandbox, the answer turn on the trajectory manager's re-tokenized ids (``ANSWER_TURN``).
    A row that stopped with ``<eos>`` answered without the tool, one that never closed its
    block has failed: both are done after one turn.

    A sample's ``tokens`` / ``rollout_logprobs`` / ``loss_mask`` are the session's active
    branch (the engine's ids where sampled). After a re-tokenization drift the branch that
    holds the engine's code turn was closed: it comes along in ``branches`` (same prompt,
    the code turn's routing), trained with the same reward. ``routing``: each position's
    experts from the first forward that fed it with this branch's context (the engine's
    prefix cache keeps the code turn's up to the fork)."""

    def _first_turn(self):
        tok = tora_task.tokenizer(self.cfg)
        self.manager = TrajectoryManager(tok.encode, tok.decode, template=tora_task.render)
        self.env = tora_task.default_env()
        self.sids = [f"{self.session_id}/{i}" for i in range(len(self.rows))]
        for sid, p in zip(self.sids, self.rows):
            self.manager.start(sid, tora_task.messages(p))
            if self.manager.prompt(sid) != p:
                raise ValueError(f"a ToRA prompt must be canonical text ids, got {p}")
        self.code_routing: Dict[int, torch.Tensor] = {}
        self.answer_routing: Dict[int, torch.Tensor] = {}
        self.observations = [""] * len(self.rows)
        return {"rows": list(enumerate(self.rows)), "steps": tora_task.CODE_TURN,
                "stops": [vocab.PY_CLOSE, vocab.EOS], "end": False}

    def _after(self, rows):
        if self.turns == 2:
            for i, r in rows.items():
                self.manager.add_assistant(self.sids[i], *_sampled(r))
                self.answer_routing[i] = r["routing"]
            return None
        called, codes = [], []
        for i, r in sorted(rows.items()):
            self.code_routing[i] = r["routing"]
            turn, turn_lps = _sampled(r)
            text = self.manager.add_assistant(self.sids[i], turn, turn_lps)
            if turn[-1] == vocab.PY_CLOSE:
                called.append(i)
                codes.append(tora_task.program(text))
        for i, text in zip(called, self.env.run_many(codes)):
            self.observations[i] = text
            self.manager.add_message(self.sids[i], "observation",
                                     tora_task.observation_content(text))
        if not called:
            return None
        return {"rows": [(i, self.manager.prompt(self.sids[i])) for i in called],
                "steps": tora_task.ANSWER_TURN, "stops": [vocab.EOS], "end": True}

    def samples(self):
        p, out = self.prompt_len, []
        for i, sid in enumerate(self.sids):
            *closed, main = self.manager.end(sid)
            routing = self.answer_routing.get(i, self.code_routing[i])
            s = self._sample(main["tokens"], main["rollout_logprobs"][p:],
                             main["loss_mask"][p:], routing,
                             rew=tora_task.reward(main["tokens"], p))
            s.update(session_id=sid, observation=self.observations[i], forks=len(closed),
                     branches=[{"tokens": b["tokens"], "prompt_len": p,
                                "rollout_logprobs": b["rollout_logprobs"][p:],
                                "loss_mask": b["loss_mask"][p:],
                                "routing": self._packet(self.code_routing[i], b["tokens"])}
                               for b in closed])
            out.append(s)
        return out


SESSIONS = {"reverse": ReverseSession, "tool": ToolSession, "tora": ToraSession}


def new_session(cfg, session_id: str, prompts: List[List[int]], group_size: int) -> Session:
    """The session driver for ``prompts`` (one task)."""
    return SESSIONS[task.task_of(prompts[0])](cfg, session_id, prompts, group_size)
