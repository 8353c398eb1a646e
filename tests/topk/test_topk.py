"""Deterministic top-k: kernels (interpreter / GPU) vs the reference vs torch.sort(stable=True).

Every comparison is bit-exact: values as raw bytes (NaN payloads, -0.0 vs +0.0), indices as
integers. Inputs are drawn from a handful of distinct values so ties are everywhere.
"""
import zlib

import pytest
import torch

import glm_kernels
from glm_kernels.topk import TopkConfig, _reference, topk
from glm_kernels.topk import topk as topk_fn
from tests.conftest import DEVICE, HAS_CUDA

FLOATS = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
INTS = [torch.int32, torch.int64]
SPECIALS = [float("nan"), float("inf"), float("-inf"), -0.0, 0.0, 1.0, -1.0, 2.5]
NEG_NAN = torch.tensor(float("nan")).neg()             # NaN with the sign bit set
SHORT = TopkConfig("short", rows_per_program=4, num_warps=4)
# Radix configurations: a small candidate buffer (rows overflow it -> full-row passes, or
# fit after one pass -> candidate refinement) over 2 persistent programs, and a buffer the
# whole row fits in (no full-row histogram pass at all).
RADIX = TopkConfig("radix", tile=16, candidates=16, programs=2)
RADIX_WIDE = TopkConfig("radix", tile=64, candidates=1024)
topk_module = __import__("sys").modules["glm_kernels.topk.topk"]


def _seed(*case):
    return zlib.crc32(repr(case).encode()) % 10_000


def tie_heavy(shape, dtype, *, seed, specials=True):
    """Values from a handful of distinct numbers (NaN of both signs, +-inf, +-0.0 included)."""
    gen = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        pool = torch.tensor(SPECIALS + [NEG_NAN.item()] if specials else [0.5, 1.0, -3.0, 7.0])
        pool = pool.to(dtype)
        if specials:    # keep the sign bit of the negative NaN after the dtype conversion
            pool[-1] = pool[0].neg()
    else:
        info = torch.iinfo(dtype)
        pool = torch.tensor([info.min, info.max, -1, 0, 1, 7], dtype=dtype)
    return pool[torch.randint(0, pool.numel(), shape, generator=gen)].to(DEVICE)


def as_bits(t):
    return t.contiguous().view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def assert_same(got, want, name=""):
    """Indices equal and values bit-identical; on failure, show the first differing rows."""
    assert got[0].shape == want[0].shape and got[0].dtype == want[0].dtype, (
        f"{name}: values {tuple(got[0].shape)}/{got[0].dtype} vs "
        f"{tuple(want[0].shape)}/{want[0].dtype}")
    assert torch.equal(got[1], want[1]), f"{name} indices differ:\n{got[1]}\nvs\n{want[1]}"
    same = as_bits(got[0]) == as_bits(want[0])
    assert bool(same.all()), (f"{name}: value bits differ at {(~same).nonzero()[:4].tolist()}: "
                              f"{as_bits(got[0])[~same][:4].tolist()} vs "
                              f"{as_bits(want[0])[~same][:4].tolist()}")


def sort_prefix(x, k, dim=-1, largest=True):
    values, indices = torch.sort(x, dim=dim, descending=largest, stable=True)
    return values.narrow(dim, 0, k), indices.narrow(dim, 0, k)


# --------------------------------------------------------------------------- reference
def test_reference_hand_cases():
    nan, inf = float("nan"), float("inf")
    x = torch.tensor([[1.0, nan, -0.0, 0.0, inf, -inf, 3.0, -nan, 0.0]])
    v, i = _reference.topk_reference(x, 9)
    assert i.tolist() == [[1, 7, 4, 6, 0, 2, 3, 8, 5]]
    assert torch.signbit(v[0, 5]) and not torch.signbit(v[0, 6])   # each element's own bits
    v, i = _reference.topk_reference(x, 4, largest=False)
    assert i.tolist() == [[5, 2, 3, 8]]
    _, i = _reference.topk_reference(x, 4, largest=False, sorted=False)
    assert i.tolist() == [[2, 3, 5, 8]]
    v, i = _reference.topk_reference(x, 4, lengths=torch.tensor([2]))
    assert i.tolist() == [[1, 0, -1, -1]] and v[0, 2:].tolist() == [-inf, -inf]
    v, i = _reference.topk_reference(x, 3, largest=False, sorted=False,
                                     lengths=torch.tensor([1]))
    assert i.tolist() == [[0, -1, -1]] and v[0].tolist() == [1.0, inf, inf]
    xi = torch.tensor([[5, -2, 5, 7, -2]], dtype=torch.int64)
    v, i = _reference.topk_reference(xi, 5, lengths=torch.tensor([4]))
    assert i.tolist() == [[3, 0, 2, 1, -1]] and v[0, 4].item() == torch.iinfo(torch.int64).min


@pytest.mark.parametrize("dtype", FLOATS + INTS)
def test_reference_is_the_stable_sort_prefix(dtype):
    x = tie_heavy((6, 33), dtype, seed=_seed("ref", dtype)).cpu()
    for largest in (True, False):
        assert_same(_reference.topk_reference(x, 11, largest=largest),
                    sort_prefix(x, 11, largest=largest), f"{dtype} largest={largest}")


# --------------------------------------------------------------------------- kernels
@pytest.mark.parametrize("dtype", FLOATS + INTS)
@pytest.mark.parametrize("config", [None, RADIX, RADIX_WIDE], ids=["default", "radix", "wide"])
def test_kernel_matches_sort_prefix(kernel_backend, dtype, config):
    x = tie_heavy((3, 45), dtype, seed=_seed(dtype, config))
    for k, largest, sorted in ((1, True, True), (13, False, True), (13, True, False),
                               (45, False, False), (45, True, True)):
        got = topk(x, k, largest=largest, sorted=sorted, config=config)
        if sorted:
            assert_same(got, sort_prefix(x, k, largest=largest), f"{dtype} k={k}")
        else:
            assert_same(got, _reference.topk_reference(x, k, largest=largest, sorted=False),
                        f"{dtype} k={k} unsorted")


@pytest.mark.parametrize("config", [SHORT, RADIX], ids=["short", "radix"])
def test_special_rows(kernel_backend, config):
    """All-equal rows, only NaN, only +-0.0, one element, non-power-of-two lengths."""
    nan = float("nan")
    rows = [torch.full((23,), 2.0), torch.full((23,), nan), torch.tensor([-0.0, 0.0] * 11 + [-0.0]),
            torch.tensor([-nan, nan] * 11 + [1.0]), torch.linspace(-1, 1, 23)]
    x = torch.stack(rows).to(DEVICE)
    for k, largest in ((1, False), (2, True), (7, False), (23, True)):
        assert_same(topk(x, k, largest=largest, config=config),
                    sort_prefix(x, k, largest=largest), f"k={k} largest={largest}")
    one = torch.tensor([[3.0], [nan], [-0.0]], device=DEVICE)
    assert_same(topk(one, 1, config=config), sort_prefix(one, 1))


@pytest.mark.parametrize("config", [SHORT, RADIX], ids=["short", "radix"])
@pytest.mark.parametrize("sorted", [True, False])
def test_lengths(kernel_backend, config, sorted):
    x = tie_heavy((2, 3, 37), torch.float32, seed=_seed("len", config, sorted))
    lengths = torch.tensor([[0, 1, 5], [36, 64, -3]], device=DEVICE)    # clamped to [0, 37]
    for largest, k in ((True, 1), (False, 9), (True, 37)):
        got = topk(x, k, largest=largest, sorted=sorted, lengths=lengths, config=config)
        want = _reference.topk_reference(x, k, largest=largest, sorted=sorted, lengths=lengths)
        assert_same(got, want, f"k={k} largest={largest}")
    flat = topk(x, 9, lengths=lengths.reshape(-1).int(), sorted=sorted, config=config)
    assert_same(flat, _reference.topk_reference(x, 9, sorted=sorted, lengths=lengths))


@pytest.mark.parametrize("radix_bits", [3, 5, 11])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_radix_digit_widths(kernel_backend, radix_bits, dtype):
    """Digit widths that do not divide the key width (a short last pass)."""
    x = tie_heavy((2, 70), dtype, seed=_seed("bits", radix_bits, dtype))
    config = TopkConfig("radix", tile=32, radix_bits=radix_bits, candidates=8)
    for largest in (True, False):
        assert_same(topk(x, 21, largest=largest, config=config),
                    sort_prefix(x, 21, largest=largest), f"bits={radix_bits}")


def test_random_values_longer_rows(kernel_backend):
    """Continuous values over several radix tiles, both paths, the default interpreter tile."""
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(2, 1500, generator=gen).to(DEVICE)
    x[0, ::7] = x[0, 3]                                      # ties among continuous values
    for config, k in ((None, 1), (None, 1500), (TopkConfig("radix", tile=256, candidates=64,
                                                            programs=1), 100), (SHORT, 100)):
        assert_same(topk(x, k, config=config), sort_prefix(x, k), f"{config} k={k}")
    lengths = torch.tensor([1000, 77], device=DEVICE)
    assert_same(topk(x, 128, lengths=lengths),
                _reference.topk_reference(x, 128, lengths=lengths))


def test_post_sort_path(kernel_backend, monkeypatch):
    """k above the in-register sort limit: the set comes out in index order, then a stable sort."""
    monkeypatch.setattr(topk_module, "SORT_IN_KERNEL_MAX", 4)
    x = tie_heavy((3, 40), torch.bfloat16, seed=5)
    lengths = torch.tensor([40, 3, 17], device=DEVICE)
    for largest in (True, False):
        got = topk(x, 9, largest=largest, lengths=lengths, config=RADIX)
        assert_same(got, _reference.topk_reference(x, 9, largest=largest, lengths=lengths))


@pytest.mark.parametrize("config", [SHORT, RADIX], ids=["short", "radix"])
def test_every_output_written(kernel_backend, config):
    """Outputs poisoned with 0x7F bytes before the launch: every slot must be overwritten."""
    x = tie_heavy((5, 29), torch.float32, seed=11)
    lengths = torch.tensor([0, 3, 29, 10, 28], device=DEVICE)
    for sorted in (True, False):
        values = torch.full((5, 12), 0x7F7F7F7F, dtype=torch.int32, device=DEVICE)
        values = values.view(torch.float32)
        indices = torch.full((5, 12), 0x7F7F7F7F7F7F7F7F, dtype=torch.int64, device=DEVICE)
        common = dict(k=12, fill=float("-inf"), is_float=True, key_bits=32, largest=True,
                      sorted=sorted, num_warps=4)
        if config.method == "short":
            from glm_kernels.topk import _kernels
            _kernels.topk_short(x, lengths, values, indices, rows_per_program=4, block=32,
                                **common)
        else:
            from glm_kernels.topk import _radix_kernels
            scratch = torch.full((2, 16), 0x7F7F7F7F7F7F7F7F, dtype=torch.int64, device=DEVICE)
            candidates = torch.full((2, 8), 0x7F7F7F7F7F7F7F7F, dtype=torch.int64,
                                    device=DEVICE)
            _radix_kernels.topk_radix(x, lengths, values, indices, scratch, candidates,
                                      direct=not sorted, radix_bits=8, tile=16, **common)
        assert_same((values, indices),
                    _reference.topk_reference(x, 12, sorted=sorted, lengths=lengths))


def test_any_dim_and_strides(any_backend):
    x = tie_heavy((9, 4, 6), torch.float32, seed=3)
    for dim in (0, 1, -1):
        for largest in (True, False):
            got = topk(x, 3, dim=dim, largest=largest)
            assert_same(got, sort_prefix(x, 3, dim=dim, largest=largest), f"dim={dim}")
    strided = x.transpose(0, 2)[:, ::2]                      # non-contiguous, rows strided
    assert_same(topk(strided, 5), sort_prefix(strided, 5))
    expanded = x[:1, :1].expand(3, 4, 6)                      # zero row stride
    assert_same(topk(expanded, 6, sorted=False),
                _reference.topk_reference(expanded, 6, sorted=False))


def test_same_bits_across_calls_and_batch_sizes(any_backend):
    x = tie_heavy((17, 300), torch.float32, seed=9)
    first = topk(x, 32)
    for _ in range(2):
        assert_same(topk(x, 32), first, "repeat")
    for rows in (1, 3, 16):
        part = topk(x[5:5 + rows], 32)
        assert_same((part[0][0], part[1][0]), (first[0][5], first[1][5]), f"batch {rows}")


def test_backends_agree_bitwise(kernel_backend):
    x = tie_heavy((6, 200), torch.bfloat16, seed=4)
    lengths = torch.tensor([200, 0, 5, 150, 199, 64], device=DEVICE)
    kernel = topk(x, 64, lengths=lengths, sorted=False)
    with glm_kernels.force_backend("torch"):
        reference = topk(x, 64, lengths=lengths, sorted=False)
    assert_same(kernel, reference)


def test_empty_inputs(any_backend):
    assert topk(torch.empty(0, 5, device=DEVICE), 3).values.shape == (0, 3)
    v, i = topk(torch.randn(4, 5, device=DEVICE), 0)
    assert v.shape == (4, 0) and i.shape == (4, 0) and i.dtype == torch.int64
    v, i = topk(torch.empty(3, 0, device=DEVICE), 0)
    assert v.shape == (3, 0)
    v, i = topk(torch.tensor([7.0], device=DEVICE), 1)
    assert v.tolist() == [7.0] and i.tolist() == [0]


def test_bad_inputs():
    x = torch.randn(4, 10)
    with pytest.raises(ValueError, match=r"k=11 must be in \[0, 10\]"):
        topk(x, 11)
    with pytest.raises(TypeError, match="k must be an int"):
        topk(x, True)
    with pytest.raises(ValueError, match="dim=2"):
        topk(x, 2, dim=2)
    with pytest.raises(TypeError, match="x must have dtype"):
        topk(x.bool(), 2)
    with pytest.raises(ValueError, match="at least 1 dim"):
        topk(torch.tensor(1.0), 1)
    with pytest.raises(TypeError, match="lengths must have dtype"):
        topk(x, 2, lengths=torch.ones(4))
    with pytest.raises(ValueError, match=r"lengths must have the shape of x without dim"):
        topk(x, 2, lengths=torch.ones(5, dtype=torch.int64))
    with pytest.raises(ValueError, match="needs keys of at most 32 bits"):
        topk(x.double(), 2, config=TopkConfig("short"))
    with pytest.raises(ValueError, match="config.tile must be a power of two"):
        topk(x, 2, config=TopkConfig("radix", tile=100))


def test_gradient_flows_to_selected_entries(any_backend):
    x = tie_heavy((3, 20), torch.float32, seed=8, specials=False).requires_grad_(True)
    lengths = torch.tensor([20, 4, 11], device=DEVICE)
    weights = torch.linspace(1, 2, 3 * 6, device=DEVICE).reshape(3, 6)
    (topk(x, 6, lengths=lengths).values.nan_to_num(0, 0, 0) * weights).sum().backward()
    indices = _reference.topk_reference(x.detach(), 6, lengths=lengths)[1]
    want = torch.zeros(3, 20, device=DEVICE)
    for row in range(3):
        for slot in range(6):
            if indices[row, slot] >= 0:
                want[row, indices[row, slot]] = weights[row, slot]
    assert torch.equal(x.grad, want)


def test_torch_compile_fullgraph(any_backend):
    x = tie_heavy((5, 40), torch.float32, seed=2)
    compiled = torch.compile(lambda t: topk_fn(t, 7, sorted=False), fullgraph=True,
                             backend="aot_eager")
    assert_same(tuple(compiled(x)), _reference.topk_reference(x, 7, sorted=False))


def test_custom_op_opcheck():
    x = tie_heavy((3, 12), torch.float32, seed=1, specials=False)   # opcheck compares NaN != NaN
    args = (x, 4, True, True, torch.tensor([12, 3, 0], device=DEVICE), "short", 4, 64, 8, 16, 0,
            4)
    torch.library.opcheck(topk_module._topk_op, args)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_gpu_dsa_and_moe_shapes():
    """GLM-5 shapes on the GPU: exact equality with the stable sort, repeated calls identical."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    for rows, n, dtype in ((64, 131072, torch.float32), (8, 200_000, torch.bfloat16),
                           (4096, 256, torch.float32)):
        x = torch.randn(rows, n, device="cuda", generator=gen).to(dtype)
        x[:, ::5] = x[:, :1]                                   # ties
        k = 8 if n == 256 else 2048
        got = topk(x, k)
        assert_same(got, sort_prefix(x, k), f"{rows}x{n}")
        assert_same(topk(x, k), got, "repeat")
        lengths = torch.randint(0, n + 1, (rows,), device="cuda", generator=gen)
        assert_same(topk(x, k, lengths=lengths),
                    _reference.topk_reference(x, k, lengths=lengths), "lengths")


def test_docstring_and_doc_examples():
    import doctest
    import os
    moe_module = __import__("sys").modules["glm_kernels.topk.moe_route"]
    codec_module = __import__("sys").modules["glm_kernels.topk.routing_codec"]
    for module in (topk_module, moe_module, codec_module):
        failed, attempted = doctest.testmod(module, verbose=False)
        assert attempted > 0 and failed == 0, f"{module.__name__}: {failed} of {attempted}"
    doc = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "topk.md")
    failed, attempted = doctest.testfile(doc, module_relative=False, verbose=False)
    assert attempted > 0 and failed == 0, f"docs/topk.md: {failed} of {attempted}"


@pytest.mark.parametrize("version", [(3, 4, 0), (3, 6, 0), (3, 9, 0)])
def test_radix_launch_fits_the_register_file(monkeypatch, version):
    """Every (warps, register cap) radix_launch picks fits sm_90's 65536-register file: a
    16-warp launch capped at 168 registers (86016) would fail to launch on the GPU."""
    from glm_kernels.topk import _radix_launch
    monkeypatch.setattr(_radix_launch, "triton_version", lambda: version)
    for asked in (4, 8, 16):
        for direct in (False, True):
            warps, maxnreg = _radix_launch.radix_launch(asked, direct)
            assert 1 <= warps <= asked, (version, asked, direct, warps)
            assert maxnreg is None or warps * 32 * maxnreg <= 65536, (version, asked, direct,
                                                                    warps, maxnreg)
