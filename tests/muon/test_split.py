"""HeadSplit and muon_split_orthogonalize: every (head, block) on its own, unequal blocks in one
batched call, against the per-block reference loop."""
from types import SimpleNamespace

import pytest
import torch

from glm_kernels.muon import (DEEPSEEK_V3_HEAD_SPLITS, GLM5_HEAD_SPLITS, HeadSplit, NSConfig,
                              head_splits_from_config, mla_head_splits, muon_split_orthogonalize,
                              newton_schulz, resolve_coefficients)
from glm_kernels.muon import _reference
from tests._compare import TOLERANCES, assert_close
from tests.conftest import DEVICE

TOL32 = TOLERANCES[torch.float32]
TOL_BF16 = TOLERANCES[torch.bfloat16]
FP32 = NSConfig(operand_dtype=torch.float32)


def _loop_reference(G, split, coefficients="jordan", method="standard", operand_dtype=None):
    schedule = resolve_coefficients(coefficients, 5)
    restarts = _reference.gram_restarts(5, 3) if method == "gram" else ()
    return _reference.split_orthogonalize_reference(
        G, split.num_heads, split.block_rows, schedule, method=method, restarts=restarts,
        operand_dtype=operand_dtype)


def test_head_split_basics():
    split = HeadSplit(64, [192, 64])
    assert split.rows == 16384 and split.rows_per_head == 256 and split.block_rows == (192, 64)
    assert split.for_rows(16384) == split and split.for_rows(2048) == HeadSplit(8, (192, 64))
    assert HeadSplit(**split.to_dict()) == split
    assert GLM5_HEAD_SPLITS["kv_b_proj"].rows == 28672         # GLM-5 shape: kv_b 28672 x 512
    assert GLM5_HEAD_SPLITS["linear_q_up_proj"] == GLM5_HEAD_SPLITS["q_b_proj"] == split
    assert DEEPSEEK_V3_HEAD_SPLITS["kv_b_proj"] == HeadSplit(128, [128, 128])
    assert mla_head_splits(64, 192, 64, 256, split_rope=False)["q_b_proj"] == HeadSplit(64, [256])
    hf = SimpleNamespace(num_attention_heads=64, qk_nope_head_dim=192, qk_rope_head_dim=64,
                         v_head_dim=256)
    megatron = SimpleNamespace(num_attention_heads=64, qk_head_dim=192, qk_pos_emb_head_dim=64,
                               v_head_dim=256)
    assert head_splits_from_config(hf) == head_splits_from_config(megatron) == GLM5_HEAD_SPLITS
    assert head_splits_from_config(SimpleNamespace(num_attention_heads=8)) is None


def test_head_split_bad_input():
    with pytest.raises(ValueError, match="num_heads"):
        HeadSplit(0, [4])
    with pytest.raises(ValueError, match="block_rows"):
        HeadSplit(2, [])
    with pytest.raises(ValueError, match="block_rows"):
        HeadSplit(2, [4, -1])
    with pytest.raises(TypeError, match="block_rows"):
        HeadSplit(2, 4)
    with pytest.raises(ValueError, match="whole heads"):
        HeadSplit(4, [3]).for_rows(7)
    with pytest.raises(ValueError, match="not divisible"):
        HeadSplit(4, [3]).for_rows(9)
    with pytest.raises(ValueError, match=r"\[\*, 8, cols\]"):
        muon_split_orthogonalize(torch.randn(9, 5), HeadSplit(2, [3, 1]))
    with pytest.raises(TypeError, match="split"):
        muon_split_orthogonalize(torch.randn(8, 5), (2, [3, 1]))


def test_split_reference_path_matches_loop():
    G = torch.randn(2, 3 * 11, 9, generator=torch.Generator().manual_seed(0))
    split = HeadSplit(3, [7, 4])                 # 7 x 9 (wide) and 4 x 9 blocks per head
    import glm_kernels
    with glm_kernels.force_backend("torch"):
        out = muon_split_orthogonalize(G, split, coefficients="polar_express")
        assert_close(out, _loop_reference(G, split, "polar_express"), tol=TOL32, name="split")
        one = muon_split_orthogonalize(G[0], HeadSplit(1, [33]))
        assert_close(one, newton_schulz(G[0]), tol=TOL32, name="one block = newton_schulz")


@pytest.mark.parametrize("method", ["standard", "gram"])
def test_split_kernel_unequal_blocks(kernel_backend, method):
    """Ragged launch: blocks 12 x 20 and 40 x 20 (tall: transposed to 20 x 40) per head, plus
    a 3-head batch, in the same launches."""
    G = torch.randn(2, 3 * 52, 20, generator=torch.Generator().manual_seed(1))
    split = HeadSplit(3, [12, 40])
    out = muon_split_orthogonalize(G.to(DEVICE), split, coefficients="polar_express",
                                   method=method, config=FP32).cpu()
    assert_close(out, _loop_reference(G, split, "polar_express", method), tol=TOL32,
                 name=f"split {method}")
    if method == "standard":
        out = muon_split_orthogonalize(G.to(DEVICE), split, coefficients="polar_express").cpu()
        ref = _loop_reference(G, split, "polar_express", operand_dtype=torch.bfloat16)
        assert_close(out, ref, tol=TOL_BF16, name="split bf16")


def test_split_kernel_size_classes(kernel_backend, monkeypatch):
    """Blocks on both sides of the small / large size-class limit go to separate batched
    calls (with their own tiles) and come back in order."""
    from glm_kernels.muon import ns
    monkeypatch.setattr(ns, "_LARGE_M", 16)
    G = torch.randn(2 * 52, 20, generator=torch.Generator().manual_seed(3))
    split = HeadSplit(2, [12, 40])               # m = 12 (small class) and 20 (large class)
    out = muon_split_orthogonalize(G.to(DEVICE), split, config=FP32).cpu()
    assert_close(out, _loop_reference(G, split), tol=TOL32, name="size classes")


def test_split_kernel_mixed_fused_and_tiled_gram(kernel_backend):
    """Gram with blocks on both sides of the one-program limit: 40 rows (one program per block)
    and 72 rows (tiled launches), nope/rope-like."""
    G = torch.randn(2 * 112, 150, generator=torch.Generator().manual_seed(2))
    split = HeadSplit(2, [72, 40])
    out = muon_split_orthogonalize(G.to(DEVICE), split, method="gram", config=FP32).cpu()
    assert_close(out, _loop_reference(G, split, method="gram"), tol=TOL32, name="mixed gram")


def test_docstring_and_doc_examples():
    import doctest
    import os
    import sys
    import glm_kernels
    for name in ("glm_kernels.muon.ns", "glm_kernels.muon.split", "glm_kernels.muon.optimizer"):
        with glm_kernels.force_backend("torch"):
            failed, attempted = doctest.testmod(sys.modules[name], verbose=False)
        assert attempted > 0 and failed == 0, f"{name}: {failed} of {attempted}"
    doc = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "muon.md")
    with glm_kernels.force_backend("torch"):
        failed, attempted = doctest.testfile(doc, module_relative=False, verbose=False)
    assert attempted > 0 and failed == 0, f"docs/muon.md: {failed} of {attempted}"
