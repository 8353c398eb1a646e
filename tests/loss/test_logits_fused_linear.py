"""fused_linear_icepop_loss: chunked over tokens; never a [tokens, V] tensor."""

import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import glm_kernels
from glm_kernels.loss.icepop import fused_linear
from glm_kernels.loss.icepop._reference import (fused_linear_icepop_loss_reference,
                                                icepop_loss_from_logits_reference)
from glm_kernels.loss.logprobs._reference import selective_logprobs_reference
from glm_kernels.loss.icepop.fused_linear import fused_linear_icepop_loss
from glm_kernels.loss._common.linear import make_fused_linear_config
from tests._compare import TOLERANCES, assert_close, assert_sum_close
from tests.loss._metrics import assert_metrics_close, metric_scales
from tests.conftest import DEVICE
from tests.loss.test_logits_logprobs import check_compiled_matches_eager

pytestmark = [pytest.mark.filterwarnings("ignore:invalid value encountered"),
              pytest.mark.filterwarnings("ignore:divide by zero encountered")]


def _inputs(b, t, v, h, *, seed, dtype=torch.float32, with_old=False):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(b, t, h, generator=g).to(dtype)
    weight = (torch.randn(v, h, generator=g) / h ** 0.5 * 3).to(dtype)
    ids = torch.randint(0, v, (b, t), generator=g)
    lp = selective_logprobs_reference(hidden.float() @ weight.float().t(), ids)
    rollout = lp + 0.6 * torch.randn(b, t, generator=g)
    old = lp + 0.2 * torch.randn(b, t, generator=g) if with_old else None
    adv = torch.randn(b, t, generator=g)
    mask = torch.rand(b, t, generator=g) > 0.2
    return tuple(None if x is None else x.to(DEVICE)
                 for x in (hidden, weight, ids, rollout, adv, mask, old))


def _run(fn, hidden, weight, *args, scale=1.0, **kw):
    h = hidden.detach().clone().requires_grad_(True)
    w = weight.detach().clone().requires_grad_(True)
    loss, metrics = fn(h, w, *args, return_metrics=True, **kw)
    (loss * scale).backward()
    return loss.detach(), h.grad, w.grad, metrics


@pytest.mark.parametrize("reduction", ["token_mean", "seq_mean_token_mean", "sum"])
@pytest.mark.parametrize("chunk_size", [4, 7, 100])       # 7 does not divide 15 tokens
@pytest.mark.parametrize("with_old", [False, True])
def test_matches_reference(any_backend, reduction, chunk_size, with_old):
    hidden, weight, ids, rollout, adv, mask, old = _inputs(3, 5, 130, 16, seed=chunk_size,
                                                           with_old=with_old)
    kw = dict(temperature=0.9, old_logprobs=old, reduction=reduction)
    got = _run(fused_linear_icepop_loss, hidden, weight, ids, rollout, adv, mask, scale=-2.0,
               chunk_size=chunk_size, **kw)
    ref = _run(fused_linear_icepop_loss_reference, hidden, weight, ids, rollout, adv, mask,
               scale=-2.0, **kw)
    with torch.no_grad():       # the same loss over |A|: every term one sign, no cancellation
        magnitude = fused_linear_icepop_loss_reference(hidden, weight, ids, rollout, adv.abs(),
                                                       mask, **kw)
    assert_sum_close(got[0], ref[0], magnitude, tol=TOLERANCES[torch.float32], name="loss")
    assert_close(got[1], ref[1], tol=1e-5, name="dhidden")
    assert_close(got[2], ref[2], tol=1e-5, name="dweight")
    lp = selective_logprobs_reference(hidden.float() @ weight.float().t(), ids, 0.9)
    scales = metric_scales(lp if old is None else old, rollout, mask,
                           also_finite=None if old is None else lp)
    assert_metrics_close(got[3], ref[3], scales)


def _bf16_logits_reference(hidden, weight, *args, **kw):
    """The unfused bf16 path: bf16 logits from the bf16 matmul, then the fp32 reference."""
    return icepop_loss_from_logits_reference(hidden @ weight.t(), *args, **kw)


def test_bf16(any_backend):
    hidden, weight, ids, rollout, adv, mask, _ = _inputs(2, 8, 300, 32, seed=1,
                                                         dtype=torch.bfloat16)
    got = _run(fused_linear_icepop_loss, hidden, weight, ids, rollout, adv, mask, chunk_size=5)
    ref = _run(_bf16_logits_reference, hidden, weight, ids, rollout, adv, mask)
    assert got[1].dtype == got[2].dtype == torch.bfloat16
    assert_close(got[0], ref[0], tol=1e-2, name="loss")
    assert_close(got[1].float(), ref[1].float(), tol=1e-2, name="dhidden")
    assert_close(got[2].float(), ref[2].float(), tol=1e-2, name="dweight")


def test_frozen_weight_and_no_grad(any_backend):
    hidden, weight, ids, rollout, adv, mask, _ = _inputs(2, 3, 60, 8, seed=2)
    h = hidden.clone().requires_grad_(True)
    fused_linear_icepop_loss(h, weight, ids, rollout, adv, mask, chunk_size=4).backward()
    h_ref = hidden.clone().requires_grad_(True)
    fused_linear_icepop_loss_reference(h_ref, weight, ids, rollout, adv, mask).backward()
    assert_close(h.grad, h_ref.grad, tol=1e-5, name="dhidden")
    with torch.no_grad():
        loss = fused_linear_icepop_loss(hidden, weight, ids, rollout, adv, mask)
    assert_close(loss, fused_linear_icepop_loss_reference(hidden, weight, ids, rollout, adv,
                                                          mask), tol=1e-5, name="loss")


class _LargestTensor(TorchDispatchMode):
    """Records the size in bytes of every tensor an aten op returns (the Triton interpreter's
    own byte views of kernel arguments included)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel() * t.element_size())
        return out


def test_no_tokens_by_vocab_tensor_is_allocated_or_saved(any_backend):
    n_tokens, v, h, chunk = 24, 90, 8, 5
    hidden, weight, ids, rollout, adv, mask, _ = _inputs(2, 12, v, h, seed=3)
    saved = []

    def run(fn, **kw):
        hh = hidden.clone().requires_grad_(True)
        ww = weight.clone().requires_grad_(True)
        tracker = _LargestTensor()
        with tracker, torch.autograd.graph.saved_tensors_hooks(
                lambda t: saved.append(t.numel()) or t, lambda t: t):
            fn(hh, ww, ids, rollout, adv, mask, **kw).backward()
        return tracker.largest

    ours = run(fused_linear_icepop_loss, chunk_size=chunk)
    assert ours == 4 * max(chunk * v, v * h)        # the fp32 chunk buffer or weight gradient
    assert max(saved) < n_tokens * v
    # The check can fail: the unfused reference does allocate [tokens, V].
    assert run(fused_linear_icepop_loss_reference) >= 4 * n_tokens * v


class _PeakLiveBytes(TorchDispatchMode):
    """The peak of the bytes held by live tensors that aten ops returned while active."""

    def __init__(self):
        super().__init__()
        self.live, self.peak, self.storages = 0, 0, set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key, nbytes = storage.data_ptr(), storage.nbytes()
            if nbytes == 0 or key in self.storages:            # views of a counted buffer
                continue
            self.storages.add(key)
            self.live += nbytes
            self.peak = max(self.peak, self.live)
            weakref.finalize(t, self._freed, key, nbytes)
        return out

    def _freed(self, key, nbytes):
        self.live -= nbytes
        self.storages.discard(key)


def test_memory_budget_covers_the_torch_backends_temporaries():
    """On the torch backend (the CPU path) the pass holds three [C, V] fp32 buffers beside the
    chunk: the budget counts them, so what the call allocates stays within it (plus the
    gradients any path returns)."""
    n_tokens, v, h = 64, 2000, 8
    hidden, weight, ids, rollout, adv, mask, _ = _inputs(4, 16, v, h, seed=8)
    hidden, weight = hidden.cpu().float(), weight.cpu().float()
    budget = 16 * v * (4 + 4 * fused_linear.TORCH_FP32_TEMPORARIES)     # 16 tokens a chunk
    gradients = 4 * (n_tokens * h + v * h)
    with glm_kernels.force_backend("torch"):
        tracker = _PeakLiveBytes()
        with tracker:
            fused_linear_icepop_loss(hidden.requires_grad_(True), weight.requires_grad_(True),
                                     ids.cpu(), rollout.cpu(), adv.cpu(), mask.cpu(),
                                     memory_budget=budget)
    assert tracker.peak <= budget + gradients + (64 << 10), (tracker.peak, budget)
    # The check can fail: counting only the chunk, the whole batch fits the budget at once.
    assert make_fused_linear_config(n_tokens, v, torch.float32,
                                    memory_budget=budget).chunk_size == n_tokens
    assert make_fused_linear_config(
        n_tokens, v, torch.float32, memory_budget=budget,
        fp32_temporaries=fused_linear.TORCH_FP32_TEMPORARIES).chunk_size == 16


def test_chunk_size_from_memory_budget():
    vocab = 154880
    cfg = make_fused_linear_config(65536, vocab, torch.bfloat16)
    assert cfg.chunk_size == 1664 and cfg.chunk_size * vocab * 2 <= 512 << 20
    assert make_fused_linear_config(100, vocab, torch.bfloat16).chunk_size == 100
    assert make_fused_linear_config(10 ** 6, vocab, torch.float32,
                                    memory_budget=1 << 30).chunk_size == 1664
    assert make_fused_linear_config(10, 50, torch.float32, memory_budget=1).chunk_size == 1
    assert make_fused_linear_config(10, 50, torch.float32, chunk_size=3).chunk_size == 3
    with pytest.raises(ValueError, match="chunk_size"):
        make_fused_linear_config(10, 50, torch.float32, chunk_size=0)
    with pytest.raises(ValueError, match="memory_budget"):
        make_fused_linear_config(10, 50, torch.float32, memory_budget=-5)


class TestBadInputs:
    def test_shapes_types_reduction(self):
        hidden, weight, ids, rollout, adv, mask, _ = _inputs(1, 4, 20, 8, seed=4)
        with pytest.raises(ValueError, match="hidden must be"):
            fused_linear_icepop_loss(hidden, weight[:, :5], ids, rollout, adv)
        with pytest.raises(TypeError, match="weight"):
            fused_linear_icepop_loss(hidden, weight.double(), ids, rollout, adv)
        with pytest.raises(ValueError, match="token_ids must have shape"):
            fused_linear_icepop_loss(hidden, weight, ids[:, :2], rollout, adv)
        with pytest.raises(ValueError, match="reduction='none'"):
            fused_linear_icepop_loss(hidden, weight, ids, rollout, adv, reduction="none")
        with pytest.raises(ValueError, match=r"token_ids must lie in \[0, 20\)"):
            fused_linear_icepop_loss(hidden, weight, ids + 20, rollout, adv)
        with pytest.raises(ValueError, match="advantages"):
            fused_linear_icepop_loss(hidden, weight, ids, rollout, adv[:, :3])


def test_torch_compile_fullgraph(any_backend):
    hidden, weight, ids, rollout, adv, mask, _ = _inputs(2, 5, 40, 8, seed=5)

    def step(h, w):
        return fused_linear_icepop_loss(h, w, ids, rollout, adv, mask, chunk_size=3) * 2.0
    check_compiled_matches_eager(step, hidden, weight)


def test_opcheck_custom_op():
    hidden, weight, ids, rollout, adv, mask = (t.cpu() for t in _inputs(1, 4, 20, 8,
                                                                          seed=6)[:6])
    args = (hidden.reshape(4, 8).clone().requires_grad_(True),
            weight.clone().requires_grad_(True), ids.reshape(-1), rollout.reshape(-1), None,
            adv.reshape(-1), mask.reshape(-1).view(torch.uint8), torch.full((4,), 0.25), 1.0,
            0.5, 2.0, 0.2, 0.28, 3.0, 3, True, True, True)
    with glm_kernels.force_backend("torch"):   # schema, fake, registered autograd, AOT dispatch
        torch.library.opcheck(fused_linear._fused_linear_op, args)


@pytest.mark.gpu
def test_gpu_glm5_vocab_bf16():
    hidden, weight, ids, rollout, adv, mask, _ = _inputs(2, 256, 154880, 512, seed=7,
                                                         dtype=torch.bfloat16)
    got = _run(fused_linear_icepop_loss, hidden, weight, ids, rollout, adv, mask,
               chunk_size=200)
    ref = _run(_bf16_logits_reference, hidden, weight, ids, rollout, adv, mask)
    assert_close(got[0], ref[0], tol=1e-2, name="loss")
    assert_close(got[1].float(), ref[1].float(), tol=1e-2, name="dhidden")
    assert_close(got[2].float(), ref[2].float(), tol=1e-2, name="dweight")
