"""Whole-model batch invariance on tiny random transformers models (no download): inside
``glm_kernels.batch_invariant()`` a sampled rollout's log-probs (``generate`` with its KV cache)
equal a full forward's to the bit, the sequences alone, in a left-padded batch of 8 of other
lengths, and shuffled; outside the context the same comparison differs."""
import threading

import pytest
import torch

import glm_kernels
from glm_kernels.testing import TINY_MODEL_TYPES, assert_batch_invariant, tiny_causal_lm

pytest.importorskip("transformers")


def _prompts(seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 96, (n,), generator=g) for n in (3, 6)]


@pytest.fixture
def threads(request):
    previous = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(previous)


@pytest.mark.parametrize("threads", [1, 2], indirect=True)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("model_type", TINY_MODEL_TYPES)
def test_rollout_equals_full_forward_bitwise(model_type, dtype, threads):
    model = tiny_causal_lm(model_type, dtype)
    with glm_kernels.batch_invariant():
        report = assert_batch_invariant(model, _prompts(), max_new_tokens=3)
    assert report["rollout"].shape == (2, 3) and torch.isfinite(report["rollout"]).all()
    assert (report["alone"], report["batch"], report["shuffled"]) == (0, 0, 0)


def test_outside_the_context_the_same_check_fails():
    """The comparison can fail: with torch's own kernels a decode step and the full forward
    get other bits on at least one model (BLAS picks another kernel for one row than for a
    block; a reduction's split follows the row count)."""
    failures = []
    for model_type in TINY_MODEL_TYPES:
        model = tiny_causal_lm(model_type, torch.float32)
        try:
            assert_batch_invariant(model, _prompts() + [torch.arange(1, 8)], max_new_tokens=4)
        except AssertionError as exc:
            assert "differs from the rollout" in str(exc)
            failures.append(model_type)
    assert failures, "torch's default kernels were batch-invariant on every model here"


def test_rollout_at_two_threads_equals_rollout_at_one():
    """Thread count: fixed tiles and vector-body elementwise ops do not depend on it, so the
    log-probs sampled at 2 threads are those sampled at 1 (each checked against its forwards)."""
    model = tiny_causal_lm("qwen3_moe", torch.float32)
    previous = torch.get_num_threads()
    results = {}
    try:
        for n in (2, 1):
            torch.set_num_threads(n)
            with glm_kernels.batch_invariant():
                results[n] = assert_batch_invariant(model, _prompts(), max_new_tokens=3)
    finally:
        torch.set_num_threads(previous)
    assert torch.equal(results[1]["rollout"].view(torch.int32),
                       results[2]["rollout"].view(torch.int32))


def test_assert_batch_invariant_rejects_bad_arguments():
    model = tiny_causal_lm("llama")
    with pytest.raises(TypeError, match="prompts"):
        assert_batch_invariant(model, torch.ones(3, dtype=torch.long))
    with pytest.raises(ValueError, match=r"prompts\[0\]"):
        assert_batch_invariant(model, [torch.ones(2, 2, dtype=torch.long)])
    with pytest.raises(ValueError, match="max_new_tokens"):
        assert_batch_invariant(model, _prompts(), max_new_tokens=True)
    with pytest.raises(ValueError, match="batch_size"):
        assert_batch_invariant(model, _prompts(), batch_size=2)
    with pytest.raises(ValueError, match="model_type"):
        tiny_causal_lm("gpt2")


@pytest.mark.parametrize("model_type", ["llama", "qwen3_moe"])
def test_training_gradients_inside_the_context(model_type):
    """The trainer's backward runs through the replaced ops' autograd formulas (sdpa's
    backward reads the override's logsumexp, left-padding rows included; grouped_mm's): the
    gradients are torch's within the fp32 tolerance and finite."""
    from glm_kernels.testing import assert_close
    model = tiny_causal_lm(model_type).train()
    ids = torch.randint(1, 96, (3, 9), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    grads = {}
    for on in (False, True):
        model.zero_grad()
        with glm_kernels.batch_invariant(on):
            logits = model(input_ids=ids, attention_mask=mask, position_ids=positions,
                           use_cache=False).logits
            torch.log_softmax(logits, -1)[..., 5][mask.bool()].sum().backward()
        grads[on] = torch.cat([p.grad.flatten() for p in model.parameters()
                               if p.grad is not None])
    assert torch.isfinite(grads[True]).all()
    assert_close(grads[True], grads[False], tol=1e-5, name=f"{model_type} gradients")


@pytest.mark.parametrize("model_type", ["qwen3_moe", "glm_moe_dsa"])
def test_rollout_equals_full_forward_bitwise_with_apply_glm_kernels(model_type):
    """The mode composes with the transformers integration: the patched routers (moe_route)
    and GLM-5's patched DSA indexer (glm_kernels.topk) inside the context, same contract."""
    from glm_kernels.integrations.transformers import apply_glm_kernels, routing_modules
    from glm_kernels.integrations.transformers._patch import is_patched
    model = apply_glm_kernels(tiny_causal_lm(model_type, torch.float32))
    assert all(is_patched(m, "forward") or is_patched(m, "route_tokens_to_experts")
               for m in routing_modules(model))
    with glm_kernels.batch_invariant():
        report = assert_batch_invariant(model, _prompts(), max_new_tokens=3)
    assert (report["alone"], report["batch"], report["shuffled"]) == (0, 0, 0)
