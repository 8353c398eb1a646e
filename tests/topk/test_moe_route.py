"""noaux_tc MoE routing: kernel vs reference vs a per-token loop written from the rule."""
import math
import zlib

import pytest
import torch

import glm_kernels
from glm_kernels.topk import MoeRouteConfig, _reference, moe_route
from tests._compare import TOLERANCES, assert_close
from tests.conftest import DEVICE, HAS_CUDA

# (n_experts, n_group, topk_group, k): GLM-5 / DeepSeek-V3 (power-of-two group view), no
# groups, groups of one expert, groups over non-power-of-two experts (masked loop).
SHAPES = [(256, 8, 4, 8), (64, 1, 1, 6), (8, 8, 3, 2), (48, 4, 2, 5), (10, 5, 3, 3),
          (7, 7, 7, 7)]


def _seed(*case):
    return zlib.crc32(repr(case).encode()) % 10_000


def _inputs(tokens, n_experts, *, seed, ties=False, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    if ties:   # a handful of logits and biases: equal scores everywhere
        logits = torch.tensor([-1.0, 0.0, 0.5, 2.0])[torch.randint(0, 4, (tokens, n_experts),
                                                                    generator=gen)]
        bias = torch.tensor([0.0, 0.25])[torch.randint(0, 2, (n_experts,), generator=gen)]
    else:
        logits = torch.randn(tokens, n_experts, generator=gen) * 2
        bias = torch.randn(n_experts, generator=gen) * 0.1
    return logits.to(dtype).to(DEVICE), bias.to(DEVICE)


def route_by_hand(logits, k, *, scoring, bias, n_group, topk_group, renormalize, scaling):
    """The routing rule token by token, with plain Python sorting (ties: lower index)."""
    weights, ids = [], []
    for row in logits.double().cpu().tolist():
        if scoring == "sigmoid":
            scores = [1 / (1 + math.exp(-v)) for v in row]
        elif scoring == "sqrtsoftplus":
            scores = [math.sqrt(math.log1p(math.exp(v))) for v in row]
        else:
            top = max(row)
            exps = [math.exp(v - top) for v in row]
            scores = [e / sum(exps) for e in exps]
        biases = [0.0] * len(row) if bias is None else bias.tolist()
        choice = [s + b for s, b in zip(scores, biases)]
        size = len(row) // n_group
        group_score = [sum(sorted(choice[g * size:(g + 1) * size], reverse=True)[:2])
                       for g in range(n_group)]
        kept = sorted(range(n_group), key=lambda g: (-group_score[g], g))[:topk_group]
        eligible = [e for e in range(len(row)) if e // size in kept]
        chosen = sorted(eligible, key=lambda e: (-choice[e], e))[:k]
        w = [scores[e] for e in chosen]
        if renormalize:
            w = [v / (sum(w) + 1e-20) for v in w]
        weights.append([v * scaling for v in w])
        ids.append(chosen)
    return torch.tensor(weights), torch.tensor(ids)


@pytest.mark.parametrize("scoring", ["sigmoid", "softmax", "sqrtsoftplus"])
@pytest.mark.parametrize("shape", SHAPES)
def test_reference_matches_rule_by_hand(scoring, shape):
    n_experts, n_group, topk_group, k = shape
    for ties in (False, True):
        logits, bias = _inputs(6, n_experts, seed=_seed(scoring, shape, ties), ties=ties)
        kwargs = dict(scoring=scoring, bias=bias, n_group=n_group, topk_group=topk_group,
                      renormalize=True)
        w, ids = _reference.moe_route_reference(logits.cpu(), k, scaling_factor=2.5,
                                                **dict(kwargs, bias=bias.cpu()))
        hand_w, hand_ids = route_by_hand(logits, k, scaling=2.5, **kwargs)
        assert torch.equal(ids, hand_ids)
        assert_close(w.double(), hand_w, tol=TOLERANCES[torch.float32], name="weights")


def test_reference_matches_hf_sequence_without_ties():
    """HF DeepseekV3TopkRouter's torch ops agree whenever no score ties and kept groups hold
    enough positive choices (its 0.0 fill for dropped groups then never wins)."""
    logits, bias = _inputs(32, 256, seed=1)
    logits, bias = logits.cpu(), bias.cpu()
    scores = logits.sigmoid()
    choice = scores + bias
    group_scores = choice.view(-1, 8, 32).topk(2, dim=-1)[0].sum(-1)
    group_idx = torch.topk(group_scores, k=4, dim=-1, sorted=False)[1]
    mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
    mask = mask.unsqueeze(-1).expand(-1, 8, 32).reshape(-1, 256)
    ids = torch.topk(choice.masked_fill(~mask.bool(), 0.0), k=8, dim=-1, sorted=True)[1]
    weights = scores.gather(1, ids)
    weights = weights / (weights.sum(-1, keepdim=True) + 1e-20) * 2.5
    w, got_ids = _reference.moe_route_reference(logits, 8, bias=bias, n_group=8,
                                                topk_group=4, scaling_factor=2.5)
    assert torch.equal(got_ids, ids)
    # The reference's sigmoid is 1 / (1 + exp(-l)) (the kernel's, and batch-invariant on CPU,
    # which torch.sigmoid is not): within an ulp or two of HF's torch.sigmoid.
    assert_close(w, weights, tol=TOLERANCES[torch.float32])


@pytest.mark.parametrize("scoring", ["sigmoid", "softmax", "sqrtsoftplus"])
@pytest.mark.parametrize("shape", SHAPES)
def test_kernel_matches_reference(kernel_backend, scoring, shape):
    n_experts, n_group, topk_group, k = shape
    for ties, with_bias, renormalize in ((False, True, True), (True, True, False),
                                         (True, False, True)):
        logits, bias = _inputs(13, n_experts, seed=_seed(scoring, shape, ties), ties=ties)
        kwargs = dict(scoring=scoring, bias=bias if with_bias else None, n_group=n_group,
                      topk_group=topk_group, renormalize=renormalize, scaling_factor=2.5)
        w, ids = moe_route(logits, k, **kwargs)
        ref_w, ref_ids = _reference.moe_route_reference(logits, k, **kwargs)
        assert torch.equal(ids, ref_ids), f"ties={ties}\n{ids}\nvs\n{ref_ids}"
        assert w.dtype == torch.float32
        assert_close(w, ref_w, tol=1e-5, name="weights")


def test_low_precision_logits_and_leading_dims(any_backend):
    logits, bias = _inputs(2 * 5, 64, seed=3, dtype=torch.bfloat16)
    logits = logits.reshape(2, 5, 64)
    w, ids = moe_route(logits, 4, bias=bias, n_group=4, topk_group=2)
    ref_w, ref_ids = _reference.moe_route_reference(logits.float(), 4, bias=bias, n_group=4,
                                                    topk_group=2)
    assert ids.shape == (2, 5, 4) and torch.equal(ids, ref_ids)
    assert_close(w, ref_w, tol=1e-5, name="weights")


def test_same_bits_across_calls_and_batch_sizes(any_backend):
    logits, bias = _inputs(19, 256, seed=5, ties=True)
    first = moe_route(logits, 8, bias=bias, n_group=8, topk_group=4)
    again = moe_route(logits, 8, bias=bias, n_group=8, topk_group=4)
    assert torch.equal(first.ids, again.ids) and torch.equal(first.weights, again.weights)
    for rows in (1, 7):
        part = moe_route(logits[4:4 + rows], 8, bias=bias, n_group=8, topk_group=4)
        assert torch.equal(part.ids[0], first.ids[4])
        assert torch.equal(part.weights[0], first.weights[4])
    single = moe_route(logits, 8, bias=bias, n_group=8, topk_group=4,
                       config=MoeRouteConfig(rows_per_program=1))
    assert torch.equal(single.ids, first.ids) and torch.equal(single.weights, first.weights)


@pytest.mark.parametrize("scoring", ["sigmoid", "softmax", "sqrtsoftplus"])
@pytest.mark.parametrize("renormalize", [True, False])
def test_gradient_matches_reference_autograd(any_backend, scoring, renormalize):
    logits, bias = _inputs(9, 48, seed=_seed("grad", scoring, renormalize))
    upstream = torch.randn(9, 5, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    grads = []
    for fn in (moe_route, _reference.moe_route_reference):
        x = logits.clone().requires_grad_(True)
        w, _ = fn(x, 5, scoring=scoring, bias=bias, n_group=4, topk_group=2,
                  renormalize=renormalize, scaling_factor=1.5)
        (w * upstream).sum().backward()
        grads.append(x.grad)
    assert_close(grads[0], grads[1], tol=1e-5, name="d logits")


def test_empty_and_single_token(any_backend):
    w, ids = moe_route(torch.empty(0, 16, device=DEVICE), 2)
    assert w.shape == (0, 2) and ids.shape == (0, 2)
    w, ids = moe_route(torch.tensor([[0.0, 1.0, -1.0]], device=DEVICE), 3, renormalize=False)
    assert ids.tolist() == [[1, 0, 2]]
    assert_close(w, torch.tensor([[0.0, 1.0, -1.0]], device=DEVICE).sigmoid()[:, [1, 0, 2]],
                 tol=TOLERANCES[torch.float32])


def test_top1_weight_renormalized_is_one_megatron_keeps_the_score(any_backend):
    """k = 1: renormalize=True gives s / (s + 1e-20), exactly 1.0 down to s ~ 1.7e-13 (the
    docstring's bound) and just below 1 under it, with no gradient to the router; Megatron's
    sigmoid top-1 weight (normalized only when topk > 1) is the score: renormalize=False."""
    logits = torch.tensor([[-29.0, -40.0], [-29.5, -40.0], [0.3, -1.0], [4.0, 6.0]],
                          device=DEVICE, requires_grad=True)
    w, ids = moe_route(logits, 1, scaling_factor=2.5)
    score = logits.detach().sigmoid().gather(1, ids)
    assert ids.flatten().tolist() == [0, 0, 0, 1]
    assert w.flatten().tolist()[0] == 2.5 and w.flatten().tolist()[2:] == [2.5, 2.5]
    assert 0 < 2.5 - w.flatten().tolist()[1] < 1e-6              # s = 1.5e-13: s + 1e-20 > s
    w.sum().backward()
    assert float(logits.grad.abs().max()) < 1e-6
    megatron, _ = moe_route(logits.detach(), 1, renormalize=False, scaling_factor=2.5)
    assert_close(megatron, score * 2.5, tol=TOLERANCES[torch.float32])   # kernel sigmoid


def test_bad_inputs():
    logits = torch.randn(4, 16)
    with pytest.raises(ValueError, match="n_group=3 must divide n_experts=16"):
        moe_route(logits, 2, n_group=3)
    with pytest.raises(ValueError, match="topk_group=5 must be <= n_group=4"):
        moe_route(logits, 2, n_group=4, topk_group=5)
    with pytest.raises(ValueError, match="k=9 exceeds the 8 experts eligible"):
        moe_route(logits, 9, n_group=4, topk_group=2)
    with pytest.raises(ValueError, match="scoring='tanh'"):
        moe_route(logits, 2, scoring="tanh")
    with pytest.raises(ValueError, match=r"bias must have shape \[16\]"):
        moe_route(logits, 2, bias=torch.zeros(15))
    with pytest.raises(TypeError, match="router_logits must have dtype"):
        moe_route(logits.long(), 2)
    with pytest.raises(ValueError, match="k must be an int >= 1"):
        moe_route(logits, 0)
    with pytest.raises(ValueError, match="scaling_factor must be finite"):
        moe_route(logits, 2, scaling_factor=float("nan"))


def test_torch_compile_fullgraph(any_backend):
    logits, bias = _inputs(6, 32, seed=2)
    compiled = torch.compile(lambda x: moe_route(x, 4, bias=bias, n_group=4, topk_group=2),
                             fullgraph=True, backend="aot_eager")
    w, ids = compiled(logits)
    ref_w, ref_ids = _reference.moe_route_reference(logits, 4, bias=bias, n_group=4,
                                                    topk_group=2)
    assert torch.equal(ids, ref_ids)
    assert_close(w, ref_w, tol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_gpu_glm5_shape():
    logits, bias = _inputs(16384, 256, seed=0)
    w, ids = moe_route(logits, 8, bias=bias, n_group=8, topk_group=4, scaling_factor=2.5)
    with glm_kernels.force_backend("torch"):
        ref_w, ref_ids = moe_route(logits, 8, bias=bias, n_group=8, topk_group=4,
                                   scaling_factor=2.5)
    assert (ids == ref_ids).all(dim=1).float().mean() > 0.999   # sigmoid ulp differences
    again = moe_route(logits, 8, bias=bias, n_group=8, topk_group=4, scaling_factor=2.5)
    assert torch.equal(again.ids, ids) and torch.equal(again.weights, w)


@pytest.mark.parametrize("scoring", ["sigmoid", "softmax", "sqrtsoftplus"])
def test_routing_is_bitwise_batch_invariant(any_backend, scoring):
    """A token's ids and weights are the same bits alone, inside 70 tokens, and shuffled
    (CPU torch's own sigmoid / softplus give other bits in a vector's tail: the scores are
    written with position-independent ops)."""
    logits, bias = _inputs(70, 16, seed=_seed("invariant", scoring))
    kwargs = dict(scoring=scoring, bias=bias, n_group=4, topk_group=2, scaling_factor=2.5)
    batch = moe_route(logits, 3, **kwargs)
    perm = torch.randperm(70, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    shuffled = moe_route(logits[perm], 3, **kwargs)
    assert torch.equal(shuffled.ids, batch.ids[perm])
    assert torch.equal(shuffled.weights, batch.weights[perm])
    for i in (0, 1, 17, 69):
        alone = moe_route(logits[i:i + 1], 3, **kwargs)
        assert torch.equal(alone.ids[0], batch.ids[i])
        assert torch.equal(alone.weights[0], batch.weights[i])
