"""The whole-model override's ops against torch (tolerance) and their invariance (bits), and
the mode's mechanics: entered and restored by batch_invariant(), thread-local, switched off by
batch_invariant(False), custom ops untouched, uncovered ops reported once by name."""
import logging
import os
import subprocess
import sys
import threading

import pytest
import torch
import torch.nn.functional as F

import glm_kernels
from glm_kernels.invariant import _reference as ref
from glm_kernels.invariant import _torch as split_kv
from glm_kernels.invariant import mode_active
from glm_kernels.invariant.mode import REGISTRATION
from glm_kernels.testing import TOLERANCES, assert_bits_equal, assert_close

torch.manual_seed(0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_reference_matches_torch(dtype):
    tol = TOLERANCES[dtype]
    a, w, bias = (torch.randn(*s).to(dtype) for s in ((70, 33), (48, 33), (48,)))
    assert_close(ref.mm(a, w.t()), a @ w.t(), tol=tol, name="mm")
    assert_close(ref.addmm(bias, a, w.t(), beta=2, alpha=0.5),
                 torch.addmm(bias, a, w.t(), beta=2, alpha=0.5), tol=tol, name="addmm")
    x, y = torch.randn(3, 5, 17).to(dtype), torch.randn(3, 17, 6).to(dtype)
    assert_close(ref.bmm(x, y), torch.bmm(x, y), tol=tol, name="bmm")
    experts = torch.randn(3, 33, 10).to(dtype)
    offsets = torch.tensor([20, 20, 64], dtype=torch.int32)
    want = torch.cat([a[:20] @ experts[0], a[20:64] @ experts[2], a[64:] * 0 @ experts[0]])
    assert_close(ref.grouped_mm(a, experts, offsets), want, tol=tol, name="grouped_mm")
    z = torch.randn(4, 7, 29).to(dtype) * 4
    for dim in (-1, 1):
        assert_close(ref.softmax(z, dim), torch.softmax(z, dim), tol=tol, name="softmax")
        assert_close(ref.softmax(z, dim, log=True), torch.log_softmax(z, dim), tol=tol,
                     name="log_softmax")
    assert_close(ref.sum_dims(z, [1, 2]), z.sum((1, 2)), tol=tol, name="sum")
    assert_close(ref.mean_dims(z, [-1], keepdim=True), z.mean(-1, keepdim=True), tol=tol,
                 name="mean")
    ln = torch.nn.LayerNorm(29).to(dtype)
    assert_close(ref.layer_norm(z, [29], ln.weight, ln.bias, ln.eps)[0], ln(z), tol=tol,
                 name="layer_norm")
    assert_close(ref.elementwise(F.silu, z), F.silu(z), tol=tol, name="silu")


def test_in_place_elementwise_ops_are_covered():
    """ATen's scalar tail rounds silu differently from its vector body for some inputs; inside
    the context silu and the in-place silu_ (nn.SiLU(inplace=True)) give the vector-body bits
    (a tensor of 5 elements is all tail)."""
    candidates = torch.randn(4096, generator=torch.Generator().manual_seed(0)) * 3
    body = ref.elementwise(F.silu, candidates)
    tail = torch.stack([F.silu(v[None])[0] for v in candidates[:2048]])
    differ = candidates[:2048][tail != body[:2048]][:5]
    if differ.numel() == 0:
        pytest.skip("this CPU's silu rounds its scalar tail like its vector body")
    want = ref.elementwise(F.silu, differ)
    assert not torch.equal(F.silu(differ), want)         # the check can fail outside
    with glm_kernels.batch_invariant():
        got = F.silu(differ.clone(), inplace=True)
        assert_bits_equal(F.silu(differ), want, name="silu")
    assert_bits_equal(got, want, name="silu_")


@pytest.mark.parametrize("case", ["causal", "bool", "additive", "gqa"])
def test_attention_matches_sdpa(case):
    q = torch.randn(2, 4, 5, 8)
    heads = 2 if case == "gqa" else 4
    k, v = torch.randn(2, heads, 9, 8), torch.randn(2, heads, 9, 6)
    mask = None
    if case == "bool":
        mask = torch.rand(2, 1, 5, 9) > 0.3
        mask[..., 0] = True
    elif case == "additive":
        mask = torch.where(torch.rand(2, 1, 5, 9) > 0.3, 0.0, torch.finfo(torch.float32).min)
    out, lse = ref.attention(q, k, v, mask, case == "causal", 0.3)
    # torch's GQA by repeating the key/value heads (sdpa's enable_gqa needs torch >= 2.5)
    k_all, v_all = (k.repeat_interleave(4 // heads, 1), v.repeat_interleave(4 // heads, 1))
    want = F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask,
                                          is_causal=case == "causal", scale=0.3)
    assert_close(out, want, tol=1e-5, name="attention")
    assert lse.shape == (2, 4, 5) and lse.dtype == torch.float32


def test_attention_is_decode_and_padding_invariant():
    """Query t of a sequence: its keys 0..t in a cache (decode), the same keys at the end of a
    longer causal row, or behind 3 left-padding keys: the same bits."""
    d, n = 8, 11
    q, k, v = torch.randn(1, 2, n, d), torch.randn(1, 2, n, d), torch.randn(1, 2, n, d)
    full, _ = ref.attention(q, k, v, is_causal=True)
    pad = torch.randn(1, 2, 3, d)
    kp, vp = torch.cat([pad, k], 2), torch.cat([pad, v], 2)
    qp = torch.cat([pad, q], 2)
    visible = torch.ones(n + 3, n + 3, dtype=torch.bool).tril()
    visible[:, :3] = False
    padded, _ = ref.attention(qp, kp, vp, visible[None, None])
    for t in (0, 4, n - 1):
        decode, _ = ref.attention(q[:, :, t:t + 1], k[:, :, :t + 1], v[:, :, :t + 1])
        assert_bits_equal(decode[:, :, 0], full[:, :, t], name=f"decode vs full, query {t}")
        assert_bits_equal(padded[:, :, t + 3], full[:, :, t], name=f"padded, query {t}")


def _one_range_mask(batch, t, length, pads, right):
    """[B, 1, T, L]: causal rows (the queries are the last T positions) behind ``pads[b]``
    left-padding keys; row 0 also has its last ``right`` keys masked (right padding)."""
    visible = torch.ones(t, length, dtype=torch.bool).tril(length - t).repeat(batch, 1, 1)
    for b, pad in enumerate(pads):
        visible[b, :, :pad] = False
    visible[0, :, length - right:] = False
    return visible[:, None]


@pytest.mark.parametrize("case", ["causal", "padded", "gqa", "decode"])
def test_split_kv_attention_matches_sdpa(case):
    """Past one split and one tile (150 keys, 70 queries): within tolerance of torch's sdpa."""
    batch, t, length = 3, 70 if case != "decode" else 1, 150
    heads = 2 if case == "gqa" else 4
    q = torch.randn(batch, 4, t, 16)
    k, v = torch.randn(batch, heads, length, 16), torch.randn(batch, heads, length, 8)
    mask = None if case == "causal" else _one_range_mask(batch, t, length, (5, 0, 77), 4)
    if case == "causal":
        q, k, v = q[..., :length, :], k[:, :, :t], v[:, :, :t]           # square causal
    ranges = ref.visible_key_ranges(batch, t, k.shape[2], mask, case == "causal", q.device)
    assert ranges is not None
    out, lse = split_kv.attention(q, k, v, *ranges, 0.25)
    k_all, v_all = k.repeat_interleave(4 // heads, 1), v.repeat_interleave(4 // heads, 1)
    want = F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask,
                                          is_causal=case == "causal", scale=0.25)
    assert_close(out, want, tol=1e-5, name="split-KV attention")
    _, want_lse = ref.attention(q, k, v, mask, case == "causal", 0.25)
    assert_close(lse, want_lse, tol=1e-5, name="split-KV logsumexp")


def test_split_kv_attention_packs_a_query_group_without_changing_bits():
    """Grouped-query heads share tiles (a decode step's group in one tile): the same bits as
    each head alone against its repeated keys, for a decode row and a padded forward."""
    for t, pads in ((1, (0, 5, 30)), (70, (5, 0, 77))):
        q = torch.randn(3, 8, t, 16)
        k, v = torch.randn(3, 2, 150, 16), torch.randn(3, 2, 150, 6)
        ranges = ref.visible_key_ranges(3, t, 150, _one_range_mask(3, t, 150, pads, 4),
                                        False, q.device)
        packed, packed_lse = split_kv.attention(q, k, v, *ranges, 0.25)
        # Keys repeated per query head (transformers' repeat_kv) are found and packed alike.
        repeated, _ = split_kv.attention(q, k.repeat_interleave(4, 1), v.repeat_interleave(4, 1),
                                         *ranges, 0.25)
        assert_bits_equal(repeated, packed, name=f"T {t} repeated heads")
        for head in (0, 3, 7):
            alone, alone_lse = split_kv.attention(q[:, head:head + 1], k[:, head // 4:][:, :1],
                                                  v[:, head // 4:][:, :1], *ranges, 0.25)
            assert_bits_equal(packed[:, head:head + 1], alone, name=f"T {t} head {head}")
            assert_bits_equal(packed_lse[:, head:head + 1], alone_lse, name="logsumexp")


def test_split_kv_attention_is_decode_and_padding_invariant():
    """Query t of a 150-token sequence (3 splits, 3 query tiles): its keys in a cache
    (decode), in a causal row, behind 70 left-padding keys, beside other rows: the same bits.
    A query that sees no key gets 0 and logsumexp +inf. Values 6 wide: the width at which
    x86 BLAS orders a row's sum by its place in the tile unless the operand is transposed."""
    d, dv, n, pad = 16, 6, 150, 70
    q, k, v = torch.randn(1, 2, n, d), torch.randn(1, 2, n, d), torch.randn(1, 2, n, dv)

    def run(q, k, v, mask=None, causal=False):
        ranges = ref.visible_key_ranges(q.shape[0], q.shape[2], k.shape[2], mask, causal,
                                        q.device)
        return split_kv.attention(q, k, v, *ranges, d ** -0.5)

    full, _ = run(q, k, v, causal=True)
    qp, kp, vp = (torch.cat([torch.randn(*x.shape[:2], pad, x.shape[-1]), x], 2)
                  for x in (q, k, v))
    visible = torch.ones(n + pad, n + pad, dtype=torch.bool).tril()
    visible[:, :pad] = False
    padded, padded_lse = run(qp, kp, vp, visible[None, None])
    other = torch.randn(1, 2, n + pad, d)
    both, _ = run(torch.cat([qp, other]), torch.cat([kp, other]),
                  torch.cat([vp, other[..., :dv]]),
                  visible[None, None].expand(2, 1, n + pad, n + pad))
    for t in (0, 63, 64, 100, n - 1):
        decode, _ = run(q[:, :, t:t + 1], k[:, :, :t + 1], v[:, :, :t + 1])
        assert_bits_equal(decode[:, :, 0], full[:, :, t], name=f"decode vs full, query {t}")
        assert_bits_equal(padded[:, :, t + pad], full[:, :, t], name=f"padded, query {t}")
        assert_bits_equal(both[:1, :, t + pad], full[:, :, t], name=f"in a batch, query {t}")
    assert torch.equal(padded[:, :, :pad], torch.zeros_like(padded[:, :, :pad]))
    assert bool((padded_lse[:, :, :pad] == float("inf")).all())
    # transformers' sdpa masks let a padding query see every key (no all-masked row): the
    # row's queries then start at two different keys (grouped apart), same bits for the rest.
    unmasked = visible.clone()
    unmasked[:pad] = True
    mixed, _ = run(qp, kp, vp, unmasked[None, None])
    for t in (0, 64, n - 1):
        assert_bits_equal(mixed[:, :, t + pad], full[:, :, t], name=f"mixed lo, query {t}")
    want = F.scaled_dot_product_attention(qp[:, :, :pad], kp, vp, scale=d ** -0.5)
    assert_close(mixed[:, :, :pad], want, tol=1e-5, name="padding queries")


def test_split_bmm_matches_torch_and_gives_rows_zero_for_zero_rows():
    """Past one split of K and one chunk of N (K 200, N 100), narrow N, rows of zeros."""
    for entries, m, k, n in ((3, 5, 16, 7), (2, 70, 150, 6), (2, 130, 200, 100), (4, 1, 20, 64)):
        a, b = torch.randn(entries, m, k), torch.randn(entries, k, n)
        a[0, :2] = 0.0                                  # rows of zeros
        a[-1, :, :3] = 0.0                              # rows that start later
        got = split_kv.bmm(a, b)
        assert_close(got, torch.bmm(a, b), tol=1e-5, name=f"split bmm {entries, m, k, n}")
        assert torch.equal(got[0, :2], torch.zeros_like(got[0, :2]))
    half = split_kv.bmm(a.bfloat16(), b.bfloat16())
    assert half.dtype == torch.bfloat16
    # Rows of at most 16 terms (the DSA indexer's head sum): the tree definition, to the bit
    # (their non-zeros are contiguous, so the window's tree is the tree over the non-zeros)
    a, b = torch.randn(256, 32, 2), torch.randn(256, 2, 1)
    assert_bits_equal(split_kv.bmm(a, b), ref.bmm(a, b), name="short rows")
    # ... also where they sit among zeros of a long row (a query's first keys, 100 keys)
    a, b = torch.zeros(4, 30, 100), torch.randn(4, 100, 8)
    for row in range(30):
        start = (7 * row) % 90
        a[:, row, start:start + 1 + row % 16] = torch.rand(4, 1 + row % 16) + 0.1
    assert_bits_equal(split_kv.bmm(a, b), ref.bmm(a, b), name="short rows among zeros")


def test_split_bmm_is_decode_and_padding_invariant():
    """Eager attention's two products: P.V with 150 keys (3 splits) and 6-wide values, and
    QK^T with a growing key count (N), for a query alone (decode), in its causal row, and
    behind 37 padding keys and queries: the same bits."""
    n, pad = 150, 37
    p = torch.rand(1, n, n).tril()
    p = p / p.sum(-1, keepdim=True)
    v = torch.randn(1, n, 6)
    full = split_kv.bmm(p, v)
    p_pad = torch.cat([torch.rand(1, pad, n + pad),
                       torch.cat([torch.zeros(1, n, pad), p], 2)], 1)
    padded = split_kv.bmm(p_pad, torch.cat([torch.randn(1, pad, 6), v], 1))
    q, k_t = torch.randn(1, n, 16), torch.randn(1, 16, n)
    scores = split_kv.bmm(q, k_t)
    for t in (0, 63, 64, 100, n - 1):
        decode = split_kv.bmm(p[:, t:t + 1, :t + 1], v[:, :t + 1])
        assert_bits_equal(decode[0, 0], full[0, t], name=f"P.V decode, query {t}")
        assert_bits_equal(padded[0, t + pad], full[0, t], name=f"P.V padded, query {t}")
        assert_bits_equal(split_kv.bmm(q[:, t:t + 1], k_t[:, :, :t + 1])[0, 0],
                          scores[0, t, :t + 1], name=f"QK^T decode, query {t}")


def test_split_bmm_short_rows_keep_their_bits_whatever_k():
    """Rows of at most 16 terms with a zero inside (an exact-zero probability) and zero products
    of either sign (a zero of ``a`` times a negative value; a column of -0 values, whose sum
    is then exactly zero): the row alone (a decode step's K, at the start of K: the broadcast
    path) and behind 37 padding keys before 50 masked ones (the gather path) agree to the
    bit, the zero column +0 in both."""
    g = torch.Generator().manual_seed(5)
    p = torch.rand(1, 1, 12, generator=g) + 0.1
    p[..., 3] = 0.0
    v = torch.randn(1, 12, 8, generator=g)
    v[:, 3] = -1.0
    v[:, :, 1] = -0.0
    alone = split_kv.bmm(p, v)
    p_full = torch.cat([torch.zeros(1, 1, 37), p, torch.zeros(1, 1, 50)], 2)
    v_full = torch.cat([torch.randn(1, 37, 8, generator=g), v,
                        -torch.rand(1, 50, 8, generator=g)], 1)
    assert_bits_equal(split_kv.bmm(p_full, v_full), alone, name="behind padding, wider K")
    assert not torch.signbit(alone[..., 1]).any()


@pytest.mark.parametrize("layout", ["linear", "x @ w"])
def test_narrow_products_do_not_depend_on_the_row_position(layout):
    """N = 5-7 and 9-11 with the weight in [K, N] layout: x86 BLAS orders a row's sum by its
    place in the tile there, unless the operand is made row-major first."""
    x = torch.randn(100, 64)
    for n in (5, 6, 7, 9, 10, 11):
        w = torch.randn(n, 64) if layout == "linear" else torch.randn(64, n)
        product = (lambda a: F.linear(a, w)) if layout == "linear" else (lambda a: a @ w)
        with glm_kernels.batch_invariant():
            full = product(x)
            alone = torch.cat([product(x[i:i + 1]) for i in range(x.shape[0])])
            flipped = product(x.flip(0)).flip(0)
        assert_bits_equal(alone, full, name=f"{layout} N={n}, rows alone")
        assert_bits_equal(flipped, full, name=f"{layout} N={n}, rows reversed")


def test_row_results_do_not_depend_on_the_batch():
    w = torch.randn(40, 24)
    a = torch.randn(130, 24)
    whole = ref.mm(a, w.t())
    for r in (0, 63, 64, 129):
        assert_bits_equal(ref.mm(a[r:r + 1], w.t())[0], whole[r], name=f"mm row {r}")
    z = torch.randn(130, 50)
    soft = ref.softmax(z, -1)
    norm = ref.mean_dims(z * z, [-1])
    rs = ref.elementwise(torch.rsqrt, norm)
    for r in (0, 77):
        assert_bits_equal(ref.softmax(z[r:r + 1], -1)[0], soft[r], name="softmax row")
        assert_bits_equal(ref.elementwise(torch.rsqrt, norm[r:r + 1])[0], rs[r], name="rsqrt")
    # Masked (zero-probability) entries anywhere leave a row's softmax bits unchanged.
    row = torch.randn(1, 13)
    spread = torch.full((1, 40), float("-inf"))
    spread[0, torch.tensor([1, 2, 5, 9, 10, 11, 17, 20, 21, 30, 33, 38, 39])] = row
    assert_bits_equal(ref.softmax(spread, -1)[spread > float("-inf")], ref.softmax(row, -1)[0])


def test_mode_is_entered_restored_and_thread_local():
    a, w = torch.randn(1, 32), torch.randn(48, 32)
    plain = a @ w.t()
    tiled = ref.mm(a, w.t())
    assert not mode_active()
    seen = {}
    with glm_kernels.batch_invariant():
        assert mode_active()
        assert_bits_equal(a @ w.t(), tiled, name="inside")
        other = threading.Thread(target=lambda: seen.update(active=mode_active()))
        other.start()
        other.join(60)
        with glm_kernels.batch_invariant(False):
            assert_bits_equal(a @ w.t(), plain, name="switched off inside")
        with glm_kernels.batch_invariant():   # nested: registered once
            assert REGISTRATION.holders == 1
    assert seen == {"active": False}
    assert not mode_active() and REGISTRATION.holders == 0
    assert not torch._C._dispatch_has_kernel_for_dispatch_key("aten::mm", "ADInplaceOrView")
    assert_bits_equal(a @ w.t(), plain, name="after exit")


def test_custom_ops_run_their_own_kernels():
    """The library's own custom ops (glm_kernels::, as apply_glm_kernels calls them) run their
    bodies on torch's kernels: they read the switch themselves. Another namespace's custom op
    is not the library's: the aten ops its body runs are answered by the override."""
    def define(qualified):
        @torch.library.custom_op(qualified, mutates_args=())
        def plain_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return a @ b
        return plain_mm

    own, users = define("glm_kernels::_test_plain_mm"), define("glm_kernels_test::plain_mm")
    a, b = torch.randn(1, 32), torch.randn(32, 48)
    with glm_kernels.batch_invariant():
        inside_own, inside_users = own(a, b), users(a, b)
    assert_bits_equal(inside_own, a @ b, name="glm_kernels custom op")
    assert_bits_equal(inside_users, ref.mm(a, b), name="another namespace's custom op")


def test_uncovered_op_is_reported_once_by_name(caplog):
    x = torch.randn(6, 5)
    with caplog.at_level(logging.WARNING, logger="glm_kernels"):
        with glm_kernels.batch_invariant():
            torch.logcumsumexp(x, 0)
            torch.logcumsumexp(x, 0)
            torch.cumsum(torch.ones(4, dtype=torch.float32), 0, dtype=torch.int32)  # exact
    named = [r for r in caplog.records if "logcumsumexp" in r.getMessage()]
    assert len(named) <= 1 and all("not covered" in r.getMessage() for r in named)
    assert not [r for r in caplog.records if "aten.cumsum" in r.getMessage()]
    assert any("logcumsumexp" in k for k in glm_kernels._dispatch.fallbacks_logged())


def test_environment_variable_enters_the_mode():
    code = ("import glm_kernels, torch; from glm_kernels.invariant import mode_active;"
            "a = mode_active()\nwith glm_kernels.batch_invariant(False): b = mode_active()\n"
            "print(a, b)")
    env = dict(os.environ, GLM_KERNELS_BATCH_INVARIANT="1", PYTHONPATH=os.getcwd())
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split() == ["True", "True"]
