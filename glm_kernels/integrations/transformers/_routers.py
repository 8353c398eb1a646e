"""Drop-in forwards for the routers and DSA indexers of transformers' MoE models.

Each function here replaces one method of one transformers class, with the original's
signature and return value; the module's parameters and buffers are untouched (same
state-dict names). Every top-k runs through ``glm_kernels.moe_route`` / ``glm_kernels.topk``:
ties go to the lower expert / token index, and a token's routing is a fixed function of its
own router logits (bitwise the same whatever else is in the batch).

Rollout routing replay (``r3.py``) plugs in through ``route``: a routing module that carries
an active ``_glm_kernels_r3`` session records its expert ids, or replays recorded ones.
"""
import functools
import inspect
from typing import Optional

import torch
import torch.nn.functional as F

from ...topk import moe_route, topk

R3_ATTR = "_glm_kernels_r3"
# (class, method name) -> transformers' own function, recorded before a class is patched.
ORIGINALS = {}

# transformers' ACT2FN class of a router's ``score_fn`` -> moe_route's scoring name.
_SCORING_OF_ACTIVATION = {"SqrtSoftplusActivation": "sqrtsoftplus", "Sigmoid": "sigmoid",
                          "SigmoidActivation": "sigmoid", "Softmax": "softmax"}


def route(module: torch.nn.Module, router_logits: torch.Tensor, k: int, *, scoring: str,
          bias: Optional[torch.Tensor] = None, n_group: int = 1, topk_group: int = 1,
          renormalize: bool = True, scaling_factor: float = 1.0,
          fixed_ids: Optional[torch.Tensor] = None):
    """(weights fp32 [T, k], ids int64 [T, k]) of one MoE layer's tokens.

    ``fixed_ids`` (DeepSeek-V4 hash layers): the experts are given (token-id lookup); only
    the weights are computed, by ``moe_route(replay_ids=...)``.
    """
    kwargs = dict(scoring=scoring, bias=bias, n_group=n_group, topk_group=topk_group,
                  renormalize=renormalize, scaling_factor=float(scaling_factor))
    session = getattr(module, R3_ATTR, None)
    if session is not None and session.replaying:
        return session.replay(module, router_logits, k, kwargs, fixed_ids)
    if fixed_ids is not None:
        out = moe_route(router_logits, k, replay_ids=fixed_ids, **kwargs)
    else:
        out = moe_route(router_logits, k, **kwargs)
    if session is not None:
        session.record(module, out.ids)
    return out.weights, out.ids


# ----------------------------------------------------------------- noaux_tc MoE blocks
def noaux_route_tokens_to_experts(self, router_logits):
    """``route_tokens_to_experts`` of GlmMoeDsaMoE / Glm4MoeMoE / DeepseekV3MoE.

    sigmoid scores, ``e_score_correction_bias`` for the choice, n_group groups scored by their
    two best biased scores, topk_group kept, top_k experts; weights s[ids], renormalized
    (+1e-20) when ``norm_topk_prob``, times ``routed_scaling_factor``. Returns
    (topk_indices int64 [T, k], topk_weights fp32 [T, k]) as the original does.
    """
    weights, ids = route(self, router_logits, self.top_k, scoring="sigmoid",
                         bias=self.gate.e_score_correction_bias, n_group=self.n_group,
                         topk_group=self.topk_group, renormalize=bool(self.norm_topk_prob),
                         scaling_factor=self.routed_scaling_factor)
    return ids, weights.to(router_logits.dtype)


def noaux_router_forward(self, hidden_states):
    """``forward`` of GlmMoeDsaTopkRouter / Glm4MoeTopkRouter / DeepseekV3TopkRouter where
    transformers (newer than 5.10) routes in the router: the fp32 logits of the hidden states,
    then the noaux_tc choice above; returns (router_logits fp32 [T, E], topk_weights fp32
    [T, k], topk_indices int64 [T, k]) as the original does."""
    flat = hidden_states.reshape(-1, self.hidden_dim)
    router_logits = F.linear(flat.float(), self.weight.float())
    weights, ids = route(self, router_logits, self.top_k, scoring="sigmoid",
                         bias=self.e_score_correction_bias, n_group=self.num_group,
                         topk_group=self.topk_group, renormalize=bool(self.norm_topk_prob),
                         scaling_factor=self.routed_scaling_factor)
    return router_logits, weights, ids


# ----------------------------------------------------------------- Qwen3-MoE
def qwen3_router_forward(self, hidden_states):
    """``Qwen3MoeTopKRouter.forward``: softmax over the experts (fp32), top_k, renormalized
    when ``norm_topk_prob``; returns (router_logits, weights in the logits' dtype, ids), or
    where the installed transformers (5.2) returns the fp32 probabilities in place of the
    logits, (probabilities, fp32 weights, ids) as it does."""
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    router_logits = F.linear(hidden_states, self.weight)
    weights, ids = route(self, router_logits, self.top_k, scoring="softmax",
                         renormalize=bool(self.norm_topk_prob))
    if _original_has(type(self), "forward", "router_logits = torch.nn.functional.softmax"):
        return router_logits.softmax(-1, dtype=torch.float), weights, ids
    return router_logits, weights.to(router_logits.dtype), ids


# ----------------------------------------------------------------- DeepSeek-V4
def _v4_scoring(router) -> str:
    name = type(router.score_fn).__name__
    if name not in _SCORING_OF_ACTIVATION:
        raise ValueError(f"{type(router).__name__}.score_fn is {name}; glm_kernels routes "
                         f"the scorings {sorted(set(_SCORING_OF_ACTIVATION.values()))}")
    return _SCORING_OF_ACTIVATION[name]


def deepseek_v4_router_forward(self, hidden_states):
    """``DeepseekV4TopKRouter.forward``: ``scoring_func`` scores (sqrtsoftplus by default),
    ``e_score_correction_bias`` for the choice, top_k, weights renormalized (+1e-20) times
    ``routed_scaling_factor``; returns (logits, weights in the logits' dtype, ids)."""
    flat = hidden_states.reshape(-1, self.hidden_dim)
    logits = F.linear(flat, self.weight)
    weights, ids = route(self, logits, self.top_k, scoring=_v4_scoring(self),
                         bias=self.e_score_correction_bias,
                         scaling_factor=self.routed_scaling_factor)
    return logits, weights.to(logits.dtype), ids


def deepseek_v4_hash_router_forward(self, hidden_states, input_ids):
    """``DeepseekV4HashRouter.forward``: experts from the frozen ``tid2eid[input_ids]`` table,
    weights from the scores of those experts (``moe_route(replay_ids=...)``)."""
    flat = hidden_states.reshape(-1, self.hidden_dim)
    logits = F.linear(flat, self.weight)
    ids = self.tid2eid[input_ids.reshape(-1)].long()
    weights, ids = route(self, logits, self.top_k, scoring=_v4_scoring(self),
                         scaling_factor=self.routed_scaling_factor, fixed_ids=ids)
    return logits, weights.to(logits.dtype), ids


# ----------------------------------------------------------------- GLM-5 DSA indexer
def causal_lengths(n_queries: int, n_keys: int, device) -> torch.Tensor:
    """int64 [n_queries]: query i of the newest n_queries (of n_keys in all) sees keys
    0 .. n_keys - n_queries + i."""
    return torch.arange(n_keys - n_queries + 1, n_keys + 1, device=device)


def _modeling(obj):
    import sys
    return sys.modules[type(obj).__module__]


@functools.lru_cache(maxsize=None)
def _original_has(cls, method: str, text: str) -> bool:
    """Whether the installed transformers' own ``cls.method`` contains ``text``: where
    transformers versions differ (>= 5.2), the patched method keeps the installed version's
    math and outputs and changes only the top-k."""
    original = ORIGINALS.get((cls, method), getattr(cls, method))
    return text in inspect.getsource(original)


@torch.no_grad()
def glm_moe_dsa_indexer_forward(self, hidden_states, q_resid, position_embeddings,
                                attention_mask, use_cache=False):
    """``GlmMoeDsaIndexer.forward`` with the top-k by ``glm_kernels.topk``.

    The index scores are the original's; the top-k keeps, per query, the best keys among its
    causal prefix (``lengths``: query i of S new tokens over T keys sees T - S + i + 1), ties
    to the lower key index. Rows with fewer causal keys than k repeat their best key in the
    spare slots (the original returns masked keys there, which the attention mask removes
    anyway): the sparse-attention mask built from the indices is the same.
    """
    apply_rotary_pos_emb = _modeling(self).apply_rotary_pos_emb
    batch_size, seq_len, _ = hidden_states.shape
    cos, sin = position_embeddings
    q = self.wq_b(q_resid).view(batch_size, seq_len, self.n_heads, self.head_dim)
    q_pe, q_nope = torch.split(q, [self.qk_rope_head_dim, self.head_dim - self.qk_rope_head_dim],
                               dim=-1)
    q = torch.cat([apply_rotary_pos_emb(q_pe, cos, sin, unsqueeze_dim=2), q_nope], dim=-1)
    k = self.k_norm(self.wk(hidden_states))
    k_pe, k_nope = torch.split(k, [self.qk_rope_head_dim, self.head_dim - self.qk_rope_head_dim],
                               dim=-1)
    k_pe = apply_rotary_pos_emb(k_pe.unsqueeze(2), cos, sin, unsqueeze_dim=2).squeeze(2)
    k = torch.cat([k_pe, k_nope], dim=-1)
    # transformers 5.2-5.10 keep the indexer's keys on the module and drop them only for a
    # forward of several tokens: a new cache whose first forward is one token would then
    # extend another sequence's keys. A forward whose mask spans only its own tokens has no
    # past either.
    if seq_len > 1 or (attention_mask is not None and attention_mask.shape[-1] == seq_len):
        self._cached_keys = None
    if use_cache:
        k_cached = k if self._cached_keys is None else torch.cat([self._cached_keys, k], dim=1)
        self._cached_keys = k_cached
    else:
        k_cached = k
    weights = self.weights_proj(hidden_states).float() * (self.n_heads ** -0.5)
    scores = torch.einsum("bshd,btd->bsht", q.float(), k_cached.float()) * self.softmax_scale
    if _original_has(type(self), "forward", "relu("):   # 5.2's indexer has no ReLU
        scores = F.relu(scores)
    index_scores = torch.einsum("bsht,bsh->bst", scores, weights)
    if attention_mask is not None:
        index_scores = index_scores + attention_mask
    return _causal_top_keys(index_scores, self.index_topk)


def _causal_top_keys(index_scores: torch.Tensor, index_topk: int) -> torch.Tensor:
    """int64 [B, S, k]: per query of ``index_scores`` [B, S, T] its best keys among its causal
    prefix (``causal_lengths``), ties to the lower key, spare slots repeating the best key."""
    batch_size, seq_len, total_len = index_scores.shape
    lengths = causal_lengths(seq_len, total_len, index_scores.device).expand(batch_size, seq_len)
    indices = topk(index_scores, min(index_topk, total_len), lengths=lengths).indices
    return torch.where(indices >= 0, indices, indices[..., :1])


@torch.no_grad()
def glm_moe_dsa_indexer_forward_cache(self, hidden_states, q_resid, position_embeddings,
                                      attention_mask, position_ids, cache=None):
    """``GlmMoeDsaIndexer.forward`` of transformers releases whose indexer keeps its keys in
    the model's ``Cache`` (``cache.update_indexer``) and applies interleaved RoPE (5.25), with
    the top-k by ``glm_kernels.topk``: the original's index scores, per query the best keys of
    its causal prefix, ties to the lower key index, spare slots repeating the best key (the
    sparse mask built from them is the same); int32 indices as the original returns."""
    rotate = _modeling(self).apply_rotary_pos_emb_interleave
    batch_size, seq_len, _ = hidden_states.shape
    cos, sin = position_embeddings
    rope, rest = self.qk_rope_head_dim, self.head_dim - self.qk_rope_head_dim
    q = self.wq_b(q_resid).view(batch_size, seq_len, self.n_heads, self.head_dim)
    q_rot, q_pass = torch.split(q, [rope, rest], dim=-1)
    k = self.k_norm(self.wk(hidden_states)).unsqueeze(2)
    k_rot, k_pass = torch.split(k, [rope, rest], dim=-1)
    q_rot, k_rot = rotate(q_rot, k_rot, cos, sin, unsqueeze_dim=2)
    q = torch.cat([q_rot, q_pass], dim=-1)
    k = torch.cat([k_rot, k_pass], dim=-1).squeeze(2)
    if cache is not None:
        k = cache.update_indexer(k, self.layer_idx)
    # the original's products in its order: the scores are its bits, only the top-k changes
    scores = F.relu(torch.matmul(q.float(), k.transpose(-1, -2).float().unsqueeze(1))
                    * self.softmax_scale)
    weights = (self.weights_proj(hidden_states.to(self.weights_proj.weight.dtype)).float()
               * (self.n_heads ** -0.5))
    index_scores = torch.matmul(weights.unsqueeze(-2), scores).squeeze(-2)
    if attention_mask.dtype == torch.bool:
        index_scores = index_scores.masked_fill(~attention_mask, float("-inf"))
    else:
        index_scores = index_scores + attention_mask
    return _causal_top_keys(index_scores, self.index_topk).to(torch.int32)


# ----------------------------------------------------------------- DeepSeek-V4 indexer
def deepseek_v4_indexer_forward(self, hidden_states, q_residual, position_ids, past_key_values,
                                layer_idx):
    """``DeepseekV4Indexer.forward`` with the top-k by ``glm_kernels.topk``: a query keeps the
    best compressed entries among those it may see (``lengths`` = (position + 1) //
    compress_rate); spare slots are -1, as the original marks them."""
    return _deepseek_v4_indexer(self, hidden_states, q_residual, position_ids, past_key_values,
                                layer_idx)


def deepseek_v4_indexer_forward_cache(self, hidden_states, q_residual, position_ids, cache,
                                      layer_idx):
    """The same where transformers names the cache argument ``cache`` (5.25)."""
    return _deepseek_v4_indexer(self, hidden_states, q_residual, position_ids, cache, layer_idx)


def _deepseek_v4_indexer(self, hidden_states, q_residual, position_ids, past_key_values,
                         layer_idx):
    mod = _modeling(self)
    batch, seq_len, _ = hidden_states.shape
    cache_layer = past_key_values.layers[layer_idx] if past_key_values is not None else None
    kv = self.kv_proj(hidden_states)
    gate = self.gate_proj(hidden_states)
    if cache_layer is None:
        usable = (kv.shape[1] // self.compress_rate) * self.compress_rate
        chunk_kv, chunk_gate, first_window_position = kv[:, :usable], gate[:, :usable], 0
    else:
        chunk_kv, chunk_gate, first_window_position = cache_layer.store_compression_weights(
            "indexer", kv, gate)
    if chunk_kv.shape[1] > 0:
        n_windows = chunk_kv.shape[1] // self.compress_rate
        ratio = self.compress_rate
        chunk_kv = chunk_kv.view(batch, n_windows, ratio, -1)
        chunk_gate = chunk_gate.view(batch, n_windows, ratio, -1) + self.position_bias
        new_kv = chunk_kv.new_zeros((batch, n_windows, 2 * ratio, self.head_dim))
        new_gate = chunk_gate.new_full((batch, n_windows, 2 * ratio, self.head_dim),
                                       float("-inf"))
        new_kv[:, :, ratio:] = chunk_kv[..., self.head_dim:]
        new_gate[:, :, ratio:] = chunk_gate[..., self.head_dim:]
        if n_windows > 1:
            new_kv[:, 1:, :ratio] = chunk_kv[:, :-1, :, :self.head_dim]
            new_gate[:, 1:, :ratio] = chunk_gate[:, :-1, :, :self.head_dim]
        if cache_layer is not None:
            prior_kv, prior_gate = cache_layer.update_overlap_state("indexer", chunk_kv,
                                                                    chunk_gate, self.head_dim)
            if prior_kv is not None:
                new_kv[:, 0, :ratio] = prior_kv.to(new_kv.dtype)
                new_gate[:, 0, :ratio] = prior_gate.to(new_gate.dtype)
        compressed = self.kv_norm(
            (new_kv * new_gate.softmax(dim=2, dtype=torch.float32).to(new_kv.dtype)).sum(dim=2))
        positions = torch.arange(n_windows, device=compressed.device)
        positions = (positions * self.compress_rate + first_window_position).unsqueeze(0)
        cos, sin = self.rotary_emb(compressed, position_ids=positions.expand(batch, -1),
                                   layer_type=self.rope_layer_type)
        compressed = mod.apply_rotary_pos_emb(compressed.unsqueeze(1), cos, sin).squeeze(1)
    else:
        compressed = chunk_kv.new_zeros((batch, 0, self.head_dim))
    compressed_kv = (compressed if cache_layer is None
                     else cache_layer.update_compressor_states("indexer", compressed))
    cos_q, sin_q = self.rotary_emb(hidden_states, position_ids=position_ids,
                                   layer_type=self.rope_layer_type)
    q = self.q_b_proj(q_residual).view(batch, seq_len, -1, self.head_dim).transpose(1, 2)
    q = mod.apply_rotary_pos_emb(q, cos_q, sin_q).transpose(1, 2)
    index_scores = self.scorer(q, compressed_kv, hidden_states)
    compressed_len = compressed_kv.shape[1]
    lengths = ((position_ids + 1) // self.compress_rate).expand(batch, seq_len)
    return topk(index_scores, min(self.index_topk, compressed_len), lengths=lengths).indices
