"""Dual-clip PPO in the IcePop losses (``dual_clip``): hand values, written-out trainer
formulas (slime / verl ``clip_ratio_c``, TRL ``delta``), kernels vs reference, bad values."""
import math

import pytest
import torch

import glm_kernels
from glm_kernels.loss.icepop import _reference
from glm_kernels.loss import fused_linear_icepop_loss, icepop_loss_from_logits
from glm_kernels.loss.icepop._reference import (fused_linear_icepop_loss_reference,
                                                icepop_loss_from_logits_reference)
from glm_kernels.loss.logprobs._reference import selective_logprobs_reference
from tests._compare import TOLERANCES, assert_close, assert_sum_close
from tests.conftest import DEVICE

FP32 = TOLERANCES[torch.float32]
WIDE = dict(gate_low=0.0, gate_high=1e6)        # a gate that keeps every finite ratio


def _tokens(n, *, seed, spread=1.0, with_old=False):
    """Log-ratios e^N(0, spread): many tokens beyond a cap of 3 (e^1.1), both signs of A."""
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(n, generator=g) * 3
    rollout = lp - torch.randn(n, generator=g) * spread
    old = lp - torch.randn(n, generator=g) * spread if with_old else None
    adv = torch.randn(n, generator=g)
    mask = torch.rand(n, generator=g) > 0.2
    return tuple(None if t is None else t.to(DEVICE) for t in (lp, rollout, adv, mask, old))


def _loss_and_grad(fn, lp, *args, **kw):
    x = lp.detach().clone().requires_grad_(True)
    loss = fn(x, *args, **kw)
    weights = torch.linspace(0.5, 1.5, loss.numel(), device=loss.device).reshape(loss.shape)
    (loss * weights).sum().backward()
    return loss.detach(), x.grad


def test_reference_by_hand():
    # coupled, wide gate: r = e^(lp - rollout) = 5, 2.5, 5; A = -1, -1, +1; cap c = 3
    lp = torch.log(torch.tensor([5.0, 2.5, 5.0])).requires_grad_(True)
    rollout = torch.zeros(3)
    adv = torch.tensor([-1.0, -1.0, 1.0])
    loss = _reference.icepop_loss_reference(lp, rollout, adv, reduction="none", dual_clip=3.0,
                                            **WIDE)
    # A < 0: max(-rA, -clip(r)A) = r, capped at 3 (5 -> 3; 2.5 stays); A > 0: -clip(5) = -1.28
    assert torch.allclose(loss, torch.tensor([3.0, 2.5, -1.28]))
    loss.sum().backward()
    # the capped term is a constant; 2.5 = r (d(-rA)/dlp = -rA); the clipped A > 0 token: 0
    assert lp.grad.tolist() == pytest.approx([0.0, 2.5, 0.0])
    off = _reference.icepop_loss_reference(lp.detach(), rollout, adv, reduction="none", **WIDE)
    assert off.tolist() == pytest.approx([5.0, 2.5, -1.28])


@pytest.mark.parametrize("with_old", [False, True])
def test_written_out_gradient_matches_autograd(with_old):
    lp, rollout, adv, mask, old = (t.cpu() if t is not None else None
                                   for t in _tokens(3000, seed=1, with_old=with_old))
    kw = dict(old_logprobs=old, gate_low=0.2, gate_high=5.0, eps_low=0.2, eps_high=0.28,
              dual_clip=3.0)
    x = lp.clone().requires_grad_(True)
    _reference.icepop_token_terms(x, rollout, adv, mask, **kw)[0].sum().backward()
    written = _reference.icepop_token_grad(lp, rollout, adv, mask, **kw)
    # (decoupled: w r A in another order than autograd's: rounding, not bits)
    assert_close(written, x.grad, tol=FP32, name="written-out gradient")
    assert torch.equal(written == 0, x.grad == 0)        # the same tokens are cut
    capped = (adv < 0) & (written == 0) & mask
    assert capped.sum() > 100            # the check can fail: many tokens hit the cap


def _slime_policy_loss(lp, old, adv, eps_clip, eps_clip_high, eps_clip_c):
    """slime's compute_policy_loss (ppo_utils.py) written out: ratio = e^(lp - old)."""
    ratio = torch.exp(lp - old)
    loss1 = -ratio * adv
    loss2 = -ratio.clamp(1 - eps_clip, 1 + eps_clip_high) * adv
    clipped = torch.maximum(loss1, loss2)
    return torch.where(adv < 0, torch.minimum(-eps_clip_c * adv, clipped), clipped)


def _trl_policy_loss(lp, old, adv, epsilon_low, epsilon_high, delta):
    """TRL's GRPO per-token loss with two-sided clipping (``delta``) written out."""
    coef_1 = torch.exp(lp - old)
    coef_2 = coef_1.clamp(1 - epsilon_low, 1 + epsilon_high)
    coef_1 = coef_1.clamp(max=delta)
    return -torch.minimum(coef_1 * adv, coef_2 * adv)


@pytest.mark.parametrize("trainer", ["slime", "trl"])
def test_matches_the_trainers_formulas(any_backend, trainer):
    """Coupled IcePop with a gate that keeps everything is PPO on (lp, rollout as old): with
    the cap it is slime's / verl's dual clip and TRL's delta (delta >= 1 + eps_high)."""
    lp, old, adv, mask, _ = _tokens(2000, seed=7)
    formula = _slime_policy_loss if trainer == "slime" else _trl_policy_loss
    x = lp.clone().requires_grad_(True)
    theirs = formula(x, old, adv, 0.2, 0.28, 3.0)
    (theirs * mask).sum().backward()
    ours, grad = _loss_and_grad(glm_kernels.icepop_loss, lp, old, adv, mask, dual_clip=3.0,
                                reduction="none", **WIDE)
    assert_close(ours, theirs.detach() * mask, tol=FP32, name="per-token loss")
    weights = torch.linspace(0.5, 1.5, lp.numel(), device=lp.device)
    x2 = lp.clone().requires_grad_(True)
    (formula(x2, old, adv, 0.2, 0.28, 3.0) * mask * weights).sum().backward()
    assert_close(grad, x2.grad, tol=FP32, name="gradient")


@pytest.mark.parametrize("reduction", ["token_mean", "sum", "none"])
@pytest.mark.parametrize("with_old", [False, True])
def test_kernel_matches_reference(kernel_backend, reduction, with_old):
    lp, rollout, adv, mask, old = _tokens(2500, seed=3, spread=0.6, with_old=with_old)
    kw = dict(old_logprobs=old, reduction=reduction, dual_clip=2.5, gate_low=0.2,
              gate_high=5.0)
    got = _loss_and_grad(glm_kernels.icepop_loss, lp, rollout, adv, mask, **kw)
    ref = _loss_and_grad(_reference.icepop_loss_reference, lp, rollout, adv, mask, **kw)
    if reduction == "none":
        assert_close(got[0], ref[0], tol=FP32, name="loss")
    else:
        terms = _reference.icepop_loss_reference(lp, rollout, adv, mask,
                                                 **dict(kw, reduction="none"))
        scale = 1.0 if reduction == "sum" else 1.0 / mask.sum().clamp(min=1)
        assert_sum_close(got[0], ref[0], terms.abs().sum() * scale, tol=FP32, name="loss")
    assert_close(got[1], ref[1], tol=FP32, name="gradient")
    # the cap changed the loss: the check can fail
    plain = _reference.icepop_loss_reference(lp, rollout, adv, mask,
                                             **dict(kw, dual_clip=None, reduction="none"))
    assert not torch.allclose(plain, _reference.icepop_loss_reference(
        lp, rollout, adv, mask, **dict(kw, reduction="none")))


@pytest.mark.parametrize("v,dtype", [(90, torch.float32), (300, torch.bfloat16),
                                     (517, torch.float32)])
@pytest.mark.parametrize("with_old", [False, True])
def test_from_logits_every_plan(any_backend, v, dtype, with_old):
    """One register tile, three bf16 tiles, streamed rows (interpreter's launch config)."""
    g = torch.Generator().manual_seed(v)
    logits = (torch.randn(3, 8, v, generator=g) * 2).to(dtype)
    ids = torch.randint(0, v, (3, 8), generator=g)
    lp = selective_logprobs_reference(logits, ids)
    rollout = lp - 0.8 * torch.randn(3, 8, generator=g)
    old = lp - 0.8 * torch.randn(3, 8, generator=g) if with_old else None
    adv = torch.randn(3, 8, generator=g)
    mask = torch.rand(3, 8, generator=g) > 0.2
    logits, ids, rollout, adv, mask = (t.to(DEVICE) for t in (logits, ids, rollout, adv, mask))
    old = None if old is None else old.to(DEVICE)
    kw = dict(old_logprobs=old, dual_clip=2.0, gate_low=0.1, gate_high=10.0)
    got = _loss_and_grad(icepop_loss_from_logits, logits, ids, rollout, adv, mask, **kw)
    ref = _loss_and_grad(icepop_loss_from_logits_reference, logits.float(), ids, rollout, adv,
                         mask, **kw)
    tol = TOLERANCES[dtype]
    terms = icepop_loss_from_logits_reference(logits.float(), ids, rollout, adv, mask,
                                              reduction="none", **kw)
    assert_sum_close(got[0], ref[0], terms.abs().sum() / mask.sum(), tol=tol, name="loss")
    assert_close(got[1].float(), ref[1], tol=tol, name="dlogits")
    # reduction="none" takes the composed path (selective log-probs + icepop_loss)
    per_token = icepop_loss_from_logits(logits, ids, rollout, adv, mask, reduction="none",
                                        **kw)
    assert_close(per_token, terms, tol=tol, name="per-token loss")


def test_fused_linear(any_backend):
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(2, 9, 16, generator=g)
    weight = torch.randn(70, 16, generator=g) / 2
    ids = torch.randint(0, 70, (2, 9), generator=g)
    lp = selective_logprobs_reference(hidden @ weight.t(), ids)
    rollout = lp - 0.8 * torch.randn(2, 9, generator=g)
    adv = torch.randn(2, 9, generator=g)
    hidden, weight, ids, rollout, adv = (t.to(DEVICE) for t in (hidden, weight, ids, rollout,
                                                                  adv))
    kw = dict(dual_clip=2.0, gate_low=0.1, gate_high=10.0)
    grads = []
    for fn, extra in ((fused_linear_icepop_loss, dict(chunk_size=5)),
                      (fused_linear_icepop_loss_reference, {})):
        h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        loss = fn(h, w, ids, rollout, adv, **kw, **extra)
        loss.backward()
        grads.append((loss.detach(), h.grad, w.grad))
    assert_close(grads[0][0], grads[1][0], tol=FP32, name="loss")
    assert_close(grads[0][1], grads[1][1], tol=FP32, name="grad hidden")
    assert_close(grads[0][2], grads[1][2], tol=FP32, name="grad weight")


@pytest.mark.parametrize("bad,error", [(1.0, ValueError), (0.5, ValueError),
                                       (math.inf, ValueError), (math.nan, ValueError),
                                       (True, TypeError), ("3", TypeError)])
def test_bad_values_are_refused(bad, error):
    lp, rollout, adv, mask, _ = _tokens(4, seed=2)
    with pytest.raises(error, match="dual_clip"):
        glm_kernels.icepop_loss(lp, rollout, adv, mask, dual_clip=bad)
    logits = torch.randn(4, 10, device=DEVICE)
    ids = torch.zeros(4, dtype=torch.long, device=DEVICE)
    with pytest.raises(error, match="dual_clip"):
        icepop_loss_from_logits(logits, ids, rollout, adv, mask, dual_clip=bad)
    with pytest.raises(error, match="dual_clip"):
        fused_linear_icepop_loss(torch.randn(4, 3, device=DEVICE),
                                 torch.randn(10, 3, device=DEVICE), ids, rollout, adv, mask,
                                 dual_clip=bad)


@pytest.mark.gpu
def test_gpu_glm5_vocab_shard():
    """The three-register-tile plan at GLM-5's TP=8 bf16 shard with the cap, vs reference."""
    g = torch.Generator().manual_seed(9)
    v = 154880 // 8
    logits = (torch.randn(4, 64, v, generator=g) * 3).to(torch.bfloat16)
    ids = torch.randint(0, v, (4, 64), generator=g)
    rollout = selective_logprobs_reference(logits, ids) - 0.8 * torch.randn(4, 64, generator=g)
    adv = torch.randn(4, 64, generator=g)
    args = [t.cuda() for t in (logits, ids, rollout, adv)]
    kw = dict(dual_clip=2.0, gate_low=0.1, gate_high=10.0)
    got = _loss_and_grad(icepop_loss_from_logits, *args, **kw)
    ref = _loss_and_grad(icepop_loss_from_logits_reference, args[0].float(), *args[1:], **kw)
    assert_close(got[0], ref[0], tol=1e-4, name="loss")
    assert_close(got[1].float(), ref[1], tol=1e-2, name="dlogits")
