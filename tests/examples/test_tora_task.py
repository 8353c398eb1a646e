"""The ToRA-style task: the code block runs in the sandbox, its output comes back as a masked
observation turn, the reward is on the final answer; every turn goes through the trajectory
manager, and a re-tokenization drift forks a branch that is trained on the engine's ids; a
bad program or a hostile one becomes an observation and generation goes on."""
import os
import sys

import pytest
import torch

from examples.async_trainer.env import task, tora_task
from examples.async_trainer.train.batch import fused_linear_grpo_loss, policy_step, sft_sample
from examples.async_trainer.config import TrainerConfig
from examples.async_trainer.model import policy
from examples.async_trainer.rollout.local import generate
from examples.async_trainer.env.tora_task import OBS_WIDTH, TOKENIZER, ToraEnv
from glm_kernels.topk import routing_header
from tests.examples._policies import ScriptedPolicy

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="sandbox: Linux")
SPAN = OBS_WIDTH + 2


def Oracle(cfg, script):
    """All probability on ``script(prompt)``'s next token at each length."""
    return ScriptedPolicy(cfg, tora_task.PROMPT_LEN, script)


def _answer(p):
    return TOKENIZER.encode(str(tora_task.product(p))) + [task.EOS]


def _base_digit_code(p):
    """The right program, its digits written with the reverse task's digit tokens: the same
    text, ids that re-tokenization does not reproduce."""
    code = [task.N_SPECIAL + (t - task.DEC0) if task.DEC0 <= t < task.DEC0 + 10 else t
            for t in p[3:-1]]
    return [task.PY_OPEN, *code, task.PY_CLOSE]


@pytest.fixture(scope="module")
def setup():
    cfg = TrainerConfig(tasks="tora", vocab_digits=10).validate()
    gen = torch.Generator().manual_seed(0)
    prompts = [task.make_prompt(cfg, "tora", gen) for _ in range(3)]
    return cfg, prompts


def test_tokenizer_is_a_prefix_code_and_reverse_digits_are_not_canonical(setup):
    cfg, prompts = setup
    pieces = list(TOKENIZER.canonical)
    assert not [(a, b) for a in pieces for b in pieces if a != b and b.startswith(a)]
    for p in prompts:
        full = p + tora_task.expected_completion(p)
        assert TOKENIZER.encode(TOKENIZER.decode(full)) == full
        assert sft_sample(cfg, p)["tokens"] == full
        assert task.reward(cfg, full, len(p)) == 1.0
        drifted = p + _base_digit_code(p)
        assert TOKENIZER.decode(drifted) == TOKENIZER.decode(p + tora_task.expected_completion(
            p)[:len(drifted) - len(p)])
        assert TOKENIZER.encode(TOKENIZER.decode(drifted)) != drifted


def test_the_tool_runs_and_its_output_is_a_masked_observation(setup):
    cfg, prompts = setup
    env = tora_task.default_env()
    runs = env.runs
    out = generate(cfg, Oracle(cfg, tora_task.expected_completion), prompts, 2,
                   gen=torch.Generator().manual_seed(1), session="req7")
    assert len(out) == 6 and env.runs - runs <= len({tuple(p) for p in prompts})
    code_len = tora_task.CODE_TURN
    for j, s in enumerate(out):
        p = s["tokens"][:s["prompt_len"]]
        assert s["observation"] == str(tora_task.product(p))          # the sandbox computed it
        assert s["reward"] == 1.0 and s["forks"] == 0 and s["branches"] == []
        assert s["session_id"] == f"req7/{j}"
        assert s["tokens"] == p + tora_task.expected_completion(p)
        obs = slice(code_len, code_len + SPAN)                        # response positions
        assert s["tokens"][len(p) + code_len] == task.OBSERVATION
        assert s["loss_mask"][obs] == [0.0] * SPAN
        assert s["rollout_logprobs"][obs] == [0.0] * SPAN
        assert s["loss_mask"][:code_len] == [1.0] * code_len          # the code is the policy's
        assert s["loss_mask"][obs.stop:] == [1.0] * len(_answer(p))
        assert s["loss_mask"] == task.template_loss_mask(s["tokens"], len(p))[len(p):]


def test_drift_forks_and_training_uses_the_engines_ids(setup):
    cfg, prompts = setup

    def drifting(p):
        return _base_digit_code(p) + tora_task.expected_completion(p)[tora_task.CODE_TURN:]

    out = generate(cfg, Oracle(cfg, drifting), prompts[:2], 2)
    for s in out:
        p = s["tokens"][:s["prompt_len"]]
        assert s["observation"] == str(tora_task.product(p))          # the same program text
        assert s["reward"] == 1.0 and s["forks"] == 1
        (closed,) = s["branches"]
        # The closed branch: the engine's own code ids, sampled (mask 1), nothing after.
        assert closed["tokens"] == p + _base_digit_code(p)
        assert closed["loss_mask"] == [1.0] * tora_task.CODE_TURN
        # The active branch: the re-tokenized code (never sampled: mask 0), the observation
        # (mask 0) and the answer the engine sampled on that context (mask 1).
        assert s["tokens"] == p + tora_task.expected_completion(p)
        n_ctx = tora_task.CODE_TURN + SPAN
        assert s["loss_mask"] == [0.0] * n_ctx + [1.0] * len(_answer(p))
        assert all(lp == 0.0 for lp in s["rollout_logprobs"][:n_ctx])
    # Training takes both branches, each with its sample's advantage.
    model = policy.new_policy(cfg)
    opt = policy.make_optimizer(model, cfg, 1e-3)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
    row_of = {id(s): i for i, s in enumerate(out)}
    seen = []
    loss_fn = fused_linear_grpo_loss(cfg, adv, row_of)

    def spy(model, mb, batch):
        seen.extend(mb)
        return loss_fn(model, mb, batch)

    sums = policy_step(cfg, model, opt, out, spy)
    assert len(seen) == 8 and sum(1 for s in seen if "origin" in s) == 4
    assert sums["tokens"] == sum(sum(s["loss_mask"]) + sum(s["branches"][0]["loss_mask"])
                                 for s in out)


def test_routing_covers_every_fed_position_of_every_branch(setup):
    cfg, prompts = setup
    torch.manual_seed(0)
    model = policy.new_policy(cfg).eval()
    out = generate(cfg, model, prompts, 4, gen=torch.Generator().manual_seed(3))
    assert len({len(s["tokens"]) for s in out}) > 1            # turns of several lengths
    for s in out:
        for seq in [s] + s["branches"]:
            head = routing_header(seq["routing"])
            assert (head.n_layers, head.n_tokens, head.k, head.n_experts) == (
                cfg.n_layers - cfg.dense_layers, len(seq["tokens"]) - 1, cfg.top_k, cfg.n_experts)
            assert len(seq["loss_mask"]) == len(seq["tokens"]) - s["prompt_len"]


def test_a_wrong_program_is_an_error_observation(setup):
    cfg, prompts = setup

    def starred(p):          # print(*3) for print(3*..): a TypeError
        code = [task.PY_OPEN, task.MUL, p[3], task.PY_CLOSE]
        obs = TOKENIZER.encode(tora_task.observation_content("x"))
        return code + [task.OBSERVATION, *obs, task.ASSISTANT] + _answer(p)

    (s,) = generate(cfg, Oracle(cfg, starred), prompts[:1], 1)
    assert s["observation"].startswith("TypeError") and s["forks"] == 0
    assert s["tokens"][s["prompt_len"] + 4:s["prompt_len"] + 6] == [task.OBSERVATION, task.ERR]
    assert s["reward"] == 1.0          # the reward is on the final answer only


def test_answers_without_the_tool_and_failures(setup):
    cfg, prompts = setup
    env = tora_task.default_env()
    calls = env.calls
    (direct,) = generate(cfg, Oracle(cfg, _answer), prompts[:1], 1)
    assert direct["reward"] == 1.0 and env.calls == calls and direct["observation"] == ""
    (wrong,) = generate(cfg, Oracle(cfg, lambda p: [task.EOS]), prompts[:1], 1)
    assert wrong["reward"] == 0.0
    (unclosed,) = generate(cfg, Oracle(cfg, lambda p: [task.PY_OPEN] * 9), prompts[:1], 1)
    assert unclosed["reward"] == 0.0 and env.calls == calls
    assert len(unclosed["tokens"]) == tora_task.PROMPT_LEN + tora_task.CODE_TURN


def test_hostile_code_becomes_an_observation():
    env = ToraEnv(timeout_s=1.0)
    text = env.run("while True:\n    pass")
    assert "TimeoutError" in text and env.timeouts == 1
    assert tora_task.observation_content(text).startswith("?")
    text = env.run("import os\nfor i in range(32):\n    if os.fork() == 0:\n        os._exit(0)\n"
                   "print(len(open(os.__file__).read()) > 0)")
    assert text == "True"                                       # forks are fine, reads too
    # the sandbox's root has no /tmp (test_sandbox.py tries every way out)
    assert env.run("open('/tmp/tora-escape', 'w')").startswith("FileNotFoundError")
    assert not os.path.exists("/tmp/tora-escape")
    assert env.run_many(["print(6*7)", "print(6*7)"]) == ["42", "42"] and env.runs == 4
