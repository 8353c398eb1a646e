"""Train/rollout mismatch metrics under verl's names (issue 22) and loss-argument validation.

The metrics against verl 0.9.1's own functions (``compute_offpolicy_metrics``,
``compute_rollout_correction_weights`` with the IcePop threshold), imported from the installed
package, on ragged batches with all-masked rows; hand-computed cases for the non-finite policy;
metrics on or off never move the loss or the gradient by a bit, on every API and plan.
"""
import math

import pytest
import torch

import glm_kernels
from glm_kernels.loss import (MISMATCH_KEYS, fused_linear_icepop_loss, icepop_loss_from_logits,
                              mismatch_metrics, reverse_kl_from_logits, selective_logprobs)
from glm_kernels.loss.icepop import _reference
from glm_kernels.loss.logprobs._reference import selective_logprobs_reference
from tests.conftest import DEVICE
from tests.loss._metrics import assert_metrics_close, metric_scales

KEYS = set(MISMATCH_KEYS)
NAN, INF = float("nan"), float("inf")
ICEPOP_KEYS = {"pop_frac", "clip_frac", "ratio_mean", "ratio_max", "ratio_min"}


def _drift(shape, seed, spread=0.5):
    g = torch.Generator().manual_seed(seed)
    train = -torch.rand(shape, generator=g) * 4
    rollout = train + spread * torch.randn(shape, generator=g)
    mask = torch.rand(shape, generator=g) > 0.3
    return train.to(DEVICE), rollout.to(DEVICE), mask.to(DEVICE)


def _verl_metrics(train, rollout, mask, lo, hi):
    """verl's own numbers on the same inputs (fp64, so only our rounding differs)."""
    helper = pytest.importorskip("verl.trainer.ppo.rollout_corr_helper")
    train, rollout = train.double().cpu(), rollout.double().cpu()
    mask = mask.double().cpu()
    out = helper.compute_offpolicy_metrics(train, rollout, mask)
    _, is_metrics = helper.compute_rollout_correction_weights(
        train - rollout, mask, rollout_is="token", rollout_is_threshold=f"{lo}_{hi}")
    out.update(is_metrics)
    return {k: torch.tensor(float(v)) for k, v in out.items()}


def _assert_equals_verl(got, train, rollout, mask, lo=0.5, hi=2.0):
    want = _verl_metrics(train, rollout, mask, lo, hi)
    assert KEYS - set(want) == {"nonfinite_frac", "rollout_nonfinite_count"}
    assert set(want) <= KEYS, set(want) - KEYS
    assert_metrics_close({k: got[k] for k in want}, want, metric_scales(train, rollout, mask))


# --------------------------------------------------------------------------- against verl
@pytest.mark.parametrize("shape", [(1, 40), (6, 33), (3, 4, 129), (2, 2100)])
def test_standalone_equals_verl(shape):
    train, rollout, mask = _drift(shape, seed=sum(shape))
    if mask.numel() > shape[-1]:
        mask.reshape(-1, shape[-1])[1] = False           # an all-masked row
    got = mismatch_metrics(train, rollout, mask, gate_low=0.6, gate_high=1.5)
    assert set(got) == KEYS
    assert all(v.dtype == torch.float32 and v.dim() == 0 for v in got.values())
    rows = shape[-1]
    _assert_equals_verl(got, train.reshape(-1, rows), rollout.reshape(-1, rows),
                        mask.reshape(-1, rows), 0.6, 1.5)


@pytest.mark.parametrize("with_old", [False, True])
def test_losses_report_verl_metrics(any_backend, with_old):
    """icepop_loss, from logits and fused-linear: train = old when decoupled, else the
    policy's log-probs (the pass's own lp on the logits paths)."""
    g = torch.Generator().manual_seed(11)
    hidden = torch.randn(4, 9, 16, generator=g)
    weight = torch.randn(70, 16, generator=g) / 2
    ids = torch.randint(0, 70, (4, 9), generator=g)
    lp = selective_logprobs_reference(hidden @ weight.t(), ids)
    rollout = lp + 0.3 * torch.randn(4, 9, generator=g)
    mask = torch.rand(4, 9, generator=g) > 0.2
    mask[2] = False
    old = lp + 0.05 * torch.randn(4, 9, generator=g) if with_old else None
    adv = torch.randn(4, 9, generator=g)
    to = lambda t: None if t is None else t.to(DEVICE)   # noqa: E731
    hidden, weight, ids, lp, rollout, mask, old, adv = map(
        to, (hidden, weight, ids, lp, rollout, mask, old, adv))
    train = lp if old is None else old
    _, m = glm_kernels.icepop_loss(lp, rollout, adv, mask, old_logprobs=old,
                                   return_metrics=True)
    assert set(m) == KEYS | ICEPOP_KEYS
    _assert_equals_verl(m, train, rollout, mask)
    _, m = icepop_loss_from_logits(hidden @ weight.t(), ids, rollout, adv, mask,
                                   old_logprobs=old, return_metrics=True)
    _assert_equals_verl(m, train, rollout, mask)
    _, m = fused_linear_icepop_loss(hidden, weight, ids, rollout, adv, mask, old_logprobs=old,
                                    chunk_size=7, return_metrics=True)
    _assert_equals_verl(m, train, rollout, mask)


# --------------------------------------------------------------------------- by hand
def test_nonfinite_policy_by_hand():
    """M leaves out non-finite tokens and counts them; a row without tokens counts as 0."""
    train = torch.tensor([[-1.0, -2.0, -0.5], [-1.0, NAN, -3.0], [-1.0, -1.0, -1.0]])
    rollout = torch.tensor([[-1.5, -2.0, -0.5], [-0.2, -1.0, INF], [-1.0, -1.0, -1.0]])
    mask = torch.tensor([[True, True, False], [True, True, True], [False, False, False]])
    m = mismatch_metrics(train, rollout, mask)
    # M = {(0,0): lr=0.5, (0,1): 0, (1,0): -0.8}; (1,1) train NaN; (1,2) rollout inf.
    lrs = [0.5, 0.0, -0.8]
    assert m["kl"].item() == pytest.approx(-sum(lrs) / 3, rel=1e-5)
    assert m["k3_kl"].item() == pytest.approx(
        sum(math.exp(x) - 1 - x for x in lrs) / 3, rel=1e-5)
    assert m["chi2_token"].item() == pytest.approx(
        sum(math.exp(2 * x) for x in lrs) / 3 - 1, rel=1e-5)
    # Per row: -0.25, 0.8 and the empty row's 0, averaged over the three rows (verl, slime).
    assert m["log_ppl_diff"].item() == pytest.approx((-0.25 + 0.8 + 0.0) / 3, rel=1e-5)
    assert m["log_ppl_diff_max"].item() == pytest.approx(0.8, rel=1e-5)
    assert m["rollout_is_oob_ratio"].item() == pytest.approx(1 / 3)   # e^-0.8 < 0.5
    assert m["nonfinite_frac"].item() == pytest.approx(1 / 5)
    assert m["rollout_nonfinite_count"].item() == 1.0


def test_k3_has_no_cancellation_for_tiny_gaps():
    train = torch.full((4,), -1.0, device=DEVICE)
    rollout = train - 1e-4
    d = float(train[0].double() - rollout[0].double())
    m = mismatch_metrics(train, rollout)
    assert m["k3_kl"].item() == pytest.approx(math.expm1(d) - d, rel=1e-4)
    assert m["chi2_token"].item() == pytest.approx(math.expm1(2 * d), rel=1e-5)


def test_empty_set_is_nan(any_backend):
    for train, rollout, mask in [
            (torch.tensor([NAN, -1.0]), torch.tensor([-1.0, -1.0]), torch.tensor([True, False])),
            (torch.zeros(0), torch.zeros(0), None), (torch.zeros(3, 0), torch.zeros(3, 0), None)]:
        m = mismatch_metrics(train.to(DEVICE), rollout.to(DEVICE),
                             None if mask is None else mask.to(DEVICE))
        assert all(math.isnan(m[k].item())
                   for k in KEYS - {"nonfinite_frac", "rollout_nonfinite_count"}), m
    assert m["nonfinite_frac"].item() == 0.0


def test_ratio_statistics_leave_out_nonfinite_tokens(any_backend):
    """An inf train-side log-prob on a masked-out, a popped or a non-finite masked token
    never reaches ratio_mean / ratio_max / ratio_min (issue 25): they describe M."""
    lp = torch.tensor([[INF, -1.0, -1.2, -INF], [-1.0, -5.0, -1.1, -0.9]], device=DEVICE)
    rollout = torch.tensor([[-1.0, -1.0, -1.0, -1.0], [-1.0, -1.0, INF, -1.0]], device=DEVICE)
    mask = torch.tensor([[False, True, True, True], [True, True, True, True]], device=DEVICE)
    adv = torch.ones(2, device=DEVICE)
    in_m = [(0, 1), (0, 2), (1, 0), (1, 1), (1, 3)]
    ratios = torch.tensor([math.exp(float(lp[i, j] - rollout[i, j])) for i, j in in_m])
    for old in (None, lp.clone()):
        _, m = glm_kernels.icepop_loss(lp, rollout, adv, mask, old_logprobs=old,
                                       return_metrics=True)
        assert m["ratio_max"].item() == pytest.approx(ratios.max().item(), rel=1e-5)
        assert m["ratio_min"].item() == pytest.approx(ratios.min().item(), rel=1e-5)
        assert m["ratio_mean"].item() == pytest.approx(ratios.mean().item(), rel=1e-5)


# --------------------------------------------------------------------------- bits
def _loss_and_grad(fn, x, metrics, **kw):
    x = x.clone().requires_grad_(True)
    out = fn(x, return_metrics=metrics, **kw)
    loss = out[0] if metrics else out
    loss.backward()
    return loss.detach(), x.grad


@pytest.mark.parametrize("shape", [(4, 300), (3, 2500)])
def test_metrics_never_change_the_token_loss(any_backend, shape):
    lp, rollout, mask = _drift(shape, seed=3)
    adv = torch.randn(shape).to(DEVICE)
    for reduction in ("token_mean", "sum", "seq_mean_token_mean"):
        fn = lambda x, **kw: glm_kernels.icepop_loss(x, rollout, adv, mask,  # noqa: E731
                                                     reduction=reduction, **kw)
        off, on = _loss_and_grad(fn, lp, False), _loss_and_grad(fn, lp, True)
        assert torch.equal(off[0], on[0]) and torch.equal(off[1], on[1]), reduction


@pytest.mark.parametrize("v,dtype", [(90, torch.float32), (300, torch.bfloat16),
                                     (517, torch.float32)])
def test_metrics_never_change_the_logits_losses(any_backend, v, dtype):
    """Under the interpreter's launch config: one register tile, three tiles (bf16), the
    streamed plan. From logits and fused-linear, loss and gradient bit for bit."""
    g = torch.Generator().manual_seed(v)
    hidden = torch.randn(2, 6, 8, generator=g).to(dtype)
    weight = torch.randn(v, 8, generator=g).to(dtype)
    ids = torch.randint(0, v, (2, 6), generator=g)
    logits = (hidden.float() @ weight.float().t()).to(dtype)
    lp = selective_logprobs_reference(logits, ids)
    rollout = lp + 0.3 * torch.randn(2, 6, generator=g)
    rollout[1, 0] = NAN
    mask = torch.rand(2, 6, generator=g) > 0.2
    adv = torch.randn(2, 6, generator=g)
    hidden, weight, ids, logits, rollout, mask, adv = (
        t.to(DEVICE) for t in (hidden, weight, ids, logits, rollout, mask, adv))
    fn = lambda x, **kw: icepop_loss_from_logits(x, ids, rollout, adv, mask, **kw)  # noqa
    assert all(torch.equal(a, b) for a, b in zip(_loss_and_grad(fn, logits, False),
                                                   _loss_and_grad(fn, logits, True)))
    fn = lambda x, **kw: fused_linear_icepop_loss(x, weight, ids, rollout, adv, mask,  # noqa
                                                  chunk_size=5, **kw)
    assert all(torch.equal(a, b) for a, b in zip(_loss_and_grad(fn, hidden, False),
                                                   _loss_and_grad(fn, hidden, True)))


def test_reductions_are_deterministic(kernel_backend):
    lp, rollout, mask = _drift((4, 2500), seed=7)
    adv = torch.randn(4, 2500).to(DEVICE)
    runs = [glm_kernels.icepop_loss(lp, rollout, adv, mask, return_metrics=True)[1]
            for _ in range(2)]
    assert all(torch.equal(runs[0][k], runs[1][k]) for k in KEYS)


def test_metrics_under_torch_compile():
    lp, rollout, mask = (t.cpu() for t in _drift((3, 40), seed=8))
    adv = torch.randn(3, 40)

    def step(x):
        loss, m = glm_kernels.icepop_loss(x, rollout, adv, mask, return_metrics=True)
        return loss, m["k3_kl"], m["log_ppl_diff"], m["rollout_is_seq_std"]

    with glm_kernels.force_backend("torch"):
        eager = step(lp)
        for backend in ("aot_eager", "inductor"):
            compiled = torch.compile(step, fullgraph=True, backend=backend)(lp)
            torch._dynamo.reset()
            assert torch.equal(eager[0], compiled[0]), backend
            for a, b in zip(eager[1:], compiled[1:]):
                assert torch.allclose(a, b, rtol=1e-5, atol=1e-7), backend


def test_standalone_bad_inputs():
    x = torch.zeros(3)
    with pytest.raises(ValueError, match="rollout_logprobs"):
        mismatch_metrics(x, torch.zeros(4))
    with pytest.raises(ValueError, match="loss_mask"):
        mismatch_metrics(x, x, torch.ones(4, dtype=torch.bool))
    with pytest.raises(TypeError, match="train_logprobs"):
        mismatch_metrics(torch.zeros(3, dtype=torch.int64), x)
    with pytest.raises(ValueError, match="beta"):
        mismatch_metrics(x, x, beta=1.0)
    with pytest.raises(TypeError, match="loss_mask"):
        mismatch_metrics(x, x, torch.ones(3, dtype=torch.complex64))
    with pytest.raises(ValueError, match="gate_low"):
        mismatch_metrics(x, x, gate_low=-1.0)


# --------------------------------------------------------------------------- validation
class TestArgumentsNameThemselves:
    def test_from_logits(self):
        logits, ids, x = torch.zeros(2, 5), torch.zeros(2, dtype=torch.long), torch.zeros(2)
        cases = [(dict(inplace_backward="yes"), TypeError, "inplace_backward"),
                 (dict(tp_group="x"), TypeError, "tp_group"),
                 (dict(return_metrics=None), TypeError, "return_metrics"),
                 (dict(raise_on_nonfinite="no"), TypeError, "raise_on_nonfinite"),
                 (dict(eps_low=1.5), ValueError, "eps_low"),
                 (dict(gate_low=-1.0), ValueError, "gate_low"),
                 (dict(beta=1.0), ValueError, "beta")]
        for kwargs, error, name in cases:
            with pytest.raises(error, match=name):
                icepop_loss_from_logits(logits, ids, x, x, **kwargs)

    def test_fused_linear(self):
        h, w, ids, x = (torch.zeros(2, 4), torch.zeros(5, 4), torch.zeros(2, dtype=torch.long),
                        torch.zeros(2))
        for kwargs, error, name in [(dict(eps_low=1.5), ValueError, "eps_low"),
                                    (dict(beta=1.0), ValueError, "beta"),
                                    (dict(gate_low=-1.0), ValueError, "gate_low"),
                                    (dict(return_metrics="yes"), TypeError, "return_metrics")]:
            with pytest.raises(error, match=name):
                fused_linear_icepop_loss(h, w, ids, x, x, **kwargs)

    def test_selective_logprobs_and_reverse_kl(self):
        logits, ids = torch.zeros(2, 5), torch.zeros(2, dtype=torch.long)
        with pytest.raises(TypeError, match="tp_group"):
            selective_logprobs(logits, ids, tp_group="x")
        with pytest.raises(TypeError, match="return_entropy"):
            selective_logprobs(logits, ids, return_entropy="yes")
        with pytest.raises(TypeError, match="tp_group"):
            reverse_kl_from_logits(logits, logits, tp_group=3)

    def test_module_exports(self):
        assert glm_kernels.mismatch_metrics is mismatch_metrics
        assert set(glm_kernels.loss.MISMATCH_KEYS) == KEYS


def test_docs_icepop_examples_run():
    """docs/icepop.md's example (metrics included) runs as written on the torch backend."""
    import doctest
    import os
    path = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "icepop.md")
    with glm_kernels.force_backend("torch"):
        result = doctest.testfile(path, module_relative=False,
                                  optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0, result
