"""Tiny random transformers MoE models of every type glm_kernels patches (built in code, no
download), fp32, eager attention.

GLM-5 (``glm_moe_dsa``) is built with ``attn_implementation="eager"``: with transformers'
default ``sdpa`` the model hands its DSA indexer no mask, so the unpatched model is not causal
there and a comparison with it means nothing. The indexer gets 16 heads so that the ReLU
index scores of two keys tie (every head clipped to 0) only with negligible probability.
"""
import copy

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers missing: pip install "
                                   "'transformers>=5.2'")

VOCAB = 64
COMMON = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=4, intermediate_size=48, moe_intermediate_size=16,
              max_position_embeddings=128, pad_token_id=0, eos_token_id=1, bos_token_id=None,
              tie_word_embeddings=False)
MLA = dict(q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
           v_head_dim=8)
NOAUX = dict(n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
             n_shared_experts=1, routed_scaling_factor=2.5)
CONFIGS = {
    "glm_moe_dsa": dict(**NOAUX, **MLA, index_n_heads=16, index_head_dim=8, index_topk=4,
                        mlp_layer_types=["dense", "sparse"]),
    "deepseek_v3": dict(**NOAUX, **MLA, first_k_dense_replace=1),
    "glm4_moe": dict(**NOAUX, first_k_dense_replace=1, head_dim=8),
    "qwen3_moe": dict(num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, head_dim=8),
    # one hash-routed layer, then sqrtsoftplus top-k layers; CSA layers run the indexer
    "deepseek_v4": dict(num_hidden_layers=3, n_routed_experts=8, num_experts_per_tok=2,
                        n_shared_experts=1, q_lora_rank=16, head_dim=16, num_key_value_heads=1,
                        index_n_heads=16, index_head_dim=8, index_topk=2, sliding_window=8,
                        o_groups=2, o_lora_rank=8, hc_mult=2,
                        mlp_layer_types=["hash_moe", "moe", "moe"],
                        layer_types=["compressed_sparse_attention",
                                     "heavily_compressed_attention",
                                     "compressed_sparse_attention"],
                        compress_rates={"compressed_sparse_attention": 2,
                                        "heavily_compressed_attention": 4}),
}
MODEL_TYPES = tuple(CONFIGS)


def available(model_type) -> bool:
    """Whether the installed transformers ships this model type (DeepSeek-V4: >= 5.9)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    return model_type in CONFIG_MAPPING_NAMES


def make_config(model_type, **overrides):
    if not available(model_type):
        pytest.skip(f"transformers {transformers.__version__} has no {model_type!r} model")
    cfg = transformers.AutoConfig.for_model(model_type,
                                            **{**COMMON, **CONFIGS[model_type], **overrides})
    return cfg


def make_model(model_type, seed=0, **overrides):
    """A fp32 model with random weights and random correction biases (so they matter)."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(
        make_config(model_type, **overrides), attn_implementation="eager").float()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.normal_(0, 0.05, generator=gen)
            if name.endswith("tid2eid"):     # DeepSeek-V4 hash table: k distinct experts each
                buf.copy_(torch.stack([torch.randperm(8, generator=gen)[:buf.shape[1]]
                                       for _ in range(buf.shape[0])]))
    return model.eval()


def pair(model_type, seed=0, **overrides):
    """(unpatched, patched) copies of one model (``overrides``: config fields)."""
    from glm_kernels.integrations.transformers import apply_glm_kernels
    model = make_model(model_type, seed, **overrides)
    return model, apply_glm_kernels(copy.deepcopy(model))


class NoTopk:
    """Inside: torch.topk and Tensor.topk raise (the patched forward must not call them)."""

    def __enter__(self):
        self.saved = torch.topk, torch.Tensor.topk

        def refuse(*args, **kwargs):
            raise AssertionError("torch.topk called inside a patched forward")
        torch.topk = refuse
        torch.Tensor.topk = refuse
        return self

    def __exit__(self, *exc):
        torch.topk, torch.Tensor.topk = self.saved
