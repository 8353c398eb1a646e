"""Rollout routing replay (R3): ``moe_route(..., replay_ids=...)``, the mismatch flag and
``routing_mismatch``. Replayed ids come back bit for bit; their weights are the normal path's
expression (bitwise equal when the ids and their order agree); bad ids are refused."""
import zlib

import pytest
import torch

from glm_kernels.topk import MoeReplay, _reference, moe_route, routing_mismatch
from tests._compare import TOLERANCES, assert_close
from tests.conftest import DEVICE, LazyKernels
from tests.topk.test_moe_route import _inputs

_kernels = LazyKernels("glm_kernels.topk._kernels")

# (n_experts, n_group, topk_group, k): GLM-5 shape (power-of-two group view), no groups,
# groups over non-power-of-two experts (masked loop), k = n_experts.
SHAPES = [(256, 8, 4, 8), (64, 1, 1, 6), (48, 4, 2, 5), (10, 5, 3, 3), (7, 7, 7, 7)]


def _seed(*case):
    return zlib.crc32(repr(case).encode()) % 10_000


def _perturbed(ids, n_experts, *, seed):
    """A recorded routing that differs from ``ids`` on about half the tokens: one expert
    swapped for one the token did not choose (or only reordered, when all are chosen), and
    every token's order shuffled."""
    gen = torch.Generator().manual_seed(seed)
    out = ids.cpu().clone()
    for t in range(out.shape[0]):
        if torch.rand((), generator=gen) < 0.5:
            unused = [e for e in range(n_experts) if e not in out[t].tolist()]
            if unused:
                out[t, int(torch.randint(0, out.shape[1], (), generator=gen))] = unused[
                    int(torch.randint(0, len(unused), (), generator=gen))]
        out[t] = out[t][torch.randperm(out.shape[1], generator=gen)]
    return out.to(ids.device)


@pytest.mark.parametrize("scoring", ["sigmoid", "softmax"])
@pytest.mark.parametrize("shape", SHAPES)
def test_replaying_own_ids_gives_the_normal_routing_bitwise(any_backend, scoring, shape):
    n_experts, n_group, topk_group, k = shape
    for ties, renormalize in ((False, True), (True, False)):
        logits, bias = _inputs(13, n_experts, seed=_seed(scoring, shape, ties), ties=ties)
        kwargs = dict(scoring=scoring, bias=bias, n_group=n_group, topk_group=topk_group,
                      renormalize=renormalize, scaling_factor=2.5)
        w, ids = moe_route(logits, k, **kwargs)
        got = moe_route(logits, k, replay_ids=ids, return_mismatch=True, **kwargs)
        assert isinstance(got, MoeReplay)
        assert torch.equal(got.ids, ids)
        assert torch.equal(got.weights, w), "same ids, same order: the same weight bits"
        assert got.mismatch.dtype == torch.bool and not got.mismatch.any()
        # The same sets in another order: no mismatch, weights follow their ids.
        order = torch.argsort(torch.rand(ids.shape, generator=torch.Generator().manual_seed(1)),
                              dim=-1).to(ids.device)
        shuffled = moe_route(logits, k, replay_ids=ids.gather(-1, order), return_mismatch=True,
                             **kwargs)
        assert torch.equal(shuffled.ids, ids.gather(-1, order))
        assert not shuffled.mismatch.any()
        assert_close(shuffled.weights, w.gather(-1, order), tol=1e-5, name="shuffled weights")


@pytest.mark.parametrize("scoring", ["sigmoid", "softmax"])
@pytest.mark.parametrize("shape", SHAPES)
def test_replay_kernel_matches_reference(kernel_backend, scoring, shape):
    n_experts, n_group, topk_group, k = shape
    for ties, with_bias in ((False, True), (True, True), (True, False)):
        logits, bias = _inputs(19, n_experts, seed=_seed("replay", scoring, shape, ties),
                               ties=ties)
        kwargs = dict(scoring=scoring, bias=bias if with_bias else None, n_group=n_group,
                      topk_group=topk_group, scaling_factor=2.5)
        own = _reference.moe_route_reference(logits, k, **kwargs)[1]
        recorded = _perturbed(own, n_experts, seed=_seed(shape, ties))
        got = moe_route(logits, k, replay_ids=recorded, return_mismatch=True, **kwargs)
        ref_w, ref_ids = _reference.moe_route_reference(logits, k, replay_ids=recorded, **kwargs)
        want_mismatch = _reference.routing_mismatch_reference(own, recorded)
        assert torch.equal(got.ids, recorded) and torch.equal(ref_ids, recorded)
        assert_close(got.weights, ref_w, tol=1e-5, name="replayed weights")
        assert torch.equal(got.mismatch, want_mismatch)
        if k < n_experts:     # the perturbation changed some tokens' sets, not all
            assert want_mismatch.any() and not want_mismatch.all()
        plain = moe_route(logits, k, replay_ids=recorded, **kwargs)     # no mismatch asked
        assert not isinstance(plain, MoeReplay)
        assert torch.equal(plain.ids, got.ids) and torch.equal(plain.weights, got.weights)


def test_reference_replay_weights_by_hand():
    logits = torch.tensor([[0.0, 2.0, -1.0, 1.0], [3.0, -2.0, 0.5, 0.0]])
    recorded = torch.tensor([[2, 0], [3, 1]])
    w, ids = _reference.moe_route_reference(logits, 2, scoring="softmax", scaling_factor=3.0,
                                            replay_ids=recorded)
    probs = logits.softmax(-1)
    for t, (a, b) in enumerate(recorded.tolist()):
        pa, pb = probs[t, a].item(), probs[t, b].item()
        assert w[t].tolist() == pytest.approx([3 * pa / (pa + pb), 3 * pb / (pa + pb)],
                                              rel=TOLERANCES[torch.float32])
    assert torch.equal(ids, recorded)
    own = _reference.moe_route_reference(logits, 2, scoring="softmax")[1]
    assert own.tolist() == [[1, 3], [0, 2]]
    assert _reference.routing_mismatch_reference(own, recorded).tolist() == [True, True]
    assert _reference.routing_mismatch_reference(own, own.flip(-1)).tolist() == [False, False]


def test_replay_id_dtypes_and_leading_dims(any_backend):
    logits, bias = _inputs(2 * 5, 64, seed=3)
    logits = logits.reshape(2, 5, 64)
    own = moe_route(logits, 4, bias=bias, n_group=4, topk_group=2)
    recorded = _perturbed(own.ids.reshape(-1, 4), 64, seed=4).reshape(2, 5, 4)
    want = moe_route(logits, 4, bias=bias, n_group=4, topk_group=2, replay_ids=recorded,
                     return_mismatch=True)
    assert want.weights.shape == (2, 5, 4) and want.mismatch.shape == (2, 5)
    for dtype in (torch.int32, torch.int16, torch.uint8):
        got = moe_route(logits, 4, bias=bias, n_group=4, topk_group=2,
                        replay_ids=recorded.to(dtype), return_mismatch=True)
        assert got.ids.dtype == torch.int64 and torch.equal(got.ids, recorded)
        assert torch.equal(got.weights, want.weights)
        assert torch.equal(got.mismatch, want.mismatch)


def test_replay_outputs_do_not_alias_the_input(any_backend):
    logits, _ = _inputs(3, 8, seed=9)
    recorded = torch.tensor([[0, 1], [2, 3], [4, 5]], device=DEVICE)
    ids = moe_route(logits, 2, replay_ids=recorded).ids
    recorded[0, 0] = 7
    assert ids[0].tolist() == [0, 1]


@pytest.mark.parametrize("scoring", ["sigmoid", "softmax"])
def test_replay_gradient_matches_reference_autograd(any_backend, scoring):
    logits, bias = _inputs(9, 48, seed=_seed("grad-replay", scoring))
    own = _reference.moe_route_reference(logits, 5, bias=bias, n_group=4, topk_group=2)[1]
    recorded = _perturbed(own, 48, seed=2)
    upstream = torch.randn(9, 5, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    grads = []
    for fn in (moe_route, _reference.moe_route_reference):
        x = logits.clone().requires_grad_(True)
        w, ids = fn(x, 5, scoring=scoring, bias=bias, n_group=4, topk_group=2,
                    scaling_factor=1.5, replay_ids=recorded)
        assert torch.equal(ids, recorded)
        (w * upstream).sum().backward()
        grads.append(x.grad)
    assert_close(grads[0], grads[1], tol=1e-5, name="d logits")
    if scoring == "sigmoid":   # only the replayed experts' logits get a gradient
        touched = torch.zeros_like(logits, dtype=torch.bool).scatter(1, recorded, True)
        assert torch.equal(grads[0] != 0, touched)


def test_replay_empty_and_single_token(any_backend):
    got = moe_route(torch.empty(0, 16, device=DEVICE), 2,
                    replay_ids=torch.empty(0, 2, dtype=torch.int64, device=DEVICE),
                    return_mismatch=True)
    assert got.weights.shape == (0, 2) and got.ids.shape == (0, 2) and got.mismatch.shape == (0,)
    logits = torch.tensor([[0.0, 1.0, -1.0]], device=DEVICE)
    got = moe_route(logits, 2, renormalize=False, replay_ids=torch.tensor([[2, 0]]).to(DEVICE),
                    return_mismatch=True)
    assert got.ids.tolist() == [[2, 0]] and got.mismatch.tolist() == [True]
    assert_close(got.weights, logits.sigmoid()[:, [2, 0]], tol=TOLERANCES[torch.float32])


def test_poisoned_outputs_are_all_written(kernel_backend):
    """The launcher on NaN / -7 / 0xAB-filled outputs: every element is overwritten."""
    logits, bias = _inputs(21, 256, seed=11)
    own = _reference.moe_route_reference(logits, 8, bias=bias, n_group=8, topk_group=4)[1]
    recorded = _perturbed(own, 256, seed=12)
    ref_w = _reference.moe_route_reference(logits, 8, n_group=8, topk_group=4,
                                           replay_ids=recorded)[0]
    for with_mismatch in (True, False):
        weights = torch.full((21, 8), float("nan"))
        ids = torch.full((21, 8), -7, dtype=torch.int64)
        flags = torch.full((21,), 0xAB, dtype=torch.uint8) if with_mismatch else None
        _kernels.moe_route(logits, bias, recorded, weights, ids, flags, k=8, scoring=0,
                           n_group=8, topk_group=4, renormalize=True, scaling_factor=1.0,
                           eps=1e-20, rows_per_program=4, num_warps=4)
        assert torch.equal(ids, recorded)
        assert_close(weights, ref_w, tol=1e-5, name="weights")
        if with_mismatch:
            assert torch.equal(flags, _reference.routing_mismatch_reference(own, recorded)
                               .to(torch.uint8))


def test_bad_replay_ids_are_refused(any_backend):
    logits = torch.randn(4, 16, device=DEVICE)
    good = torch.arange(8, device=DEVICE).reshape(4, 2)
    with pytest.raises(TypeError, match="replay_ids must have dtype"):
        moe_route(logits, 2, replay_ids=good.float())
    with pytest.raises(TypeError, match="replay_ids must have dtype"):
        moe_route(logits, 2, replay_ids=good > 3)
    with pytest.raises(TypeError, match="replay_ids must be a torch.Tensor"):
        moe_route(logits, 2, replay_ids=good.tolist())
    with pytest.raises(ValueError, match=r"replay_ids must have shape \(4, 2\).*got shape \(4, 3\)"):
        moe_route(logits, 2, replay_ids=torch.zeros(4, 3, dtype=torch.int64, device=DEVICE))
    with pytest.raises(ValueError, match=r"replay_ids must have shape \(4, 2\)"):
        moe_route(logits, 2, replay_ids=good.reshape(8))
    with pytest.raises(ValueError, match=r"replay_ids must lie in \[0, 16\).*\[-1, 7\]"):
        moe_route(logits, 2, replay_ids=torch.where(good == 5, -1, good))
    with pytest.raises(ValueError, match=r"replay_ids must lie in \[0, 16\).*\[0, 16\]"):
        moe_route(logits, 2, replay_ids=torch.where(good == 5, 16, good))
    with pytest.raises(ValueError, match=r"distinct experts per token; token 2 has \[4, 4\]"):
        moe_route(logits, 2, replay_ids=torch.where(good == 5, 4, good))
    with pytest.raises(ValueError, match="return_mismatch=True needs replay_ids"):
        moe_route(logits, 2, return_mismatch=True)
    with pytest.raises(ValueError, match="replay_ids"):     # also when gradients are on
        moe_route(logits.requires_grad_(True), 2, replay_ids=torch.where(good == 0, 99, good))


def test_replay_under_torch_compile_fullgraph(any_backend):
    logits, bias = _inputs(6, 32, seed=2)
    own = _reference.moe_route_reference(logits, 4, bias=bias, n_group=4, topk_group=2)[1]
    recorded = _perturbed(own, 32, seed=3)
    compiled = torch.compile(lambda x, r: moe_route(x, 4, bias=bias, n_group=4, topk_group=2,
                                                    replay_ids=r, return_mismatch=True),
                             fullgraph=True, backend="aot_eager")
    got = compiled(logits, recorded)
    ref_w = _reference.moe_route_reference(logits, 4, n_group=4, topk_group=2,
                                           replay_ids=recorded)[0]
    assert torch.equal(got.ids, recorded)
    assert torch.equal(got.mismatch, _reference.routing_mismatch_reference(own, recorded))
    assert_close(got.weights, ref_w, tol=1e-5)


def test_routing_mismatch():
    a = torch.tensor([[[1, 6], [0, 2]], [[3, 4], [5, 7]]])
    b = torch.tensor([[[6, 1], [0, 3]], [[3, 4], [7, 6]]], dtype=torch.int32)
    assert routing_mismatch(a, b).tolist() == [[False, True], [False, True]]
    assert routing_mismatch(a[:0], b[:0]).shape == (0, 2)
    with pytest.raises(ValueError, match="other_ids must have the shape of ids"):
        routing_mismatch(a, b[:, :1])
    with pytest.raises(TypeError, match="other_ids must have dtype"):
        routing_mismatch(a, b.float())


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA GPU")
def test_gpu_glm5_shape_replay():
    import glm_kernels
    logits, bias = _inputs(16384, 256, seed=0)
    kwargs = dict(bias=bias, n_group=8, topk_group=4, scaling_factor=2.5)
    w, ids = moe_route(logits, 8, **kwargs)
    got = moe_route(logits, 8, replay_ids=ids, return_mismatch=True, **kwargs)
    assert torch.equal(got.ids, ids) and torch.equal(got.weights, w)
    assert not got.mismatch.any()
    with glm_kernels.force_backend("torch"):      # the rollout engine's routing, replayed
        ref_w, ref_ids = moe_route(logits, 8, **kwargs)
    got = moe_route(logits, 8, replay_ids=ref_ids, return_mismatch=True, **kwargs)
    assert torch.equal(got.ids, ref_ids)
    assert_close(got.weights, ref_w, tol=1e-5, name="weights")
    assert torch.equal(got.mismatch, routing_mismatch(ids, ref_ids))
