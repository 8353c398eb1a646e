"""kl_penalty_loss / kl_penalty_terms vs verl 0.9.1's own kl_penalty + agg_loss (imported from
the installed verl), on both backends (torch; Triton kernel under the interpreter / GPU)."""
import re
from pathlib import Path

import numpy as np
import pytest
import torch

import glm_kernels
from tests._compare import TOLERANCES, assert_close
from tests.conftest import DEVICE, LazyKernels
from tests.test_compile_inductor import check_compiled_matches_eager

core_algos = pytest.importorskip("verl.trainer.ppo.core_algos")
verl_kl_penalty, verl_agg_loss = core_algos.kl_penalty, core_algos.agg_loss

_kl_kernels = LazyKernels("glm_kernels.loss.kl._kernels")
ROOT = Path(__file__).resolve().parents[2]

BASE_KINDS = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
KINDS = BASE_KINDS + tuple(k + "+" for k in BASE_KINDS)
MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-sum-norm",
         "seq-mean-token-mean")
# verl's global_batch_info as a data-parallel rank sees it (dp_size > 1 needs the counts).
DP_ARGS = ({}, dict(batch_num_tokens=40, global_batch_size=8, loss_scale_factor=3),
           dict(dp_size=4, batch_num_tokens=57, global_batch_size=11),
           dict(dp_size=2, batch_num_tokens=30, global_batch_size=9, loss_scale_factor=64))


def _batch(shape=(7, 13), dtype=torch.float32, seed=0, mask_kind="int"):
    """log_prob, ref_log_prob with differences wide enough to hit both k3 clamps
    (|ref - lp| > 20 and e^x - x - 1 > 10), a ragged mask with all-masked rows."""
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(shape, generator=g) * 4
    spread = torch.randn(shape, generator=g) * torch.tensor([0.3, 2.0, 12.0])[
        torch.randint(0, 3, shape, generator=g)]
    ref = lp + spread
    lengths = torch.randint(0, shape[-1] + 1, shape[:-1], generator=g)
    lengths.view(-1)[0] = 0                                     # an all-masked row
    if lengths.numel() > 1:
        lengths.view(-1)[1] = shape[-1]                         # a full row
        if shape[-1] >= 3:                                      # in it, both k3 clamps
            rows_lp, rows_ref = lp.view(-1, shape[-1]), ref.view(-1, shape[-1])
            rows_ref[1, :3] = rows_lp[1, :3] + torch.tensor([25.0, -25.0, 3.0])
    mask = torch.arange(shape[-1]) < lengths.unsqueeze(-1)
    mask = {"bool": mask, "int": mask.long(), "float": mask.float()}[mask_kind]
    return lp.to(dtype).to(DEVICE), ref.to(dtype).to(DEVICE), mask.to(DEVICE)


def _ours(lp, ref, mask, kind, mode, **dp):
    x = lp.detach().clone().requires_grad_(True)
    r = ref.detach().clone().requires_grad_(True)
    loss = glm_kernels.kl_penalty_loss(log_prob=x, ref_log_prob=r, response_mask=mask,
                                       kl_penalty=kind, loss_agg_mode=mode, **dp)
    loss.backward()
    assert r.grad is None                               # the reference gets no gradient
    return loss.detach(), x.grad


def _verl(lp, ref, mask, kind, mode, **dp):
    x = lp.detach().clone().requires_grad_(True)
    loss = verl_agg_loss(loss_mat=verl_kl_penalty(x, ref, kind), loss_mask=mask,
                         loss_agg_mode=mode, **dp)
    loss.backward()
    return loss.detach(), x.grad


def _assert_matches(got, want, tol, what):
    assert got[0].dtype == torch.float32 and got[0].shape == ()
    assert got[1].dtype == want[1].dtype
    assert_close(got[0], want[0].float(), tol=tol, name=f"{what} loss")
    assert_close(got[1].float(), want[1].float(), tol=tol, name=f"{what} grad")


@pytest.mark.parametrize("kind", KINDS)
def test_matches_verl_fp32(any_backend, kind):
    lp, ref, mask = _batch(seed=KINDS.index(kind))
    x, masked = ref - lp, mask != 0
    assert (masked & (x.abs() > 20)).any() and (masked & (x > 2.7)).any()    # both k3 clamps
    assert (masked & (x.abs() < 2.5)).any()                                  # and neither
    for mode in MODES:
        for dp in DP_ARGS:
            _assert_matches(_ours(lp, ref, mask, kind, mode, **dp),
                            _verl(lp, ref, mask, kind, mode, **dp), 1e-5, f"{mode} {dp}")


@pytest.mark.parametrize("kind", ("k1", "abs", "k2", "k3", "k3+", "abs+"))
def test_matches_verl_bf16(any_backend, kind):
    # The fused op computes in fp32 from the bf16 values; verl computes in bf16 (its d, its
    # exp and its sums are rounded to 8 bits): the loss agrees to bf16 rounding. Both clamp
    # ends of k3 are kept out of reach here, where bf16 rounding alone would move a token
    # across an end (tests below hit the ends in fp32).
    g = torch.Generator().manual_seed(1)
    lp = (-torch.rand(6, 40, generator=g) * 4)
    ref = lp + torch.randn(6, 40, generator=g).clamp(-2, 2)
    mask = (torch.rand(6, 40, generator=g) > 0.3)
    mask[0] = False
    lp, ref, mask = lp.bfloat16().to(DEVICE), ref.bfloat16().to(DEVICE), mask.to(DEVICE)
    for mode in MODES:
        got, want = _ours(lp, ref, mask, kind, mode), _verl(lp, ref, mask, kind, mode)
        _assert_matches(got, want, TOLERANCES[torch.bfloat16], mode)
        # Against verl on the same bf16 values in fp32: the loss is fp32 math; the gradient is
        # rounded twice to bf16 (the saved coefficient, then coefficient x scale), each within
        # bf16's unit roundoff 2^-8 (relative).
        exact = _verl(lp.float(), ref.float(), mask, kind, mode)
        assert_close(got[0], exact[0], tol=1e-5, name=f"{mode} loss vs fp32 verl")
        assert_close(got[1].float(), exact[1], tol=2 ** -7, name=f"{mode} grad vs fp32 verl")


@pytest.mark.parametrize("mask_kind", ("bool", "int", "float"))
def test_mask_dtypes_and_weights(any_backend, mask_kind):
    lp, ref, mask = _batch((5, 9), seed=3, mask_kind=mask_kind)
    for kind in ("k3", "k2+"):
        for mode in MODES:
            _assert_matches(_ours(lp, ref, mask, kind, mode), _verl(lp, ref, mask, kind, mode),
                            1e-5, f"{mask_kind} {mode}")
    # verl's mask is a multiplier: fractional weights count as weights
    weights = mask.float() * torch.linspace(0.25, 2.0, mask.shape[-1], device=DEVICE)
    for mode in MODES:
        _assert_matches(_ours(lp, ref, weights, "k3", mode), _verl(lp, ref, weights, "k3", mode),
                        1e-5, f"weights {mode}")


@pytest.mark.parametrize("shape", ((11,), (2, 3, 17), (3, 1100)))
def test_other_layouts(any_backend, shape):
    # 1-D (one row), 3-D (rows = leading dims) and rows spanning several column blocks.
    lp, ref, mask = _batch(shape, seed=4)
    for mode in MODES:
        _assert_matches(_ours(lp, ref, mask, "low_var_kl", mode),
                        _verl(lp, ref, mask, "low_var_kl", mode), 1e-5, f"{shape} {mode}")


def test_clamp_ends_and_zero_gradient_regions(any_backend):
    # x = ref - lp on and beyond the ends of [-20, 20]; e^x - x - 1 on both sides of 10.
    x = torch.tensor([[-25.0, -20.0, -19.5, -11.0, -10.9, -9.0, 0.0, 1e-4, 2.6, 2.7, 19.0,
                       20.0, 21.0]], device=DEVICE)
    lp = torch.full_like(x, -1.0)
    ref, mask = lp + x, torch.ones_like(x)
    for kind in ("k3", "low_var_kl+", "abs", "k1"):
        got = _ours(lp, ref, mask, kind, "token-sum")
        want = _verl(lp, ref, mask, kind, "token-sum")
        _assert_matches(got, want, 1e-6, kind)
        assert torch.equal(got[1] == 0, want[1] == 0), kind      # same zero-gradient tokens
    k3_grad = _ours(lp, ref, mask, "k3", "token-sum")[1][0]
    # e^x - x - 1 > 10 for x < -10.999 or x > 2.63 (so the log-ratio clamp at |x| = 20 never
    # decides: its term is clamped first); x = 0 has a zero gradient of its own.
    assert (k3_grad[[0, 1, 2, 3, 6, 9, 10, 11, 12]] == 0).all()
    assert (k3_grad[[4, 5, 7, 8]] != 0).all()


def test_masked_out_nonfinite_inputs_are_ignored(any_backend):
    lp, ref, mask = _batch((6, 10), seed=5, mask_kind="bool")
    dirty_lp, dirty_ref = lp.clone(), ref.clone()
    dirty_lp[~mask] = float("-inf")
    dirty_ref[~mask] = float("nan")
    for kind in ("k1", "k2", "k3", "abs+"):
        for mode in MODES:
            got = _ours(dirty_lp, dirty_ref, mask, kind, mode)
            want = _verl(lp, ref, mask, kind, mode)      # verl on the clean inputs
            _assert_matches(got, want, 1e-5, f"{kind} {mode}")
            assert (got[1][~mask] == 0).all()
            # verl on the dirty inputs, as docs/kl_penalty.md says: its token modes give the
            # same loss (masked_sum), its seq-mean modes NaN (they multiply by the mask).
            verl_dirty = _verl(dirty_lp, dirty_ref, mask, kind, mode)[0]
            if mode.startswith("token"):
                assert_close(got[0], verl_dirty, tol=1e-5, name=f"{kind} {mode} dirty")
            else:
                assert torch.isnan(verl_dirty), f"{kind} {mode}"


def test_all_masked_batch(any_backend):
    lp, ref, _ = _batch((3, 5), seed=6)
    mask = torch.zeros(3, 5, dtype=torch.long, device=DEVICE)
    for mode in MODES:
        got, want = _ours(lp, ref, mask, "k3", mode), _verl(lp, ref, mask, "k3", mode)
        if mode == "token-sum":
            assert got[0] == 0 and want[0] == 0
        else:                                                      # verl: 0 / 0
            assert torch.isnan(got[0]) and torch.isnan(want[0]), mode
        assert (got[1] == 0).all() and (want[1] == 0).all(), mode
        dp = dict(dp_size=2, batch_num_tokens=10, global_batch_size=4)
        _assert_matches(_ours(lp, ref, mask, "k3", mode, **dp),
                        _verl(lp, ref, mask, "k3", mode, **dp), 0.0, mode)


def test_empty(any_backend):
    for shape in ((0, 5), (4, 0)):
        x = torch.zeros(shape, device=DEVICE, requires_grad=True)
        mask = torch.ones(shape, device=DEVICE)
        loss = glm_kernels.kl_penalty_loss(log_prob=x, ref_log_prob=x.detach(),
                                           response_mask=mask, loss_agg_mode="token-sum")
        loss.backward()
        assert loss.item() == 0.0 and x.grad.shape == shape
        terms = glm_kernels.kl_penalty_terms(x, x.detach())
        assert terms.shape == shape


def test_row_gradient_independent_of_the_batch(any_backend):
    # With verl's global counts given, a row's gradient is its per-token coefficient times
    # dp_size / batch_num_tokens (or its row's seq-mean weight): bitwise the same alone and in
    # any batch (the tile shape changes with the row count; the per-token math does not).
    lp, ref, mask = _batch((9, 300), seed=16)
    dp = dict(dp_size=2, batch_num_tokens=700, global_batch_size=16)
    for mode in ("token-mean", "seq-mean-token-mean"):
        batch = _ours(lp, ref, mask, "k3", mode, **dp)[1]
        alone = _ours(lp[3:4], ref[3:4], mask[3:4], "k3", mode, **dp)[1]
        assert torch.equal(alone[0], batch[3]), mode


def test_no_grad_and_non_contiguous(any_backend):
    lp, ref, mask = _batch((9, 6), seed=7)
    lp_t, ref_t, mask_t = lp.t(), ref.t(), mask.t()            # non-contiguous [6, 9]
    with torch.no_grad():
        loss = glm_kernels.kl_penalty_loss(log_prob=lp_t, ref_log_prob=ref_t,
                                           response_mask=mask_t,
                                           loss_agg_mode="seq-mean-token-mean")
    want = _verl(lp_t.contiguous(), ref_t.contiguous(), mask_t, "low_var_kl",
                 "seq-mean-token-mean")
    assert_close(loss, want[0], tol=1e-5, name="loss")
    got = _ours(lp_t, ref_t, mask_t, "low_var_kl", "seq-mean-token-mean")
    _assert_matches(got, want, 1e-5, "non-contiguous")


# --------------------------------------------------------------------------- per-token terms
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float16))
def test_terms_match_verl_kl_penalty(any_backend, dtype):
    lp, ref, _ = _batch((4, 11), dtype=torch.float32, seed=8)
    lp, ref = lp.to(dtype), ref.to(dtype)
    weights = torch.linspace(-1.0, 2.0, lp.numel(), device=DEVICE).reshape(lp.shape)
    for kind in KINDS:
        x = lp.detach().clone().requires_grad_(True)
        terms = glm_kernels.kl_penalty_terms(x, ref, kl_penalty=kind)
        (terms * weights).sum().backward()
        y = lp.detach().float().clone().requires_grad_(True)   # verl on the same values
        want = verl_kl_penalty(y, ref.float(), kind)
        (want * weights).sum().backward()
        assert terms.dtype == torch.float32 and x.grad.dtype == dtype
        assert_close(terms, want, tol=1e-5, name=f"{kind} terms")
        assert_close(x.grad.float(), y.grad, tol=TOLERANCES[dtype], name=f"{kind} grad")


def test_terms_unclamped_k3_is_the_hand_derived_k3(any_backend):
    lp, ref, _ = _batch((5, 12), seed=9)
    ref = ref.clamp(max=lp + 30)                     # e^30: finite in fp32
    weights = torch.linspace(-1.0, 2.0, lp.numel(), device=DEVICE).reshape(lp.shape)
    x = lp.detach().clone().requires_grad_(True)
    terms = glm_kernels.kl_penalty_terms(x, ref, kl_penalty="k3", clamp=False)
    (terms * weights).sum().backward()
    y = lp.detach().clone().requires_grad_(True)
    want = torch.exp(ref - y) - (ref - y) - 1
    (want * weights).sum().backward()
    assert_close(terms, want, tol=1e-5, name="terms")
    assert_close(x.grad, y.grad, tol=1e-5, name="grad")
    assert terms.max() > 10                                   # beyond verl's clamp


def test_terms_unclamped_k3_is_trls_per_token_kl(any_backend):
    """TRL 1.16 writes its per-token KL inline in ``GRPOTrainer._compute_loss`` (no function
    to import): the expression is read from the installed grpo_trainer.py and evaluated on
    the same tensors, so a TRL release that changes it fails here."""
    grpo = pytest.importorskip("trl.trainer.grpo_trainer")
    source = Path(grpo.__file__).read_text()
    found = re.search(r"per_token_kl = \(\s*(torch\.exp\(ref_per_token_logps - per_token_logps"
                      r"\)[^\n]*)\n\s*\)", source)
    assert found, "TRL's per-token KL moved or changed: re-derive kl_penalty_terms' TRL mode"
    trl_expression = compile(found.group(1).strip(), "trl per_token_kl", "eval")
    lp, ref, _ = _batch((4, 9), seed=13)
    ref = ref.clamp(max=lp + 30)
    weights = torch.linspace(-1.0, 2.0, lp.numel(), device=DEVICE).reshape(lp.shape)
    x = lp.detach().clone().requires_grad_(True)
    terms = glm_kernels.kl_penalty_terms(x, ref, kl_penalty="k3", clamp=False)
    (terms * weights).sum().backward()
    y = lp.detach().clone().requires_grad_(True)
    want = eval(trl_expression, {"torch": torch},
                {"ref_per_token_logps": ref, "per_token_logps": y})
    (want * weights).sum().backward()
    assert_close(terms, want, tol=1e-5, name="terms")
    assert_close(x.grad, y.grad, tol=1e-5, name="grad")


# --------------------------------------------------------------------------- bad inputs
def test_refuses_what_verl_refuses():
    lp, ref, mask = _batch((2, 4), seed=10)
    for kind in ("full", "full+", "k4", "k3++", "+", "", "K3"):
        with pytest.raises(NotImplementedError):
            verl_kl_penalty(lp, ref, kind)
        with pytest.raises(ValueError, match="kl_penalty"):
            glm_kernels.kl_penalty_loss(log_prob=lp, ref_log_prob=ref, response_mask=mask,
                                        kl_penalty=kind)
        with pytest.raises(ValueError, match="kl_penalty"):
            glm_kernels.kl_penalty_terms(lp, ref, kl_penalty=kind)
    with pytest.raises(ValueError, match="Invalid loss_agg_mode"):
        verl_agg_loss(lp, mask, "seq-mean")
    with pytest.raises(ValueError, match="loss_agg_mode"):
        glm_kernels.kl_penalty_loss(log_prob=lp, ref_log_prob=ref, response_mask=mask,
                                    loss_agg_mode="seq-mean")
    for mode, needed in (("token-mean", "batch_num_tokens"),
                         ("seq-mean-token-mean", "global_batch_size"),
                         ("seq-mean-token-sum-norm", "global_batch_size")):
        with pytest.raises(ValueError, match=needed):
            verl_agg_loss(lp, mask, mode, dp_size=2)
        with pytest.raises(ValueError, match=needed):
            glm_kernels.kl_penalty_loss(log_prob=lp, ref_log_prob=ref, response_mask=mask,
                                        loss_agg_mode=mode, dp_size=2)


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(kl_penalty=3), TypeError, "kl_penalty"),
    (dict(dp_size=0), ValueError, "dp_size"),
    (dict(dp_size=2.0), TypeError, "dp_size"),
    (dict(dp_size=True), TypeError, "dp_size"),
    (dict(batch_num_tokens=0), ValueError, "batch_num_tokens"),
    (dict(batch_num_tokens=float("nan")), ValueError, "batch_num_tokens"),
    (dict(global_batch_size="8"), TypeError, "global_batch_size"),
    (dict(loss_scale_factor=-1), ValueError, "loss_scale_factor"),
    (dict(log_prob=torch.zeros(2, 4, dtype=torch.long)), TypeError, "log_prob"),
    (dict(log_prob=torch.tensor(0.5)), ValueError, "log_prob"),
    (dict(ref_log_prob=torch.zeros(2, 5)), ValueError, "ref_log_prob"),
    (dict(ref_log_prob=[0.0]), TypeError, "ref_log_prob"),
    (dict(response_mask=torch.ones(2, 5)), ValueError, "response_mask"),
    (dict(response_mask=torch.ones(2, 4, dtype=torch.complex64)), TypeError, "response_mask"),
])
def test_bad_arguments(kwargs, error, match):
    args = dict(log_prob=torch.zeros(2, 4), ref_log_prob=torch.zeros(2, 4),
                response_mask=torch.ones(2, 4))
    args.update(kwargs)
    with pytest.raises(error, match=match):
        glm_kernels.kl_penalty_loss(**args)


def test_numpy_counts_accepted():
    lp, ref, mask = _batch((3, 5), seed=14)
    args = dict(log_prob=lp, ref_log_prob=ref, response_mask=mask, loss_agg_mode="token-mean")
    plain = glm_kernels.kl_penalty_loss(**args, dp_size=2, batch_num_tokens=12)
    numpy_counts = glm_kernels.kl_penalty_loss(**args, dp_size=np.int64(2),
                                               batch_num_tokens=np.int64(12))
    assert torch.equal(plain, numpy_counts)
    with pytest.raises(TypeError, match="dp_size"):
        glm_kernels.kl_penalty_loss(**args, dp_size=np.bool_(True))


def test_positional_arguments_refused():
    with pytest.raises(TypeError):
        glm_kernels.kl_penalty_loss(torch.zeros(2, 4), torch.zeros(2, 4), torch.ones(2, 4))


@pytest.mark.parametrize("value", [1, 0, None, "no", 1.0, np.bool_(True)])
def test_clamp_takes_bool_only(value):
    with pytest.raises(TypeError, match="clamp"):
        glm_kernels.kl_penalty_terms(torch.zeros(3), torch.zeros(3), clamp=value)


# --------------------------------------------------------------------------- kernel, compile
def test_kernel_writes_every_element(kernel_backend):
    lp, ref, mask = _batch((37, 29), seed=11)
    block_r, block_t, warps = _kl_kernels.tile_shape(37, 29)
    n_col_blocks = -(-29 // block_t)
    for kind in (1, 2, 3, 4):
        terms = torch.full((37, 29), float("nan"), device=DEVICE)
        coef = torch.full((37, 29), float("nan"), device=DEVICE)
        partials = torch.full((37, n_col_blocks, 2), float("nan"), device=DEVICE)
        _kl_kernels.kl_fwd(lp, ref, mask, terms, coef, partials, kind_code=kind,
                           straight_through=False, clamp=True, block_r=block_r,
                           block_t=block_t, num_warps=warps)
        assert not terms.isnan().any() and not coef.isnan().any()
        assert not partials.isnan().any()
        assert_close(partials.sum(1)[:, 1], mask.float().sum(-1), tol=0.0, name="row counts")
        # kl_penalty_terms' launch: no mask, no row sums
        terms.fill_(float("nan"))
        coef.fill_(float("nan"))
        _kl_kernels.kl_fwd(lp, ref, None, terms, coef, torch.empty(0, device=DEVICE),
                           kind_code=kind, straight_through=True, clamp=False,
                           block_r=block_r, block_t=block_t, num_warps=warps)
        assert not terms.isnan().any()
        assert torch.equal(coef, lp - ref)                   # straight-through: d


def test_opcheck_custom_ops(any_backend):
    from glm_kernels.loss.kl import kl_penalty
    lp, ref, mask = _batch((4, 7), seed=15)
    lp.requires_grad_(True)
    for args in ((lp, ref, mask, 4, False, "seq-mean-token-mean", 1, None, None, None, True),
                 (lp, ref, mask.bool(), 3, True, "token-mean", 2, 30.0, None, None, True),
                 (lp, ref, mask, 1, False, "seq-mean-token-sum-norm", 1, None, 5.0, 9.0, True)):
        torch.library.opcheck(kl_penalty._kl_loss_op, args)
    torch.library.opcheck(kl_penalty._kl_terms_op, (lp, ref, 4, False, False, True))
    torch.library.opcheck(kl_penalty._kl_terms_op, (lp, ref, 2, True, True, True))
    # Without need_grad there is no backward to check: schema and fake kernel only.
    no_backward = ("test_schema", "test_faketensor")
    torch.library.opcheck(kl_penalty._kl_loss_op, (lp.detach(), ref, mask, 4, False,
                                                   "token-sum", 1, None, None, None, False),
                          test_utils=no_backward)
    torch.library.opcheck(kl_penalty._kl_terms_op, (lp.detach(), ref, 3, False, True, False),
                          test_utils=no_backward)


def test_compiled_matches_eager(any_backend):
    lp, ref, mask = _batch((5, 9), seed=12, mask_kind="bool")
    leaves = [lp, lp.bfloat16()]

    def step(*lps):
        outs = []
        for x in lps:
            for kind, mode, m in (("low_var_kl", "token-mean", mask),
                                  ("k3+", "seq-mean-token-mean", mask.long()),
                                  ("abs", "seq-mean-token-sum-norm", mask.float())):
                outs.append(glm_kernels.kl_penalty_loss(
                    log_prob=x, ref_log_prob=ref, response_mask=m, kl_penalty=kind,
                    loss_agg_mode=mode, dp_size=2, batch_num_tokens=20, global_batch_size=6))
            outs.append(glm_kernels.kl_penalty_loss(log_prob=x, ref_log_prob=ref,
                                                    response_mask=mask, kl_penalty="k2"))
            outs.append(glm_kernels.kl_penalty_terms(x, ref, clamp=False).mean())
        return (sum(outs),) + tuple(outs)
    torch._dynamo.reset()
    check_compiled_matches_eager(step, leaves)


# --------------------------------------------------------------------------- docs
def test_docs_page_and_docstring_examples():
    """docs/kl_penalty.md's examples and the public docstrings' run as written (doctest
    compares what each prints), on the torch backend."""
    import doctest
    from glm_kernels.loss.kl import kl_penalty
    with glm_kernels.force_backend("torch"):
        page = doctest.testfile(str(ROOT / "docs" / "kl_penalty.md"), module_relative=False)
        module = doctest.testmod(kl_penalty)
    assert page.attempted >= 5 and page.failed == 0
    assert module.attempted >= 4 and module.failed == 0
