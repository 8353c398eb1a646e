"""Rollout routing replay (R3) in the example trainer: generation records every MoE layer's
experts per position, the trainer replays them (or only compares), and the routing mismatch
rate reaches the metrics."""
import dataclasses
import json

import torch

from examples.async_trainer.env import task
from examples.async_trainer.__main__ import parse
from examples.async_trainer.train.batch import (collate, fused_linear_grpo_loss, policy_step,
                                                replay_tap, routing_metrics)
from examples.async_trainer.config import TrainerConfig
from examples.async_trainer.model.tinylm import RoutingTap, TinyLM, make_optimizer, routing_tap
from examples.async_trainer.rollout.local import generate
from glm_kernels.topk import decode_routing, routing_header, routing_mismatch
from tests.examples.test_trainer_async import Oracle


def _model(cfg, seed):
    torch.manual_seed(seed)
    return TinyLM(cfg, task.vocab_size(cfg))


def _samples(cfg, model, seed=0):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for name in ("reverse", "tool"):         # two lengths: the tool span makes tool longer
        prompts = [task.make_prompt(cfg, name, gen) for _ in range(2)]
        out += generate(cfg, model, prompts, 2, gen=gen)
    return out


def test_generation_records_every_position_it_feeds():
    cfg = TrainerConfig().validate()
    model = _model(cfg, 0).eval()
    samples = _samples(cfg, model)
    assert len({len(s["tokens"]) for s in samples}) == 2
    for s in samples:
        head = routing_header(s["routing"])
        assert (head.n_layers, head.n_tokens, head.k, head.n_experts) == (
            cfg.n_layers, len(s["tokens"]) - 1, cfg.top_k, cfg.n_experts)
    # The prompt positions come from generation's first forward: the same computation again.
    rows = samples[:4]
    prompts = torch.tensor([s["tokens"][:s["prompt_len"]] for s in rows])
    with routing_tap(model, RoutingTap()) as tap, torch.no_grad():
        model(prompts)
    for b, s in enumerate(rows):
        recorded = decode_routing(s["routing"])
        for layer in range(cfg.n_layers):
            assert torch.equal(recorded[layer, :s["prompt_len"]], tap.ids[layer][b])
    # A model without MoE layers records nothing.
    prompt = samples[0]["tokens"][:samples[0]["prompt_len"]]
    (plain,) = generate(cfg, Oracle(cfg), [prompt], 1)
    assert plain["routing"] is None


def test_replayed_forward_routes_to_the_recorded_experts():
    cfg = TrainerConfig(n_layers=1, n_experts=8, top_k=2, n_expert_groups=2,
                        topk_groups=2).validate()
    policy, other = _model(cfg, 1), _model(cfg, 2)
    samples = _samples(cfg, other.eval())            # recorded by a different policy
    batch = collate(samples, "cpu")
    counts = {}
    for replay in (True, False):
        tap = replay_tap(cfg, samples, batch)
        tap.replay = replay
        with routing_tap(policy, tap):
            out = policy.hidden(batch.inputs)
        valid = tap.valid
        ids = tap.ids[0]
        if replay:
            assert torch.equal(ids[valid], tap.recorded[0][valid])   # bitwise the rollout's
            out.square().sum().backward()
            assert policy.blocks[0][3].router.weight.grad.abs().sum() > 0   # grads reach it
            replayed_out = out.detach()
        else:
            own = ids
            assert not torch.equal(out.detach(), replayed_out)
        counts[replay] = (int(tap.mismatched), tap.compared)
    want = routing_mismatch(own, tap.recorded[0])[valid]
    assert 0 < int(want.sum()) < want.numel()
    # One layer: its input does not depend on routing, so both modes see the same mismatch.
    assert counts[True] == counts[False] == (int(want.sum()), want.numel())
    assert want.numel() == sum(len(s["tokens"]) - 1 for s in samples)


def test_policy_step_reports_the_mismatch_rate_with_replay_on_and_off():
    base = TrainerConfig(n_layers=2, dp_ranks=2, max_tokens_per_microbatch=40).validate()
    rollout = _model(base, 3).eval()
    samples = _samples(base, rollout)
    expected = base.n_layers * sum(len(s["tokens"]) - 1 for s in samples)
    rates = {}
    for replay in (True, False):
        cfg = dataclasses.replace(base, routing_replay=replay)
        policy = _model(cfg, 3)
        with torch.no_grad():      # a trainer a few steps ahead of its rollout (staleness)
            for *_, moe in policy.blocks:
                moe.router.weight.add_(0.3 * torch.randn_like(moe.router.weight))
        opt = make_optimizer(policy, cfg, 1e-3)
        rewards = torch.tensor([s["reward"] for s in samples])
        adv = rewards - rewards.mean()
        row_of = {id(s): i for i, s in enumerate(samples)}
        sums = policy_step(cfg, policy, opt, samples, fused_linear_grpo_loss(cfg, adv, row_of))
        assert sums["route_compared"] == expected
        rates[replay] = routing_metrics(sums)["routing_mismatch"]
        assert 0.0 < rates[replay] < 1.0
    assert routing_metrics({"pop": 0.0}) == {}


def test_flag_and_metrics_file(tmp_path):
    assert parse(["--routing-replay", "false"]).routing_replay is False
    assert TrainerConfig().routing_replay is True
    cfg = TrainerConfig(tasks="reverse", sft_steps=2, rl_steps=2, opd_steps=2, prompts_per_step=2,
                        group_size=2, opd_prompts_per_step=4, eval_prompts=4,
                        routing_replay=False, out_dir=str(tmp_path), progress=False)
    from examples.async_trainer.trainer import train
    train(cfg)
    records = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    steps = [r for r in records if r["kind"] == "train" and r["stage"] != "sft"]
    assert {r["stage"] for r in steps} == {"rl:reverse", "opd"}
    assert all(0.0 <= r["routing_mismatch"] <= 1.0 for r in steps)
    assert (tmp_path / "metrics.png").exists()
