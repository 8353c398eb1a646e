"""icepop_loss's torch backend (``loss/icepop/_torch.lean_icepop``) against the readable
reference, on inputs with NaN / inf on every side, and with its metric-only statistics
skipped (``return_metrics=False``): the loss and the gradient must not change by a bit."""
import math

import pytest
import torch

import glm_kernels
from glm_kernels.loss.icepop._reference import icepop_loss_reference
from tests._compare import assert_close

NAN, INF = float("nan"), float("inf")


def _batch(seed, shape=(5, 37)):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(shape, generator=g) * 3 - 0.05
    rollout = old + 0.5 * torch.randn(shape, generator=g)
    lp = old + 0.4 * torch.randn(shape, generator=g)
    lp[0, 3] = -40.0                                     # a kept log-ratio beyond the clamp
    adv = torch.randn(shape, generator=g)
    mask = torch.rand(shape, generator=g) > 0.25
    mask[2] = False                                      # an all-masked row
    # non-finite train-side and rollout log-probs, masked and unmasked
    for (row, col), value in {(0, 0): NAN, (0, 1): INF, (1, 2): -INF, (3, 4): NAN}.items():
        lp[row, col] = value
        mask[row, col] = True
    old[1, 5], old[3, 6], rollout[4, 7], rollout[4, 8] = NAN, -INF, INF, NAN
    mask[1, 5] = mask[3, 6] = mask[4, 7] = mask[4, 8] = True
    return lp, old, rollout, adv, mask


def _run(lp, fn, **kwargs):
    x = lp.clone().requires_grad_(True)
    out = fn(x, **kwargs)
    loss = out[0] if isinstance(out, tuple) else out
    loss.backward()
    return loss.detach(), x.grad


@pytest.mark.parametrize("gate", [dict(), dict(gate_low=0.0, gate_high=3.0),
                                  dict(gate_low=0.7, gate_high=1e9)])
@pytest.mark.parametrize("dual_clip", [None, 2.5])
@pytest.mark.parametrize("decoupled", [False, True])
@pytest.mark.parametrize("reduction", ["token_mean", "seq_mean_token_mean", "sum"])
def test_torch_backend_matches_reference_and_ignores_metrics(decoupled, dual_clip, gate,
                                                             reduction):
    lp, old, rollout, adv, mask = _batch(1)
    kwargs = dict(old_logprobs=old if decoupled else None, dual_clip=dual_clip,
                  reduction=reduction, **gate)

    def ours(x, **kw):
        return glm_kernels.icepop_loss(x, rollout, adv, mask, **kwargs, **kw)

    def ref(x):
        return icepop_loss_reference(x, rollout, adv, mask, **kwargs)

    with glm_kernels.force_backend("torch"):
        off = _run(lp, ours)
        on = _run(lp, ours, return_metrics=True)
    want = _run(lp, ref)
    assert torch.isfinite(off[0]) and torch.isfinite(off[1]).all()
    assert torch.equal(off[0], on[0]) and torch.equal(off[1], on[1])
    assert_close(off[0], want[0], tol=1e-5, name="loss")
    assert_close(off[1], want[1], tol=1e-5, name="grad")
    assert off[1][0, 3] == 0 and off[1][~mask].abs().sum() == 0


def test_metrics_of_the_torch_backend_match_reference():
    lp, old, rollout, adv, mask = _batch(2)
    for old_lp in (None, old):
        with glm_kernels.force_backend("torch"):
            _, got = glm_kernels.icepop_loss(lp, rollout, adv, mask, old_logprobs=old_lp,
                                             dual_clip=3.0, return_metrics=True)
        _, want = icepop_loss_reference(lp, rollout, adv, mask, old_logprobs=old_lp,
                                        dual_clip=3.0, return_metrics=True)
        for key in ("pop_frac", "clip_frac", "ratio_mean", "ratio_max", "ratio_min"):
            assert got[key].item() == pytest.approx(want[key].item(), rel=1e-6), key
        assert got["pop_frac"] > 0 and got["clip_frac"] > 0
        assert math.isfinite(got["ratio_max"].item())
