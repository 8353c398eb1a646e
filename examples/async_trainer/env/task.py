"""Three verifiable tasks in the 4-role template, with a binary reward (pass 1, fail 0).

Every trajectory is one token stream with role tokens::

    <system> TASK <user> ...question... <assistant>  ...policy tokens...

* ``reverse``: the question is d1..dn; the assistant answers ``dn..d1 <eos>``.
* ``tool``: the assistant must first emit ``<tool_call>``; the environment (not the policy)
  then appends ``<observation> o1..on <assistant>`` where ``o = lookup(d)``, and the assistant
  answers ``on..o1 <eos>``. Observation tokens are never sampled by the policy: they carry
  no rollout log-prob and are masked out of every loss (:func:`template_loss_mask`).
* ``tora``: a ToRA-style multi-turn task (``env/tora_task.py``): the assistant writes a
  ```` ```python ```` block, the sandbox runs it, its output comes back as an
  ``<observation>`` turn, and the assistant answers.

A ``reverse`` / ``tool`` trajectory that leaves the expected path (a wrong token, a tool call
where none is offered, no tool call where one is required) has reward 0. A tool session whose
first turn is not the call ends there (no second turn); a turn's positions after its stop
token are padded with ``<eos>`` and masked. The turns and the environment between them are
driven by ``rollout/sessions.py``.

Vocabulary: ``env/vocab.py`` (one for all tasks, so one model learns them all).
"""
from typing import List

import torch

from . import tora_task
from .vocab import (ASSISTANT, DEC0, EOS, ERR, MUL, N_SPECIAL, OBSERVATION, PAD, PY_CLOSE,  # noqa: F401
                    PY_OPEN, ROLE_NAMES, SYSTEM, TASK_REVERSE, TASK_TOOL, TASK_TORA, TOOL_CALL,
                    USER, vocab_size)

TASKS = ("reverse", "tool", "tora")
_TASK_TOKEN = {"reverse": TASK_REVERSE, "tool": TASK_TOOL}


def max_len(cfg) -> int:
    """Longest trajectory of any task: for tool, prompt (n + 4) + tool call, observation span
    (n + 2), answer (n + 1); for tora, ``tora_task.MAX_LEN``."""
    return max(3 * cfg.num_digits + 8, tora_task.MAX_LEN)


def make_prompt(cfg, task: str, gen: torch.Generator) -> List[int]:
    if task == "tora":
        return tora_task.make_prompt(gen)
    digits = torch.randint(0, cfg.vocab_digits, (cfg.num_digits,), generator=gen) + N_SPECIAL
    return [SYSTEM, _TASK_TOKEN[task], USER, *digits.tolist(), ASSISTANT]


def task_of(prompt: List[int]) -> str:
    return {TASK_TOOL: "tool", TASK_TORA: "tora"}.get(prompt[1], "reverse")


def _digits(prompt: List[int]) -> List[int]:
    return prompt[3:-1]


def tool_lookup(cfg, digits: List[int]) -> List[int]:
    """The tool's answer: every digit shifted by one (mod the digit alphabet)."""
    return [N_SPECIAL + (d - N_SPECIAL + 1) % cfg.vocab_digits for d in digits]


def observation_span(cfg, prompt: List[int]) -> List[int]:
    """What the environment appends after ``<tool_call>``: observation role, result, assistant."""
    return [OBSERVATION, *tool_lookup(cfg, _digits(prompt)), ASSISTANT]


def expected_completion(cfg, prompt: List[int]) -> List[int]:
    """The one passing continuation of ``prompt`` (environment tokens included; for tora the
    one that uses the tool)."""
    kind = task_of(prompt)
    if kind == "tora":
        return tora_task.expected_completion(prompt)
    if kind == "tool":
        obs = tool_lookup(cfg, _digits(prompt))
        return [TOOL_CALL, *observation_span(cfg, prompt), *reversed(obs), EOS]
    return [*reversed(_digits(prompt)), EOS]


def reward(cfg, tokens: List[int], prompt_len: int) -> float:
    """1.0 when the trajectory is exactly the passing one (then only padding), else 0.0; for
    tora, when its final answer is right (``tora_task.reward``)."""
    prompt = tokens[:prompt_len]
    if task_of(prompt) == "tora":
        return tora_task.reward(tokens, prompt_len)
    want = prompt + expected_completion(cfg, prompt)
    return 1.0 if tokens[:len(want)] == want else 0.0


def template_loss_mask(tokens: List[int], prompt_len: int) -> List[float]:
    """1 on assistant-produced tokens; 0 on the prompt and on environment (observation) spans.

    An observation span runs from ``<observation>`` through the ``<assistant>`` token that hands
    the turn back; both role tokens are written by the environment, not the policy.
    """
    mask, in_obs = [], False
    for i, t in enumerate(tokens):
        if i < prompt_len:
            mask.append(0.0)
            continue
        if t == OBSERVATION:
            in_obs = True
        mask.append(0.0 if in_obs else 1.0)
        if in_obs and t == ASSISTANT:
            in_obs = False
    return mask
