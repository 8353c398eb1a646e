"""glm_kernels inside transformers' own MoE models (the installed package's modeling code):
patched vs unpatched logits and gradients, routing sets and the tie rule, batch invariance of
the routing, no torch.topk in a patched forward, the DSA indexer, class-level patching, and a
compiled patched MoE layer."""
import copy

import pytest
import torch

from glm_kernels import force_backend
from glm_kernels.integrations import transformers as gt
from glm_kernels.integrations.transformers import _patch
from tests._compare import assert_close
from tests.conftest import skip_without_kernels
from tests.integrations._tiny_moe import MODEL_TYPES, NoTopk, make_model, pair

TOL = 1e-5


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_patched_model_matches_transformers(model_type):
    """Same logits and gradients (fp32 tolerance), with torch.topk forbidden in the patched
    forward (routing, and GLM-5's indexer)."""
    ref_model, model = pair(model_type)
    ids = torch.randint(2, 64, (3, 11), generator=torch.Generator().manual_seed(1))
    ref = ref_model(ids).logits
    with NoTopk():
        out = model(ids).logits
        (out.square().mean()).backward()
    ref.square().mean().backward()
    assert_close(out, ref, tol=TOL)
    pairs = [(name, p.grad, q.grad) for (name, p), q in
             zip(model.named_parameters(), ref_model.parameters()) if q.grad is not None]
    assert_close(torch.cat([g.reshape(-1) for _, g, _ in pairs]),
                 torch.cat([g.reshape(-1) for _, _, g in pairs]), tol=TOL, name="all grads")
    # DeepSeek-V4's Sinkhorn hyper-connection head amplifies ulp changes of the router scores:
    # computing HF's own sqrt(softplus) by an equivalent formula moves its gradient by 3e-5.
    per_param = 1e-4 if model_type == "deepseek_v4" else TOL
    for name, grad, ref_grad in pairs:
        if ref_grad.norm() > 0:
            assert_close(grad, ref_grad, tol=per_param, name=name)
    assert model.state_dict().keys() == ref_model.state_dict().keys()


def _router(module):
    """The module holding the router weight and correction bias: the MoE block's gate where
    the block routes (transformers <= 5.10), else the routing module itself (newer)."""
    return module.gate if hasattr(module, "route_tokens_to_experts") else module


def _route(module, hidden):
    """(ids, weights) of one noaux routing module for hidden states [T, H], in either layout:
    gate + route_tokens_to_experts, or the router's forward."""
    if hasattr(module, "route_tokens_to_experts"):
        return module.route_tokens_to_experts(module.gate(hidden))
    _, weights, ids = module(hidden)
    return ids, weights


def _method(module):
    """The name of the replaced routing method of a routing module (either layout)."""
    return "route_tokens_to_experts" if hasattr(module, "route_tokens_to_experts") else "forward"


def _logits_as_hidden(module, logits):
    """Hidden states whose router logits are exactly ``logits`` [T, E]: the router weight
    becomes [I_E | 0] (every product exact, one nonzero term per sum), so a test of the
    routing sees the logits it chose, whatever order the matmul sums in."""
    router = _router(module)
    experts, hidden_size = router.weight.shape
    with torch.no_grad():
        router.weight.zero_()
        router.weight[:, :experts] = torch.eye(experts)
    return torch.nn.functional.pad(logits, (0, hidden_size - experts))


def _by_expert(ids, weights):
    order = ids.argsort(-1)
    return ids.gather(-1, order), weights.gather(-1, order)


@pytest.mark.parametrize("model_type", ["glm_moe_dsa", "deepseek_v3", "glm4_moe"])
def test_noaux_routing_sets_and_weights_match(model_type):
    ref_model, model = pair(model_type)
    ref_block, block = gt.routing_modules(ref_model)[0], gt.routing_modules(model)[0]
    hidden = torch.randn(200, 32, generator=torch.Generator().manual_seed(2))
    ref_ids, ref_w = _by_expert(*_route(ref_block, hidden))
    with NoTopk():
        ids, w = _by_expert(*_route(block, hidden))
    assert torch.equal(ids, ref_ids)
    assert_close(w, ref_w, tol=TOL)


def test_qwen3_router_matches_transformers():
    ref_model, model = pair("qwen3_moe")
    ref_router, router = gt.routing_modules(ref_model)[0], gt.routing_modules(model)[0]
    hidden = torch.randn(200, 32, generator=torch.Generator().manual_seed(3))
    ref_logits, ref_w, ref_ids = ref_router(hidden)
    with NoTopk():
        logits, w, ids = router(hidden)
    assert torch.equal(logits, ref_logits)
    (ids, w), (ref_ids, ref_w) = _by_expert(ids, w), _by_expert(ref_ids, ref_w)
    assert torch.equal(ids, ref_ids) and w.dtype == ref_w.dtype
    assert_close(w, ref_w, tol=TOL)


def test_deepseek_v4_routers_match_transformers():
    """sqrtsoftplus top-k layers: the same expert sets and weights; the hash layer: experts
    from tid2eid[input_ids], weights from their scores."""
    ref_model, model = pair("deepseek_v4")
    hidden = torch.randn(60, 32, generator=torch.Generator().manual_seed(3))
    tokens = torch.randint(2, 64, (60,), generator=torch.Generator().manual_seed(4))
    for ref_router, router in zip(gt.routing_modules(ref_model), gt.routing_modules(model)):
        args = (hidden, tokens) if type(router).__name__.endswith("HashRouter") else (hidden,)
        ref_logits, ref_w, ref_ids = ref_router(*args)
        with NoTopk():
            logits, w, ids = router(*args)
        assert torch.equal(logits, ref_logits)
        (ids, w), (ref_ids, ref_w) = _by_expert(ids, w), _by_expert(ref_ids, ref_w)
        assert torch.equal(ids, ref_ids)
        assert_close(w, ref_w, tol=TOL)
    assert [type(r).__name__ for r in gt.routing_modules(model)] == [
        "DeepseekV4HashRouter", "DeepseekV4TopKRouter", "DeepseekV4TopKRouter"]


@pytest.mark.parametrize("backend", ["torch", "interpret"])
def test_routing_is_bitwise_batch_invariant(backend):
    """A token's experts and weights are the same bits alone, in a batch of 8 and shuffled
    (from its router logits: the router's matmul itself is the model's; Qwen3-MoE's softmax
    and DeepSeek-V4's scorings: tests/topk/test_moe_route.py)."""
    if backend == "interpret":
        skip_without_kernels()
    block = gt.routing_modules(pair("glm_moe_dsa")[1])[0]
    gen = torch.Generator().manual_seed(4)
    hidden = _logits_as_hidden(block, torch.randn(8, 8, generator=gen))
    perm = torch.randperm(8, generator=gen)
    with force_backend(backend):
        batch_ids, batch_w = _route(block, hidden)
        shuffled_ids, shuffled_w = _route(block, hidden[perm])
        for i in range(8):
            ids, w = _route(block, hidden[i:i + 1])
            assert torch.equal(ids[0], batch_ids[i]) and torch.equal(w[0], batch_w[i])
    assert torch.equal(shuffled_ids, batch_ids[perm]) and torch.equal(shuffled_w, batch_w[perm])


def test_ties_go_to_the_lower_expert_id():
    """Equal logits and biases: groups 0..topk_group-1 are kept, experts 0 and 1 chosen."""
    _, model = pair("glm_moe_dsa")
    block = gt.routing_modules(model)[0]
    _router(block).e_score_correction_bias.zero_()
    ids, w = _route(block, torch.zeros(3, 32))
    assert ids.tolist() == [[0, 1]] * 3
    assert_close(w, torch.full((3, 2), 0.5 * 2.5), tol=TOL)


def test_indexer_keeps_causal_keys_and_breaks_ties_low():
    """All index scores equal (weights_proj = 0): each query keeps its first keys, never a
    future one; the attention mask built from the indices is causal."""
    _, model = pair("glm_moe_dsa")
    indexer = model.model.layers[0].self_attn.indexer
    seen = []
    indexer.register_forward_hook(lambda mod, args, out: seen.append(out))
    torch.nn.init.zeros_(indexer.weights_proj.weight)
    model(torch.randint(2, 64, (2, 7)))
    indices = seen[0]
    for s in range(7):
        want = sorted(range(min(s + 1, 4)))
        assert sorted(set(indices[0, s].tolist())) == want, (s, indices[0, s])


def test_a_new_cache_starting_with_one_token_does_not_see_an_earlier_sequence():
    """transformers 5.2-5.10 keep the DSA indexer's keys on the module and reset them only
    for a forward of several tokens; the patched indexer also resets when the forward has no
    past, so a one-token first step after another sequence's decode is that token alone."""
    from transformers import DynamicCache
    _, model = pair("glm_moe_dsa")
    model.eval()
    first = torch.randint(2, 64, (1, 10))
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        model(first[:, :8], past_key_values=cache, use_cache=True)
        model(first[:, 8:9], past_key_values=cache, use_cache=True)
        token = torch.tensor([[5]])
        fresh = DynamicCache(config=model.config)
        stepped = model(token, past_key_values=fresh, use_cache=True).logits
        alone = model(token, use_cache=False).logits
    assert_close(stepped, alone, tol=TOL)


def test_refusals():
    with pytest.raises(ValueError, match="glm_moe_dsa, glm4_moe, deepseek_v3, deepseek_v4"):
        gt.apply_glm_kernels(torch.nn.Linear(2, 2))
    model = make_model("qwen3_moe")
    with pytest.raises(TypeError, match="routing"):
        gt.apply_glm_kernels(model, routing=1)
    with pytest.raises(TypeError, match="indexer"):
        gt.apply_glm_kernels(model, indexer="yes")
    with pytest.raises(TypeError, match="model must be"):
        gt.apply_glm_kernels("model")


def test_a_method_with_other_arguments_is_refused_before_any_change(monkeypatch):
    """A transformers release whose indexer takes arguments no replacement was written for is
    refused, naming the flag that leaves it alone; nothing is patched, not even the
    router; indexer=False patches the router only."""
    model = make_model("glm_moe_dsa")
    modeling = _patch._modeling_module("glm_moe_dsa")

    def forward(self, hidden_states, q_resid, position_embeddings, attention_mask=None,
                position_ids=None, cache=None, index_topk=None):       # a future release
        raise AssertionError("not called")
    monkeypatch.setattr(modeling.GlmMoeDsaIndexer, "forward", forward)
    router = gt.routing_modules(model)[0]
    for apply in (lambda: gt.apply_glm_kernels(model),
                  gt.apply_glm_kernels_to_glm_moe_dsa):
        with pytest.raises(ValueError, match=r"GlmMoeDsaIndexer\.forward.*indexer=False"):
            apply()
        assert not _patch.is_patched(router, _method(router))
        assert modeling.GlmMoeDsaIndexer.forward is forward
    monkeypatch.undo()
    gt.apply_glm_kernels(model, indexer=False)
    assert _patch.is_patched(router, _method(router))
    monkeypatch.delattr(modeling, "GlmMoeDsaIndexer")          # a release without the class
    with pytest.raises(ValueError, match=r"no class GlmMoeDsaIndexer.*indexer=False"):
        gt.apply_glm_kernels_to_glm_moe_dsa()


def test_instance_patch_leaves_other_models_alone_and_class_patch_patches_new_ones(
        monkeypatch):
    ref_model, model = pair("deepseek_v3")
    method = _method(gt.routing_modules(model)[0])
    assert _patch.is_patched(gt.routing_modules(model)[0], method)
    assert not _patch.is_patched(gt.routing_modules(ref_model)[0], method)
    modeling = _patch._modeling_module("deepseek_v3")
    routing = next(p for p in _patch.installed_patches("deepseek_v3") if p.kind == "routing")
    cls = getattr(modeling, routing.cls_name)
    monkeypatch.setattr(cls, method, getattr(cls, method))              # restored after
    gt.apply_glm_kernels_to_deepseek_v3()
    fresh = make_model("deepseek_v3")
    assert _patch.is_patched(gt.routing_modules(fresh)[0], method)
    with NoTopk():
        out = fresh(torch.randint(2, 64, (2, 5))).logits
    assert torch.isfinite(out).all()


def _compiled_matches_eager(fn, hidden):
    x = hidden.clone().requires_grad_(True)
    y = hidden.clone().requires_grad_(True)
    torch._dynamo.reset()
    eager, out = fn(x), torch.compile(fn, fullgraph=True, backend="inductor")(y)
    for got, want in zip(out, eager):
        if got.is_floating_point():
            assert_close(got, want, tol=TOL)
        else:
            assert torch.equal(got, want)
    sum(o.square().sum() for o in eager if o.is_floating_point()).backward()
    sum(o.square().sum() for o in out if o.is_floating_point()).backward()
    assert_close(y.grad, x.grad, tol=TOL)


def test_compiled_patched_router_matches_eager():
    """torch.compile(fullgraph=True) with Inductor of a patched GLM-5 MoE layer's routing
    (its gate and the replaced routing method, either layout), forward and backward."""
    block = gt.routing_modules(pair("glm_moe_dsa")[1])[0]
    hidden = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(5))
    _compiled_matches_eager(lambda h: _route(block, h), hidden)


@pytest.mark.slow
def test_compiled_patched_moe_layer_matches_eager():
    """The whole patched GLM-5 MoE layer compiled (experts by transformers' batched_mm
    implementation: the eager one loops over data). ~80 s of Inductor on a loaded CPU."""
    _, model = pair("glm_moe_dsa")
    model.config._experts_implementation = "batched_mm"
    block = next(m for m in model.modules() if type(m).__name__ == "GlmMoeDsaMoE")
    hidden = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(5))
    _compiled_matches_eager(lambda h: (block(h),), hidden)
