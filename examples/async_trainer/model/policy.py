"""The policy: ``transformers.GlmMoeDsaForCausalLM`` (GLM-5's architecture as transformers ships
it) with a tiny config, built from the config (no download) and patched by
``glm_kernels.integrations.transformers.apply_glm_kernels`` (routing by ``moe_route``, the DSA
indexer's top-k by ``glm_kernels.topk``). Every stage, engine and teacher is this one class.

Shape, from ``TrainerConfig``: ``n_layers`` decoder layers, the first ``dense_layers`` with a
dense SwiGLU MLP, the rest sigmoid noaux_tc MoE (``n_experts`` routed experts in
``n_expert_groups`` groups, ``top_k`` per token from ``topk_groups`` groups, one shared expert,
the aux-loss-free ``e_score_correction_bias``); MLA attention with q and kv low-rank paths
(rank ``d_model // 2``) and the DSA indexer, whose top-k covers the whole context here
(``index_topk`` = the longest trajectory: GLM-5 trains its indexer with a loss of its own,
which this example does not, so an untrained indexer must not drop keys). Eager attention:
with sdpa transformers hands the indexer no mask.

Routing replay (R3) is the library's: ``record_routing`` on the engines, ``replay_routing`` in
training (``train_routing`` here adds the counts the trainer logs and the expert load the
balancing bias follows). Under ``glm_kernels.batch_invariant()`` the whole model is
batch-invariant (the library's aten-level mode): a KV-cache decode and a full forward give
every token the same bits.
"""
import contextlib
import math
from typing import List, Optional, Sequence

import torch

import glm_kernels
from glm_kernels.integrations.transformers import (apply_glm_kernels, record_routing,
                                                   replay_routing)
from glm_kernels.optim import MuonSplit, muon_param_groups

from .. import kernels
from ..env import task, vocab


# transformers initialises GLM-5 with std 0.02 (right for width 6144); a 48-wide model from
# that start learns the SFT stage's tasks too slowly for 70 steps (held-out reverse / tool /
# tora after SFT: 0.0 / 0.02 / 0.36 at 0.02, 0.11 / 0.19 / 1.0 at 0.1, 0.13 / 0.53 / 0.98 at 0.2).
INIT_STD = 0.2


def _transformers():
    try:
        import transformers
    except ImportError as err:
        raise ImportError("the example's policy is transformers' GlmMoeDsaForCausalLM: "
                          "pip install 'transformers>=5.2'") from err
    if not hasattr(transformers, "GlmMoeDsaConfig"):
        raise ImportError(f"transformers {transformers.__version__} has no GLM-5 model "
                          "(glm_moe_dsa): pip install 'transformers>=5.2'")
    return transformers


def policy_config(cfg):
    """The ``GlmMoeDsaConfig`` of ``cfg``'s model fields."""
    transformers = _transformers()
    d, heads = cfg.d_model, cfg.n_heads
    head = d // heads
    rope = 2 * max(1, head // 6)         # GLM-5: 64 rotary of a 256 query-key head
    return transformers.GlmMoeDsaConfig(
        vocab_size=vocab.vocab_size(cfg), hidden_size=d, intermediate_size=2 * d,
        moe_intermediate_size=d, num_hidden_layers=cfg.n_layers,
        mlp_layer_types=["dense"] * cfg.dense_layers
        + ["sparse"] * (cfg.n_layers - cfg.dense_layers),
        num_attention_heads=heads, num_key_value_heads=heads,
        q_lora_rank=d // 2, kv_lora_rank=d // 2, qk_nope_head_dim=head - rope,
        qk_rope_head_dim=rope, v_head_dim=head,
        index_topk=task.max_len(cfg), index_n_heads=heads, index_head_dim=head,
        n_routed_experts=cfg.n_experts, num_experts_per_tok=cfg.top_k,
        n_group=cfg.n_expert_groups, topk_group=cfg.topk_groups, n_shared_experts=1,
        max_position_embeddings=task.max_len(cfg), pad_token_id=vocab.PAD,
        eos_token_id=vocab.EOS, bos_token_id=None, tie_word_embeddings=False,
        initializer_range=INIT_STD, attn_implementation="eager")


def new_policy(cfg, dtype: Optional[torch.dtype] = None, state=None):
    """A fresh (seeded by torch's global RNG) patched policy on ``cfg``'s device, in ``dtype``
    (default fp32), with ``state`` loaded if given."""
    transformers = _transformers()
    model = transformers.GlmMoeDsaForCausalLM(policy_config(cfg))
    apply_glm_kernels(model)
    model.to(cfg.resolved_device(), dtype or torch.float32)
    if state is not None:
        model.load_state_dict(state)
    return model


def device_of(model) -> torch.device:
    return next(model.parameters()).device


def logits(model, tokens: torch.Tensor) -> torch.Tensor:
    """[B, T, V] logits of ``tokens`` [B, T] (a full causal forward, no cache)."""
    return model(input_ids=tokens, use_cache=False).logits


def hidden(model, tokens: torch.Tensor) -> torch.Tensor:
    """[B, T, d] last hidden states (after the final norm: the lm_head's input)."""
    return model.model(input_ids=tokens, use_cache=False).last_hidden_state


def new_cache(model):
    """An empty KV cache for ``model`` (transformers' ``DynamicCache``)."""
    return _transformers().DynamicCache(config=model.config)


def decode(model, tokens: torch.Tensor, cache) -> torch.Tensor:
    """Logits of ``tokens`` [B, t], the positions after those ``cache`` holds (which grows)."""
    return model(input_ids=tokens, past_key_values=cache, use_cache=True).logits


def moe_gates(model) -> List[torch.nn.Module]:
    """The routers of the MoE layers, in layer order (each holds ``e_score_correction_bias``)."""
    return [layer.mlp.gate for layer in model.model.layers if hasattr(layer.mlp, "gate")]


def n_experts(model) -> int:
    return model.config.n_routed_experts


def expert_load(ids: torch.Tensor, valid: torch.Tensor, experts: int) -> torch.Tensor:
    """Tokens per expert of each MoE layer, fp32 [layers, experts], from routing ``ids``
    int64 [layers, B, T, k] at the ``valid`` bool [B, T] positions."""
    picked = ids[:, valid]                                         # [layers, N, k]
    return torch.stack([torch.bincount(p.flatten(), minlength=experts).float()
                        for p in picked]) if picked.numel() else \
        torch.zeros(ids.shape[0], experts)


@torch.no_grad()
def update_balance_bias(model, load: Optional[torch.Tensor], rate: float) -> None:
    """DeepSeek-V3's aux-loss-free balancing: nudge each MoE layer's selection-only bias
    (``e_score_correction_bias``) by ``rate`` towards equal expert ``load`` [layers, E]."""
    if load is None:
        return
    for gate, layer_load in zip(moe_gates(model), load):
        if layer_load.sum() > 0:
            bias = gate.e_score_correction_bias
            bias += rate * torch.sign(layer_load.mean() - layer_load).to(bias)


class RoutingStats:
    """What one training forward did with routing: ``mismatched`` / ``compared`` count the
    (position, MoE layer) pairs of recorded positions whose own choice is another expert set
    than the rollout's (0 / 0 with nothing recorded); ``load`` fp32 [layers, E], the tokens
    each expert took (the routing used: the replayed one with R3)."""

    def __init__(self):
        self.mismatched = 0
        self.compared = 0
        self.load: Optional[torch.Tensor] = None


@contextlib.contextmanager
def train_routing(model, packets: Optional[Sequence[bytes]], width: int, replay: bool,
                  positions: Optional[torch.Tensor] = None):
    """The routing of the training forwards of rows ``[B, width]`` inside the block.

    ``packets`` (one rollout routing packet per row, ``record_routing``'s wire format) with
    ``replay``: R3, every recorded position routes to the rollout's experts
    (``replay_routing``); without ``replay``: the model routes by itself and is compared with
    them. ``packets`` None: the model routes by itself. ``positions`` bool [B, width] (the
    rows' real tokens) limits the load to them. Yields a :class:`RoutingStats`, filled on exit.
    """
    stats = RoutingStats()
    experts = n_experts(model)
    recorded = lengths = None
    if packets is not None:
        recorded, lengths = kernels.decode_routing_batch(packets, width, device_of(model))
    if packets is not None and replay:
        with replay_routing(model, packets) as rep:
            yield stats
        used = recorded
        stats.mismatched = sum(rep.mismatch_counts())
    else:
        with record_routing(model) as rec:
            yield stats
        used = rec.ids()
        if recorded is not None:
            valid = torch.arange(width, device=used.device) < lengths.to(used.device)[:, None]
            differ = kernels.routing_mismatch(used.reshape(-1, used.shape[-1]),
                                              recorded.reshape(-1, used.shape[-1]))
            stats.mismatched = int(differ.view(used.shape[:3])[:, valid].sum())
    valid = torch.ones(used.shape[1:3], dtype=torch.bool, device=used.device)
    if lengths is not None:
        stats.compared = int(lengths.clamp(max=width).sum()) * used.shape[0]
        if replay:          # past a packet's end the decoded ids are padding, not routing
            valid = torch.arange(width, device=used.device) < lengths.to(used.device)[:, None]
    if positions is not None:
        valid = valid & positions.to(used.device)
    stats.load = expert_load(used, valid, experts)


def make_optimizer(model, cfg, adamw_lr: float):
    """``glm_kernels.optim.MuonSplit`` over ``muon_param_groups(model)``: per head for the MLA
    up-projections (q_b_proj, kv_b_proj) and the indexer's wq_b, per expert for the 3-D expert
    stacks, Muon for the other hidden matrices, AdamW (``adamw_lr``) for embeddings, the
    lm_head, norms and the routers."""
    return MuonSplit(muon_param_groups(model), lr=cfg.muon_lr, adamw_lr=adamw_lr,
                     weight_decay=cfg.weight_decay)


def schedule_lr(opt, cfg, step: int, steps: int) -> float:
    """Set every group's rate for optimizer step ``step`` (0-based) of a stage of ``steps``:
    ``cfg.lr_warmup_steps`` of linear warm-up, then ``cfg.lr_schedule`` from the group's own
    rate (kept as ``base_lr``) down to ``cfg.lr_min_ratio`` times it at the last step.
    Returns the factor."""
    warm = cfg.lr_warmup_steps
    if step < warm:
        factor = (step + 1) / (warm + 1)
    elif cfg.lr_schedule == "constant" or steps - warm <= 1:
        factor = 1.0
    else:
        t = (step - warm) / (steps - warm - 1)
        shape = 1.0 - t if cfg.lr_schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * t))
        factor = cfg.lr_min_ratio + (1.0 - cfg.lr_min_ratio) * shape
    for g in opt.param_groups:
        g["lr"] = g.setdefault("base_lr", g["lr"]) * factor
    return factor


def batch_invariant(enabled: bool):
    """``glm_kernels.batch_invariant()`` when ``enabled``, else a no-op context."""
    return glm_kernels.batch_invariant() if enabled else contextlib.nullcontext()
