"""The override's Triton kernels under the interpreter (tiny sizes) against the torch
definitions, and their own invariance in bits: a matmul row alone or in any batch, an
attention query decoded from a KV cache, at the end of a causal row or behind left padding."""
import pytest
import torch

import glm_kernels
from glm_kernels.invariant import _reference as ref
from glm_kernels.testing import TOLERANCES, assert_bits_equal, assert_close

from ..conftest import LazyKernels

kernels = LazyKernels("glm_kernels.invariant._kernels")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_persistent_matmul(kernel_backend, dtype):
    torch.manual_seed(0)
    a, w = torch.randn(70, 40).to(dtype), torch.randn(33, 40).to(dtype)
    out = torch.full((70, 33), float("nan"), dtype=dtype)
    kernels.matmul(a, w.t(), out, num_programs=3, interpret=True)
    assert not out.isnan().any()
    assert_close(out, ref.mm(a, w.t()), tol=TOLERANCES[dtype], name="matmul")
    for rows in ((5, 6), (0, 70), (64, 70)):
        alone = torch.empty(rows[1] - rows[0], 33, dtype=dtype)
        kernels.matmul(a[rows[0]:rows[1]], w.t(), alone, num_programs=1, interpret=True)
        assert_bits_equal(alone, out[rows[0]:rows[1]], name=f"rows {rows}")


def _attention(q, k, v, lo, hi):
    out = torch.full((*q.shape[:3], v.shape[-1]), float("nan"), dtype=q.dtype)
    lse = torch.full(q.shape[:3], float("nan"))
    kernels.attention(q.contiguous(), k.contiguous(), v.contiguous(), lo, hi, out, lse, 0.25)
    assert not out.isnan().any() and not lse.isnan().any()
    return out, lse


def test_split_kv_attention(kernel_backend):
    """Queries 65..67 of a 70-key causal row (two splits of 64, the second ragged), grouped-
    query heads (2 over 1): against the torch definition, then one query decoded against a KV
    cache of only its keys and behind 3 left-padding keys, to the bit."""
    torch.manual_seed(0)
    n, d, first = 70, 16, 65
    q, k, v = torch.randn(1, 2, 3, d), torch.randn(1, 1, n, d), torch.randn(1, 1, n, 8)
    lo = torch.zeros(1, 3, dtype=torch.int32)
    hi = torch.arange(first + 1, first + 4, dtype=torch.int32)[None]
    out, lse = _attention(q, k, v, lo, hi)
    visible = torch.arange(n)[None, :] < hi[0, :, None]
    want, want_lse = ref.attention(q, k, v, visible[None, None], False, 0.25)
    assert_close(out, want, tol=1e-5, name="attention")
    assert_close(lse, want_lse, tol=1e-5, name="logsumexp")
    s = first + 1                                   # query 1 sees keys 0..66
    decode, _ = _attention(q[:, :, 1:2], k[:, :, :s + 1], v[:, :, :s + 1],
                           torch.zeros(1, 1, dtype=torch.int32),
                           torch.full((1, 1), s + 1, dtype=torch.int32))
    assert_bits_equal(decode[:, :, 0], out[:, :, 1], name="decode vs full")
    pad = torch.randn(1, 1, 3, d)
    padded, _ = _attention(q[:, :, 1:2], torch.cat([pad, k[:, :, :s + 1]], 2),
                           torch.cat([pad[..., :8], v[:, :, :s + 1]], 2),
                           torch.full((1, 1), 3, dtype=torch.int32),
                           torch.full((1, 1), s + 4, dtype=torch.int32))
    assert_bits_equal(padded[:, :, 0], out[:, :, 1], name="left-padded")


def test_visible_key_ranges():
    mask = torch.ones(2, 1, 3, 5, dtype=torch.bool).tril(2)
    mask[1, ..., 0] = False
    lo, hi = ref.visible_key_ranges(2, 3, 5, mask, False, "cpu")
    assert lo.tolist() == [[0, 0, 0], [1, 1, 1]] and hi.tolist() == [[3, 4, 5], [3, 4, 5]]
    holes = mask.clone()
    holes[0, 0, 2, 1] = False
    assert ref.visible_key_ranges(2, 3, 5, holes, False, "cpu") is None
    bias = torch.zeros(2, 1, 3, 5)
    bias[..., 0] = 0.5                      # a real bias, not a mask: the kernel cannot take it
    assert ref.visible_key_ranges(2, 3, 5, bias, False, "cpu") is None


@pytest.mark.slow
def test_tiny_model_through_the_kernels(kernel_backend):
    """Llama's linears and its sdpa run the interpreted kernels inside the context: the
    rollout and the full forwards still agree to the bit (slow: about a minute of interpreted
    attention programs; the kernels' own invariance is checked above)."""
    from glm_kernels.testing import assert_batch_invariant, tiny_causal_lm
    pytest.importorskip("transformers")
    model = tiny_causal_lm("llama")
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, 96, (n,), generator=g) for n in (2, 4)]
    with glm_kernels.batch_invariant():
        report = assert_batch_invariant(model, prompts, max_new_tokens=2, batch_size=4)
    assert (report["alone"], report["batch"], report["shuffled"]) == (0, 0, 0)
