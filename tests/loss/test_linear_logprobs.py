"""fused_linear_logprobs: per-token log-probs and entropy of hidden @ weight.T, chunked over
tokens, never a [tokens, V] tensor; against selective_logprobs on the materialised logits,
TRL 1.16's own fused LM head (``trl.kernels.chunked_logprob.ChunkedLogProbFunction``, what
its GRPO trainer runs for log-probs and entropy) and verl's ``entropy_from_logits``."""
import numpy as np
import pytest
import torch

import glm_kernels
from glm_kernels import fused_linear_logprobs, selective_logprobs
from glm_kernels.loss.logprobs import linear as linear_logprobs
from glm_kernels.loss._common.linear import make_fused_linear_config
from glm_kernels.testing import rel_error
from tests._compare import TOLERANCES, assert_close
from tests.conftest import DEVICE
from tests.loss.test_logits_fused_linear import _LargestTensor, _PeakLiveBytes
from tests.test_compile_inductor import check_compiled_matches_eager

FP32 = TOLERANCES[torch.float32]
BF16 = TOLERANCES[torch.bfloat16]


def _inputs(b, t, v, h, *, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(b, t, h, generator=g).to(dtype)
    weight = (torch.randn(v, h, generator=g) / h ** 0.5 * 3).to(dtype)
    ids = torch.randint(0, v, (b, t), generator=g)
    grad_lp, grad_ent = torch.randn(b, t, generator=g), torch.randn(b, t, generator=g)
    return tuple(x.to(DEVICE) for x in (hidden, weight, ids, grad_lp, grad_ent))


def _run(fn, hidden, weight, grad_lp, grad_ent):
    """fn(h, w) -> (lp, entropy or None); backward of sum(grad_lp lp + grad_ent H), where an
    upstream gradient that is None leaves that output out of the loss."""
    h = hidden.detach().clone().requires_grad_(True)
    w = weight.detach().clone().requires_grad_(True)
    lp, entropy = fn(h, w)
    loss = 0.0
    if grad_lp is not None:
        loss = loss + (lp * grad_lp).sum()
    if grad_ent is not None:
        loss = loss + (entropy * grad_ent).sum()
    loss.backward()
    detach = lambda t: None if t is None else t.detach()        # noqa: E731
    return detach(lp), detach(entropy), h.grad, w.grad


def _ours(ids, temperature, chunk_size, entropy=True):
    def fn(h, w):
        out = fused_linear_logprobs(h, w, ids, temperature=temperature, chunk_size=chunk_size,
                                    return_entropy=entropy)
        return out if entropy else (out, None)
    return fn


def _materialised(ids, temperature, entropy=True):
    """The unfused path: logits = hidden @ weight.T in the input dtype, then
    selective_logprobs."""
    def fn(h, w):
        out = selective_logprobs(h @ w.t(), ids, temperature=temperature,
                                 return_entropy=entropy)
        return out if entropy else (out, None)
    return fn


def _trl(ids, temperature):
    """TRL's own fused LM head, as its GRPO trainer calls it (vocab chunks of 32 columns)."""
    chunked_logprob = pytest.importorskip("trl.kernels.chunked_logprob")

    def fn(h, w):
        lp, entropy, *_ = chunked_logprob.ChunkedLogProbFunction.apply(
            h.reshape(-1, h.shape[-1]), w, None, ids.reshape(-1), temperature, 32, None, 1.0,
            ("entropy",))
        return lp.reshape(ids.shape), entropy.reshape(ids.shape)
    return fn


@pytest.mark.parametrize("chunk_size", [4, 7, 100])        # 7 does not divide 15 tokens
@pytest.mark.parametrize("temperature", [1.0, 0.8])
@pytest.mark.parametrize("grads", ["both", "logprobs only", "entropy only"])
def test_matches_materialised_logits(any_backend, chunk_size, temperature, grads):
    hidden, weight, ids, grad_lp, grad_ent = _inputs(3, 5, 130, 16, seed=chunk_size)
    grad_lp = None if grads == "entropy only" else grad_lp
    grad_ent = None if grads == "logprobs only" else grad_ent
    got = _run(_ours(ids, temperature, chunk_size), hidden, weight, grad_lp, grad_ent)
    ref = _run(_materialised(ids, temperature), hidden, weight, grad_lp, grad_ent)
    for a, b, name in zip(got, ref, ("logprobs", "entropy", "dhidden", "dweight")):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert_close(a, b, tol=FP32, name=name)


def test_without_entropy(any_backend):
    hidden, weight, ids, grad_lp, _ = _inputs(2, 6, 90, 8, seed=1)
    got = _run(_ours(ids, 0.7, 5, entropy=False), hidden, weight, grad_lp, None)
    ref = _run(_materialised(ids, 0.7, entropy=False), hidden, weight, grad_lp, None)
    for a, b, name in zip(got[::2] + got[3:], ref[::2] + ref[3:], ("lp", "dhidden", "dweight")):
        assert_close(a, b, tol=FP32, name=name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_matches_trl_fused_lm_head(any_backend, dtype, temperature):
    """Both sum the weight gradient over chunks in fp32 and round once (TRL over vocab tiles
    of 32 columns, ours over 3 token chunks)."""
    hidden, weight, ids, grad_lp, grad_ent = _inputs(3, 8, 200, 16, seed=2, dtype=dtype)
    got = _run(_ours(ids, temperature, 9), hidden, weight, grad_lp, grad_ent)
    ref = _run(_trl(ids, temperature), hidden, weight, grad_lp, grad_ent)
    tol = TOLERANCES[dtype]
    assert got[2].dtype == got[3].dtype == dtype
    assert_close(got[0], ref[0], tol=max(tol / 10, FP32), name="logprobs vs TRL")
    assert_close(got[1], ref[1], tol=max(tol / 10, FP32), name="entropy vs TRL")
    assert_close(got[2].float(), ref[2].float(), tol=tol, name="dhidden vs TRL")
    assert_close(got[3].float(), ref[3].float(), tol=tol, name="dweight vs TRL")


def test_fp32_weight_grad_keeps_many_chunks_accurate():
    """bf16 weights, 128 token chunks: summed in fp32 (the default) the weight gradient is as
    accurate as TRL's (fp32 sums, one rounding); summed in bf16 it loses accuracy with every
    chunk (the check fails if the fp32 sum were not used: the two errors then agree)."""
    hidden, weight, ids, grad_lp, grad_ent = (t.cpu() for t in _inputs(
        1, 2048, 256, 16, seed=14, dtype=torch.bfloat16))
    exact = _run(_materialised(ids, 1.0), hidden.double(), weight.double(), grad_lp, grad_ent)
    trl = _run(_trl(ids, 1.0), hidden, weight, grad_lp, grad_ent)

    def weight_grad_error(fp32_weight_grad):
        def fn(h, w):
            return fused_linear_logprobs(h, w, ids, return_entropy=True, chunk_size=16,
                                         fp32_weight_grad=fp32_weight_grad)
        with glm_kernels.force_backend("torch"):
            got = _run(fn, hidden, weight, grad_lp, grad_ent)
        assert got[3].dtype == torch.bfloat16
        return rel_error(got[3], exact[3])

    trl_error = rel_error(trl[3], exact[3])
    assert weight_grad_error(True) <= 1.05 * trl_error
    assert weight_grad_error(False) > 1.5 * trl_error


def test_entropy_matches_verl(any_backend):
    """verl's actor: logits / T, then its ``entropy_from_logits``; value and gradient."""
    verl_functional = pytest.importorskip("verl.utils.torch_functional")
    hidden, weight, ids, _, grad_ent = _inputs(2, 7, 150, 16, seed=3)

    def verl_fn(h, w):
        return None, verl_functional.entropy_from_logits((h @ w.t()) / 0.9)
    got = _run(_ours(ids, 0.9, 4), hidden, weight, None, grad_ent)
    ref = _run(verl_fn, hidden, weight, None, grad_ent)
    for a, b, name in zip(got[1:], ref[1:], ("entropy", "dhidden", "dweight")):
        assert_close(a, b, tol=FP32, name=f"{name} vs verl")


def test_bf16_matches_unfused_bf16(any_backend):
    hidden, weight, ids, grad_lp, grad_ent = _inputs(2, 8, 300, 32, seed=4,
                                                     dtype=torch.bfloat16)
    got = _run(_ours(ids, 1.0, 5), hidden, weight, grad_lp, grad_ent)
    ref = _run(_materialised(ids, 1.0), hidden, weight, grad_lp, grad_ent)
    assert_close(got[0], ref[0], tol=FP32, name="logprobs")        # the same bf16 logits
    assert_close(got[1], ref[1], tol=FP32, name="entropy")
    assert_close(got[2].float(), ref[2].float(), tol=BF16, name="dhidden")
    assert_close(got[3].float(), ref[3].float(), tol=BF16, name="dweight")


def test_fp16_int32_ids_strided_hidden_and_frozen_hidden(any_backend):
    """fp16, int32 ids, a non-contiguous hidden (a slice of a wider buffer) and a frozen
    hidden: only the weight gets a gradient."""
    hidden, weight, ids, grad_lp, grad_ent = _inputs(2, 6, 70, 16, seed=15,
                                                     dtype=torch.float16)
    wide = torch.stack([hidden, hidden], -1)[..., 0]             # strided, same values
    assert not wide.is_contiguous() and torch.equal(wide, hidden)
    w = weight.clone().requires_grad_(True)
    lp, ent = fused_linear_logprobs(wide, w, ids.int(), return_entropy=True, chunk_size=5)
    ((lp * grad_lp).sum() + (ent * grad_ent).sum()).backward()
    ref = _run(_materialised(ids, 1.0), hidden, weight, grad_lp, grad_ent)
    assert_close(lp, ref[0], tol=FP32, name="logprobs")
    assert_close(ent, ref[1], tol=FP32, name="entropy")
    assert w.grad.dtype == torch.float16
    assert_close(w.grad.float(), ref[3].float(), tol=TOLERANCES[torch.float16], name="dweight")


def test_frozen_weight_no_grad_and_empty(any_backend):
    hidden, weight, ids, grad_lp, grad_ent = _inputs(2, 3, 60, 8, seed=5)
    h = hidden.clone().requires_grad_(True)
    lp, ent = fused_linear_logprobs(h, weight, ids, return_entropy=True, chunk_size=4)
    ((lp * grad_lp).sum() + (ent * grad_ent).sum()).backward()
    ref = _run(_materialised(ids, 1.0), hidden, weight, grad_lp, grad_ent)
    assert_close(h.grad, ref[2], tol=FP32, name="dhidden")
    with torch.no_grad():
        lp = fused_linear_logprobs(hidden, weight, ids)
    assert not lp.requires_grad
    assert_close(lp, ref[0], tol=FP32, name="logprobs under no_grad")
    empty_h = hidden[:, :0].clone().requires_grad_(True)
    lp, ent = fused_linear_logprobs(empty_h, weight, ids[:, :0], return_entropy=True)
    assert lp.shape == ent.shape == (2, 0)
    (lp.sum() + ent.sum()).backward()
    assert empty_h.grad.shape == empty_h.shape


def test_no_tokens_by_vocab_tensor_is_allocated_or_saved(any_backend):
    n_tokens, v, h, chunk = 24, 90, 8, 5
    hidden, weight, ids, grad_lp, grad_ent = _inputs(2, 12, v, h, seed=6)
    saved = []

    def run(fn):
        tracker = _LargestTensor()
        with tracker, torch.autograd.graph.saved_tensors_hooks(
                lambda t: saved.append(t.numel()) or t, lambda t: t):
            _run(fn, hidden, weight, grad_lp, grad_ent)
        return tracker.largest

    largest = run(_ours(ids, 1.0, chunk))
    assert largest == 4 * max(chunk * v, v * h)      # the fp32 chunk buffer or weight gradient
    assert max(saved) < n_tokens * v
    # The check can fail: the materialised path does allocate [tokens, V].
    assert run(_materialised(ids, 1.0)) >= 4 * n_tokens * v


def test_memory_budget_covers_the_torch_backends_temporaries():
    """The torch backend (CPU path) holds fp32 [C, V] buffers beside the chunk in each pass;
    the budget counts TORCH_FP32_TEMPORARIES of them, and forward + backward stay within it
    (plus the gradients any path returns)."""
    n_tokens, v, h = 64, 2000, 8
    hidden, weight, ids, grad_lp, grad_ent = (t.cpu() for t in _inputs(4, 16, v, h, seed=7))
    budget = 16 * v * (4 + 4 * linear_logprobs.TORCH_FP32_TEMPORARIES)      # 16 tokens a chunk
    gradients = 4 * (n_tokens * h + v * h)
    with glm_kernels.force_backend("torch"):
        tracker = _PeakLiveBytes()
        hh, ww = hidden.requires_grad_(True), weight.requires_grad_(True)
        with tracker:
            lp, ent = fused_linear_logprobs(hh, ww, ids, return_entropy=True,
                                            memory_budget=budget)
            ((lp * grad_lp).sum() + (ent * grad_ent).sum()).backward()
    assert tracker.peak <= budget + gradients + (64 << 10), (tracker.peak, budget)
    # The check can fail: one fewer temporary and the measured peak exceeds its budget.
    assert tracker.peak > 16 * v * (4 + 4 * (linear_logprobs.TORCH_FP32_TEMPORARIES - 1))
    assert make_fused_linear_config(
        n_tokens, v, torch.float32, memory_budget=budget,
        fp32_temporaries=linear_logprobs.TORCH_FP32_TEMPORARIES).chunk_size == 16


class TestBadInputs:
    def test_messages_name_the_argument(self):
        hidden, weight, ids, _, _ = _inputs(1, 4, 20, 8, seed=8)
        with pytest.raises(ValueError, match="hidden must be"):
            fused_linear_logprobs(hidden, weight[:, :5], ids)
        with pytest.raises(TypeError, match="weight"):
            fused_linear_logprobs(hidden, weight.double(), ids)
        with pytest.raises(ValueError, match="token_ids must have shape"):
            fused_linear_logprobs(hidden, weight, ids[:, :2])
        with pytest.raises(TypeError, match="token_ids"):
            fused_linear_logprobs(hidden, weight, ids.float())
        with pytest.raises(ValueError, match="temperature"):
            fused_linear_logprobs(hidden, weight, ids, temperature=0.0)
        with pytest.raises(ValueError, match="chunk_size"):
            fused_linear_logprobs(hidden, weight, ids, chunk_size=0)
        with pytest.raises(ValueError, match="memory_budget"):
            fused_linear_logprobs(hidden, weight, ids, memory_budget=-1)

    @pytest.mark.parametrize("value", ["no", np.bool_(True), 1, None])
    @pytest.mark.parametrize("flag", ["return_entropy", "fp32_weight_grad"])
    def test_flags_take_bool_only(self, flag, value):
        hidden, weight, ids, _, _ = _inputs(1, 4, 20, 8, seed=8)
        with pytest.raises(TypeError, match=flag):
            fused_linear_logprobs(hidden, weight, ids, **{flag: value})

    def test_out_of_range_ids_on_cpu(self):
        hidden, weight, ids, _, _ = (t.cpu() for t in _inputs(1, 4, 20, 8, seed=9))
        with pytest.raises(ValueError, match=r"token_ids must lie in \[0, 20\)"):
            fused_linear_logprobs(hidden, weight, ids + 20)


def test_torch_compile_fullgraph_inductor(any_backend):
    """torch.compile(fullgraph=True) with the default Inductor backend (aot_eager without a
    C++ compiler, as tests/test_compile_inductor.py): forward and backward equal eager, for
    each float dtype, with and without the entropy."""
    torch._dynamo.reset()
    ids = torch.randint(0, 23, (2, 5), generator=torch.Generator().manual_seed(10)).to(DEVICE)
    leaves = []
    for i, dt in enumerate((torch.float32, torch.bfloat16, torch.float16)):
        g = torch.Generator().manual_seed(11 + i)
        leaves += [torch.randn(2, 5, 8, generator=g).to(dt).to(DEVICE),
                   (torch.randn(23, 8, generator=g) * 0.5).to(dt).to(DEVICE)]

    def step(*tensors):
        outs = []
        for hidden, weight in zip(tensors[0::2], tensors[1::2]):
            lp, ent = fused_linear_logprobs(hidden, weight, ids, temperature=0.9,
                                            return_entropy=True, chunk_size=3)
            outs += [lp, ent, fused_linear_logprobs(hidden, weight, ids, chunk_size=4)]
        loss = sum((o * (k + 1)).sum() for k, o in enumerate(outs))
        return (loss,) + tuple(outs)
    check_compiled_matches_eager(step, leaves)


def test_opcheck_custom_ops():
    hidden, weight, ids, grad_lp, grad_ent = (t.cpu() for t in _inputs(1, 4, 20, 8, seed=12))
    hidden, ids = hidden.reshape(4, 8), ids.reshape(-1)
    lse = torch.logsumexp(hidden @ weight.t(), -1)
    utils = ("test_schema", "test_faketensor")
    with glm_kernels.force_backend("torch"):
        for entropy in (True, False):   # schema, fake, registered autograd, AOT dispatch
            torch.library.opcheck(linear_logprobs._fused_linear_logprobs_op,
                                  (hidden.clone().requires_grad_(True),
                                   weight.clone().requires_grad_(True), ids, 1.0, entropy, 3,
                                   True))
        torch.library.opcheck(linear_logprobs._backward_op,
                              (hidden, weight, ids, lse, torch.rand(4), grad_lp.reshape(-1),
                               grad_ent.reshape(-1), 1.0, 3, True, True, True),
                              test_utils=utils)
        torch.library.opcheck(linear_logprobs._backward_op,
                              (hidden, weight, ids, lse, torch.rand(0), grad_lp.reshape(-1),
                               None, 1.0, 3, False, True, False), test_utils=utils)
        torch.library.opcheck(linear_logprobs._backward_op,
                              (hidden.bfloat16(), weight.bfloat16(), ids, lse, torch.rand(0),
                               grad_lp.reshape(-1), None, 1.0, 3, True, True, True),
                              test_utils=utils)


@pytest.mark.gpu
def test_gpu_glm5_vocab_bf16():
    hidden, weight, ids, grad_lp, grad_ent = _inputs(2, 256, 154880, 512, seed=13,
                                                     dtype=torch.bfloat16)
    got = _run(_ours(ids, 1.0, 200), hidden, weight, grad_lp, grad_ent)
    ref = _run(_trl(ids, 1.0), hidden, weight, grad_lp, grad_ent)
    assert_close(got[0], ref[0], tol=BF16, name="logprobs")
    assert_close(got[1], ref[1], tol=BF16, name="entropy")
    assert_close(got[2].float(), ref[2].float(), tol=BF16, name="dhidden")
    assert_close(got[3].float(), ref[3].float(), tol=BF16, name="dweight")


def test_docstring_example():
    import doctest
    with glm_kernels.force_backend("torch"):
        result = doctest.testmod(linear_logprobs, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0
