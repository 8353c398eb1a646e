"""icepop_loss_from_logits: fused kernel and composed paths vs the fp32 reference."""
import math
import zlib

import pytest
import torch

import glm_kernels
from glm_kernels.loss.icepop import from_logits
from glm_kernels.loss._common import launch
from glm_kernels.loss.icepop._reference import icepop_loss_from_logits_reference
from glm_kernels.loss.logprobs._reference import selective_logprobs_reference
from glm_kernels.loss.icepop.from_logits import icepop_loss_from_logits
from tests._compare import TOLERANCES, assert_close
from tests.loss._metrics import assert_metrics_close, metric_scales
from tests.conftest import DEVICE, LazyKernels
from tests.loss.test_logits_logprobs import check_compiled_matches_eager

_logits_kernels = LazyKernels("glm_kernels.loss.icepop._kernels")

REDUCTIONS = ["token_mean", "seq_mean_token_mean", "sum", "none"]
pytestmark = [pytest.mark.filterwarnings("ignore:invalid value encountered"),
              pytest.mark.filterwarnings("ignore:divide by zero encountered"),
              pytest.mark.filterwarnings("ignore:All-NaN slice encountered")]


def _inputs(b, t, v, *, seed, dtype=torch.float32, scale=3.0, with_old=False):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(b, t, v, generator=g) * scale).to(dtype)
    ids = torch.randint(0, v, (b, t), generator=g)
    lp = selective_logprobs_reference(logits, ids)
    # Ratios e^N(0, 0.6): a real share of tokens is popped (outside [1/2, 2]) or clipped.
    rollout = lp + 0.6 * torch.randn(b, t, generator=g)
    old = lp + 0.2 * torch.randn(b, t, generator=g) if with_old else None
    adv = torch.randn(b, t, generator=g)
    mask = torch.rand(b, t, generator=g) > 0.2
    return tuple(None if x is None else x.to(DEVICE)
                 for x in (logits, ids, rollout, adv, mask, old))


def _run(fn, logits, *args, inplace=False, **kw):
    x = logits.detach().clone().requires_grad_(True)
    # inplace: feed a non-leaf (the usual lm_head output); its buffer receives the gradient.
    feed = x * 1.0 if inplace else x
    loss, metrics = fn(feed, *args, return_metrics=True,
                       **(dict(inplace_backward=True) if inplace else {}), **kw)
    weights = torch.linspace(0.5, 1.5, loss.numel(), device=loss.device).reshape(loss.shape)
    (loss * weights).sum().backward()
    return loss.detach(), x.grad, metrics


def _check(got, ref, grad_tol=1e-5, scales=None):
    assert_close(got[0], ref[0], tol=1e-5, name="loss")
    assert_close(got[1].double(), ref[1].double(), tol=grad_tol, name="dlogits")
    assert_metrics_close(got[2], ref[2], scales)


def _scales(logits, ids, rollout, mask, old=None, temperature=1.0):
    lp = selective_logprobs_reference(logits, ids, temperature)
    return metric_scales(lp if old is None else old, rollout, mask,
                         also_finite=None if old is None else lp)


# V = 200: one register tile; 300: three tiles for bf16, streamed for fp32; 517: streamed.
@pytest.mark.parametrize("v", [200, 517])
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("with_old", [False, True])
def test_matches_reference(any_backend, v, reduction, with_old):
    seed = zlib.crc32(repr((v, reduction, with_old)).encode()) % 1000
    logits, ids, rollout, adv, mask, old = _inputs(3, 5, v, seed=seed, with_old=with_old)
    kw = dict(temperature=0.8, old_logprobs=old, reduction=reduction, eps_high=0.3)
    got = _run(icepop_loss_from_logits, logits, ids, rollout, adv, mask, **kw)
    ref = _run(icepop_loss_from_logits_reference, logits, ids, rollout, adv, mask, **kw)
    _check(got, ref, scales=_scales(logits, ids, rollout, mask, old, temperature=0.8))


@pytest.mark.parametrize("v,dtype", [(300, torch.bfloat16), (300, torch.float32),
                                     (150, torch.float16)])
@pytest.mark.parametrize("inplace", [False, True])
def test_dtypes_plans_and_inplace(any_backend, v, dtype, inplace):
    logits, ids, rollout, adv, mask, _ = _inputs(2, 7, v, seed=v, dtype=dtype)
    got = _run(icepop_loss_from_logits, logits, ids, rollout, adv, mask, inplace=inplace,
               temperature=1.2)
    ref = _run(icepop_loss_from_logits_reference, logits, ids, rollout, adv, mask,
               temperature=1.2)
    assert got[1].dtype == dtype
    _check(got, ref, grad_tol=TOLERANCES[dtype],
           scales=_scales(logits, ids, rollout, mask, temperature=1.2))


def test_inplace_backward_writes_the_gradient_into_the_logits_buffer(any_backend):
    logits, ids, rollout, adv, mask, _ = _inputs(2, 4, 150, seed=3)
    x = logits.clone().requires_grad_(True)
    logits_buffer = x * 1.0
    captured = {}
    logits_buffer.register_hook(lambda g: captured.setdefault("grad", g))
    loss = icepop_loss_from_logits(logits_buffer, ids, rollout, adv, mask,
                                   inplace_backward=True)
    loss.backward()
    assert captured["grad"].data_ptr() == logits_buffer.data_ptr()
    ref_x = logits.clone().requires_grad_(True)
    icepop_loss_from_logits_reference(ref_x, ids, rollout, adv, mask).backward()
    assert_close(x.grad, ref_x.grad, tol=1e-5, name="dlogits")


@pytest.mark.parametrize("reduction", ["token_mean", "none"])
def test_inplace_backward_is_refused_when_someone_else_needs_the_logits(any_backend,
                                                                          reduction):
    logits, ids, rollout, adv, mask, _ = _inputs(2, 4, 50, seed=4)
    logits_buffer = logits.clone().requires_grad_(True) * 1.0
    w = torch.ones((), device=DEVICE, requires_grad=True)
    other = (logits_buffer * w).sum()          # saves the logits for dw
    loss = icepop_loss_from_logits(logits_buffer, ids, rollout, adv, mask,
                                   inplace_backward=True, reduction=reduction).sum()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        (loss + other).backward()


def test_grad_output_scales_the_gradient(any_backend):
    logits, ids, rollout, adv, mask, _ = _inputs(2, 6, 130, seed=5)
    x, y = logits.clone().requires_grad_(True), logits.clone().requires_grad_(True)
    (icepop_loss_from_logits(x, ids, rollout, adv, mask) * -3.5).backward()
    (icepop_loss_from_logits_reference(y, ids, rollout, adv, mask) * -3.5).backward()
    assert_close(x.grad, y.grad, tol=1e-5, name="dlogits")


def test_per_sequence_advantages_and_no_mask(any_backend):
    logits, ids, rollout, _, _, _ = _inputs(3, 4, 90, seed=6)
    adv = torch.tensor([0.5, -1.0, 2.0], device=DEVICE)
    for reduction in ("token_mean", "seq_mean_token_mean"):
        got = _run(icepop_loss_from_logits, logits, ids, rollout, adv, reduction=reduction)
        ref = _run(icepop_loss_from_logits_reference, logits, ids, rollout, adv,
                   reduction=reduction)
        _check(got, ref, scales=_scales(logits, ids, rollout, None))


@pytest.mark.parametrize("with_old", [False, True])
def test_popped_tokens_give_exact_zero_even_with_nan_inf_logits(any_backend, with_old):
    logits, ids, rollout, adv, _, old = _inputs(1, 6, 64, seed=8, with_old=with_old)
    logits[0, 0, :] = float("nan")                 # NaN lp -> gate ratio NaN -> popped
    logits[0, 1, 5] = float("inf")                 # inf logit -> lse inf -> lp NaN -> popped
    rollout[0, 2] += 5.0                           # ratio e^-5: popped
    mask = torch.ones(1, 6, dtype=torch.bool, device=DEVICE)
    mask[0, 3] = False                             # unmasked with a NaN logit row
    logits[0, 3, :] = float("nan")
    if with_old:                                   # decoupled: the gate is on old vs rollout
        old[0, :3] = rollout[0, :3] + 5.0
    x = logits.clone().requires_grad_(True)
    loss = icepop_loss_from_logits(x, ids, rollout, adv, mask, old_logprobs=old,
                                   reduction="sum")
    loss.backward()
    popped_or_unmasked = [0, 1, 2, 3]
    assert torch.isfinite(loss)
    assert torch.all(x.grad[0, popped_or_unmasked] == 0)
    assert torch.isfinite(x.grad).all() and x.grad[0, 4:].abs().sum() > 0


def test_empty_input(any_backend):
    x = torch.zeros(0, 5, device=DEVICE, requires_grad=True)
    empty = torch.zeros(0, device=DEVICE)
    loss, metrics = icepop_loss_from_logits(x, torch.zeros(0, dtype=torch.long, device=DEVICE),
                                            empty, empty,
                                            return_metrics=True)
    loss.backward()
    assert loss.item() == 0.0 and x.grad.shape == (0, 5)
    assert math.isnan(metrics["ratio_mean"].item())


def test_no_grad_forward_matches(any_backend):
    logits, ids, rollout, adv, mask, _ = _inputs(2, 3, 77, seed=9)
    with torch.no_grad():
        loss = icepop_loss_from_logits(logits, ids, rollout, adv, mask)
    assert_close(loss, icepop_loss_from_logits_reference(logits, ids, rollout, adv, mask),
                 tol=1e-5, name="loss")


def test_fused_kernel_writes_every_element(kernel_backend):
    """Poisoned gradient, stats rows and log-probs (the metrics' input); 3 programs walk 10
    rows (persistent loop)."""
    for v, dtype in ((517, torch.float32), (300, torch.bfloat16), (100, torch.float32)):
        logits, ids, rollout, adv, mask, _ = _inputs(2, 5, v, seed=v, dtype=dtype)
        n = 10
        cfg = launch.make_launch_config("interpret")
        row_tiles, block_v, warps = cfg.row_plan(v, logits.element_size())
        grad = torch.full((n, v), float("nan"), dtype=dtype, device=DEVICE)
        rows = torch.full((n, 8), float("nan"), device=DEVICE)
        flag = torch.zeros(1, dtype=torch.int32, device=DEVICE)
        lp = torch.full((n,), float("nan"), device=DEVICE)
        _logits_kernels.icepop_logits(
            logits.reshape(n, v), ids.reshape(-1), rollout.reshape(-1), None, adv.reshape(-1),
            mask.reshape(-1).view(torch.uint8), torch.full((n,), 0.1, device=DEVICE), grad,
            rows, flag, lp,
            inv_temp=1.0, gate_low=0.5, gate_high=2.0, clip_low=0.8, clip_high=1.28,
            block_v=block_v, row_tiles=row_tiles, num_warps=warps, max_programs=3)
        assert not torch.isnan(grad).any() and not torch.isnan(rows).any()
        assert flag.item() == 0
        assert_close(lp, selective_logprobs_reference(logits.reshape(n, v), ids.reshape(-1)),
                     tol=1e-5, name="lp")


def test_row_plans_cover_every_path():
    cfg = launch.LogitsLaunchConfig()
    assert cfg.row_plan(19360, 2) == (3, 8192, 32)          # TP=8 shard of GLM-5, bf16
    assert cfg.row_plan(19360, 4)[0] == 0                   # fp32: streamed
    assert cfg.row_plan(154880, 2)[0] == 0
    assert cfg.row_plan(16384, 4) == (1, 16384, 16)
    assert cfg.row_plan(1000, 2) == (1, 1024, 4)
    small = launch.make_launch_config("interpret")
    assert [small.row_plan(v, 2)[0] for v in (200, 300, 517)] == [1, 3, 0]


class TestBadInputs:
    def test_shapes_types_and_ids(self):
        logits = torch.zeros(2, 3, 10)
        ids = torch.zeros(2, 3, dtype=torch.long)
        ok = torch.zeros(2, 3)
        with pytest.raises(ValueError, match="rollout_logprobs"):
            icepop_loss_from_logits(logits, ids, torch.zeros(2, 4), ok)
        with pytest.raises(ValueError, match="token_ids must have shape"):
            icepop_loss_from_logits(logits, ids[:, :2], ok, ok)
        with pytest.raises(ValueError, match=r"token_ids must lie in \[0, 10\)"):
            icepop_loss_from_logits(logits, ids + 10, ok, ok)
        with pytest.raises(ValueError, match="reduction"):
            icepop_loss_from_logits(logits, ids, ok, ok, reduction="mean")
        with pytest.raises(ValueError, match="gate_low must be < gate_high"):
            icepop_loss_from_logits(logits, ids, ok, ok, gate_low=3.0, gate_high=2.0)
        with pytest.raises(ValueError, match="temperature"):
            icepop_loss_from_logits(logits, ids, ok, ok, temperature=-1.0)
        with pytest.raises(TypeError, match="logits"):
            icepop_loss_from_logits(logits.long(), ids, ok, ok)

    def test_nothing_is_overwritten_on_bad_ids(self):
        logits = torch.randn(4, 10)
        before = logits.clone()
        with pytest.raises(ValueError):
            icepop_loss_from_logits(logits.requires_grad_(True) * 1.0,
                                    torch.tensor([0, 1, 2, 99]), torch.zeros(4),
                                    torch.ones(4), inplace_backward=True)
        assert torch.equal(logits.detach(), before)


def test_torch_compile_fullgraph(any_backend):
    logits, ids, rollout, adv, mask, _ = _inputs(2, 4, 60, seed=10)

    def step(x):
        loss, metrics = icepop_loss_from_logits(x, ids, rollout, adv, mask,
                                                reduction="seq_mean_token_mean",
                                                return_metrics=True)
        return loss * 2.0, metrics["pop_frac"]
    check_compiled_matches_eager(step, logits)


def test_opcheck_fused_op():
    """The public op (schema, fake, registered autograd, AOT dispatch with dynamic shapes),
    its gradient in a new buffer and written over the logits in backward; the in-place
    backward op's schema and fake."""
    logits, ids, rollout, adv, mask = (t.cpu() for t in _inputs(1, 4, 20, seed=11)[:5])
    tokens = (ids.reshape(-1), rollout.reshape(-1), None, adv.reshape(-1),
              mask.reshape(-1).view(torch.uint8), torch.full((4,), 0.25))
    params = (1.0, 0.5, 2.0, 0.2, 0.28, 3.0)
    with glm_kernels.force_backend("torch"):
        for inplace in (False, True):
            torch.library.opcheck(from_logits._icepop_from_logits_op,
                                  (logits.reshape(4, 20).clone().requires_grad_(True), *tokens,
                                   *params, True, inplace, True))
        torch.library.opcheck(from_logits._grad_inplace_op,
                              (logits.reshape(4, 20).clone(), *tokens, torch.tensor([0.5]),
                               *params), test_utils=("test_schema", "test_faketensor"))


@pytest.mark.gpu
@pytest.mark.parametrize("v", [154880 // 8, 154880])   # three register tiles / streamed rows
@pytest.mark.parametrize("inplace", [False, True])
def test_gpu_glm5_vocab(v, inplace):
    logits, ids, rollout, adv, mask, _ = _inputs(4, 64, v, seed=12, dtype=torch.bfloat16)
    got = _run(icepop_loss_from_logits, logits, ids, rollout, adv, mask, inplace=inplace)
    ref = _run(icepop_loss_from_logits_reference, logits, ids, rollout, adv, mask)
    _check(got, ref, grad_tol=1e-2, scales=_scales(logits, ids, rollout, mask))


@pytest.mark.gpu
@pytest.mark.parametrize("with_old", [False, True])
def test_gpu_inplace_gradient_equals_a_separate_buffer_bitwise(with_old):
    """GLM-5's TP=8 bf16 shard (the three-register-tile plan), 4096 rows: each persistent
    program walks ~15 rows. The gradient written over the logits equals the one written to
    a new buffer bit for bit: no warp reads a target logit another warp has overwritten."""
    logits, ids, rollout, adv, mask, old = _inputs(8, 512, 154880 // 8, seed=5,
                                                   dtype=torch.bfloat16, with_old=with_old)
    kw = {} if old is None else {"old_logprobs": old}
    apart = _run(icepop_loss_from_logits, logits, ids, rollout, adv, mask, **kw)
    over = _run(icepop_loss_from_logits, logits, ids, rollout, adv, mask, inplace=True, **kw)
    assert torch.equal(apart[0], over[0]) and torch.equal(apart[1], over[1])
