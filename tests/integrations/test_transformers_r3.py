"""R3 and token_logprobs on transformers' own MoE models: routing recorded during
``model.generate`` (KV cache) is replayed exactly in a training forward; a perturbed packet is
followed and counted as a mismatch; ``token_logprobs`` equals the model's own logits."""
import pytest
import torch

from glm_kernels.integrations import transformers as gt
from glm_kernels.topk import decode_routing, encode_routing
from tests._compare import assert_close
from tests.integrations._tiny_moe import NoTopk, pair

TOL = 1e-5


def _experts_inputs(model):
    """Capture the expert ids each MoE layer's experts module receives, per forward."""
    seen = []
    for module in gt.routing_modules(model):
        experts = module.experts if hasattr(module, "experts") else None
        if experts is None:   # Qwen3-MoE: the router is the routing module; experts beside it
            experts = next(m for m in model.modules() if getattr(m, "gate", None) is module
                           ).experts
        experts.register_forward_hook(lambda mod, args, out: seen.append(args[1]))
    return seen


@pytest.mark.parametrize("model_type", ["glm_moe_dsa", "qwen3_moe", "deepseek_v4"])
def test_record_during_generate_then_replay_reproduces_the_experts(model_type):
    _, model = pair(model_type)
    prompt = torch.randint(2, 64, (2, 5), generator=torch.Generator().manual_seed(6))
    mask = torch.ones_like(prompt)
    mask[1, :2] = 0                                    # left padding in row 1
    with torch.no_grad(), gt.record_routing(model) as rec, NoTopk():
        out = model.generate(prompt, attention_mask=mask, max_new_tokens=4, do_sample=False,
                             pad_token_id=0, eos_token_id=None)
    packets = rec.packets()
    assert len(packets) == 2
    recorded = torch.stack([decode_routing(p) for p in packets], dim=1)   # [L, B, T, k]
    n_layers, _, n_tokens, k = recorded.shape
    assert n_layers == len(gt.routing_modules(model)) and n_tokens == out.shape[1] - 1
    full_mask = torch.cat([mask, torch.ones(2, out.shape[1] - 5, dtype=mask.dtype)], dim=1)
    seen = _experts_inputs(model)
    with gt.replay_routing(model, packets) as rep, NoTopk():
        lp = gt.token_logprobs(model, out, full_mask)
        lp.sum().backward()
    replayed = torch.stack([ids.view(2, -1, k) for ids in seen[:n_layers]])
    assert torch.equal(replayed[:, :, :n_tokens], recorded)
    counts = rep.mismatch_counts()
    assert len(counts) == n_layers and all(c >= 0 for c in counts)
    router_grads = [p.grad for n, p in model.named_parameters() if "gate.weight" in n
                    and "compressor" not in n]
    assert router_grads and all(g is not None and g.norm() > 0 for g in router_grads)


def test_replay_follows_a_changed_packet_and_counts_the_mismatch():
    _, model = pair("glm_moe_dsa")
    ids = torch.randint(2, 64, (1, 6), generator=torch.Generator().manual_seed(7))
    with torch.no_grad(), gt.record_routing(model) as rec:
        model(ids)
    own = rec.ids()[:, 0]                                  # [L, T, k]
    changed = own.clone()
    free = next(e for e in range(8) if e not in own[0, 3].tolist())
    changed[0, 3, 0] = free
    seen = _experts_inputs(model)
    with torch.no_grad(), gt.replay_routing(model, [encode_routing(changed, 8)]) as rep:
        model(ids)
    assert torch.equal(seen[0].view(6, -1), changed[0])
    assert rep.mismatch_counts() == [1]


def test_r3_refusals():
    ref_model, model = pair("qwen3_moe")
    with pytest.raises(ValueError, match="apply_glm_kernels"):
        with gt.record_routing(ref_model):
            pass
    bad = encode_routing(torch.zeros(3, 4, 2, dtype=torch.int64) + torch.tensor([0, 1]), 8)
    with pytest.raises(ValueError, match="MoE layers"):
        with gt.replay_routing(model, [bad]):
            pass
    with gt.record_routing(model):
        with pytest.raises(RuntimeError, match="already active"):
            with gt.record_routing(model):
                pass


@pytest.mark.parametrize("patched", [False, True])
def test_token_logprobs_equal_the_models_logits(patched):
    ref_model, model = pair("glm_moe_dsa")
    model = model if patched else ref_model
    ids = torch.randint(2, 64, (2, 7), generator=torch.Generator().manual_seed(8))
    logits = model(ids).logits.float() / 0.7
    want = logits.log_softmax(-1)[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]
    probs = logits.softmax(-1)[:, :-1]
    want_entropy = -(probs * logits.log_softmax(-1)[:, :-1]).sum(-1)
    lp, entropy = gt.token_logprobs(model, ids, temperature=0.7, return_entropy=True)
    assert lp.dtype == torch.float32 and lp.shape == (2, 6)
    assert_close(lp, want, tol=TOL)
    assert_close(entropy, want_entropy, tol=TOL)
    grads = torch.autograd.grad(lp.sum(), [model.lm_head.weight, model.model.embed_tokens.weight])
    want_grads = torch.autograd.grad(want.sum(), [model.lm_head.weight,
                                                  model.model.embed_tokens.weight])
    for got, ref in zip(grads, want_grads):
        assert_close(got, ref, tol=TOL)
    with pytest.raises(TypeError, match="return_entropy"):
        gt.token_logprobs(model, ids, return_entropy=1)
    with pytest.raises(TypeError, match="ForCausalLM"):
        gt.token_logprobs(model.model, ids)


def test_patched_glm5_trains_three_steps_with_fused_grpo_trainer(tmp_path, monkeypatch):
    """TRL's own GRPO loop (generation by transformers, the loss by FusedGRPOTrainer) on a
    patched tiny GLM-5, 3 optimizer steps on CPU: every routing goes through glm_kernels."""
    pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    from glm_kernels.integrations import trl as gtrl
    from glm_kernels.integrations.transformers import _routers
    from tests.integrations import test_trl
    tokenizer = test_trl.make_tokenizer()
    _, model = pair("glm_moe_dsa", vocab_size=len(test_trl.WORDS))
    calls = []
    real_route = _routers.route
    monkeypatch.setattr(_routers, "route", lambda *a, **k: calls.append(1) or real_route(*a, **k))
    ds = datasets.Dataset.from_dict({"prompt": test_trl.PROMPTS})
    args = test_trl.config(test_trl.trl.GRPOConfig, tmp_path, max_steps=3, learning_rate=1e-2)
    trainer = gtrl.FusedGRPOTrainer(model=model, reward_funcs=test_trl.length_reward,
                                    args=args, train_dataset=ds, processing_class=tokenizer)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.train()
    assert trainer.state.global_step == 3 and trainer.fused_calls > 0
    assert len(calls) > 0
    moved = [not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters())]
    assert sum(moved) > len(moved) // 2
