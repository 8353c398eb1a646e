"""torch's CUDA attention ops inside the whole-model mode: flash, memory-efficient and cuDNN
sdpa answered by the fixed-split attention. The mode runs below the backend kernels, so on CPU
the ops are called directly with CPU tensors (torch has no CPU kernel for them: only the
override can answer); their values against sdpa, their outputs laid out as torch's own (its
Meta kernels, where this torch has them), a decode step equal to the full forward's row and to
the CPU op's bits, and the calls they decline. On a GPU, a tiny Llama with sdpa end to end."""
import pytest
import torch
import torch.nn.functional as F

import glm_kernels
from glm_kernels.invariant import _fused_sdpa
from glm_kernels.invariant import mode as invariant_mode
from glm_kernels.testing import TOLERANCES, assert_bits_equal, assert_close

aten = torch.ops.aten
PRESENT = [name for name in _fused_sdpa.OPS if _fused_sdpa.handler(name, None) is not None]


def _inputs(t=5, length=7, seed=0, dv=8):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 4, t, 16, generator=g)
    k, v = torch.randn(2, 2, length, 16, generator=g), torch.randn(2, 2, length, dv, generator=g)
    visible = torch.ones(2, 1, t, length, dtype=torch.bool).tril(length - t)
    visible[1, ..., :2] = False                                    # row 1: 2 keys of padding
    return q, k, v, visible


def _takes_bias(name):
    return "attn_bias" in [a.name for a in getattr(aten, name).default._schema.arguments]


def _call(name, q, k, v, visible, **kwargs):
    """One op called as F.scaled_dot_product_attention calls it: efficient / cuDNN (torch >=
    2.5) with an additive bias, flash / cuDNN of torch 2.4 with no mask and equal head
    counts."""
    op = getattr(aten, name).default
    if not _takes_bias(name):
        return op(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), **kwargs)
    bias = torch.zeros(visible.shape, device=q.device).masked_fill(~visible, float("-inf"))
    return op(q, k, v, bias, True, **kwargs)


@pytest.mark.parametrize("backend", ["torch", "kernels"])
@pytest.mark.parametrize("name", PRESENT)
def test_values_match_sdpa(name, backend, request):
    if backend == "kernels":
        request.getfixturevalue("kernel_backend")
    q, k, v, visible = _inputs()
    if not _takes_bias(name):
        visible = torch.ones_like(visible)
    want = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1),
                                          v.repeat_interleave(2, 1), attn_mask=visible)
    with glm_kernels.batch_invariant():
        got = _call(name, q, k, v, visible)
    assert_close(got[0], want, tol=TOLERANCES[torch.float32], name=f"{name} output")
    scores = (q @ k.repeat_interleave(2, 1).transpose(-1, -2)) / 4.0
    lse = torch.logsumexp(scores.masked_fill(~visible, float("-inf")), -1)
    got_lse = got[1].reshape(*lse.shape[:2], -1)[..., :lse.shape[-1]]
    assert_close(got_lse, lse, tol=TOLERANCES[torch.float32], name=f"{name} logsumexp")


@pytest.mark.parametrize("name", PRESENT)
def test_outputs_are_laid_out_as_torch_lays_them_out(name):
    """Every return the op's autograd formula saves has torch's shape and dtype: compared with
    the op's Meta kernel where this torch has one (2.5 and newer), else with its schema
    (flash takes equal query and value head sizes)."""
    q, k, v, visible = _inputs(dv=16)
    with glm_kernels.batch_invariant():
        got = _call(name, q, k, v, visible)
    returns = getattr(aten, name).default._schema.returns
    assert len(got) == len(returns)
    try:
        meta = _call(name, q.to("meta"), k.to("meta"), v.to("meta"), visible.to("meta"))
    except NotImplementedError:
        pytest.skip(f"torch {torch.__version__} has no Meta kernel for {name}")
    for ret, ours, theirs in zip(returns, got, meta):
        if isinstance(theirs, torch.Tensor):
            assert isinstance(ours, torch.Tensor), ret.name
            assert (tuple(ours.shape), ours.dtype) == (tuple(theirs.shape), theirs.dtype), \
                ret.name
        elif not isinstance(theirs, torch.Tensor):
            assert ours == theirs, ret.name


@pytest.mark.parametrize("name", [n for n in PRESENT if _takes_bias(n)])
def test_decode_step_has_the_full_forward_bits(name):
    """A query decoded against its KV cache (the keys it sees, behind 2 keys of left padding)
    equals its row of a full forward, and the CPU sdpa op's bits for the same inputs."""
    q, k, v, visible = _inputs(t=7, length=7)
    with glm_kernels.batch_invariant():
        full = _call(name, q, k, v, visible)[0]
        cpu_op = aten._scaled_dot_product_flash_attention_for_cpu(
            q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), attn_mask=visible)[0]
        step = _call(name, q[1:, :, 4:5], k[1:, :, :5], v[1:, :, :5], visible[1:, :, 4:5, :5])[0]
    assert_bits_equal(step[:, :, 0], full[1:, :, 4], name=f"{name}: decode vs full forward")
    assert_bits_equal(full, cpu_op, name=f"{name} vs the CPU op")


@pytest.mark.parametrize("name", PRESENT)
def test_dropout_and_unaligned_causal_calls_are_declined(name):
    impl = invariant_mode.COVERED[getattr(aten, name).default]
    q, k, v, _ = _inputs(t=3, length=7)
    k, v = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    extra = [None, True] if _takes_bias(name) else []
    assert impl(q, k, v, *extra, dropout_p=0.1) is NotImplemented
    assert impl(q, k, v, *extra, is_causal=True) is NotImplemented        # T 3 != L 7
    square = impl(q, k[:, :, :3], v[:, :, :3], *extra, is_causal=True)
    assert square is not NotImplemented and square[0].shape == (2, 4, 3, 8)


def test_an_unknown_return_layout_stays_uncovered(monkeypatch):
    """A torch whose op returns something this module does not know is left uncovered (and
    reported by name when it runs), never answered with a guessed tuple."""
    monkeypatch.setattr(_fused_sdpa, "_KNOWN_RETURNS", frozenset(("output",)))
    assert _fused_sdpa.handler(PRESENT[0], None) is None
    assert _fused_sdpa.handler("_no_such_attention_op", None) is None


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gpu_llama_with_sdpa_is_bitwise_on_policy(dtype):
    """CUDA sdpa end to end: the rollout's KV-cache decode equals the full forwards to the bit,
    and the training backward through torch's own sdpa backward kernels (fed the override's
    outputs) gives torch's gradients within tolerance."""
    from glm_kernels.testing import assert_batch_invariant, tiny_causal_lm
    pytest.importorskip("transformers")
    model = tiny_causal_lm("llama", dtype).cuda()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, 96, (n,), generator=g) for n in (3, 6)]
    with glm_kernels.batch_invariant():
        report = assert_batch_invariant(model, prompts, max_new_tokens=3)
    assert (report["alone"], report["batch"], report["shuffled"]) == (0, 0, 0)
    ids = torch.randint(1, 96, (3, 9), generator=g).cuda()
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    grads = {}
    for on in (False, True):
        model.zero_grad()
        with glm_kernels.batch_invariant(on):
            logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
            torch.log_softmax(logits.float(), -1)[..., 5][mask.bool()].sum().backward()
        grads[on] = torch.cat([p.grad.flatten().float() for p in model.parameters()
                               if p.grad is not None])
    assert torch.isfinite(grads[True]).all()
    assert_close(grads[True], grads[False], tol=TOLERANCES[dtype], name="gradients")
