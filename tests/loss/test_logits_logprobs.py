"""selective_logprobs: kernels (interpreter / GPU) and torch path vs the fp32 reference."""
import warnings

import pytest
import torch

import glm_kernels
from glm_kernels.loss._common import launch
from glm_kernels.loss.logprobs import logprobs
from glm_kernels.loss.logprobs._reference import selective_logprobs_reference
from glm_kernels.loss.logprobs.logprobs import selective_logprobs
from tests._compare import TOLERANCES, assert_close
from tests.conftest import DEVICE, HAS_CUDA, LazyKernels

FP32 = TOLERANCES[torch.float32]

_logits_kernels = LazyKernels("glm_kernels.loss.logprobs._kernels")

TOL = {torch.float32: 1e-5, torch.float64: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-3}
pytestmark = [pytest.mark.filterwarnings("ignore:invalid value encountered"),
              pytest.mark.filterwarnings("ignore:divide by zero encountered")]


def _logits(shape, dtype=torch.float32, scale=3.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale).to(dtype).to(DEVICE)


def _ids(shape, v, seed=1, low=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(low, v, shape, generator=g).to(DEVICE)


def _run(fn, logits, ids, **kw):
    """Values and gradients of sum(w1 * lp + w2 * H) with fixed random weights."""
    x = logits.detach().clone().requires_grad_(True)
    lp, ent = fn(x, ids, **kw)
    g = torch.Generator().manual_seed(7)
    w1, w2 = (torch.randn(lp.shape, generator=g).to(lp.device) for _ in range(2))
    (w1 * lp + w2 * ent).sum().backward()
    return lp.detach(), ent.detach(), x.grad


def _ours(x, ids, temperature=1.0):
    return selective_logprobs(x, ids, temperature=temperature, return_entropy=True)


def _ref(x, ids, temperature=1.0):
    return selective_logprobs_reference(x, ids, temperature, return_entropy=True)


# V: one tile, several tiles with a ragged tail (interpreter tile 256), and 1.
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("shape,v,temperature", [((6,), 300, 1.0), ((2, 3), 517, 0.7),
                                                 ((5,), 1, 1.3)])
def test_values_entropy_and_grads_match_reference(any_backend, dtype, shape, v, temperature):
    logits = _logits(shape + (v,), dtype)
    ids = _ids(shape, v)
    got = _run(_ours, logits, ids, temperature=temperature)
    ref = _run(_ref, logits, ids, temperature=temperature)
    assert got[0].dtype == got[1].dtype == torch.float32 and got[2].dtype == dtype
    assert_close(got[0], ref[0], tol=1e-5, name="logprobs")
    assert_close(got[1], ref[1], tol=1e-5 if v > 1 else 0.0, name="entropy")
    assert_close(got[2].double(), ref[2].double(), tol=TOL[dtype], name="dlogits")


def test_large_magnitudes_masked_vocab_and_temperature(any_backend):
    logits = _logits((5, 600), scale=1e4)
    logits[:, 100:180] = float("-inf")      # masked vocab in every row
    logits[2, :] = float("-inf")
    logits[2, 7] = 5.0                      # a row with one finite entry: lp 0, H 0
    logits[3, 250:] = float("-inf")         # -inf across whole tiles
    ids = torch.tensor([3, 250, 7, 99, 599], device=DEVICE)
    got = _run(_ours, logits, ids, temperature=0.5)
    ref = _run(_ref, logits, ids, temperature=0.5)
    assert torch.isfinite(got[0]).all() and torch.isfinite(got[1]).all()
    assert got[0][2] == 0.0 and got[1][2] == 0.0
    assert_close(got[0], ref[0], tol=1e-5, name="logprobs")
    # H at |z| ~ 2e4: the reference's own fp32 rounding is ~1e-3 absolute; compare absolutely.
    assert (got[1] - ref[1]).abs().max() < 5e-3
    assert_close(got[2], ref[2], tol=1e-5, name="dlogits")


def test_neg_inf_target_and_all_neg_inf_row(any_backend):
    logits = _logits((3, 40))
    logits[0, 5] = float("-inf")            # sampled a masked token: lp = -inf
    logits[1, :] = float("-inf")            # no distribution: NaN
    ids = torch.tensor([5, 3, 0], device=DEVICE)
    x = logits.clone().requires_grad_(True)
    lp, ent = selective_logprobs(x, ids, return_entropy=True)
    assert lp[0] == float("-inf") and torch.isfinite(ent[0])
    assert torch.isnan(lp[1]) and torch.isnan(ent[1])
    lp[[0, 2]].sum().backward()             # the NaN row gets upstream gradient 0
    ref_x = logits.clone().requires_grad_(True)
    selective_logprobs_reference(ref_x, ids)[[0, 2]].sum().backward()
    assert torch.isfinite(x.grad).all() and torch.all(x.grad[1] == 0)
    assert_close(x.grad[[0, 2]], ref_x.grad[[0, 2]], tol=1e-5, name="dlogits")


def test_zero_upstream_gradient_gives_exact_zero_row_even_for_nan_logits(kernel_backend):
    logits = _logits((2, 50))
    logits[0, 3] = float("nan")
    x = logits.clone().requires_grad_(True)
    lp = selective_logprobs(x, torch.tensor([1, 2], device=DEVICE))
    (lp * torch.tensor([0.0, 1.0], device=DEVICE)).sum().backward()
    assert torch.all(x.grad[0] == 0) and torch.isfinite(x.grad[1]).all()


def test_empty_and_one_element(any_backend):
    x = torch.zeros(0, 7, device=DEVICE, requires_grad=True)
    lp, ent = selective_logprobs(x, torch.zeros(0, dtype=torch.long, device=DEVICE),
                                 return_entropy=True)
    (lp.sum() + ent.sum()).backward()
    assert lp.shape == ent.shape == (0,) and x.grad.shape == (0, 7)
    one = torch.tensor([2.5], device=DEVICE, requires_grad=True)
    lp = selective_logprobs(one, torch.tensor(0, device=DEVICE))
    lp.backward()
    assert lp.shape == () and lp.item() == 0.0 and one.grad.item() == 0.0


def test_non_contiguous_logits_and_int32_ids(any_backend):
    base = _logits((7, 2, 300))
    logits = base[:, 0, :]                  # row stride 600
    ids = _ids((7,), 300).int()
    got = _run(_ours, logits, ids)
    ref = _run(_ref, logits.contiguous(), ids.long())
    for a, b, name in zip(got, ref, ("lp", "entropy", "dlogits")):
        assert_close(a, b, tol=1e-5, name=name)


class TestKernelsWriteEverything:
    """Poisoned outputs: an element a kernel skipped would stay NaN / 0xFF."""

    def test_final_and_partial_stats(self, kernel_backend):
        logits, ids = _logits((9, 517)), _ids((9,), 517)
        outs = [torch.full((9,), float("nan"), device=DEVICE) for _ in range(3)]
        flag = torch.zeros(1, dtype=torch.int32, device=DEVICE)
        _logits_kernels.logprob_final(logits, ids, flag, *outs, inv_temp=1.0, block_v=256,
                                      num_warps=4)
        assert not any(torch.isnan(o).any() for o in outs)
        partial = torch.full((9, 4), float("nan"), device=DEVICE)
        _logits_kernels.logprob_partial(logits, ids, flag, partial, want_entropy=True,
                                        inv_temp=1.0, vocab_start=0, vocab_total=517,
                                        block_v=128, num_warps=4)
        assert not torch.isnan(partial).any() and flag.item() == 0

    @pytest.mark.parametrize("entropy", [False, True])
    def test_gradient(self, kernel_backend, entropy):
        logits, ids = _logits((5, 517), torch.bfloat16), _ids((5,), 517)
        lse = torch.logsumexp(logits.float(), -1)
        ent, coef, coef_ent = (torch.rand(5, device=DEVICE) for _ in range(3))
        grad = torch.full((5, 517), float("nan"), dtype=torch.bfloat16, device=DEVICE)
        _logits_kernels.logits_grad(logits, ids, lse, ent, coef,
                                    coef_ent if entropy else None, grad, inv_temp=1.0,
                                    vocab_start=0, block_v=256, num_warps=4)
        assert not torch.isnan(grad).any()

    def test_out_of_range_ids_are_flagged_and_give_nan(self, kernel_backend):
        logits = _logits((4, 30))
        for bad in (-1, 30, 1 << 40):
            ids = torch.tensor([0, bad, 2, 3], device=DEVICE)
            flag = torch.zeros(1, dtype=torch.int32, device=DEVICE)
            lp, lse = torch.empty(4, device=DEVICE), torch.empty(4, device=DEVICE)
            _logits_kernels.logprob_final(logits, ids, flag, lp, lse, None, inv_temp=1.0,
                                          block_v=16, num_warps=4)
            assert flag.item() == 1 and torch.isnan(lp[1]) and torch.isfinite(lp[[0, 2, 3]]).all()


# The ValueError is the CPU behaviour (on CUDA: the kernel's flag and a device-side assert).
CPU_BACKENDS = ["torch"] + ([] if HAS_CUDA else ["interpret"])


class TestBadInputs:
    @pytest.mark.parametrize("backend", CPU_BACKENDS)
    def test_token_ids_out_of_range_raise_before_running(self, backend):
        for bad in ([0, 1, 10], [-1, 0, 0]):
            with glm_kernels.force_backend(backend), \
                    pytest.raises(ValueError, match=r"token_ids must lie in \[0, 10\)"):
                selective_logprobs(torch.zeros(3, 10), torch.tensor(bad))

    def test_types_and_shapes(self):
        with pytest.raises(TypeError, match="token_ids"):
            selective_logprobs(torch.zeros(3, 10), torch.zeros(3))
        with pytest.raises(TypeError, match="logits"):
            selective_logprobs(torch.zeros(3, 10, dtype=torch.int64), torch.zeros(3).long())
        with pytest.raises(ValueError, match="token_ids must have shape"):
            selective_logprobs(torch.zeros(3, 10), torch.zeros(4).long())
        with pytest.raises(ValueError, match="V >= 1"):
            selective_logprobs(torch.zeros(3, 0), torch.zeros(3).long())
        with pytest.raises(ValueError, match="temperature"):
            selective_logprobs(torch.zeros(3, 10), torch.zeros(3).long(), temperature=0.0)


def check_compiled_matches_eager(step, *inputs):
    """step(*leaves) -> loss or (loss, *extras): torch.compile(fullgraph=True, aot_eager)
    gives the eager loss, extras and gradients. Shared by the test_logits_* files."""
    def run(fn):
        leaves = [t.clone().requires_grad_(True) for t in inputs]
        out = fn(*leaves)
        out = out if isinstance(out, tuple) else (out,)
        out[0].backward()
        return [o.detach() for o in out], [t.grad for t in leaves]

    eager = run(step)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        compiled = run(torch.compile(step, fullgraph=True, backend="aot_eager"))
    for a, b in zip(compiled[0] + compiled[1], eager[0] + eager[1]):
        assert_close(a, b, tol=FP32, name="compiled vs eager")


def test_torch_compile_fullgraph(any_backend):
    logits, ids = _logits((4, 5, 70)), _ids((4, 5), 70)

    def step(x):
        lp, ent = selective_logprobs(x, ids, temperature=0.9, return_entropy=True)
        return (lp * 2.0).sum() + ent.mean()
    check_compiled_matches_eager(step, logits)


def test_opcheck_custom_ops():
    """The public op (schema, fake, registered autograd, AOT dispatch with dynamic shapes) with
    and without entropy, nucleus and in-place backward; the backward ops' schema and fakes."""
    logits, ids = _logits((3, 20)).cpu(), _ids((3,), 20).cpu()
    keep, offsets = torch.tensor([1, 4, 2]), torch.tensor([0, 2, 2, 3])
    lse = torch.logsumexp(logits, -1)
    utils = ("test_schema", "test_faketensor")
    with glm_kernels.force_backend("torch"):
        for entropy, nucleus, inplace in ((True, False, False), (False, True, False),
                                          (True, True, True)):
            nuc = (keep, offsets) if nucleus else (None, None)
            args = (logits.clone().requires_grad_(True), ids, *nuc, 1.0, entropy, "", inplace)
            torch.library.opcheck(logprobs._selective_logprobs_op, args)
        for nuc, lse_keep in (((None, None), lse[:0]), ((keep, offsets), lse + 0.5)):
            args = (ids, *nuc, lse, torch.rand(3), lse_keep, torch.rand(3), torch.rand(3), 1.0,
                    0)
            torch.library.opcheck(logprobs._backward_op, (logits, *args), test_utils=utils)
            torch.library.opcheck(logprobs._backward_inplace_op, (logits.clone(), *args),
                                  test_utils=utils)


@pytest.mark.gpu
def test_gpu_kernel_flags_bad_ids_on_device():
    """On CUDA the range check is the kernel's flag (then torch._assert_async, which would
    end the CUDA context, so only the flag is tested here)."""
    logits = _logits((4, 30)).to(DEVICE)
    ids = torch.tensor([0, 31, 2, -4], device=DEVICE)
    flag = launch.token_id_flag(ids, 30)
    lp, lse = torch.empty(4, device=DEVICE), torch.empty(4, device=DEVICE)
    _logits_kernels.logprob_final(logits, ids, flag, lp, lse, None, inv_temp=1.0,
                                  block_v=4096, num_warps=8)
    assert flag.item() == 1 and torch.isnan(lp[[1, 3]]).all()


@pytest.mark.gpu
@pytest.mark.parametrize("v", [154880 // 8, 154880])
def test_gpu_glm5_vocab(v):
    logits = _logits((64, v), torch.bfloat16).to(DEVICE)
    ids = _ids((64,), v).to(DEVICE)
    got = _run(_ours, logits, ids)
    ref = _run(_ref, logits, ids)
    assert_close(got[0], ref[0], tol=1e-5, name="lp")
    assert_close(got[1], ref[1], tol=1e-5, name="entropy")
    assert_close(got[2].float(), ref[2].float(), tol=1e-2, name="dlogits")


@pytest.mark.parametrize("module", ["logprobs.logprobs", "icepop.from_logits",
                                    "reverse_kl.reverse_kl", "icepop.fused_linear"])
def test_docstring_examples(module):
    """The runnable examples in the public docstrings (torch backend, CPU)."""
    import doctest
    import importlib
    mod = importlib.import_module(f"glm_kernels.loss.{module}")
    with glm_kernels.force_backend("torch"):
        result = doctest.testmod(mod, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0


def test_docs_examples():
    """The examples of docs/logits.md run as written (torch backend, CPU)."""
    import doctest
    import os
    path = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "logits.md")
    with glm_kernels.force_backend("torch"):
        result = doctest.testfile(os.path.abspath(path), module_relative=False)
    assert result.attempted > 0 and result.failed == 0
