"""The ToRA-style task: the code block runs in the sandbox, its output comes back as a masked
observation turn, the reward is on the final answer; a bad program or a hostile one becomes
an observation and generation goes on."""
import sys

import pytest
import torch

from examples.async_trainer import task
from examples.async_trainer.config import TrainerConfig
from examples.async_trainer.tora_task import OBS_WIDTH, ToraEnv, ToraVocab, generate

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="sandbox: Linux")


class Oracle(torch.nn.Module):
    """All probability on ``script(prompt)``'s next token (environment tokens included)."""

    def __init__(self, vocab, script):
        super().__init__()
        self.vocab, self.script = vocab, script
        self.dummy = torch.nn.Parameter(torch.zeros(()))

    def forward(self, toks):
        b, t = toks.shape
        logits = torch.full((b, t, self.vocab.size), -30.0)
        for i, row in enumerate(toks.tolist()):
            p = row[:self.vocab.cfg.num_digits + 4]
            want = p + self.script(p)
            logits[i, -1, want[t] if t < len(want) else task.EOS] = 30.0
        return logits


@pytest.fixture(scope="module")
def setup():
    cfg = TrainerConfig().validate()
    vocab = ToraVocab(cfg)
    gen = torch.Generator().manual_seed(0)
    prompts = [vocab.make_prompt(gen) for _ in range(3)]
    return cfg, vocab, prompts


def test_the_tool_runs_and_its_output_is_a_masked_observation(setup):
    cfg, vocab, prompts = setup
    env = ToraEnv(vocab)
    out = generate(cfg, vocab, env, Oracle(vocab, vocab.expected_completion), prompts, 2,
                   gen=torch.Generator().manual_seed(1))
    assert len(out) == 6 and env.calls == 6 and env.runs == len({tuple(p) for p in prompts})
    code_len = cfg.num_digits + 3
    for s in out:
        p = s["tokens"][:s["prompt_len"]]
        n = vocab.prompt_number(p)
        assert s["observation"] == str(n * 7)                      # the sandbox computed it
        assert s["reward"] == 1.0
        assert s["tokens"][s["prompt_len"]:][:len(vocab.expected_completion(p))] \
            == vocab.expected_completion(p)
        obs = slice(code_len, code_len + OBS_WIDTH + 2)            # response positions
        assert s["loss_mask"][obs] == [0.0] * (OBS_WIDTH + 2)
        assert s["rollout_logprobs"][obs] == [0.0] * (OBS_WIDTH + 2)
        assert s["loss_mask"][:code_len] == [1.0] * code_len       # the code is the policy's
        answer = len(str(n * 7)) + 1
        assert s["loss_mask"][obs.stop:obs.stop + answer] == [1.0] * answer


def test_a_wrong_program_is_an_error_observation(setup):
    cfg, vocab, prompts = setup

    def swapped(p):          # the multiplication fragment first: int("") raises
        code = [vocab.PY_OPEN, vocab.TIMES7, *p[3:-1], vocab.PY_CLOSE]
        return code + vocab.observation_span("x") + vocab.answer(p) + [task.EOS]

    env = ToraEnv(vocab)
    out = generate(cfg, vocab, env, Oracle(vocab, swapped), prompts[:1], 1)
    (s,) = out
    assert s["observation"].startswith("ValueError: invalid literal") and env.errors == 1
    assert s["tokens"][s["prompt_len"] + cfg.num_digits + 3 + 1] == vocab.ERR
    # The oracle still copies the right answer: the reward is on the final answer only.
    assert s["reward"] == 1.0


def test_answers_without_the_tool_and_failures(setup):
    cfg, vocab, prompts = setup
    env = ToraEnv(vocab)
    direct = generate(cfg, vocab, env, Oracle(vocab, lambda p: vocab.answer(p) + [task.EOS]),
                      prompts[:1], 1)
    assert direct[0]["reward"] == 1.0 and env.calls == 0
    wrong = generate(cfg, vocab, env, Oracle(vocab, lambda p: [task.EOS]), prompts[:1], 1)
    assert wrong[0]["reward"] == 0.0


def test_hostile_code_becomes_an_observation(setup):
    cfg, vocab, _ = setup
    env = ToraEnv(vocab, timeout_s=1.0)
    text = env.run("while True:\n    pass")
    assert "TimeoutError" in text and env.timeouts == 1
    span = vocab.observation_span(text)
    assert span[0] == task.OBSERVATION and span[-1] == task.ASSISTANT and vocab.ERR in span
    text = env.run("import os\nfor i in range(32):\n    if os.fork() == 0:\n        os._exit(0)\n"
                   "print(len(open('/etc/hostname').read()) >= 0)")
    assert text == "True"                                       # forks are fine, reads too
    assert env.run("open('/tmp/tora-escape', 'w')").startswith("PermissionError")
