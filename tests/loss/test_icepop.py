"""IcePop loss: kernel (interpreter / GPU) vs reference vs hand-computed values."""
import math
import zlib

import pytest
import torch

import glm_kernels
from glm_kernels.loss.icepop import _reference
from tests._compare import TOLERANCES, assert_close
from tests.loss._metrics import assert_metrics_close, metric_scales
from tests.conftest import DEVICE

FP32 = TOLERANCES[torch.float32]

REDUCTIONS = ["token_mean", "seq_mean_token_mean", "sum", "none"]


def _inputs(shape, *, seed, dtype=torch.float32, per_seq_adv=False, with_old=False,
            spread=0.8):
    """Drawn on the CPU (same values on every machine), returned on the test device: the
    kernel backend is the interpreter on CPU tensors, compiled Triton on CUDA tensors."""
    gen = torch.Generator().manual_seed(seed)
    lp = -torch.rand(shape, generator=gen) * 3
    # Ratios e^N(0, spread): a real share of tokens falls outside [1/2, 2] and gets popped.
    rollout = lp + torch.randn(shape, generator=gen) * spread
    old = lp + torch.randn(shape, generator=gen) * 0.3 if with_old else None
    adv_shape = shape[:1] if per_seq_adv else shape
    adv = torch.randn(adv_shape, generator=gen)
    mask = torch.rand(shape, generator=gen) > 0.25
    return tuple(None if t is None else t.to(DEVICE)
                 for t in (lp.to(dtype), rollout, adv, mask, old))


def _run(fn, lp, *args, **kwargs):
    lp = lp.detach().clone().requires_grad_(True)
    loss, metrics = fn(lp, *args, return_metrics=True, **kwargs)
    weights = torch.linspace(0.5, 1.5, loss.numel(), device=loss.device).reshape(loss.shape)
    (loss * weights).sum().backward()
    return loss.detach(), lp.grad.detach(), metrics


@pytest.mark.parametrize("shape", [(1,), (1000,), (5, 333), (3, 4, 129)])
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("with_old", [False, True])
def test_kernel_matches_reference(kernel_backend, shape, reduction, with_old):
    if reduction == "seq_mean_token_mean" and len(shape) != 2:
        pytest.skip("seq_mean_token_mean is defined for [B, T]")
    seed = zlib.crc32(repr((shape, reduction, with_old)).encode()) % 1000   # stable per case
    lp, rollout, adv, mask, old = _inputs(shape, seed=seed, with_old=with_old)
    got = _run(glm_kernels.icepop_loss, lp, rollout, adv, mask, old_logprobs=old,
               reduction=reduction)
    ref = _run(_reference.icepop_loss_reference, lp, rollout, adv, mask, old_logprobs=old,
               reduction=reduction)
    if reduction == "none":
        assert_close(got[0], ref[0], tol=1e-5, name="loss")
    else:
        # Scalar sums of mixed-sign terms: fp32 summation-order error scales with sum |l|.
        terms = _reference.icepop_loss_reference(lp, rollout, adv, mask, old_logprobs=old,
                                                 reduction="none")
        budget = 1e-6 * terms.abs().sum().item() + 1e-7
        assert abs(got[0].item() - ref[0].item()) <= budget, (got[0].item(), ref[0].item())
    assert_close(got[1], ref[1], tol=1e-5, name="grad")
    scales = metric_scales(lp if old is None else old, rollout, mask,
                           also_finite=None if old is None else lp)
    assert_metrics_close(got[2], ref[2], scales)


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_per_sequence_advantages(any_backend, reduction):
    lp, rollout, adv, mask, _ = _inputs((4, 77), seed=3, per_seq_adv=True)
    got = _run(glm_kernels.icepop_loss, lp, rollout, adv, mask, reduction=reduction)
    full = adv[:, None].expand(4, 77)
    ref = _run(_reference.icepop_loss_reference, lp, rollout, full, mask, reduction=reduction)
    assert_close(got[0], ref[0], tol=1e-5, name="loss")
    assert_close(got[1], ref[1], tol=1e-5, name="grad")


def test_bf16_logprobs(any_backend):
    lp, rollout, adv, mask, _ = _inputs((2000,), seed=4, dtype=torch.bfloat16)
    got = _run(glm_kernels.icepop_loss, lp, rollout, adv, mask)
    ref = _run(_reference.icepop_loss_reference, lp.float(), rollout, adv, mask)
    assert got[1].dtype == torch.bfloat16
    assert_close(got[0], ref[0], tol=1e-5, name="loss")   # computed in fp32 from bf16 inputs
    assert_close(got[1].float(), ref[1], tol=1e-2, name="grad")


def test_reference_autograd_equals_written_out_gradient():
    lp, rollout, adv, mask, old = _inputs((3000,), seed=5, with_old=True)
    for mode_old in (None, old):
        lp_req = lp.clone().requires_grad_(True)
        kw = dict(old_logprobs=mode_old, gate_low=0.5, gate_high=2.0, eps_low=0.2,
                  eps_high=0.28)
        terms = _reference.icepop_token_terms(lp_req, rollout, adv, mask, **kw)[0]
        autograd = torch.autograd.grad(terms.sum(), lp_req)[0]
        written = _reference.icepop_token_grad(lp, rollout, adv, mask, **kw)
        assert_close(written, autograd, tol=FP32, name="written-out gradient")


class TestHandComputed:
    """Values worked out by hand from the formulas in docs/design.md 3.1."""

    def _one(self, lp, rollout, adv, **kw):
        lp_t = torch.tensor([lp], device=DEVICE, requires_grad=True)
        loss = glm_kernels.icepop_loss(lp_t, torch.tensor([rollout], device=DEVICE),
                                       torch.tensor([adv], device=DEVICE), reduction="sum",
                                       **kw)
        loss.backward()
        return loss.item(), lp_t.grad.item()

    def test_inside_clip_band(self, any_backend):
        # rho = e^0.1 in [0.8, 1.28]: l = -rho*A, dl/dlp = -rho*A
        rho = math.exp(0.1)
        loss, grad = self._one(-1.0, -1.1, 2.0)
        assert loss == pytest.approx(-rho * 2.0, rel=1e-5)
        assert grad == pytest.approx(-rho * 2.0, rel=1e-5)

    def test_positive_advantage_clipped_above(self, any_backend):
        # rho = e^0.5 = 1.6487 > 1.28, A > 0: max(-1.6487A, -1.28A) = -1.28A, gradient cut
        loss, grad = self._one(-1.0, -1.5, 1.0)
        assert loss == pytest.approx(-1.28, rel=1e-5)
        assert grad == 0.0

    def test_negative_advantage_not_clipped_above(self, any_backend):
        # rho = e^0.5, A = -1: max(1.6487, 1.28) = 1.6487, gradient -rho*A = rho
        rho = math.exp(0.5)
        loss, grad = self._one(-1.0, -1.5, -1.0)
        assert loss == pytest.approx(rho, rel=1e-5)
        assert grad == pytest.approx(rho, rel=1e-5)

    def test_negative_advantage_clipped_below(self, any_backend):
        # rho = e^-0.5 = 0.6065 < 0.8, A = -1: max(0.6065, 0.8) = 0.8, gradient cut
        loss, grad = self._one(-1.5, -1.0, -1.0)
        assert loss == pytest.approx(0.8, rel=1e-5)
        assert grad == 0.0

    def test_popped_above_gate(self, any_backend):
        # rho = e^1 = 2.718 > beta = 2: popped
        assert self._one(-1.0, -2.0, 1.0) == (0.0, 0.0)

    @pytest.mark.parametrize("log_ratio", [math.log(2.0), -math.log(2.0)])
    @pytest.mark.parametrize("end", ["low", "high"])
    def test_gate_bounds_inclusive(self, any_backend, log_ratio, end):
        # A gate end equal to the ratio itself keeps the token (both ends inclusive).
        rho = torch.exp(torch.tensor(log_ratio)).item()
        bounds = (dict(gate_low=rho, gate_high=4 * rho) if end == "low"
                  else dict(gate_low=rho / 4, gate_high=rho))
        loss, _ = self._one(log_ratio - 1.0, -1.0, 1.0, **bounds)
        expected = -min(rho, 1.28) if rho > 1 else -rho
        assert loss == pytest.approx(expected, rel=1e-5)

    def test_exactly_on_clip_bound_keeps_gradient(self, any_backend):
        # rho exactly 1 + eps_high (as fp32): unclipped == clipped, gradient -rho*A passes
        rho = torch.tensor(1.28)
        lp = torch.log(rho).item()
        loss, grad = self._one(lp, 0.0, 1.0, eps_high=(torch.exp(torch.tensor(lp)) - 1).item())
        assert grad != 0.0
        assert loss == pytest.approx(grad, rel=1e-5)

    def test_decoupled_weight(self, any_backend):
        # k = e^0.2 (gate ok), r = e^0.1 inside the band: l = -k*r*A
        k, r = math.exp(0.2), math.exp(0.1)
        lp_t = torch.tensor([-1.0], device=DEVICE, requires_grad=True)
        loss = glm_kernels.icepop_loss(lp_t, torch.tensor([-1.3], device=DEVICE),
                                       torch.tensor([1.5], device=DEVICE),
                                       old_logprobs=torch.tensor([-1.1], device=DEVICE),
                                       reduction="sum")
        loss.backward()
        assert loss.item() == pytest.approx(-k * r * 1.5, rel=1e-5)
        assert lp_t.grad.item() == pytest.approx(-k * r * 1.5, rel=1e-5)

    def test_decoupled_popped_by_old_vs_rollout(self, any_backend):
        # k = e^1 > 2 even though r = 1: popped
        lp_t = torch.tensor([-1.0], device=DEVICE, requires_grad=True)
        loss = glm_kernels.icepop_loss(lp_t, torch.tensor([-2.0], device=DEVICE),
                                       torch.tensor([1.0], device=DEVICE),
                                       old_logprobs=torch.tensor([-1.0], device=DEVICE),
                                       reduction="sum")
        loss.backward()
        assert loss.item() == 0.0 and lp_t.grad.item() == 0.0


@pytest.mark.parametrize("with_old", [False, True])
def test_popped_nonfinite_inputs_give_exact_zero(any_backend, with_old):
    lp = torch.tensor([float("nan"), float("inf"), -1.0, -1.0, -1.0, -1.0], device=DEVICE)
    rollout = torch.tensor([-1.0, -1.0, float("-inf"), float("nan"), -1.0, -1.05],
                           device=DEVICE)
    adv = torch.tensor([1.0, 1.0, 1.0, 1.0, float("nan"), 2.0], device=DEVICE)
    mask = torch.tensor([True, True, True, True, False, True], device=DEVICE)
    old = lp.clone() if with_old else None
    if with_old:
        old[4:] = -1.0
    lp_req = lp.clone().requires_grad_(True)
    loss, metrics = glm_kernels.icepop_loss(lp_req, rollout, adv, mask, old_logprobs=old,
                                            reduction="none", return_metrics=True)
    loss.sum().backward()
    assert torch.all(loss[:5] == 0) and torch.all(lp_req.grad[:5] == 0)
    assert torch.isfinite(loss[5]) and loss[5] != 0 and lp_req.grad[5] != 0
    # Tokens 0, 1: train-side NaN / inf (non-finite, not popped); 2, 3: rollout-side (popped).
    assert metrics["pop_frac"].item() == pytest.approx(2 / 5)
    assert metrics["nonfinite_frac"].item() == pytest.approx(2 / 5)
    # Only token 5 has finite log-probs on both sides: the mismatch metrics are its own.
    d = -1.0 + 1.05                                      # train (lp or old) - rollout
    assert metrics["kl"].item() == pytest.approx(-d, rel=1e-5)
    assert metrics["k3_kl"].item() == pytest.approx(math.expm1(d) - d, rel=1e-5)
    assert metrics["chi2_token"].item() == pytest.approx(math.expm1(2 * d), rel=1e-5)
    assert metrics["rollout_is_oob_ratio"].item() == 0.0
    assert metrics["rollout_nonfinite_count"].item() == 2.0


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_decoupled_nonfinite_logprobs_loss_and_gradient_agree(any_backend, bad):
    """Decoupled mode, old finite and in the gate, lp non-finite: the token contributes 0 to
    the loss and the gradient (before: NaN loss with a zero gradient), counted non-finite."""
    lp = torch.tensor([bad, -1.0], device=DEVICE, requires_grad=True)
    rollout = torch.tensor([-1.0, -1.1], device=DEVICE)
    old = torch.tensor([-1.0, -1.0], device=DEVICE)
    adv = torch.tensor([1.0, 1.0], device=DEVICE)
    loss, metrics = glm_kernels.icepop_loss(lp, rollout, adv, old_logprobs=old, reduction="sum",
                                            return_metrics=True)
    loss.backward()
    k = math.exp(0.1)
    assert loss.item() == pytest.approx(-k, rel=1e-5)         # token 1 only: -k * r * A, r = 1
    assert lp.grad[0].item() == 0.0 and lp.grad[1].item() == pytest.approx(-k, rel=1e-5)
    assert metrics["nonfinite_frac"].item() == 0.5 and metrics["pop_frac"].item() == 0.0
    with pytest.raises(ValueError, match="non-finite"):
        glm_kernels.icepop_loss(lp, rollout, adv, old_logprobs=old, raise_on_nonfinite=True)


def test_raise_on_nonfinite_coupled_and_clean_input(any_backend):
    lp = torch.tensor([-1.0, float("nan"), -2.0], device=DEVICE)
    rollout = torch.tensor([-1.0, -1.0, float("nan")], device=DEVICE)
    adv = torch.ones(3, device=DEVICE)
    with pytest.raises(ValueError, match="1 of 3 masked tokens"):
        glm_kernels.icepop_loss(lp, rollout, adv, raise_on_nonfinite=True)
    # Unmasked non-finite tokens and rollout-side NaN do not raise.
    mask = torch.tensor([True, False, True], device=DEVICE)
    loss = glm_kernels.icepop_loss(lp, rollout, adv, mask, raise_on_nonfinite=True)
    assert loss.item() == pytest.approx(-0.5)      # token 0: -1 * 1, over 2 masked tokens


def test_nonfinite_train_logprobs_warn_once_naming_the_count(any_backend, monkeypatch, caplog):
    """Non-finite train-side log-probs give 0 loss and 0 gradient: said once per process (a
    diverged policy is not silent), with the count; warn_on_nonfinite=False is silent."""
    from glm_kernels import _dispatch
    monkeypatch.setattr(_dispatch, "_warned", set())
    lp = torch.tensor([float("nan"), float("-inf"), -1.0], device=DEVICE, requires_grad=True)
    rollout = torch.full((3,), -1.0, device=DEVICE)
    adv = torch.ones(3, device=DEVICE)
    mask = torch.tensor([1, 1, 0], device=DEVICE)
    with caplog.at_level("WARNING", logger="glm_kernels"):
        glm_kernels.icepop_loss(lp, rollout, adv, warn_on_nonfinite=False)
        assert caplog.records == []
        glm_kernels.icepop_loss(lp[2:], rollout[2:], adv[2:])          # finite: nothing
        assert caplog.records == []
        loss = glm_kernels.icepop_loss(lp, rollout, adv, mask)
        loss.backward()
        assert loss.item() == 0.0 and lp.grad.abs().sum().item() == 0.0
        (record,) = caplog.records
        assert record.levelname == "WARNING"
        assert "icepop_loss: 2 of 2 masked tokens have a non-finite" in record.getMessage()
        glm_kernels.icepop_loss(lp, rollout, adv, old_logprobs=rollout.flip(0))
        assert len(caplog.records) == 1                                  # once per process
    with pytest.raises(ValueError, match="non-finite"):                  # raise still raises
        glm_kernels.icepop_loss(lp, rollout, adv, raise_on_nonfinite=True)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nonfinite_advantage_of_a_kept_token_propagates(any_backend, bad):
    """Documented: a NaN/inf advantage of a kept token reaches the loss and that token's
    gradient; other tokens' gradients stay finite; popped/unmasked tokens never read theirs."""
    lp = torch.tensor([-1.0, -1.0, -1.0, -1.0], device=DEVICE, requires_grad=True)
    rollout = torch.tensor([-1.0, -1.0, -3.0, -1.0], device=DEVICE)     # token 2 popped
    adv = torch.tensor([bad, 1.0, bad, bad], device=DEVICE)
    mask = torch.tensor([True, True, True, False], device=DEVICE)
    loss = glm_kernels.icepop_loss(lp, rollout, adv, mask)
    loss.backward()
    assert not math.isfinite(loss.item())
    assert not math.isfinite(lp.grad[0].item())
    assert lp.grad[1].item() == pytest.approx(-1 / 3) and lp.grad[2:].tolist() == [0.0, 0.0]


def test_empty_mask_and_empty_input(any_backend):
    lp = torch.zeros(5, device=DEVICE, requires_grad=True)
    loss, metrics = glm_kernels.icepop_loss(lp, torch.zeros(5, device=DEVICE),
                                            torch.ones(5, device=DEVICE),
                                            torch.zeros(5, dtype=torch.bool, device=DEVICE),
                                            return_metrics=True)
    loss.backward()
    assert loss.item() == 0.0 and torch.all(lp.grad == 0)
    assert metrics["pop_frac"].item() == 0.0 and math.isnan(metrics["ratio_mean"].item())
    empty = torch.zeros(0, device=DEVICE, requires_grad=True)
    loss = glm_kernels.icepop_loss(empty, torch.zeros(0, device=DEVICE),
                                   torch.zeros(0, device=DEVICE))
    loss.backward()
    assert loss.item() == 0.0 and empty.grad.shape == (0,)
    rows = torch.zeros(2, 3, device=DEVICE, requires_grad=True)
    mask = torch.tensor([[True, False, False], [False, False, False]], device=DEVICE)
    loss = glm_kernels.icepop_loss(rows, torch.zeros(2, 3, device=DEVICE),
                                   torch.ones(2, device=DEVICE), mask,
                                   reduction="seq_mean_token_mean")
    loss.backward()
    assert loss.item() == pytest.approx(-1.0)   # only row 0 counts: -rho*A = -1
    assert rows.grad[0, 0].item() == pytest.approx(-1.0) and rows.grad[1].abs().sum() == 0


def test_reductions_by_hand(any_backend):
    lp = torch.zeros(2, 2, device=DEVICE, requires_grad=True)   # rho = 1 everywhere: l = -A
    adv = torch.tensor([[1.0, 2.0], [3.0, 4.0]], device=DEVICE)
    mask = torch.tensor([[True, True], [True, False]], device=DEVICE)
    args = (lp, torch.zeros(2, 2, device=DEVICE), adv, mask)
    assert glm_kernels.icepop_loss(*args, reduction="sum").item() == pytest.approx(-6.0)
    assert glm_kernels.icepop_loss(*args, reduction="token_mean").item() == pytest.approx(-2.0)
    seq = glm_kernels.icepop_loss(*args, reduction="seq_mean_token_mean").item()
    assert seq == pytest.approx((-1.5 - 3.0) / 2)
    none = glm_kernels.icepop_loss(*args, reduction="none")
    assert none.tolist() == [[-1.0, -2.0], [-3.0, 0.0]]


def test_non_contiguous_inputs(any_backend):
    lp, rollout, adv, mask, _ = _inputs((64, 40), seed=7)
    strided = [t.t() for t in (lp, rollout, adv, mask)]
    got = _run(glm_kernels.icepop_loss, *strided, reduction="sum")
    ref = _run(_reference.icepop_loss_reference, *[t.contiguous() for t in strided],
               reduction="sum")
    assert_close(got[0], ref[0], tol=1e-5, name="loss")
    assert_close(got[1], ref[1], tol=1e-5, name="grad")


def test_gradient_only_to_logprobs():
    lp, rollout, adv, mask, old = _inputs((50,), seed=8, with_old=True)
    tensors = [t.clone().requires_grad_(True) for t in (lp, rollout, adv, old)]
    glm_kernels.icepop_loss(tensors[0], tensors[1], tensors[2], mask,
                            old_logprobs=tensors[3]).backward()
    assert tensors[0].grad is not None
    assert all(t.grad is None for t in tensors[1:])


def test_kernel_writes_every_gradient_element(kernel_backend):
    """Poisoned outputs: a kernel that skipped an element would leave NaN behind."""
    from glm_kernels.loss.icepop import icepop
    lp, rollout, adv, mask, _ = _inputs((3001,), seed=9)
    n = lp.numel()
    loss_out = torch.full((n,), float("nan"), device=DEVICE)
    grad_out = torch.full((n,), float("nan"), device=DEVICE)
    programs = -(-n // icepop._BLOCK_INTERPRET)
    stats = torch.full((programs, 8), float("nan"), device=DEVICE)
    from glm_kernels.loss.icepop import _kernels
    _kernels.icepop_fwd(lp, rollout, None, adv, mask.view(torch.uint8), loss_out, grad_out,
                        stats, seq_len=1, gate_low=0.5, gate_high=2.0, clip_low=0.8,
                        clip_high=1.28, adv_per_seq=False, block=icepop._BLOCK_INTERPRET,
                        num_warps=4)
    assert not torch.isnan(loss_out).any() and not torch.isnan(grad_out).any()
    assert not torch.isnan(stats).any()


def test_torch_compile_matches_eager():
    lp, rollout, adv, mask, _ = _inputs((8, 33), seed=10)

    def step(lp_in):
        loss, metrics = glm_kernels.icepop_loss(lp_in, rollout, adv, mask,
                                                reduction="seq_mean_token_mean",
                                                return_metrics=True)
        return loss * 2.0, metrics["pop_frac"]

    with glm_kernels.force_backend("torch"):
        eager_lp = lp.clone().requires_grad_(True)
        eager = step(eager_lp)
        eager[0].backward()
        compiled_lp = lp.clone().requires_grad_(True)
        compiled = torch.compile(step, fullgraph=True, backend="aot_eager")(compiled_lp)
        compiled[0].backward()
    assert_close(compiled[0].detach(), eager[0].detach(), tol=FP32, name="compiled loss")
    assert_close(compiled_lp.grad, eager_lp.grad, tol=FP32, name="compiled grad")
    assert compiled[1].item() == eager[1].item()


def test_opcheck_custom_op():
    """torch.library.opcheck: schema, fake kernel and autograd registration agree."""
    from glm_kernels.loss.icepop import icepop
    lp, rollout, adv, mask, _ = _inputs((4, 9), seed=11)
    with glm_kernels.force_backend("torch"):
        torch.library.opcheck(icepop._icepop_op, (lp.requires_grad_(True), rollout, adv, mask,
                                                  None, 0.5, 2.0, 0.2, 0.28, 3.0,
                                                  "token_mean", True),
                              test_utils=("test_schema", "test_faketensor",
                                          "test_autograd_registration"))


class TestBadInputs:
    def test_shapes(self):
        lp = torch.zeros(4, 5)
        with pytest.raises(ValueError, match="rollout_logprobs"):
            glm_kernels.icepop_loss(lp, torch.zeros(4, 6), torch.zeros(4, 5))
        with pytest.raises(ValueError, match="advantages"):
            glm_kernels.icepop_loss(lp, lp, torch.zeros(5))
        with pytest.raises(ValueError, match="loss_mask"):
            glm_kernels.icepop_loss(lp, lp, lp, torch.ones(4, dtype=torch.bool))
        with pytest.raises(ValueError, match="old_logprobs"):
            glm_kernels.icepop_loss(lp, lp, lp, old_logprobs=torch.zeros(3))
        with pytest.raises(ValueError, match="seq_mean_token_mean"):
            glm_kernels.icepop_loss(torch.zeros(5), torch.zeros(5), torch.zeros(5),
                                    reduction="seq_mean_token_mean")

    def test_dtypes_and_types(self):
        with pytest.raises(TypeError, match="logprobs"):
            glm_kernels.icepop_loss(torch.zeros(3, dtype=torch.int64), torch.zeros(3),
                                    torch.zeros(3))
        with pytest.raises(TypeError, match="advantages"):
            glm_kernels.icepop_loss(torch.zeros(3), torch.zeros(3), [1, 2, 3])
        with pytest.raises(TypeError, match="rollout_logprobs"):
            glm_kernels.icepop_loss(torch.zeros(3), torch.zeros(3, dtype=torch.int32),
                                    torch.zeros(3))

    def test_hyperparameters(self):
        args = (torch.zeros(3), torch.zeros(3), torch.zeros(3))
        with pytest.raises(ValueError, match="reduction"):
            glm_kernels.icepop_loss(*args, reduction="mean")
        with pytest.raises(ValueError, match="beta"):
            glm_kernels.icepop_loss(*args, beta=0.0)
        with pytest.raises(ValueError, match="gate_low must be < gate_high"):
            glm_kernels.icepop_loss(*args, gate_low=3.0, gate_high=2.0)
        with pytest.raises(ValueError, match="eps_low"):
            glm_kernels.icepop_loss(*args, eps_low=float("nan"))

    @pytest.mark.parametrize("kwargs,error,name", [
        (dict(eps_low=1.5), ValueError, "eps_low"),        # clip band starts below 0
        (dict(eps_low=1.0), ValueError, "eps_low"),
        (dict(eps_high=-0.1), ValueError, "eps_high"),
        (dict(gate_low=-1.0), ValueError, "gate_low"),     # negative gate end
        (dict(gate_low=1.0, gate_high=1.0), ValueError, "gate_low"),   # a single point
        (dict(gate_high=0.4), ValueError, "gate_low"),     # [1/2, 0.4]: inverted
        (dict(beta=1.0), ValueError, "beta"),              # [1, 1]: empty
        (dict(beta=0.5), ValueError, "beta"),              # [2, 0.5]: inverted
        (dict(beta="2"), TypeError, "beta"),
        (dict(gate_high=float("inf")), ValueError, "gate_high"),
        (dict(return_metrics="yes"), TypeError, "return_metrics"),
        (dict(raise_on_nonfinite=1), TypeError, "raise_on_nonfinite"),
        (dict(warn_on_nonfinite=0), TypeError, "warn_on_nonfinite"),
    ])
    def test_silent_band_and_flag_errors_name_the_argument(self, kwargs, error, name):
        args = (torch.zeros(3), torch.zeros(3), torch.zeros(3))
        with pytest.raises(error, match=name):
            glm_kernels.icepop_loss(*args, **kwargs)

    def test_accepted_edges(self):
        args = (torch.zeros(3), torch.zeros(3), torch.ones(3))
        # gate_low = 0 (no lower gate, slime's --tis-clip-low 0 default) and eps_low = 0.
        loss = glm_kernels.icepop_loss(*args, gate_low=0.0, eps_low=0.0, reduction="sum")
        assert loss.item() == pytest.approx(-3.0)

    def test_forced_interpret_refuses_cuda_like_misuse(self):
        with pytest.raises(ValueError, match="backend"):
            with glm_kernels.force_backend("cuda"):
                pass
