"""A ToRA-style tool-integrated task: the assistant writes a fenced ```python block, the
environment runs it in the sandbox (``sandbox.run_python``), and its output comes back as an
``<observation>`` turn that is masked out of the loss; the reward is on the final answer.

The question is a product ``a*b`` (``a``, ``b`` in 2..9, ``A_RANGE`` / ``B_RANGE``): a tiny
model does not learn the table within the demo's budget, but learns to copy the question into
code and the tool's output into its answer. Token stream (ids in ``env/vocab.py``)::

    <system> <tora> <user> 7 * 6 <assistant>                   prompt
        ```python\nprint(  7 * 6  )\n```                      policy: the code block
        <observation> 4 2 <eos> <eos> <assistant>              environment: its stdout
        4 2 <eos>                                              policy: the answer

so the program is ``print(7*6)``. Every token has a text (:data:`TOKENIZER`), and the
conversation is also kept as text messages by the trajectory manager (``rollout/trajectory.py``),
which re-tokenizes it before each turn. Text to ids is canonical: a digit character is always
a ``DEC`` digit token; the reverse / tool tasks' digit tokens (0 .. ``vocab_digits`` - 1)
print as the same digits, so an engine that writes ``4`` with one of those in its code
produces ids that re-tokenization does not reproduce (drift: the manager forks a branch).

The session itself (turns through the router, the sandbox between them, the trajectory
manager) is driven by ``sessions.ToraSession``; this module is the task: prompts, text,
environment, reward.

The observation span has a fixed width (``OBS_WIDTH`` + 2 tokens): stdout digits stay
digits, any other character run becomes one ``?`` (ERR), the rest is ``<eos>`` padding; it
is truncated to the width. Reward 1 when the last assistant turn is exactly the product's
digits then ``<eos>`` (with or without the tool).

Runs are cached by program text (:class:`ToraEnv`): the sandbox is deterministic for these
programs and starts fresh each time, and a batch repeats programs. Only a run that exited 0
within its limits is cached; any other is run again when the program comes back.
"""
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, List, Optional, Tuple

import torch

from . import vocab
from .sandbox import SandboxUnavailable, run_python

A_RANGE = (2, 10)              # the question a*b: a, b drawn from these ranges
B_RANGE = (2, 10)
_DIGITS = (len(str(A_RANGE[1] - 1)), len(str(B_RANGE[1] - 1)),
           len(str((A_RANGE[1] - 1) * (B_RANGE[1] - 1))))
OBS_WIDTH = _DIGITS[2] + 1     # stdout tokens of an observation (an answer and one more)
CODE_TURN = _DIGITS[0] + _DIGITS[1] + 3    # ```python\nprint( a * b )\n```
ANSWER_TURN = _DIGITS[2] + 1   # the product's digits and <eos>
PROMPT_LEN = _DIGITS[0] + _DIGITS[1] + 5
MAX_LEN = PROMPT_LEN + CODE_TURN + OBS_WIDTH + 2 + ANSWER_TURN
ROLES = {"system": "<system>", "user": "<user>", "assistant": "<assistant>",
         "observation": "<observation>"}


class Tokenizer:
    """Text of every token and the canonical text -> ids map (longest match; the pieces are
    prefix-free, so a text has exactly one parse)."""

    def __init__(self, base_digits: int = 10):
        self.pieces: Dict[int, str] = {
            vocab.SYSTEM: "<system>", vocab.USER: "<user>", vocab.ASSISTANT: "<assistant>",
            vocab.OBSERVATION: "<observation>", vocab.EOS: "<eos>", vocab.TOOL_CALL: "<tool_call>",
            vocab.TASK_REVERSE: "<reverse>", vocab.TASK_TOOL: "<tool>", vocab.TASK_TORA: "<tora>",
            vocab.PY_OPEN: "```python\nprint(", vocab.MUL: "*", vocab.PY_CLOSE: ")\n```",
            vocab.ERR: "?"}
        self.pieces.update({vocab.DEC0 + d: str(d) for d in range(10)})
        self.canonical = {text: i for i, text in self.pieces.items()}
        # The reverse / tool digits: the same text as the decimal digits, never produced
        # by encode (non-canonical ids); past 9 they get pieces of their own.
        self.base_digits(base_digits)

    def base_digits(self, n: int) -> None:
        for d in range(n):
            self.pieces[vocab.N_SPECIAL + d] = str(d) if d < 10 else f"<d{d}>"
            if d >= 10:
                self.canonical[f"<d{d}>"] = vocab.N_SPECIAL + d
        self._by_first: Dict[str, List[str]] = {}
        for text in self.canonical:
            self._by_first.setdefault(text[0], []).append(text)

    def decode(self, ids: List[int]) -> str:
        return "".join(self.pieces[i] for i in ids)

    def encode(self, text: str) -> List[int]:
        out, i = [], 0
        while i < len(text):
            piece = next((p for p in self._by_first.get(text[i], ()) if text.startswith(p, i)),
                         None)
            if piece is None:
                raise ValueError(f"no token for {text[i:i + 12]!r}")
            out.append(self.canonical[piece])
            i += len(piece)
        return out


TOKENIZER = Tokenizer()


def tokenizer(cfg) -> Tokenizer:
    """The tokenizer for ``cfg`` (its reverse / tool digits printable)."""
    if cfg.vocab_digits > 10 and vocab.N_SPECIAL + cfg.vocab_digits - 1 not in TOKENIZER.pieces:
        TOKENIZER.base_digits(cfg.vocab_digits)
    return TOKENIZER


def make_prompt(gen: torch.Generator) -> List[int]:
    a = int(torch.randint(*A_RANGE, (1,), generator=gen))
    b = int(torch.randint(*B_RANGE, (1,), generator=gen))
    question = [vocab.DEC0 + int(c) for c in str(a)] + [vocab.MUL, vocab.DEC0 + b]
    return [vocab.SYSTEM, vocab.TASK_TORA, vocab.USER, *question, vocab.ASSISTANT]


def question(prompt: List[int]) -> str:
    return TOKENIZER.decode(prompt[3:-1])


def product(prompt: List[int]) -> int:
    a, b = question(prompt).split("*")
    return int(a) * int(b)


def messages(prompt: List[int]) -> List[dict]:
    """The prompt as the trajectory manager's messages (renders back to exactly its ids)."""
    return [{"role": "system", "content": TOKENIZER.pieces[prompt[1]]},
            {"role": "user", "content": question(prompt)}]


def render(msgs: List[dict]) -> str:
    """The 4-role template as text, ending with the assistant header (generation prompt)."""
    return "".join(ROLES[m["role"]] + m["content"] for m in msgs) + ROLES["assistant"]


def observation_content(stdout: str) -> str:
    """The observation turn's text: ``OBS_WIDTH`` pieces of ``stdout`` (digits; any other
    run of characters one ``?``), padded with ``<eos>``."""
    pieces: List[str] = []
    for ch in stdout.strip():
        if ch.isdigit() and ch.isascii():
            pieces.append(ch)
        elif not pieces or pieces[-1] != "?":
            pieces.append("?")
    pieces = pieces[:OBS_WIDTH]
    return "".join(pieces) + "<eos>" * (OBS_WIDTH - len(pieces))


def program(code_turn: str) -> str:
    """The program of a code turn's text: the body of its last ```python block."""
    body = code_turn.rsplit("```python\n", 1)[-1]
    return body[:-len("\n```")] if body.endswith("\n```") else body


def expected_completion(prompt: List[int]) -> List[int]:
    """The passing continuation that uses the tool (environment tokens included)."""
    answer = str(product(prompt))
    code = [vocab.PY_OPEN, *prompt[3:-1], vocab.PY_CLOSE]
    obs = TOKENIZER.encode(observation_content(answer))
    return [*code, vocab.OBSERVATION, *obs, vocab.ASSISTANT, *TOKENIZER.encode(answer), vocab.EOS]


def final_turn(tokens: List[int], prompt_len: int) -> List[int]:
    """The last assistant turn of a trajectory: after the last ``<assistant>`` (the prompt's
    or an observation's), through the first ``<eos>``."""
    rest = tokens[prompt_len:]
    if vocab.ASSISTANT in rest:
        rest = rest[len(rest) - rest[::-1].index(vocab.ASSISTANT):]
    return rest[:rest.index(vocab.EOS) + 1] if vocab.EOS in rest else rest


def reward(tokens: List[int], prompt_len: int) -> float:
    """1.0 when the last assistant turn reads exactly the product then ``<eos>`` (on the
    text: any digit tokens), else 0.0."""
    turn = final_turn(tokens, prompt_len)
    try:
        text = TOKENIZER.decode(turn)
    except KeyError:
        return 0.0
    return 1.0 if text == f"{product(tokens[:prompt_len])}<eos>" else 0.0


class ToraEnv:
    """Runs programs in the sandbox (cached by program text, distinct ones concurrently:
    each is its own process) and counts what happened."""

    def __init__(self, *, timeout_s: float = 3.0, output_limit: int = 256,
                 cache_size: int = 8192, workers: int = 4):
        self.timeout_s, self.output_limit = timeout_s, output_limit
        self.cache: Dict[str, str] = {}
        self.cache_size, self.workers = cache_size, workers
        self.calls = self.runs = self.errors = self.timeouts = 0

    def _run(self, code: str) -> Tuple[str, bool]:
        """The observation, and whether it is the program's answer (cacheable): only a run
        that exited 0 within every limit is; a timeout, a limit, a signal, an error exit or a
        sandbox failure may be the machine's doing (load, a concurrent run) and is run again
        next time."""
        try:
            res = run_python(code, timeout_s=self.timeout_s, output_limit=self.output_limit)
        except SandboxUnavailable:
            raise                        # the machine's configuration, not the program
        except Exception as e:           # a sandbox bug must not end the rollout
            self.errors += 1
            return f"SandboxError: {type(e).__name__}", False
        self.errors += not res.ok
        self.timeouts += res.timed_out
        return res.observation(self.output_limit), res.ok

    def run_many(self, programs: List[str]) -> List[str]:
        """The observation text of every program (never raises for anything it does)."""
        self.calls += len(programs)
        todo = sorted({p for p in programs if p not in self.cache})
        if len(todo) > 1 and self.workers > 1:
            with ThreadPoolExecutor(min(self.workers, len(todo))) as pool:
                texts = list(pool.map(self._run, todo))
        else:
            texts = [self._run(p) for p in todo]
        self.runs += len(todo)
        fresh = {p: text for p, (text, _) in zip(todo, texts)}
        for p, (text, answer) in zip(todo, texts):
            if answer and len(self.cache) < self.cache_size:
                self.cache[p] = text
        return [fresh[p] if p in fresh else self.cache[p] for p in programs]

    def run(self, code: str) -> str:
        return self.run_many([code])[0]


_ENV: Optional[ToraEnv] = None


def default_env() -> ToraEnv:
    """This process's environment (one cache per engine / rollout process / trainer)."""
    global _ENV
    if _ENV is None:
        _ENV = ToraEnv()
    return _ENV
