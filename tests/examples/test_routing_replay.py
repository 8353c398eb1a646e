"""Rollout routing replay (R3) in the example trainer: generation records every MoE layer's
experts per position, the trainer replays them (or only compares), and the routing mismatch
rate reaches the metrics."""
import dataclasses
import json

import torch

from examples.async_trainer import kernels
from examples.async_trainer.env import task
from examples.async_trainer.__main__ import parse
from examples.async_trainer.train.batch import (collate, fused_linear_grpo_loss, policy_step,
                                                real_positions, routing, routing_metrics)
from examples.async_trainer.config import TrainerConfig
from examples.async_trainer.model import policy
from examples.async_trainer.rollout.local import generate
from glm_kernels.integrations.transformers import record_routing
from glm_kernels.topk import decode_routing, routing_header, routing_mismatch


def _model(cfg, seed):
    torch.manual_seed(seed)
    return policy.new_policy(cfg)


def _moe_layers(cfg) -> int:
    return cfg.n_layers - cfg.dense_layers


def _samples(cfg, model, seed=0):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for name in ("reverse", "tool"):         # two lengths: the tool span makes tool longer
        prompts = [task.make_prompt(cfg, name, gen) for _ in range(2)]
        out += generate(cfg, model, prompts, 2, gen=gen)
    return out


def _experts_fed(model):
    """Per MoE layer (model order), the expert ids its experts module is handed, per forward:
    the routing the forward actually used. Returns (lists, hook handles)."""
    seen, handles = [], []
    for layer in model.model.layers:
        if hasattr(layer.mlp, "gate"):
            calls = []
            seen.append(calls)
            handles.append(layer.mlp.experts.register_forward_hook(
                lambda mod, args, out, calls=calls: calls.append(args[1].detach().clone())))
    return seen, handles


def test_generation_records_every_position_it_feeds():
    cfg = TrainerConfig(n_layers=3, device="cpu").validate()   # a dense layer, two MoE layers
    assert _moe_layers(cfg) == 2
    model = _model(cfg, 0).eval()
    samples = _samples(cfg, model)
    assert len({len(s["tokens"]) for s in samples}) == 2
    for s in samples:
        head = routing_header(s["routing"])
        assert (head.n_layers, head.n_tokens, head.k, head.n_experts) == (
            _moe_layers(cfg), len(s["tokens"]) - 1, cfg.top_k, cfg.n_experts)
        ids = decode_routing(s["routing"])
        assert ids.shape == (_moe_layers(cfg), len(s["tokens"]) - 1, cfg.top_k)
        assert int(ids.min()) >= 0 and int(ids.max()) < cfg.n_experts
        assert all(len(set(pos)) == cfg.top_k for pos in ids.view(-1, cfg.top_k).tolist())
    # The prompt positions come from generation's first forward (the KV cache's prefill):
    # the same computation again gives the same experts, layer by layer.
    rows = samples[:4]
    assert len({s["prompt_len"] for s in rows}) == 1
    prompts = torch.tensor([s["tokens"][:s["prompt_len"]] for s in rows])
    with record_routing(model) as rec, torch.no_grad():
        policy.logits(model, prompts)
    fresh = rec.ids()                                   # [MoE layers, rows, prompt, k]
    assert fresh.shape == (_moe_layers(cfg), len(rows), prompts.shape[1], cfg.top_k)
    for b, s in enumerate(rows):
        recorded = decode_routing(s["routing"])
        for layer in range(_moe_layers(cfg)):
            assert torch.equal(recorded[layer, :s["prompt_len"]], fresh[layer, b])


def test_replayed_forward_routes_to_the_recorded_experts():
    # One MoE layer and nothing before it that routes: its input does not depend on routing.
    cfg = TrainerConfig(n_layers=1, dense_layers=0, n_experts=8, top_k=2, n_expert_groups=2,
                        topk_groups=2, device="cpu").validate()
    trainee, other = _model(cfg, 1), _model(cfg, 1)
    with torch.no_grad():      # recorded by a different policy: the same but its router
        router = other.model.layers[0].mlp.gate.weight
        router.add_(0.1 * torch.randn_like(router))
    samples = _samples(cfg, other.eval())
    batch = collate(samples, "cpu")
    width = batch.inputs.shape[1]
    recorded, lengths = kernels.decode_routing_batch([s["routing"] for s in samples], width,
                                                     "cpu")
    valid = real_positions(samples, batch)             # what the packets cover
    assert torch.equal(valid, torch.arange(width) < lengths[:, None])
    gate = trainee.model.layers[0].mlp.gate
    counts = {}
    for replay in (True, False):
        seen, handles = _experts_fed(trainee)
        with routing(dataclasses.replace(cfg, routing_replay=replay), trainee, samples,
                     batch) as stats:
            out = policy.hidden(trainee, batch.inputs)
        for h in handles:
            h.remove()
        ((ids,),) = seen                                 # one MoE layer, one forward
        ids = ids.view(*batch.inputs.shape, cfg.top_k)
        if replay:
            assert torch.equal(ids[valid], recorded[0][valid])   # bitwise the rollout's
            trainee.zero_grad(set_to_none=True)
            out.square().sum().backward()
            assert gate.weight.grad is not None and gate.weight.grad.abs().sum() > 0
            replayed_out = out.detach()
        else:
            own = ids
            assert not torch.equal(out.detach(), replayed_out)
        counts[replay] = (int(stats.mismatched), stats.compared)
    want = routing_mismatch(own.reshape(-1, cfg.top_k),
                            recorded[0].reshape(-1, cfg.top_k)).view(valid.shape)[valid]
    assert 0 < int(want.sum()) < want.numel()
    # One layer: its input does not depend on routing, so both modes see the same mismatch.
    assert counts[True] == counts[False] == (int(want.sum()), want.numel())
    assert want.numel() == sum(len(s["tokens"]) - 1 for s in samples)


def test_policy_step_reports_the_mismatch_rate_with_replay_on_and_off():
    base = TrainerConfig(n_layers=3, dp_ranks=2, max_tokens_per_microbatch=40,
                         device="cpu").validate()
    rollout = _model(base, 3).eval()
    samples = _samples(base, rollout)
    expected = _moe_layers(base) * sum(len(s["tokens"]) - 1 for s in samples)
    rates = {}
    for replay in (True, False):
        cfg = dataclasses.replace(base, routing_replay=replay)
        trainee = _model(cfg, 3)
        with torch.no_grad():      # a trainer a few steps ahead of its rollout (staleness)
            for gate in policy.moe_gates(trainee):
                gate.weight.add_(0.3 * torch.randn_like(gate.weight))
        opt = policy.make_optimizer(trainee, cfg, 1e-3)
        rewards = torch.tensor([s["reward"] for s in samples])
        adv = rewards - rewards.mean()
        row_of = {id(s): i for i, s in enumerate(samples)}
        sums = policy_step(cfg, trainee, opt, samples, fused_linear_grpo_loss(cfg, adv, row_of))
        assert sums["route_compared"] == expected
        rates[replay] = routing_metrics(sums)["routing_mismatch"]
        assert 0.0 < rates[replay] < 1.0
        # The step's expert load moved every MoE layer's balancing bias.
        for gate in policy.moe_gates(trainee):
            assert gate.e_score_correction_bias.abs().max() == cfg.balance_bias_rate
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
