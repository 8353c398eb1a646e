"""A ToRA-style tool-integrated task: the assistant writes a fenced ```python block, the
environment runs it in the sandbox (``sandbox.run_python``), and its output comes back as an
``<observation>`` turn that is masked out of the loss; the reward is on the final answer.

Token stream (ids above the base task's vocabulary, see :class:`ToraVocab`)::

    <system> TORA <user> d1 d2 d3 <assistant>
        PY_OPEN d1 d2 d3 TIMES7 PY_CLOSE                       policy: the code block
        <observation> D D D D . . <assistant>                 environment: its stdout
        D D D D <eos>                                         policy: the answer

The code block renders as text (``PY_OPEN`` = ``"```python\\nprint(int(\\""``, a digit token
= its digit, ``TIMES7`` = ``"\\") * 7"``, ``PY_CLOSE`` = ``")\\n```"``), so the program is
``print(int("d1d2d3") * 7)``. The answer is the decimal digits of ``int(d1d2d3) * 7`` (the
prompt digits read as a decimal number): hard to compute token by token, easy to copy from
the tool's output. Reward 1 when the last assistant turn is exactly those digits and
``<eos>``, with or without the tool. A code block in the wrong order is still run: its
``SyntaxError`` (or whatever the program does) is the observation.

The observation span has a fixed width (``OBS_WIDTH`` + 2 tokens) so that a batch of rows
stays aligned: stdout digits become ``D0..D9``, any other character run one ``ERR``, the rest
is padding; it is truncated to the width. Every environment token has mask 0 and log-prob 0.

Runs are cached by program text (``ToraEnv``): the sandbox is deterministic for these
programs and starts fresh each time, and a batch repeats a few programs many times.
"""
from typing import Dict, List, Optional, Tuple

import torch

from . import task
from .sandbox import run_python

OBS_WIDTH = 6
MULTIPLIER = 7
FRAGMENTS = ('```python\nprint(int("', '") * 7', ')\n```')


class ToraVocab:
    """Token ids of the ToRA task, from ``base`` (default: the base task's vocabulary size)."""

    def __init__(self, cfg, base: Optional[int] = None):
        self.cfg = cfg
        self.base = task.vocab_size(cfg) if base is None else base
        (self.TASK_TORA, self.PY_OPEN, self.TIMES7, self.PY_CLOSE,
         self.ERR) = range(self.base, self.base + 5)
        self.D0 = self.base + 5                              # decimal digits D0..D9
        self.size = self.D0 + 10

    def digit(self, ch: str) -> int:
        return self.D0 + int(ch)

    def make_prompt(self, gen: torch.Generator) -> List[int]:
        p = task.make_prompt(self.cfg, "reverse", gen)
        p[1] = self.TASK_TORA
        return p

    def prompt_number(self, prompt: List[int]) -> int:
        return int("".join(str(d - task.N_SPECIAL) for d in prompt[3:-1]))

    def answer(self, prompt: List[int]) -> List[int]:
        return [self.digit(c) for c in str(self.prompt_number(prompt) * MULTIPLIER)]

    def code_tokens(self, prompt: List[int]) -> List[int]:
        return [self.PY_OPEN, *prompt[3:-1], self.TIMES7, self.PY_CLOSE]

    def render_code(self, tokens: List[int]) -> str:
        """Program text of a code block's tokens (``PY_OPEN`` .. ``PY_CLOSE``)."""
        frag = {self.PY_OPEN: FRAGMENTS[0], self.TIMES7: FRAGMENTS[1], self.PY_CLOSE: FRAGMENTS[2]}
        out = []
        for t in tokens:
            if t in frag:
                out.append(frag[t])
            elif task.N_SPECIAL <= t < task.vocab_size(self.cfg):
                out.append(str(t - task.N_SPECIAL))
            elif self.D0 <= t < self.D0 + 10:
                out.append(str(t - self.D0))
            else:
                out.append("?")                              # any other token: not code
        text = "".join(out)
        body = text.split("```python\n", 1)[-1]
        return body.rsplit("\n```", 1)[0]

    def observation_span(self, text: str) -> List[int]:
        """``<observation>`` + the output as ``OBS_WIDTH`` tokens (padded) + ``<assistant>``."""
        toks: List[int] = []
        for ch in text.strip():
            if ch.isdigit() and ch.isascii():
                toks.append(self.digit(ch))
            elif not toks or toks[-1] != self.ERR:
                toks.append(self.ERR)
        toks = toks[:OBS_WIDTH]
        return [task.OBSERVATION, *toks, *[task.PAD] * (OBS_WIDTH - len(toks)), task.ASSISTANT]

    def expected_completion(self, prompt: List[int]) -> List[int]:
        out = str(self.prompt_number(prompt) * MULTIPLIER)
        return [*self.code_tokens(prompt), *self.observation_span(out), *self.answer(prompt),
                task.EOS]

    def reward(self, tokens: List[int], prompt_len: int) -> float:
        """1.0 when the last assistant turn is exactly the answer digits then ``<eos>``."""
        prompt, rest = tokens[:prompt_len], tokens[prompt_len:]
        if task.ASSISTANT in rest:
            rest = rest[len(rest) - rest[::-1].index(task.ASSISTANT):]
        want = self.answer(prompt) + [task.EOS]
        return 1.0 if rest[:len(want)] == want and all(t == task.PAD for t in rest[len(want):]) \
            else 0.0


class ToraEnv:
    """Runs code blocks in the sandbox (cached by program text) and counts what happened."""

    def __init__(self, vocab: ToraVocab, *, timeout_s: float = 3.0, output_limit: int = 256,
                 cache_size: int = 4096):
        self.vocab, self.timeout_s, self.output_limit = vocab, timeout_s, output_limit
        self.cache: Dict[str, str] = {}
        self.cache_size = cache_size
        self.calls = self.runs = self.errors = self.timeouts = 0

    def run(self, code: str) -> str:
        """The observation text of ``code`` (never raises for anything the code does)."""
        self.calls += 1
        if code in self.cache:
            return self.cache[code]
        res = run_python(code, timeout_s=self.timeout_s, output_limit=self.output_limit)
        self.runs += 1
        self.errors += not res.ok
        self.timeouts += res.timed_out
        text = res.observation(self.output_limit)
        if len(self.cache) < self.cache_size:
            self.cache[code] = text
        return text

    def step(self, code_tokens: List[int]) -> Tuple[str, List[int]]:
        text = self.run(self.vocab.render_code(code_tokens))
        return text, self.vocab.observation_span(text)


@torch.no_grad()
def generate(cfg, vocab: ToraVocab, env: ToraEnv, model, prompts: List[List[int]],
             group_size: int, *, gen=None, greedy: bool = False) -> List[Dict]:
    """``group_size`` multi-turn trajectories per prompt, as ``rollout.generate`` returns them
    (``tokens``, ``prompt_len``, ``rollout_logprobs`` and ``loss_mask`` per response position,
    ``reward``, ``observation`` text). Turn 1 samples up to the code block's length; rows
    that closed it get the observation span; the answer turn follows. A row that emits
    ``<eos>`` first is answering without the tool: it is done at once."""
    device = next(model.parameters()).device
    rows = [p for p in prompts for _ in range(group_size)]
    toks = torch.tensor(rows, device=device)
    n, prompt_len = toks.shape
    done = torch.zeros(n, dtype=torch.bool, device=device)
    lps, masks = [], []
    code_len = cfg.num_digits + 3
    answer_len = len(str((10 ** cfg.num_digits - 1) * MULTIPLIER)) + 1
    observations = [""] * n

    def sample(steps, stop_at):
        nonlocal toks, done
        for _ in range(steps):
            logp = torch.log_softmax(model(toks)[:, -1].float(), -1)
            if greedy:
                nxt = logp.argmax(-1, keepdim=True)
            else:
                nxt = torch.multinomial(logp.exp().cpu(), 1, generator=gen).to(logp.device)
            lp = logp.gather(-1, nxt).squeeze(-1)
            nxt = nxt.squeeze(-1)
            live = ~done
            nxt = torch.where(live, nxt, torch.full_like(nxt, task.PAD))
            lps.append(torch.where(live, lp, torch.zeros_like(lp)))
            masks.append(live.float())
            toks = torch.cat([toks, nxt[:, None]], 1)
            done = done | (nxt == stop_at) | (nxt == task.EOS)

    sample(code_len, vocab.PY_CLOSE)
    called = done & (toks[:, -code_len:] == vocab.PY_CLOSE).any(1)
    span_len = OBS_WIDTH + 2
    env_toks = torch.full((n, span_len), task.PAD, dtype=toks.dtype, device=device)
    for i in torch.nonzero(called).flatten().tolist():
        code = toks[i, prompt_len:].tolist()
        observations[i], span = env.step(code[:code.index(vocab.PY_CLOSE) + 1])
        env_toks[i] = torch.tensor(span, device=device)
    toks = torch.cat([toks, env_toks], 1)
    lps.extend(torch.zeros(n, device=device) for _ in range(span_len))
    masks.extend(torch.zeros(n, device=device) for _ in range(span_len))
    done = ~called          # answered without the tool, or never closed the block: finished
    sample(answer_len, task.EOS)
    lp_rows = torch.stack(lps, 1).float().cpu().tolist()
    mask_rows = torch.stack(masks, 1).cpu().tolist()
    out = []
    for i, t in enumerate(toks.cpu().tolist()):
        out.append({"tokens": t, "prompt_len": prompt_len, "rollout_logprobs": lp_rows[i],
                    "loss_mask": mask_rows[i], "task": "tora", "observation": observations[i],
                    "reward": vocab.reward(t, prompt_len)})
    return out
