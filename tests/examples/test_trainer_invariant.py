"""``--batch-invariant`` in the example trainer, on its policy (transformers'
``GlmMoeDsaForCausalLM``, ``model/policy.py``) and the library's whole-model mode
(``glm_kernels.batch_invariant()``): the ops of the policy's forward under the mode (its linear
layers, norms, softmax and products over padded keys, elementwise functions), a KV-cache
decode bitwise equal to the full forward (any batch, order, thread count) where outside the
mode the same comparison fails, the rollout's recorded log-probs bitwise equal to the
trainer's (alone, in other batches, shuffled, on 1 and 2 threads), an engine running a
session on one weight version, and short runs (process and Ray rollout backends) whose every
step logs logprob_max_abs_diff == 0.0 and pop_frac == 0."""
import copy
import json
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import glm_kernels
from glm_kernels import selective_logprobs
from examples.async_trainer.env import task
from examples.async_trainer.model import policy
from examples.async_trainer.__main__ import parse
from examples.async_trainer.train.batch import collate, routing
from examples.async_trainer.train.behaviour import BehaviourPolicy
from examples.async_trainer.config import TrainerConfig
from examples.async_trainer.rollout.local import generate

ROOT = Path(__file__).resolve().parents[2]


def _model(cfg, seed=0):
    torch.manual_seed(seed)
    model = policy.new_policy(cfg).eval()
    with torch.no_grad():               # a trained-looking balancing bias: routing near ties
        for gate in policy.moe_gates(model):
            bias = gate.e_score_correction_bias
            bias.copy_(0.05 * torch.randn_like(bias))
    return model


@pytest.fixture(scope="module")
def model():
    """The default config's policy (seed 0), for the tests that only read it."""
    return _model(TrainerConfig().validate())


@pytest.mark.parametrize("n", [0, 1, 5, 16, 17, 64, 65, 130])
def test_linear_layers_give_each_row_the_bits_it_gets_alone(model, n):
    """The policy's projections and lm_head under the mode (fixed row tiles): the same
    function as outside it, and each of n rows the bits it gets alone (n = 1: a decode step)."""
    torch.manual_seed(n)
    x = torch.randn(n, model.config.hidden_size)
    for layer in (model.model.layers[1].self_attn.q_a_proj, model.lm_head):
        with torch.no_grad():
            plain = layer(x)
            with glm_kernels.batch_invariant():
                out = layer(x)
                rows = [layer(x[i:i + 1])[0] for i in range(n)]
        assert out.shape == (n, layer.out_features)
        torch.testing.assert_close(out, plain, rtol=1e-5, atol=1e-5)
        assert all(torch.equal(r, out[i]) for i, r in enumerate(rows))


def test_softmax_and_products_over_padded_keys_ignore_the_padding():
    """What a right-padded or causally masked row needs (eager attention: softmax, then bmm
    with the values): under the mode, keys masked to -inf get exactly 0 and change no bit of
    the row's probabilities or of its weighted sum of values, whatever their values."""
    torch.manual_seed(0)
    x = torch.randn(5, 70, dtype=torch.float32)
    with glm_kernels.batch_invariant():
        for n in (1, 2, 3, 12, 16, 17, 64, 70):
            p = torch.softmax(x[:, :n], -1)
            padded = torch.softmax(torch.cat([x[:, :n], torch.full((5, 100 - n), -torch.inf)], 1),
                                   -1)
            torch.testing.assert_close(p, torch.softmax(x[:, :n].double(), -1).float())
            assert torch.equal(padded[:, :n], p) and torch.equal(padded[:, n:],
                                                                  torch.zeros(5, 100 - n))
            v = torch.randn(5, 100, 12)
            out = torch.bmm(p[:, None], v[:, :n])
            torch.testing.assert_close(out, torch.bmm(p[:, None].double(), v[:, :n].double())
                                       .float(), rtol=1e-5, atol=1e-5)
            assert torch.equal(torch.bmm(padded[:, None], v), out)


def test_norms_of_the_policy_match_torch_and_give_rows_their_own_bits(model):
    """The policy's RMSNorm (every layer, the final norm) and the DSA indexer's LayerNorm
    (with bias) under the mode: torch's function (fp32 tolerance), each row its own bits."""
    torch.manual_seed(0)
    rms = copy.deepcopy(model.model.norm)
    ln = copy.deepcopy(model.model.layers[1].self_attn.indexer.k_norm)
    with torch.no_grad():
        rms.weight.add_(torch.randn(rms.weight.shape) * 0.1)
        ln.weight.add_(torch.randn(ln.weight.shape) * 0.1)
        ln.bias.add_(torch.randn(ln.bias.shape) * 0.1)
    for norm in (rms, ln):
        x = torch.randn(7, 5, norm.weight.shape[0]) * 3 + 1
        with torch.no_grad():
            plain = norm(x)
            with glm_kernels.batch_invariant():
                out = norm(x)
                rows = [norm(x[i:i + 1, j:j + 1]) for i in range(7) for j in range(5)]
        torch.testing.assert_close(out, plain, rtol=1e-5, atol=1e-5)
        assert torch.equal(torch.cat(rows).view_as(out), out)


@pytest.mark.parametrize("op", [torch.exp, torch.rsqrt, torch.sigmoid, F.silu, F.relu])
def test_elementwise_ops_of_the_forward_do_not_depend_on_position(op):
    """The policy applies these to tensors of any size (softmax's exp, RMSNorm's rsqrt, the
    router's sigmoid, the SwiGLU's silu, the indexer's relu): under the mode an element's bits
    must not depend on whether it falls in a vectorized chunk or the scalar tail (outside it
    sigmoid's and silu's do on x86)."""
    torch.manual_seed(0)
    x = torch.randn(1001).abs() + 0.01 if op is torch.rsqrt else torch.randn(1001) * 5
    with glm_kernels.batch_invariant():
        whole = op(x)
        assert all(torch.equal(op(x[i:i + 1]), whole[i:i + 1]) for i in range(x.numel()))
        assert torch.equal(op(x[3:40]), whole[3:40])
    torch.testing.assert_close(whole, op(x.double()).float())


def _decode(model, toks, prefill: int):
    """Logits of every position of ``toks`` [n, T]: a prefill of ``prefill`` positions, then
    one position per step against the KV cache (as the rollout decodes)."""
    cache = policy.new_cache(model)
    out = [policy.decode(model, toks[:, :prefill], cache)]
    for t in range(prefill, toks.shape[1]):
        out.append(policy.decode(model, toks[:, t:t + 1], cache))
    assert cache.get_seq_length() == toks.shape[1]
    return torch.cat(out, 1)


def test_the_mode_is_the_same_model_and_outside_it_decode_differs(model):
    """The mode computes the default model's function (fp32 tolerance) on another path (not
    the same bits); outside it a KV-cache decode is the same function as the full forward but
    not the same bits (what the mode removes: this comparison can fail)."""
    cfg = TrainerConfig().validate()
    toks = torch.randint(0, task.vocab_size(cfg), (6, task.max_len(cfg)),
                         generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        default = policy.logits(model, toks)
        with glm_kernels.batch_invariant():
            fixed = policy.logits(model, toks)
        torch.testing.assert_close(fixed, default, rtol=1e-5, atol=1e-5)
        assert not torch.equal(fixed, default)          # really another path
        dec = _decode(model, toks[:2], 4)
    torch.testing.assert_close(dec, default[:2], rtol=1e-5, atol=1e-5)
    assert not torch.equal(dec, default[:2])
    assert not torch.equal(selective_logprobs(dec, toks[:2]),
                           selective_logprobs(default[:2], toks[:2]))


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
            full = policy.logits(model, toks[:, :-1])
            lp_full = selective_logprobs(full, toks[:, 1:])
            torch.set_num_threads(threads[1])
            for prefill in (1, 4, width // 2):
                dec = _decode(model, toks[rows, :-1], prefill)
                assert torch.equal(dec, full[rows])
                assert torch.equal(selective_logprobs(dec, toks[rows, 1:]), lp_full[rows])
    finally:
        torch.set_num_threads(previous)


def test_row_alone_vs_padded_in_a_wide_shuffled_batch(model):
    """A sequence alone at its own length vs inside a batch of 64 rows (its tail there is
    other tokens: right padding), and the batch shuffled."""
    cfg = TrainerConfig().validate()
    width = task.max_len(cfg)
    gen = torch.Generator().manual_seed(3)
    toks = torch.randint(0, task.vocab_size(cfg), (64, width), generator=gen)
    perm = torch.randperm(64, generator=gen)
    with torch.no_grad(), glm_kernels.batch_invariant():
        batch = policy.logits(model, toks)
        shuffled = policy.logits(model, toks[perm])
        assert torch.equal(shuffled, batch[perm])
        for i, length in ((0, 1), (9, 7), (40, width)):
            assert torch.equal(policy.logits(model, toks[i:i + 1, :length])[0],
                               batch[i, :length])


def _trainer_logprobs(cfg, model, seqs, threads: int):
    """The trainer's forward of ``seqs`` as one micro-batch (collated, their routing replayed),
    under the mode, on ``threads`` threads: the log-probs [B, L-1] and the loss mask."""
    batch = collate(seqs, torch.device("cpu"))
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.no_grad(), glm_kernels.batch_invariant(), \
                routing(cfg, model, seqs, batch) as route:
            lp = selective_logprobs(policy.logits(model, batch.inputs), batch.targets)
    finally:
        torch.set_num_threads(previous)
    assert route.compared > 0 and route.mismatched == 0      # the rollout's own experts
    return lp, batch


@pytest.mark.parametrize("tasks", ["reverse,tool", "tora"])
def test_rollout_logprobs_equal_the_trainers_bitwise(tasks):
    """generate() (KV-cache decode, one thread, as an engine) records log-probs (and routing)
    that the trainer's full forward of the same tokens, with routing replay, reproduces
    exactly: the behaviour recompute in chunks of 5, one shuffled micro-batch of everything
    on 2 threads, and a sequence alone on 1; outside the mode the same forward differs."""
    cfg = TrainerConfig(tasks=tasks, batch_invariant=True, vocab_digits=10 if tasks == "tora"
                        else 5).validate()
    assert cfg.rollout_torch_dtype() == torch.float32
    model = _model(cfg, seed=1)
    gen = torch.Generator().manual_seed(0)
    samples = []
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for name in cfg.task_list():
            prompts = [task.make_prompt(cfg, name, gen) for _ in range(3)]
            samples += generate(cfg, model, prompts, 2, gen=gen)
    finally:
        torch.set_num_threads(previous)
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
    # The trainer's own micro-batch (one collate of everything, shuffled, 2 threads): the same.
    order = torch.randperm(len(seqs), generator=torch.Generator().manual_seed(1)).tolist()
    shuffled = [seqs[i] for i in order]
    lp, batch = _trainer_logprobs(cfg, model, shuffled, threads=2)
    m = batch.loss_mask > 0
    assert torch.equal(lp[m], batch.rollout_logprobs[m])
    # The longest sequence alone (no padding, a batch of one), on 1 thread: the same.
    longest = max(seqs, key=lambda s: len(s["tokens"]))
    lp, alone = _trainer_logprobs(cfg, model, [longest], threads=1)
    m1 = alone.loss_mask > 0
    assert torch.equal(lp[m1], alone.rollout_logprobs[m1])
    # Without the mode the same tokens' log-probs differ by rounding (what the mode removes).
    with torch.no_grad(), routing(cfg, model, shuffled, batch):
        plain = torch.log_softmax(policy.logits(model, batch.inputs), -1).gather(
            -1, batch.targets[..., None])[..., 0]
    assert not torch.equal(plain[m], batch.rollout_logprobs[m])
    torch.testing.assert_close(plain[m], batch.rollout_logprobs[m], rtol=1e-5, atol=1e-5)


def test_engine_turn_gives_a_row_the_same_bits_alone_or_with_other_sessions_rows():
    """``EngineCore`` (what a Ray engine actor or the rollout process serves turns with):
    a row's ids and log-probs are the same served alone (1 thread) as among other rows of
    other lengths (2 threads), and equal to the trainer's full forward of the grown
    sequence."""
    from examples.async_trainer.rollout.sampler import EngineCore
    cfg = TrainerConfig(batch_invariant=True).validate()
    model = _model(cfg, seed=2)
    gen = torch.Generator().manual_seed(4)
    ctxs = [torch.randint(0, task.vocab_size(cfg), (n,), generator=gen).tolist()
            for n in (5, 9, 9, 3)]
    req = {"steps": 6, "stops": [task.EOS], "greedy": True}
    core = EngineCore(model, batch_invariant=True)
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = core.turn(dict(req, session="a", rows=[[0, ctxs[0]]], end=True))["rows"][0]
        torch.set_num_threads(2)
        mixed = core.turn(dict(req, session="b", end=True,
                               rows=[[i, c] for i, c in enumerate(ctxs)][::-1]))["rows"][0]
    finally:
        torch.set_num_threads(previous)
    assert alone["ids"] == mixed["ids"] and alone["logprobs"] == mixed["logprobs"]
    assert torch.equal(alone["routing"], mixed["routing"])
    mask = torch.tensor(alone["mask"]) > 0
    assert mask.any()
    toks = torch.tensor([ctxs[0] + alone["ids"]])
    with torch.no_grad(), glm_kernels.batch_invariant():
        lp = selective_logprobs(policy.logits(model, toks[:, :-1]),
                                toks[:, 1:])[0, len(ctxs[0]) - 1:]
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
    """A policy whose every position's logits are ``call_logit`` for ``<tool_call>`` and 0
    elsewhere: every tool session has a second turn, whose log-probs name the weights. Every
    token embeds to the same vector, so every position of every row has the same last hidden
    state h (attention averages equal values, the MoE routes equal inputs alike): the lm_head
    reads ``call_logit`` off h; the layers still run (and route) as in a real model."""
    model = _model(cfg, seed=3)
    with torch.no_grad():
        emb = model.model.embed_tokens.weight
        emb.copy_(emb[:1].expand_as(emb))
        h = policy.hidden(model, torch.tensor([[task.SYSTEM]]))[0, 0]
        model.lm_head.weight.zero_()
        model.lm_head.weight[task.TOOL_CALL] = call_logit * h / h.dot(h)
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
    assert set(engine.kept) == {1, 2}                                   # both versions held
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
    # v2's weights give those tokens other log-probs: the pin is what made them match.
    as_v2 = [dict(s, version=2) for s in samples]
    behaviour.annotate(as_v2)
    for s in as_v2:
        mask = torch.tensor(s["loss_mask"]) > 0
        assert not torch.equal(torch.tensor(s[BEHAVIOUR_KEY])[mask],
                               torch.tensor(s["rollout_logprobs"])[mask])
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
    assert TrainerConfig(batch_invariant=True).validate().rollout_torch_dtype() == torch.float32
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
    assert any(r["prefix_reused_tokens"] > 0 for r in steps)    # second turns were served


def test_docs_example_prints_what_the_page_says(capsys):
    with open(ROOT / "docs" / "trainer.md") as f:
        page = f.read()
    section = page[page.index("## Batch-invariant mode"):]
    section = section[:section.index("\n## ", 1)]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    expected = re.search(r"```text\n(.*?)```", section, re.S).group(1)
    exec(compile(code, "docs/trainer.md", "exec"), {})
    assert capsys.readouterr().out == expected
