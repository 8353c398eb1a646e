"""``--batch-invariant`` in the example trainer: the invariant forward's primitives, a KV-cache
decode bitwise equal to the full forward (any batch, order, thread count), the rollout's
recorded log-probs bitwise equal to the trainer's, and short runs (process and Ray rollout
backends) whose every step logs logprob_max_abs_diff == 0.0 and pop_frac == 0."""
import json
import re
from pathlib import Path

import pytest
import torch

import glm_kernels
from examples.async_trainer.env import task
from examples.async_trainer.model import invariant
from examples.async_trainer.__main__ import parse
from examples.async_trainer.train.batch import collate, replay_tap
from examples.async_trainer.train.behaviour import BehaviourPolicy
from examples.async_trainer.config import TrainerConfig
from examples.async_trainer.model.tinylm import TinyLM, routing_tap
from examples.async_trainer.rollout.local import generate

ROOT = Path(__file__).resolve().parents[2]


def _model(cfg, seed=0):
    torch.manual_seed(seed)
    model = TinyLM(cfg, task.vocab_size(cfg)).eval()
    with torch.no_grad():               # a trained-looking balancing bias: routing near ties
        for moe in (m for m in model.modules() if hasattr(m, "route_bias")):
            moe.route_bias.copy_(0.05 * torch.randn_like(moe.route_bias))
    return model


@pytest.mark.parametrize("n", [0, 1, 5, 64, 65, 130])
def test_tiles_give_each_row_the_bits_it_gets_alone(n):
    torch.manual_seed(n)
    x, w = torch.randn(n, 48), torch.randn(48, 96)
    out = invariant.matmul(x, w)
    assert out.shape == (n, 96)
    torch.testing.assert_close(out, x @ w, rtol=1e-5, atol=1e-5)
    for i in range(n):
        assert torch.equal(invariant.matmul(x[i:i + 1], w)[0], out[i])


def test_tree_sum_is_a_sum_and_ignores_zero_padding():
    torch.manual_seed(0)
    for n in (1, 2, 3, 12, 17, 64):
        x = torch.randn(5, n, dtype=torch.float64)
        torch.testing.assert_close(invariant.tree_sum(x), x.sum(-1))
        padded = torch.cat([x, torch.zeros(5, 100 - n, dtype=torch.float64)], 1)
        x32, p32 = x.float(), padded.float()
        assert torch.equal(invariant.tree_sum(x32), invariant.tree_sum(p32))
    assert invariant.tree_sum(torch.zeros(3, 0)).tolist() == [0.0, 0.0, 0.0]
    x = torch.randn(4, 6, 7)
    torch.testing.assert_close(invariant.tree_sum(x, dim=1), x.sum(1))


def test_layer_norm_matches_torch():
    torch.manual_seed(0)
    norm = torch.nn.LayerNorm(48)
    with torch.no_grad():
        norm.weight.add_(torch.randn(48) * 0.1)
        norm.bias.add_(torch.randn(48) * 0.1)
    x = torch.randn(7, 5, 48) * 3 + 1
    torch.testing.assert_close(invariant.layer_norm(x, norm), norm(x), rtol=1e-5, atol=1e-5)


def test_invariant_forward_is_the_same_model():
    """The invariant path computes the default model's function (fp32 tolerance), and only
    inside glm_kernels.batch_invariant(); a KV cache outside it is refused."""
    cfg = TrainerConfig().validate()
    model = _model(cfg)
    toks = torch.randint(0, task.vocab_size(cfg), (6, task.max_len(cfg)))
    with torch.no_grad():
        default = model(toks)
        with glm_kernels.batch_invariant():
            fixed = model(toks)
    torch.testing.assert_close(fixed, default, rtol=1e-5, atol=1e-5)
    assert not torch.equal(fixed, default)          # really another path
    with pytest.raises(ValueError, match="KV cache"):
        model(toks, cache=invariant.KVCache())


def _decode(model, toks, prefill: int):
    """Logits of every position of ``toks`` [n, T]: a prefill of ``prefill`` positions, then
    one position per step against the KV cache (as the rollout decodes)."""
    cache = invariant.KVCache()
    out = [model(toks[:, :prefill], cache=cache)]
    for t in range(prefill, toks.shape[1]):
        out.append(model(toks[:, t:t + 1], cache=cache))
    assert cache.length == toks.shape[1]
    return torch.cat(out, 1)


@pytest.mark.parametrize("rows,threads", [([5], (1, 2)), ([2, 7, 4], (2, 1)),
                                          ([6, 0, 3, 1, 7, 2, 5, 4], (1, 1))])
def test_kv_cache_decode_equals_full_forward_bitwise(rows, threads):
    """Decode (batch sizes 1 / 3 / 8, shuffled, its own thread count) vs the trainer's full
    forward of all 8 rows (another thread count): logits and log-probs bit for bit."""
    cfg = TrainerConfig().validate()
    model = _model(cfg, seed=len(rows))
    gen = torch.Generator().manual_seed(len(rows))
    width = task.max_len(cfg)
    toks = torch.randint(0, task.vocab_size(cfg), (8, width), generator=gen)
    previous = torch.get_num_threads()
    try:
        with torch.no_grad(), glm_kernels.batch_invariant():
            torch.set_num_threads(threads[0])
            full = model(toks[:, :-1])
            lp_full = invariant.token_logprobs(full, toks[:, 1:])
            torch.set_num_threads(threads[1])
            for prefill in (1, 4, width // 2):
                dec = _decode(model, toks[rows, :-1], prefill)
                assert torch.equal(dec, full[rows])
                assert torch.equal(invariant.token_logprobs(dec, toks[rows, 1:]), lp_full[rows])
    finally:
        torch.set_num_threads(previous)


def test_row_alone_vs_padded_in_a_wide_shuffled_batch():
    """A sequence alone at its own length vs inside a batch of 64 right-padded rows."""
    cfg = TrainerConfig().validate()
    model = _model(cfg, seed=3)
    width = task.max_len(cfg)
    toks = torch.randint(0, task.vocab_size(cfg), (64, width))
    perm = torch.randperm(64)
    with torch.no_grad(), glm_kernels.batch_invariant():
        batch = model(toks)
        shuffled = model(toks[perm])
        assert torch.equal(shuffled, batch[perm])
        for i, length in ((0, 1), (9, 7), (40, width)):
            assert torch.equal(model(toks[i:i + 1, :length])[0], batch[i, :length])


@pytest.mark.parametrize("tasks", ["reverse,tool", "tora"])
def test_rollout_logprobs_equal_the_trainers_bitwise(tasks):
    """generate() on the invariant path records log-probs (and routing) that the trainer's
    forward of the same tokens, with routing replay, reproduces exactly, in any chunking."""
    cfg = TrainerConfig(tasks=tasks, batch_invariant=True, vocab_digits=10 if tasks == "tora"
                        else 5).validate()
    assert cfg.rollout_torch_dtype() == torch.float32
    model = _model(cfg, seed=1)
    gen = torch.Generator().manual_seed(0)
    samples = []
    for name in cfg.task_list():
        prompts = [task.make_prompt(cfg, name, gen) for _ in range(3)]
        samples += generate(cfg, model, prompts, 2, gen=gen)
    for s in samples:
        s["version"] = 1
    behaviour = BehaviourPolicy(cfg, chunk=5)
    behaviour.remember(1, model)
    behaviour.annotate(samples)
    seqs = [q for s in samples for q in (s, *s.get("branches", ()))]
    masked = 0
    for s in seqs:
        mask = torch.tensor(s["loss_mask"]) > 0
        rollout = torch.tensor(s["rollout_logprobs"])[mask]
        assert torch.equal(torch.tensor(s["behaviour_logprobs"])[mask], rollout)
        masked += int(mask.sum())
    assert masked > 0
    # The trainer's own micro-batch (one collate of everything, replayed routing): the same.
    batch = collate(seqs, torch.device("cpu"))
    with torch.no_grad(), glm_kernels.batch_invariant(), \
            routing_tap(model, replay_tap(cfg, seqs, batch)):
        lp = invariant.token_logprobs(model(batch.inputs), batch.targets)
    m = batch.loss_mask > 0
    assert torch.equal(lp[m], batch.rollout_logprobs[m])
    # Without the mode the same tokens' log-probs differ by rounding (what the mode removes).
    with torch.no_grad(), routing_tap(model, replay_tap(cfg, seqs, batch)):
        plain = torch.log_softmax(model(batch.inputs), -1).gather(
            -1, batch.targets[..., None])[..., 0]
    assert not torch.equal(plain[m], batch.rollout_logprobs[m])
    torch.testing.assert_close(plain[m], batch.rollout_logprobs[m], rtol=1e-5, atol=1e-5)


def test_engine_turn_gives_a_row_the_same_bits_alone_or_with_other_sessions_rows():
    """``EngineCore`` (what a Ray engine actor or the rollout process serves turns with):
    a row's ids and log-probs are the same served alone as among other rows of other
    lengths, and equal to the trainer's full forward of the grown sequence."""
    from examples.async_trainer.rollout.sampler import EngineCore
    cfg = TrainerConfig(batch_invariant=True).validate()
    model = _model(cfg, seed=2)
    gen = torch.Generator().manual_seed(4)
    ctxs = [torch.randint(0, task.vocab_size(cfg), (n,), generator=gen).tolist()
            for n in (5, 9, 9, 3)]
    req = {"steps": 6, "stops": [task.EOS], "greedy": True}
    core = EngineCore(model, batch_invariant=True)
    alone = core.turn(dict(req, session="a", rows=[[0, ctxs[0]]], end=True))["rows"][0]
    mixed = core.turn(dict(req, session="b", end=True,
                           rows=[[i, c] for i, c in enumerate(ctxs)][::-1]))["rows"][0]
    assert alone["ids"] == mixed["ids"] and alone["logprobs"] == mixed["logprobs"]
    mask = torch.tensor(alone["mask"]) > 0
    assert mask.any()
    toks = torch.tensor([ctxs[0] + alone["ids"]])
    with torch.no_grad(), glm_kernels.batch_invariant():
        lp = invariant.token_logprobs(model(toks[:, :-1]), toks[:, 1:])[0, len(ctxs[0]) - 1:]
    assert torch.equal(lp[mask], torch.tensor(alone["logprobs"])[mask])
    # The default engine path gives the same tokens other bits (what the mode removes).
    plain = EngineCore(model).turn(dict(req, session="c", rows=[[0, ctxs[0]]], end=True))
    assert plain["rows"][0]["ids"] == alone["ids"]
    assert plain["rows"][0]["logprobs"] != alone["logprobs"]


def test_behaviour_policy_refuses_a_version_it_does_not_hold():
    cfg = TrainerConfig(batch_invariant=True).validate()
    model = _model(cfg)
    behaviour = BehaviourPolicy(cfg, keep=2)
    for v in (1, 2, 3):
        behaviour.remember(v, model)
    assert list(behaviour.snapshots) == [2, 3]
    sample = {"tokens": [1, 2, 3], "prompt_len": 2, "rollout_logprobs": [0.0],
              "loss_mask": [1.0], "version": 1}
    with pytest.raises(RuntimeError, match="version 1"):
        behaviour.annotate([sample])


def _tool_caller(cfg, call_logit: float):
    """A model whose every position's logits are ``call_logit`` for ``<tool_call>`` and 0
    elsewhere: every tool session has a second turn, whose log-probs name the weights."""
    model = _model(cfg, seed=3)
    with torch.no_grad():
        model.norm.weight.zero_()
        model.norm.bias.fill_(1.0)
        model.lm_head.weight.zero_()
        model.lm_head.weight[task.TOOL_CALL] = call_logit / cfg.d_model
    return model


def test_a_session_spanning_a_weight_update_runs_on_one_version():
    """A Ray engine's session whose weights change between its two turns (what broke
    logprob_max_abs_diff == 0 on the Ray backend, multi-turn tasks only): both turns run on
    the first turn's weights, and the trainer's recompute with the sample's version matches
    every sampled token bitwise. An engine that does not hold that version (a replacement)
    says so, and the session can start over."""
    from examples.async_trainer.rollout.engines import _EngineImpl, _Link
    from examples.async_trainer.train.batch import BEHAVIOUR_KEY
    from examples.async_trainer.rollout.sessions import new_session
    cfg = TrainerConfig(tasks="tool", batch_invariant=True).validate()
    engine, link, behaviour = _EngineImpl(cfg, "e0", 0), _Link(0), BehaviourPolicy(cfg)

    def publish(model):
        frames, _ = link.publish({k: v.detach().clone() for k, v in model.state_dict().items()})
        version = engine.update(frames)["version"]
        behaviour.remember(version, model)
        return version

    assert publish(_tool_caller(cfg, 40.0)) == 1
    prompt = task.make_prompt(cfg, "tool", torch.Generator().manual_seed(0))
    sess = new_session(cfg, "s", [prompt], 2)
    res = engine.turn(dict(sess.next_turn(), session="s", seed=1))
    sess.feed(res, res["version"])
    assert not sess.done                                                # the tool was called
    assert publish(_tool_caller(cfg, 2.0)) == 2                         # other log-probs
    res = engine.turn(dict(sess.next_turn(), session="s", seed=2))
    sess.feed(res, res["version"])
    samples = sess.samples()
    behaviour.annotate(samples)
    for s in samples:
        assert s["version"] == 1
        mask = torch.tensor(s["loss_mask"]) > 0
        assert mask.sum() > 1                                           # both turns sampled
        assert torch.equal(torch.tensor(s[BEHAVIOUR_KEY])[mask],
                           torch.tensor(s["rollout_logprobs"])[mask])
    assert res["version"] == 1                            # the second turn ran on v1's weights
    # A fresh engine (a replacement: only the current weights) refuses version 1.
    fresh = _EngineImpl(cfg, "e1", 0)
    fresh.update(_Link(1).publish({k: v.clone() for k, v in behaviour.snapshots[2].items()},
                                  full=True)[0])
    again = new_session(cfg, "t", [prompt], 2)
    res = fresh.turn(dict(again.next_turn(), session="t", seed=1))
    again.feed(res, 1)
    res = fresh.turn(dict(again.next_turn(), session="t", seed=2))
    assert res["missing_version"] == 1 and res["rows"] is None


def test_a_session_whose_version_its_engine_lacks_starts_over():
    """The pump's side of ``missing_version``: the session starts over (no turn of it kept),
    queued for its engine, counted; nothing is emitted."""
    import threading
    from examples.async_trainer.rollout.ray_rollout import RayRollout

    class Router:
        def route(self, sid):
            return "e1", False

    class Group:
        lock, router, version = threading.RLock(), Router(), 2
        ray = type("Ray", (), {"get": staticmethod(lambda ref: ref_results[ref])})

        def alive(self):
            return ["e0", "e1"]

    cfg = TrainerConfig(tasks="tool", batch_invariant=True).validate()
    rollout = RayRollout(Group(), cfg, "t", 0, {"tool": 1.0}, 2, 1)
    (sid,) = rollout._new_sessions(1)
    old = rollout.sessions[sid]
    old.turns, old.version = 1, 1                              # as after its first turn
    ref_results = {"r": {"rows": None, "missing_version": 1, "version": 2, "engine": "e0",
                         "session_found": False, "reused_tokens": 0}}
    rollout.inflight["r"] = {"session": sid, "engine": "e0", "t0": 0.0, "rows": 2,
                             "continued": True, "moved": False}
    rollout._finish("r")
    new = rollout.sessions[sid]
    assert new is not old and new.turns == 0 and new.next_turn()["version"] is None
    assert new.rows == old.rows and list(rollout.queues["e1"]) == [sid]
    assert rollout.sessions_restarted == 1 and rollout.env_jobs == []
    assert rollout.outbox.empty()
    rollout._env.shutdown()


def test_config_and_flag():
    assert parse(["--batch-invariant"]).batch_invariant is True
    assert parse(["--batch-invariant", "false"]).batch_invariant is False
    assert parse([]).batch_invariant is False
    assert TrainerConfig().validate().rollout_torch_dtype() == torch.bfloat16
    assert TrainerConfig(batch_invariant=True, rollout_dtype="float32").validate()
    with pytest.raises(ValueError, match="config.rollout_dtype"):
        TrainerConfig(batch_invariant=True, rollout_dtype="bfloat16").validate()
    with pytest.raises(TypeError, match="config.batch_invariant"):
        TrainerConfig(batch_invariant=1).validate()


def _train_steps(tmp_path, tasks="reverse", **kw):
    from examples.async_trainer.trainer import train
    kw = dict(dict(sft_steps=2, rl_steps=4, opd_steps=2), **kw)
    cfg = TrainerConfig(tasks=tasks, prompts_per_step=2, group_size=2, opd_prompts_per_step=4,
                        eval_prompts=4, out_dir=str(tmp_path), progress=False, **kw)
    train(cfg)
    records = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    steps = [r for r in records if r["kind"] == "train" and r["stage"] != "sft"]
    assert [r["stage"] for r in steps] == \
        [f"rl:{t}" for t in cfg.task_list() for _ in range(cfg.rl_steps)] + ["opd"] * cfg.opd_steps
    return steps


def test_short_run_is_bitwise_on_policy_process_backend(tmp_path):
    steps = _train_steps(tmp_path / "inv", batch_invariant=True, rollout_backend="process")
    assert all(r["logprob_max_abs_diff"] == 0.0 for r in steps)
    assert all(r["pop_frac"] == 0.0 for r in steps)
    assert any(r["staleness"] > 0 for r in steps)      # stale samples matched too
    default = _train_steps(tmp_path / "default", rollout_backend="process")
    assert all(r["logprob_max_abs_diff"] > 0.0 for r in default)   # the real bf16 gap


@pytest.mark.xdist_group("ray")                    # see tests/conftest.py
def test_short_run_is_bitwise_on_policy_ray_backend(tmp_path):
    # The tool task: two-turn sessions (20 SFT steps teach the call), whose turns an
    # engine could run on two weight versions (test_a_session_spanning_...).
    pytest.importorskip("ray")
    steps = _train_steps(tmp_path, tasks="tool", sft_steps=20, rl_steps=6,
                         batch_invariant=True, rollout_backend="ray", engines=2)
    assert [r["logprob_max_abs_diff"] for r in steps] == [0.0] * len(steps)
    assert all(r["pop_frac"] == 0.0 for r in steps)


def test_docs_example_prints_what_the_page_says(capsys):
    with open(ROOT / "docs" / "trainer.md") as f:
        page = f.read()
    section = page[page.index("## Batch-invariant mode"):]
    section = section[:section.index("\n## ", 1)]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    expected = re.search(r"```text\n(.*?)```", section, re.S).group(1)
    exec(compile(code, "docs/trainer.md", "exec"), {})
    assert capsys.readouterr().out == expected


@pytest.mark.parametrize("op", [torch.exp, torch.rsqrt, torch.relu])
def test_elementwise_ops_of_the_forward_do_not_depend_on_position(op):
    """The invariant forward applies these to tensors of any size: an element's bits must not
    depend on whether it falls in a vectorized chunk or the scalar tail (sigmoid's do:
    invariant.moe_route tiles it)."""
    torch.manual_seed(0)
    x = torch.randn(1001).abs() + 0.01 if op is torch.rsqrt else torch.randn(1001) * 5
    whole = op(x)
    assert all(torch.equal(op(x[i:i + 1]), whole[i:i + 1]) for i in range(x.numel()))
    assert torch.equal(op(x[3:40]), whole[3:40])
