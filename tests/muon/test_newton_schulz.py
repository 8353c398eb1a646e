"""Newton-Schulz: reference vs hand cases, Triton kernels (interpreter / GPU) vs reference,
singular-value bands, gram vs standard accuracy, poison, edge cases, bad input, compile."""
import math

import pytest
import torch

import glm_kernels
from glm_kernels.muon import (NSConfig, POLAR_EXPRESS, newton_schulz, resolve_coefficients,
                              singular_value_band)
from glm_kernels.muon import _reference, ns
from tests._compare import TOLERANCES, assert_close, rel_error
from tests.conftest import DEVICE

TOL32 = TOLERANCES[torch.float32]
TOL64 = TOLERANCES[torch.float64]
TOL_BF16 = TOLERANCES[torch.bfloat16]
SCHEDULES = ["jordan", "polar_express"]
FP32 = NSConfig(operand_dtype=torch.float32)
# Shapes: wide, tall, square, m and n not multiples of any tile (16 / 32 / 64), and m past 32
# rows (several row tiles; for gram: the tiled path instead of the one-program kernel).
SHAPES = [(3, 20, 45), (2, 45, 20), (40, 40), (70, 100)]


def _randn(shape, seed, dtype=torch.float32):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def _with_spectrum(m, n, lowest, seed):
    """m x n (m <= n) with singular values log-spaced in [lowest, 1], random singular vectors."""
    gen = torch.Generator().manual_seed(seed)
    u, _ = torch.linalg.qr(torch.randn(m, m, generator=gen, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(n, m, generator=gen, dtype=torch.float64))
    s = torch.logspace(math.log10(lowest), 0, m, dtype=torch.float64)
    return (u * s) @ v.T


def _ns(G, *args, **kwargs):
    """newton_schulz on the test device (the GPU when there is one), result on the CPU."""
    return newton_schulz(G.to(DEVICE), *args, **kwargs).cpu()


def _reference_for(G, coefficients, method, steps=5, operand_dtype=None, restart_every=3):
    schedule = resolve_coefficients(coefficients, steps)
    restarts = _reference.gram_restarts(steps, restart_every) if method == "gram" else ()
    return _reference.newton_schulz_reference(G, schedule, method=method, restarts=restarts,
                                              operand_dtype=operand_dtype)


# ----------------------------------------------------------------------- the reference
@pytest.mark.parametrize("coefficients", SCHEDULES)
def test_reference_acts_on_singular_values(coefficients):
    """G = U diag(s) V^T  ->  U diag(p(s / ||s||)) V^T, p the composed scalar polynomial."""
    m, n = 6, 9
    G = _with_spectrum(m, n, 0.05, seed=0)
    s = torch.linalg.svdvals(G)
    x = s / (s.norm() + 1e-7)
    for a, b, c in resolve_coefficients(coefficients, 5):
        x = a * x + b * x ** 3 + c * x ** 5
    out = _reference_for(G, coefficients, "standard")
    assert_close(torch.linalg.svdvals(out), x.sort(descending=True).values, tol=TOL64,
                 name="singular values")
    # same singular vectors: out^T G is symmetric positive semi-definite
    sym = out.T @ G
    assert_close(sym, sym.T, tol=TOL64, name="out^T G symmetric")


def test_reference_scalar_and_transpose_and_batch():
    g = torch.tensor([[-3.0]], dtype=torch.float64)
    x = -3.0 / (3.0 + 1e-7)
    for a, b, c in POLAR_EXPRESS[:5]:
        x = a * x + b * x ** 3 + c * x ** 5
    assert _reference_for(g, "polar_express", "standard").item() == pytest.approx(x, rel=TOL64)
    G = _randn((3, 5, 8), 1, torch.float64)
    wide = _reference_for(G, "jordan", "standard")
    assert_close(_reference_for(G.mT, "jordan", "standard"), wide.mT, tol=TOL64,
                 name="tall = transposed wide")
    assert_close(_reference_for(G[1], "jordan", "standard"), wide[1], tol=TOL64, name="batch")


@pytest.mark.parametrize("restart_every", [0, 2, 3])
@pytest.mark.parametrize("coefficients", SCHEDULES)
def test_reference_gram_equals_standard_in_fp64(coefficients, restart_every):
    G = _randn((2, 12, 30), 2, torch.float64)
    assert_close(_reference_for(G, coefficients, "gram", restart_every=restart_every),
                 _reference_for(G, coefficients, "standard"), tol=TOL64, name="gram vs standard")


@pytest.mark.parametrize("coefficients", SCHEDULES)
@pytest.mark.parametrize("lowest", [None, 1e-3, 1e-2])
def test_gram_precision_is_as_accurate_as_standard(coefficients, lowest):
    """The GPU precisions: gram (fp16 products, restart every 3) vs standard (bf16 products),
    both against the exact fp64 iteration, on Gaussian and ill-conditioned inputs."""
    G = _randn((2, 48, 300), 3, torch.float64) if lowest is None else \
        torch.stack([_with_spectrum(48, 300, lowest, seed) for seed in (3, 4)])
    exact = _reference_for(G, coefficients, "standard")
    standard = _reference_for(G.float(), coefficients, "standard",
                              operand_dtype=torch.bfloat16)
    gram = _reference_for(G.float(), coefficients, "gram", operand_dtype=torch.float16)
    gram_no_restart = _reference_for(G.float(), coefficients, "gram",
                                     operand_dtype=torch.float16, restart_every=0)
    err_standard, err_gram = rel_error(standard, exact), rel_error(gram, exact)
    assert err_gram <= err_standard, (err_gram, err_standard)
    if lowest == 1e-3 and coefficients == "polar_express":
        # why the restart: without it the fp16 Gram iteration loses the small singular values
        assert rel_error(gram_no_restart, exact) > 2 * err_standard


# ----------------------------------------------------------------------- kernels
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("method", ["standard", "gram"])
@pytest.mark.parametrize("coefficients", SCHEDULES)
def test_kernel_fp32_matches_reference(kernel_backend, shape, method, coefficients):
    """fp32 products: the same arithmetic as the fp32 reference up to summation order; five
    quintic steps amplify those 1e-7 differences (slope up to ~8 per step), hence 5e-5."""
    G = _randn(shape, 10 + len(shape))
    out = _ns(G, coefficients=coefficients, method=method, config=FP32)
    assert_close(out, _reference_for(G, coefficients, method), tol=TOL32, name=method)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("coefficients", SCHEDULES)
def test_kernel_standard_bf16_matches_emulated_reference(kernel_backend, shape, coefficients):
    G = _randn(shape, 20 + shape[-1])
    out = _ns(G, coefficients=coefficients)
    ref = _reference_for(G, coefficients, "standard", operand_dtype=torch.bfloat16)
    assert_close(out, ref, tol=TOL_BF16, name="bf16 standard")


@pytest.mark.parametrize("shape", [(3, 20, 45), (70, 100)])
@pytest.mark.parametrize("coefficients", SCHEDULES)
def test_kernel_gram_fp16_accuracy(kernel_backend, shape, coefficients):
    """One-program (m <= 64) and tiled Gram kernels: as accurate as the fp16 reference and
    more accurate than bf16 standard, against the exact iteration."""
    G = _randn(shape, 30 + shape[-1])
    exact = _reference_for(G.double(), coefficients, "standard")
    out = _ns(G, coefficients=coefficients, method="gram")
    emulated = _reference_for(G, coefficients, "gram", operand_dtype=torch.float16)
    standard = _reference_for(G, coefficients, "standard", operand_dtype=torch.bfloat16)
    assert rel_error(out, exact) <= 1.5 * rel_error(emulated, exact) + 1e-4
    assert rel_error(out, exact) <= rel_error(standard, exact)


@pytest.mark.parametrize("method", ["standard", "gram"])
def test_kernel_writes_every_element(kernel_backend, method, monkeypatch):
    """Every workspace and the output start as NaN: any element a kernel skips shows up."""
    def poisoned(shape, dtype, device):
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    monkeypatch.setattr(ns, "_workspace", poisoned)
    G = torch.cat([_randn((1, 33, 47), 5), _randn((1, 33, 47), 6).mT.mT])
    for config in (FP32, NSConfig(operand_dtype=torch.float32, fused_max_m=0)):
        out = _ns(G, coefficients="polar_express", method=method, config=config)
        assert torch.isfinite(out).all()
        assert_close(out, _reference_for(G, "polar_express", method), tol=TOL32, name=method)


@pytest.mark.parametrize("coefficients", SCHEDULES)
@pytest.mark.parametrize("method", ["standard", "gram"])
def test_kernel_singular_values_in_band(kernel_backend, coefficients, method):
    """The band each schedule promises for the input's normalized spectrum, widened by the
    rounding of the product dtype (bf16 2e-2, fp16 5e-3, fp32 1e-4)."""
    G = _with_spectrum(24, 40, 0.05, seed=7).float()
    s_in = torch.linalg.svdvals(G.double())
    lo, hi = singular_value_band(coefficients, 5, (s_in.min() / s_in.norm()).item(),
                                 (s_in.max() / s_in.norm()).item())
    for config, slack in ((FP32, 1e-4), (NSConfig(), 2e-2 if method == "standard" else 5e-3)):
        s = torch.linalg.svdvals(_ns(G, coefficients=coefficients, method=method,
                                               config=config).double())
        assert lo - slack <= s.min() and s.max() <= hi + slack, (config, lo, hi, s.min(), s.max())


def test_kernel_edge_cases(kernel_backend):
    for shape in [(0, 5), (5, 0), (0, 3, 4), (1, 1), (2, 1, 7)]:
        G = _randn(shape, 8)
        out = _ns(G, config=FP32)
        assert out.shape == G.shape and out.dtype == G.dtype
        assert_close(out, _reference_for(G, "jordan", "standard"), tol=TOL32, name=str(shape))
    G = torch.zeros(2, 3, 4)
    assert torch.equal(_ns(G), G)                  # 0 / (0 + eps) stays 0
    G = _randn((2, 6, 9), 9)
    G[1, 2, 3] = float("nan")
    out = _ns(G, config=FP32)
    assert torch.isnan(out[1]).all() and torch.isfinite(out[0]).all()
    strided = _randn((40, 30), 16).T                         # non-contiguous input
    assert_close(_ns(strided, config=FP32), _reference_for(strided, "jordan", "standard"),
                 tol=TOL32, name="non-contiguous")
    out0 = _ns(G[:1], steps=0, config=FP32)        # steps=0: the normalized input
    assert_close(out0, G[:1] / (G[:1].norm() + 1e-7), tol=TOL32, name="steps=0")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kernel_low_precision_input(kernel_backend, dtype):
    G = _randn((2, 24, 40), 12).to(dtype)
    out = _ns(G, coefficients="polar_express", config=FP32)
    assert out.dtype == dtype
    assert_close(out.float(), _reference_for(G.float(), "polar_express", "standard"),
                 tol=TOLERANCES[dtype], name=str(dtype))


def test_custom_coefficient_list(any_backend):
    G = _randn((2, 10, 30), 13)
    schedule = [(2.0, -1.5, 0.5), (1.875, -1.25, 0.375)]     # 7 steps: the last one repeats
    out = _ns(G, 7, coefficients=schedule, config=FP32)
    ref = _reference.newton_schulz_reference(G, schedule + [schedule[-1]] * 5)
    assert_close(out, ref, tol=TOL32, name="list")


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["standard", "gram"])
def test_gpu_glm5_head_shapes(method):
    """64 heads of q_b (256 x 2048) on the GPU vs the reference emulating its precision."""
    G = torch.randn(64, 256, 2048, device="cuda")
    out = newton_schulz(G, coefficients="polar_express", method=method)
    exact = _reference_for(G.double(), "polar_express", "standard")
    standard = _reference_for(G, "polar_express", "standard", operand_dtype=torch.bfloat16)
    assert rel_error(out, exact) <= 1.5 * rel_error(standard, exact)


# ----------------------------------------------------------------------- API
def test_bad_input():
    G = torch.randn(4, 5)
    with pytest.raises(TypeError, match="G"):
        newton_schulz(G.tolist())
    with pytest.raises(ValueError, match="G must have at least 2 dims"):
        newton_schulz(torch.randn(5))
    with pytest.raises(TypeError, match="G"):
        newton_schulz(torch.ones(4, 5, dtype=torch.int64))
    with pytest.raises(ValueError, match="method"):
        newton_schulz(G, method="svd")
    with pytest.raises(ValueError, match="coefficients"):
        newton_schulz(G, coefficients="nope")
    with pytest.raises(ValueError, match="coefficients"):
        newton_schulz(G, coefficients=[(1.0, 2.0)])
    with pytest.raises(ValueError, match="steps"):
        newton_schulz(G, -1)
    with pytest.raises(ValueError, match="eps"):
        newton_schulz(G, eps=float("nan"))
    with pytest.raises(TypeError, match="config"):
        newton_schulz(G, config={"block": 64})
    with pytest.raises(ValueError, match="NSConfig.block"):
        NSConfig(block=48)
    with pytest.raises(ValueError, match="operand_dtype"):
        NSConfig(operand_dtype=torch.int8)


def test_bands_documented():
    assert singular_value_band("jordan", 5, 0.01) == pytest.approx((0.6818, 1.1344), abs=1e-4)
    assert singular_value_band("polar_express", 5, 1e-3) == pytest.approx((0.8462, 1.1236),
                                                                         abs=1e-4)
    assert singular_value_band("polar_express", 6, 1e-3) == pytest.approx((0.9944, 1.0012),
                                                                         abs=1e-4)
    # the published Polar Express values with the paper's 1.01 safety factor
    assert POLAR_EXPRESS[0] == pytest.approx((8.28721201814563 / 1.01,
                                              -23.595886519098837 / 1.01 ** 3,
                                              17.300387312530933 / 1.01 ** 5))
    assert POLAR_EXPRESS[-1] == (1.875, -1.25, 0.375)


def test_torch_compile_fullgraph():
    G = _randn((2, 8, 12), 14)
    compiled = torch.compile(lambda g: newton_schulz(g, coefficients="polar_express"),
                             fullgraph=True, backend="aot_eager")
    with glm_kernels.force_backend("torch"):
        assert_close(compiled(G), newton_schulz(G, coefficients="polar_express"), tol=TOL32,
                     name="compiled")


def test_custom_op_registration():
    G = _randn((3, 12, 10), 15)                   # batch of 3, 2 heads x [4, 2] rows
    torch.library.opcheck(ns._orthogonalize_op,
                          (G, 2, [4, 2], [3.4445, -4.775, 2.0315] * 2, "standard", 1e-7, 3, None,
                           [0] * 7),
                          test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize("version, sym_block", [((3, 4, 0), 64), ((3, 6, 0), 128),
                                                ((3, 9, 0), 128)])
def test_triangle_tile_per_triton_release(monkeypatch, version, sym_block):
    """Whole matrices (m > 512) tile triangle products 128 x 128, except on Triton < 3.6,
    whose code for those tiles spills (sm_90 AOT): 64 x 64 there. Per-head blocks use 64
    everywhere; an explicit NSConfig.block stands; the left products keep 128-row tiles."""
    pytest.importorskip("triton")
    from glm_kernels.muon import _kernels
    monkeypatch.setattr(_kernels, "triton_version", lambda: version)
    cap = _kernels.sym_block_max()
    assert cap == sym_block
    run = ns._resolve(NSConfig(), "standard", 5, [1024, 2048], False, cap)
    assert (run.block, run.sym_warps, run.block_m) == (sym_block, sym_block // 16, 128)
    assert ns._resolve(NSConfig(), "gram", 5, [256], False, cap).block == 64
    assert ns._resolve(NSConfig(block=128), "standard", 5, [1024], False, cap).block == 128
    launched = {s.name for s in _kernels._muon_aot_specs()}
    assert ("muon_sym[bf16,SSt+D,128x64]" in launched) == (sym_block == 128)
