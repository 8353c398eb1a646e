"""Muon Split: per-head row blocks of the MLA up-projections, orthogonalized independently.

GLM-5 (and DeepSeek-V3-style MLA) stores the per-head up-projections as one matrix whose rows
are head-major: q_b_proj / linear_q_up_proj is [H * (qk_nope + qk_rope), q_lora_rank] with each
head's rows [nope | rope]; kv_b_proj / linear_kv_up_proj is [H * (qk_nope + v), kv_lora_rank]
with each head's rows [k_nope | v]. Orthogonalizing every (head, part) block on its own keeps
each head's update spectrally bounded, which bounds the attention logits without clipping.

A column-parallel (tensor-parallel) shard of such a matrix holds whole heads (rank r owns heads
[r H / tp, (r + 1) H / tp)), so per-head Newton-Schulz is shard-local: ``HeadSplit.for_rows``
gives the split of a shard.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch

from .. import _checks
from .coefficients import Coefficients
from .ns import NSConfig, run_orthogonalize


@dataclass(frozen=True)
class HeadSplit:
    """A [num_heads * sum(block_rows), cols] matrix seen as num_heads x len(block_rows) blocks.

    >>> HeadSplit(64, [192, 64]).rows          # GLM-5 q_b: nope + rope rows per head
    16384
    >>> HeadSplit(64, [192, 64]).for_rows(2048)    # a tensor-parallel shard of 8 heads
    HeadSplit(num_heads=8, block_rows=(192, 64))
    """
    num_heads: int
    block_rows: Tuple[int, ...]

    def __post_init__(self):
        if isinstance(self.num_heads, bool) or not isinstance(self.num_heads, int) \
                or self.num_heads <= 0:
            raise ValueError(f"HeadSplit.num_heads must be an int > 0, got {self.num_heads!r}")
        try:
            rows = tuple(self.block_rows)
        except TypeError as exc:
            raise TypeError("HeadSplit.block_rows must be a sequence of ints, got "
                            f"{self.block_rows!r}") from exc
        if not rows or any(isinstance(r, bool) or not isinstance(r, int) or r <= 0
                           for r in rows):
            raise ValueError("HeadSplit.block_rows must be a non-empty sequence of ints > 0, "
                             f"got {self.block_rows!r}")
        object.__setattr__(self, "block_rows", rows)

    @property
    def rows_per_head(self) -> int:
        return sum(self.block_rows)

    @property
    def rows(self) -> int:
        return self.num_heads * self.rows_per_head

    def for_rows(self, rows: int) -> "HeadSplit":
        """The split of a matrix (or tensor-parallel shard) with ``rows`` rows: whole heads."""
        if rows % self.rows_per_head or not rows:
            raise ValueError(f"a matrix with {rows} rows is not whole heads of {self}: rows "
                             f"must be a positive multiple of {self.rows_per_head}")
        heads = rows // self.rows_per_head
        if self.num_heads % heads:
            raise ValueError(f"{heads} heads of {self} cannot be a tensor-parallel shard: "
                             f"{self.num_heads} is not divisible by {heads}")
        return HeadSplit(heads, self.block_rows)

    def to_dict(self) -> dict:
        return {"num_heads": self.num_heads, "block_rows": list(self.block_rows)}


def mla_head_splits(num_heads: int, qk_nope_head_dim: int, qk_rope_head_dim: int,
                    v_head_dim: int, *, split_rope: bool = True) -> Dict[str, HeadSplit]:
    """Head splits of the MLA up-projections under Hugging Face and Megatron names.

    q_b_proj / linear_q_up_proj: [nope, rope] per head (``split_rope=False``: one block of
    nope + rope rows); kv_b_proj / linear_kv_up_proj: [k_nope, v] per head.
    """
    split_rope = _checks.check_bool("split_rope", split_rope)
    q_rows = [qk_nope_head_dim, qk_rope_head_dim] if split_rope \
        else [qk_nope_head_dim + qk_rope_head_dim]
    q = HeadSplit(num_heads, q_rows)
    kv = HeadSplit(num_heads, [qk_nope_head_dim, v_head_dim])
    return {"q_b_proj": q, "kv_b_proj": kv, "linear_q_up_proj": q, "linear_kv_up_proj": kv}


GLM5_HEAD_SPLITS = mla_head_splits(64, 192, 64, 256)          # GLM-5: 64 heads, 192/64/256
DEEPSEEK_V3_HEAD_SPLITS = mla_head_splits(128, 128, 64, 128)  # DeepSeek-V3: 128 heads
PRESETS = {"glm5": GLM5_HEAD_SPLITS, "deepseek_v3": DEEPSEEK_V3_HEAD_SPLITS}


def _indexer_head_splits(config) -> Dict[str, HeadSplit]:
    """DSA indexer query projections (GLM-5 ``indexer.wq_b``, DeepSeek-V4
    ``indexer.q_b_proj``): index_n_heads x index_head_dim rows."""
    heads, dim = getattr(config, "index_n_heads", None), getattr(config, "index_head_dim", None)
    if not isinstance(heads, int) or not isinstance(dim, int):
        return {}
    split = HeadSplit(heads, [dim])
    return {"indexer.wq_b.weight": split, "indexer.q_b_proj.weight": split}


def head_splits_from_config(config) -> Optional[Dict[str, HeadSplit]]:
    """Per-head splits from a Hugging Face or Megatron model config, or None if it has none.

    Hugging Face MLA (DeepseekV3 / GLM-5 / GLM-MoE-DSA configs): num_attention_heads,
    qk_nope_head_dim, qk_rope_head_dim, v_head_dim (q_b_proj [nope, rope] and kv_b_proj
    [nope, v] per head); DeepSeek-V4 (``model_type`` "deepseek_v4"): q_b_proj as
    num_attention_heads x head_dim; a DSA indexer (index_n_heads, index_head_dim): its query
    projection per index head (these more specific keys come first). Megatron
    MLATransformerConfig: num_attention_heads, qk_head_dim, qk_pos_emb_head_dim, v_head_dim.
    """
    get = lambda *names: next((getattr(config, n) for n in names  # noqa: E731
                               if getattr(config, n, None) is not None), None)
    splits = _indexer_head_splits(config)
    heads = get("num_attention_heads")
    head_dim = get("head_dim")
    if getattr(config, "model_type", None) == "deepseek_v4" and None not in (heads, head_dim):
        splits["self_attn.q_b_proj.weight"] = HeadSplit(int(heads), [int(head_dim)])
        return splits
    nope = get("qk_nope_head_dim", "qk_head_dim")
    rope = get("qk_rope_head_dim", "qk_pos_emb_head_dim")
    v = get("v_head_dim")
    if None in (heads, nope, rope, v):
        return splits or None
    splits.update(mla_head_splits(int(heads), int(nope), int(rope), int(v)))
    return splits


def muon_split_orthogonalize(G: torch.Tensor, split: HeadSplit, *, steps: int = 5,
                             coefficients: Coefficients = "jordan", method: str = "standard",
                             eps: float = 1e-7, config: Optional[NSConfig] = None
                             ) -> torch.Tensor:
    """Newton-Schulz of every (head, block) of ``G`` independently, in one batched call.

    Parameters
    ----------
    G : Tensor [*, split.rows, cols], float32 / bfloat16 / float16 / float64
        Rows head-major: head h's block j is rows h * sum(r) + sum(r[:j]) ... + r[j].
    split : HeadSplit
        Heads and rows per block; unequal blocks (e.g. [192, 64]) run in the same launches.
    steps, coefficients, method, eps, config
        As in :func:`glm_kernels.muon.newton_schulz`.

    Returns
    -------
    Tensor like ``G``: each block replaced by its own orthogonalization (each block is
    normalized by its own Frobenius norm; tall blocks are transposed internally).

    Example
    -------
    >>> import torch
    >>> from glm_kernels.muon import HeadSplit, muon_split_orthogonalize, newton_schulz
    >>> split = HeadSplit(2, [3, 5])
    >>> G = torch.randn(16, 40)
    >>> O = muon_split_orthogonalize(G, split)
    >>> torch.allclose(O[3:8], newton_schulz(G[3:8]), atol=1e-5)
    True
    """
    _checks.check_tensor("G", G, floating=True)
    if not isinstance(split, HeadSplit):
        raise TypeError(f"split must be a HeadSplit, got {type(split).__name__}")
    if G.dim() < 2 or G.shape[-2] != split.rows:
        raise ValueError(f"G must have shape [*, {split.rows}, cols] for {split}, got shape "
                         f"{tuple(G.shape)}")
    return run_orthogonalize(G, split.num_heads, split.block_rows, steps, coefficients, method,
                             eps, config)
