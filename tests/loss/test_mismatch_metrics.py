"""Train/rollout mismatch metrics (issue 15) and loss-argument validation (issue 17).

Every metric: the kernels (interpreter / GPU) and the torch backend against the written-out
formulas of loss/_reference.py; the reference against values worked out by hand here.
"""
import math

import pytest
import torch

import glm_kernels
from glm_kernels.loss import (_kernels, _logits_kernels, _reference, icepop,
                              icepop_loss_from_logits, fused_linear_icepop_loss,
                              mismatch_metrics, reverse_kl_from_logits, selective_logprobs)
from glm_kernels.loss._logits_reference import selective_logprobs_reference
from tests.conftest import DEVICE
from tests.loss._metrics import assert_metrics_close, metric_scales

KEYS = set(_reference.MISMATCH_KEYS)
NAN, INF = float("nan"), float("inf")


def _drift(shape, seed, spread=0.5):
    g = torch.Generator().manual_seed(seed)
    train = -torch.rand(shape, generator=g) * 4
    rollout = train + spread * torch.randn(shape, generator=g)
    mask = torch.rand(shape, generator=g) > 0.3
    return train.to(DEVICE), rollout.to(DEVICE), mask.to(DEVICE)


# --------------------------------------------------------------------------- the reference
def test_reference_by_hand():
    """Two sequences; d = train - rollout per token, written out."""
    train = torch.tensor([[-1.0, -2.0, -0.5], [-1.0, NAN, -3.0]])
    rollout = torch.tensor([[-1.5, -2.0, -0.5], [-0.2, -1.0, INF]])
    mask = torch.tensor([[True, True, False], [True, True, True]])
    m = _reference.mismatch_metrics_reference(train, rollout, mask, gate_low=0.5,
                                              gate_high=2.0)
    # M = {(0,0): d=0.5, (0,1): d=0, (1,0): d=-0.8}; (0,2) unmasked, (1,1) train NaN
    # (non-finite), (1,2) rollout inf (not in M, not non-finite).
    ds = [0.5, 0.0, -0.8]
    assert m["mismatch_k1"].item() == pytest.approx(-sum(ds) / 3, rel=1e-5)
    assert m["log_ppl_gap"].item() == pytest.approx(-sum(ds) / 3, rel=1e-5)
    assert m["mismatch_k3"].item() == pytest.approx(
        sum(math.exp(d) - 1 - d for d in ds) / 3, rel=1e-5)
    assert m["mismatch_chi2"].item() == pytest.approx(
        sum(math.exp(2 * d) - 1 for d in ds) / 3, rel=1e-5)
    # Row 0: mean(-0.5, 0) = -0.25; row 1: 0.8 -> mean over the two rows.
    assert m["log_ppl_gap_seq"].item() == pytest.approx((-0.25 + 0.8) / 2, rel=1e-5)
    assert m["gate_out_frac"].item() == pytest.approx(1 / 3)     # e^-0.8 = 0.449 < 0.5
    assert m["nonfinite_frac"].item() == pytest.approx(1 / 5)


def test_reference_empty_set_is_nan():
    m = _reference.mismatch_metrics_reference(torch.tensor([NAN, -1.0]),
                                              torch.tensor([-1.0, -1.0]),
                                              torch.tensor([True, False]))
    assert all(math.isnan(m[k].item()) for k in KEYS - {"nonfinite_frac"})
    assert m["nonfinite_frac"].item() == 1.0


def test_k3_has_no_cancellation_for_tiny_gaps():
    """d = 1e-4: r - 1 - d = d^2/2 + ... ; fp32 would lose every digit."""
    train = torch.full((4,), -1.0, device=DEVICE)
    rollout = train - 1e-4
    d = float(train[0].double() - rollout[0].float().double())
    want = math.expm1(d) - d
    for backend in ("torch", "kernel"):
        m = _standalone(backend, train, rollout, None)
        assert m["mismatch_k3"].item() == pytest.approx(want, rel=1e-4)
        assert m["mismatch_chi2"].item() == pytest.approx(math.expm1(2 * d), rel=1e-5)


def _standalone(backend, *args, **kw):
    from tests.conftest import KERNEL_BACKEND, skip_without_kernels
    if backend == "kernel":
        skip_without_kernels()
        backend = KERNEL_BACKEND
    with glm_kernels.force_backend(backend):
        return mismatch_metrics(*args, **kw)


# --------------------------------------------------------------------------- standalone
@pytest.mark.parametrize("shape", [(1,), (3000,), (5, 333), (3, 4, 129), (2, 2100)])
def test_standalone_matches_reference(any_backend, shape):
    train, rollout, mask = _drift(shape, seed=sum(shape))
    got = mismatch_metrics(train, rollout, mask, gate_low=0.6, gate_high=1.5)
    ref = _reference.mismatch_metrics_reference(train, rollout, mask, gate_low=0.6,
                                                gate_high=1.5)
    assert set(got) == KEYS
    assert all(v.dtype == torch.float32 and v.dim() == 0 for v in got.values())
    assert_metrics_close(got, ref, metric_scales(train, rollout, mask))


def test_standalone_nonfinite_and_empty(any_backend):
    train = torch.tensor([[NAN, -1.0, INF], [-INF, -2.0, -1.0]], device=DEVICE)
    rollout = torch.tensor([[-1.0, NAN, -1.0], [-1.0, -2.5, -INF]], device=DEVICE)
    got = mismatch_metrics(train, rollout)
    ref = _reference.mismatch_metrics_reference(train, rollout)
    assert_metrics_close(got, ref)
    assert got["nonfinite_frac"].item() == pytest.approx(3 / 6)
    assert got["mismatch_k1"].item() == pytest.approx(-0.5)    # M = {(1,1)}: d = 0.5
    for empty in (torch.zeros(0, device=DEVICE), torch.zeros(3, 0, device=DEVICE)):
        got = mismatch_metrics(empty, empty)
        assert all(math.isnan(got[k].item()) for k in KEYS - {"nonfinite_frac"})
        assert got["nonfinite_frac"].item() == 0.0
    got = mismatch_metrics(train, rollout, torch.zeros(2, 3, dtype=torch.bool, device=DEVICE))
    assert math.isnan(got["mismatch_k3"].item()) and got["nonfinite_frac"].item() == 0.0


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


# --------------------------------------------------------------------------- in the losses
@pytest.mark.parametrize("with_old", [False, True])
def test_icepop_loss_metrics_with_nonfinite_inputs(any_backend, with_old):
    """Reference equality where inf/NaN sit on every side (train, old, rollout, masked or
    not), over two kernel programs per row."""
    shape = (3, 1500)
    train, rollout, mask = _drift(shape, seed=1)
    g = torch.Generator().manual_seed(2)
    pick = lambda p: (torch.rand(shape, generator=g) < p).to(DEVICE)   # noqa: E731
    lp = torch.where(pick(0.02), NAN, torch.where(pick(0.02), -INF, train))
    rollout = torch.where(pick(0.02), NAN, torch.where(pick(0.02), INF, rollout))
    old = torch.where(pick(0.02), INF, train + 0.1) if with_old else None
    adv = torch.randn(shape, generator=g).to(DEVICE)
    _, got = glm_kernels.icepop_loss(lp, rollout, adv, mask, old_logprobs=old,
                                     return_metrics=True)
    _, ref = _reference.icepop_loss_reference(lp, rollout, adv, mask, old_logprobs=old,
                                              return_metrics=True)
    scales = metric_scales(lp if old is None else old, rollout, mask,
                           also_finite=None if old is None else lp)
    assert_metrics_close(got, ref, scales)
    assert got["nonfinite_frac"].item() > 0.02


def test_per_sequence_gap_uses_rows_of_the_last_dim(any_backend):
    """Row 0 drifts by 1 nat on 1 token, row 1 by 0.1 on 3: the token mean and the sequence
    mean differ."""
    train = torch.zeros(2, 3, device=DEVICE)
    rollout = torch.tensor([[1.0, 0.0, 0.0], [0.1, 0.1, 0.1]], device=DEVICE)
    mask = torch.tensor([[True, False, False], [True, True, True]], device=DEVICE)
    _, m = glm_kernels.icepop_loss(train, rollout, torch.ones(2, device=DEVICE), mask,
                                   return_metrics=True)
    assert m["log_ppl_gap"].item() == pytest.approx((1.0 + 0.3) / 4, rel=1e-5)
    assert m["log_ppl_gap_seq"].item() == pytest.approx((1.0 + 0.1) / 2, rel=1e-5)
    flat = glm_kernels.icepop_loss(train.reshape(-1), rollout.reshape(-1),
                                   torch.ones(6, device=DEVICE), mask.reshape(-1),
                                   return_metrics=True)[1]
    assert flat["log_ppl_gap_seq"].item() == pytest.approx(flat["log_ppl_gap"].item())


def test_metrics_off_is_the_same_loss_and_gradient(any_backend):
    lp, rollout, mask = _drift((4, 300), seed=3)
    adv = torch.randn(4, 300).to(DEVICE)
    outs = []
    for metrics in (False, True):
        x = lp.clone().requires_grad_(True)
        loss = glm_kernels.icepop_loss(x, rollout, adv, mask, return_metrics=metrics)
        loss = loss[0] if metrics else loss
        loss.backward()
        outs.append((loss.detach(), x.grad))
    # Same gradient bit for bit; the loss sum may differ in the last bit (with metrics the
    # kernel's programs follow the rows, so the fp32 partial sums group tokens differently).
    assert torch.equal(outs[0][1], outs[1][1])
    assert outs[0][0].item() == pytest.approx(outs[1][0].item(), rel=1e-5, abs=1e-9)


def test_from_logits_and_fused_linear_metrics(any_backend):
    g = torch.Generator().manual_seed(4)
    hidden = torch.randn(3, 7, 16, generator=g)
    weight = torch.randn(90, 16, generator=g) / 2
    ids = torch.randint(0, 90, (3, 7), generator=g)
    logits = hidden @ weight.t()
    lp = selective_logprobs_reference(logits, ids)
    rollout = lp + 0.4 * torch.randn(3, 7, generator=g)
    rollout[0, 1] = NAN
    logits[1, 2] = NAN                                     # train-side non-finite
    mask = torch.rand(3, 7, generator=g) > 0.2
    adv = torch.randn(3, 7, generator=g)
    dev = [t.to(DEVICE) for t in (hidden, weight, ids, logits, rollout, mask, adv)]
    hidden, weight, ids, logits, rollout, mask, adv = dev
    lp = selective_logprobs_reference(logits, ids)
    ref = _reference.mismatch_metrics_reference(lp, rollout, mask)
    scales = metric_scales(lp, rollout, mask)
    for reduction in ("token_mean", "none"):               # fused pass / composed path
        _, m = icepop_loss_from_logits(logits, ids, rollout, adv, mask, reduction=reduction,
                                       return_metrics=True)
        assert_metrics_close({k: m[k] for k in KEYS}, ref, scales)
    lp_fl = selective_logprobs_reference(hidden @ weight.t(), ids)
    _, m = fused_linear_icepop_loss(hidden, weight, ids, rollout, adv, mask, chunk_size=5,
                                    return_metrics=True)
    assert_metrics_close({k: m[k] for k in KEYS},
                         _reference.mismatch_metrics_reference(lp_fl, rollout, mask),
                         metric_scales(lp_fl, rollout, mask))
    with pytest.raises(ValueError, match="non-finite"):
        icepop_loss_from_logits(logits, ids, rollout, adv, mask, raise_on_nonfinite=True)


@pytest.mark.parametrize("v,dtype", [(300, torch.bfloat16), (517, torch.float32)])
def test_from_logits_metrics_on_every_row_plan(any_backend, v, dtype):
    """Under the interpreter's launch config 300 bf16 columns take the three-register-tile
    plan and 517 fp32 columns the streamed one (90 columns, one tile, is the test above).
    Metrics on or off: the same plan, so the same loss and gradient bit for bit."""
    g = torch.Generator().manual_seed(v)
    logits = (torch.randn(2, 6, v, generator=g) * 2).to(dtype)
    ids = torch.randint(0, v, (2, 6), generator=g)
    lp = selective_logprobs_reference(logits, ids)
    rollout = lp + 0.3 * torch.randn(2, 6, generator=g)
    rollout[1, 0] = NAN
    mask = torch.rand(2, 6, generator=g) > 0.2
    adv = torch.randn(2, 6, generator=g)
    logits, ids, lp, rollout, mask, adv = (t.to(DEVICE)
                                           for t in (logits, ids, lp, rollout, mask, adv))
    outs = []
    for metrics in (False, True):
        x = logits.clone().requires_grad_(True)
        out = icepop_loss_from_logits(x, ids, rollout, adv, mask, return_metrics=metrics)
        loss = out[0] if metrics else out
        loss.backward()
        outs.append((loss.detach(), x.grad))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    assert_metrics_close({k: out[1][k] for k in KEYS},
                         _reference.mismatch_metrics_reference(lp, rollout, mask),
                         metric_scales(lp, rollout, mask))


# --------------------------------------------------------------------------- kernels
def test_token_kernel_writes_every_metric_column(kernel_backend):
    lp, rollout, mask = _drift((3, 1100), seed=5)
    adv = torch.randn(3, 1100).to(DEVICE)
    block = 512
    programs = 3 * -(-1100 // block)
    stats = torch.full((programs, _kernels.NUM_STATS_METRICS), NAN, device=DEVICE)
    loss = torch.full((3300,), NAN, device=DEVICE)
    grad = torch.full((3300,), NAN, device=DEVICE)
    _kernels.icepop_fwd(lp.reshape(-1), rollout.reshape(-1), None, adv.reshape(-1),
                        mask.reshape(-1).view(torch.uint8), loss, grad, stats, seq_len=1,
                        gate_low=0.5, gate_high=2.0, clip_low=0.8, clip_high=1.28,
                        adv_per_seq=False, block=block, num_warps=4, row_len=1100,
                        metrics=True)
    assert not torch.isnan(stats).any() and not torch.isnan(loss).any()
    assert not torch.isnan(grad).any()
    # The per-row programs' sums give each row's |M| exactly.
    in_m = _reference.mismatch_token_terms(lp, rollout, mask, gate_low=0.5, gate_high=2.0)[0]
    per_row = stats[:, _kernels.STAT_M_COUNT].reshape(3, -1).sum(1)
    assert per_row.tolist() == in_m.sum(-1).float().tolist()


def test_logits_kernel_writes_every_metric_column(kernel_backend):
    from glm_kernels.loss import logprobs
    g = torch.Generator().manual_seed(6)
    n, v = 10, 300
    logits = torch.randn(n, v, generator=g).to(DEVICE)
    ids_all = torch.randint(0, v, (n,), generator=g).to(DEVICE)
    cfg = logprobs.make_launch_config("interpret")
    # 300 columns: streamed (fp32), three register tiles (bf16); 200: one register tile.
    for dtype, v in ((torch.float32, 300), (torch.bfloat16, 300), (torch.float32, 200)):
        x = logits[:, :v].to(dtype)
        ids = ids_all % v
        rollout = selective_logprobs_reference(x, ids) + 0.3
        row_tiles, block_v, warps = cfg.row_plan(v, x.element_size())
        rows = torch.full((n, _kernels.NUM_STATS), NAN, device=DEVICE)
        full = _logits_kernels.icepop_logits(
            x, ids, rollout, None, torch.ones(n, device=DEVICE), None,
            torch.full((n,), 0.1, device=DEVICE), None, rows,
            torch.zeros(1, dtype=torch.int32, device=DEVICE), inv_temp=1.0, gate_low=0.5,
            gate_high=2.0, clip_low=0.8, clip_high=1.28, block_v=block_v, row_tiles=row_tiles,
            num_warps=warps, max_programs=3, metrics=True)
        # Every column the kernel owns was written (4, 5 carry the metric terms; 6 unused).
        assert not torch.isnan(rows[:, [0, 1, 2, 3, 4, 5, 7]]).any()
        assert full.shape == (n, _kernels.NUM_STATS_METRICS)
        assert not torch.isnan(full[:, :5]).any() and not torch.isnan(full[:, 7:]).any()
        d = full[:, 10].double()
        assert torch.equal(full[:, 11], (torch.expm1(d) - d).float())


def test_glm5_vocab_shard_keeps_its_row_in_registers_with_metrics():
    """GLM-5's TP=8 bf16 vocab shard (19360 columns) takes the three-register-tile plan with
    or without metrics (one read of the row), and the METRICS variant of that plan is among
    the sm_90 configurations the AOT check compiles (and fails on any spill)."""
    from glm_kernels.loss import logprobs
    assert logprobs.LogitsLaunchConfig().row_plan(19360, 2) == (3, 8192, 32)
    compiled = {spec.name for spec in _logits_kernels.AOT_SPECS}
    for old in ("", ",old"):
        assert f"icepop_logits[bf16,row_tiles=3,BLOCK_V=8192,metrics=True{old}]" in compiled


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
        return loss, m["mismatch_k3"], m["log_ppl_gap_seq"]

    with glm_kernels.force_backend("torch"):
        eager = step(lp)
        compiled = torch.compile(step, fullgraph=True, backend="aot_eager")(lp)
    assert all(torch.equal(a, b) for a, b in zip(eager, compiled))


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

    def test_icepop_module_exports(self):
        assert icepop.mismatch_metrics is mismatch_metrics


def test_docs_icepop_examples_run():
    """docs/icepop.md's example (metrics included) runs as written on the torch backend."""
    import doctest
    import os
    path = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "icepop.md")
    with glm_kernels.force_backend("torch"):
        result = doctest.testfile(path, module_relative=False,
                                  optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0, result
