"""Tiny causal transformer: MLA-style attention (q_b / kv_b up-projections per head) and a
sigmoid-routed MoE feed-forward (noaux_tc routing with an aux-loss-free balancing bias).

Rollout routing replay (R3): ``RoutingRecorder`` records which experts every MoE layer sent
each position to during generation (one wire packet per trajectory); in training a
``RoutingTap`` installed with ``routing_tap`` replays those experts (or, with replay off, only
compares against them) and counts the routing mismatch.

Under ``glm_kernels.batch_invariant()`` the model takes the batch-invariant path of
``model/invariant.py`` (fixed-shape tiles, fixed-order reductions, one thread), which also decodes
with a KV cache (``TinyLM.forward(tokens, cache=invariant.KVCache())``) bitwise equal to the
full forward.
"""
import contextlib
from typing import List, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from glm_kernels import batch_invariant_enabled
from glm_kernels.optim import MuonSplit, muon_param_groups

from . import invariant
from .. import kernels
from ..env import task


class MLA(nn.Module):
    """Low-rank query and key/value paths; ``q_b`` and ``kv_b`` are [heads * rows, rank] so
    Muon Split can orthogonalize each head's block separately (as for GLM-5's q_b / kv_b)."""

    def __init__(self, d, heads, rank):
        super().__init__()
        self.h, self.dh = heads, d // heads
        self.q_a, self.q_b = nn.Linear(d, rank, bias=False), nn.Linear(rank, d, bias=False)
        self.kv_a, self.kv_b = nn.Linear(d, rank, bias=False), nn.Linear(rank, 2 * d, bias=False)
        self.o = nn.Linear(d, d, bias=False)

    def forward(self, x):
        b, t, d = x.shape
        q = self.q_b(self.q_a(x)).view(b, t, self.h, self.dh).transpose(1, 2)
        # kv_b rows are laid out head-major: head i owns rows [i*2dh, (i+1)*2dh) = [k_i; v_i].
        k, v = self.kv_b(self.kv_a(x)).view(b, t, self.h, 2 * self.dh).transpose(1, 2).chunk(2, -1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, d))


class RoutingTap:
    """What the MoE layers do with routing during one forward of [B, T] tokens.

    ``recorded`` int64 [layers, B, T, k] (the rollout's routing) and ``valid`` bool [B, T]
    (positions it covers): with ``replay`` the layers route to the recorded experts,
    otherwise they choose and are compared. Either way ``mismatched`` / ``compared`` count
    the (position, layer) pairs of valid positions whose own choice is another expert set.
    With nothing recorded the tap only keeps each layer's ids (``ids``, for recording).
    """

    def __init__(self, recorded: Optional[torch.Tensor] = None,
                 valid: Optional[torch.Tensor] = None, replay: bool = False):
        self.recorded, self.valid, self.replay = recorded, valid, replay
        self.ids: List[Optional[torch.Tensor]] = []
        self.mismatched = self.compared = 0

    def observe(self, layer: int, ids: torch.Tensor, mismatch: Optional[torch.Tensor]) -> None:
        while len(self.ids) <= layer:
            self.ids.append(None)
        self.ids[layer] = ids
        if mismatch is not None:
            picked = mismatch.view(self.valid.shape)[self.valid]
            self.mismatched += picked.sum()         # tensors: no host sync per layer
            self.compared += picked.numel()


@contextlib.contextmanager
def routing_tap(model, tap: Optional[RoutingTap]):
    """Install ``tap`` on every MoE layer of ``model`` for the block (None: no-op)."""
    layers = [m for m in model.modules() if isinstance(m, MoE)] if tap is not None else []
    for i, moe in enumerate(layers):
        moe.tap = (tap, i)
    try:
        yield tap
    finally:
        for moe in layers:
            moe.tap = None


class RoutingRecorder:
    """Records generation's routing as an inference engine with a KV cache would: each
    position's experts (every MoE layer) from the first forward that sees the position.

    ``step()`` after every forward; ``finish()`` -> one packet (bytes) per row covering
    positions 0 .. T-1 of the last forward, or None per row for a model without MoE layers;
    ``recorded()`` -> the same as one int64 tensor [layers, rows, T, k] (None without MoE).
    """

    def __init__(self, model):
        self.layers = [m for m in model.modules() if isinstance(m, MoE)]
        self.tap = RoutingTap()
        self.chunks: List[torch.Tensor] = []        # [layers, rows, new positions, k]
        self.seen = 0
        for i, moe in enumerate(self.layers):
            moe.tap = (self.tap, i)

    @property
    def n_experts(self) -> int:
        return self.layers[0].n_experts

    def step(self, start: int = 0) -> None:
        """After a forward over positions ``start`` .. (``start`` > 0: a KV-cache decode)."""
        if self.layers:
            ids = torch.stack(self.tap.ids)                 # [layers, rows, new positions, k]
            self.chunks.append(ids[:, :, self.seen - start:])
            self.seen = start + ids.shape[2]

    def recorded(self) -> Optional[torch.Tensor]:
        for moe in self.layers:
            moe.tap = None
        return torch.cat(self.chunks, dim=2).cpu() if self.layers else None

    def finish(self, rows: int) -> List[Optional[bytes]]:
        ids = self.recorded()
        if ids is None:
            return [None] * rows
        return [kernels.encode_routing(ids[:, r], self.n_experts) for r in range(rows)]


class MoE(nn.Module):
    def __init__(self, d, n_experts, k, n_group, topk_group):
        super().__init__()
        self.tap = None            # (RoutingTap, layer index) while recording / replaying
        self.k, self.n_group, self.topk_group = k, n_group, topk_group
        self.router = nn.Linear(d, n_experts, bias=False)
        # Selection-only bias (DeepSeek-V3 aux-loss-free balancing): a buffer, not trained by
        # the optimizer; ``update_balance_bias`` nudges it towards equal expert load.
        self.register_buffer("route_bias", torch.zeros(n_experts))
        self.register_buffer("load", torch.zeros(n_experts), persistent=False)
        # Expert weights stacked expert-major as 2-D matrices (the grouped-GEMM layout):
        # up [E * d, 2d], down [E * 2d, d]. Muon Split orthogonalizes each expert's block.
        self.n_experts = n_experts
        self.up = nn.Parameter(torch.randn(n_experts * d, 2 * d) * d ** -0.5)
        self.down = nn.Parameter(torch.randn(n_experts * 2 * d, d) * (2 * d) ** -0.5)

    def forward(self, x):
        b, t, d = x.shape
        flat = x.reshape(-1, d)
        fixed = batch_invariant_enabled()
        ops = invariant if fixed else kernels
        logits = invariant.linear(flat, self.router.weight) if fixed else self.router(flat)
        tap, layer = self.tap if self.tap is not None else (None, 0)
        recorded = None if tap is None or tap.recorded is None else \
            tap.recorded[layer].reshape(-1, self.k)
        if recorded is not None and tap.replay:    # R3: the rollout's experts, fresh weights
            ids, w, mismatch = ops.moe_route_replay(logits, self.k, self.route_bias,
                                                    self.n_group, self.topk_group, recorded)
        else:
            ids, w = ops.moe_route(logits, self.k, self.route_bias, self.n_group,
                                   self.topk_group)                       # [N, k] each
            mismatch = None if recorded is None else kernels.routing_mismatch(ids, recorded)
        if tap is not None:
            tap.observe(layer, ids.view(b, t, self.k), mismatch)
        if self.training:
            self.load += torch.bincount(ids.flatten(), minlength=self.load.numel()).float()
        up = self.up.view(self.n_experts, d, 2 * d)
        down = self.down.view(self.n_experts, 2 * d, d)
        if fixed:
            return invariant.experts(flat, up, down, ids, w).view(b, t, d)
        h = torch.einsum("nd,edf->nef", flat, up).relu()
        y = torch.einsum("nef,efd->ned", h, down)                          # all experts (tiny)
        picked = y.gather(1, ids[..., None].expand(*ids.shape, d))        # [N, k, d]
        return (picked * w[..., None].to(picked.dtype)).sum(1).view(b, t, d)

    @torch.no_grad()
    def update_balance_bias(self, rate: float) -> None:
        if self.load.sum() > 0:
            self.route_bias += rate * torch.sign(self.load.mean() - self.load)
        self.load.zero_()


class TinyLM(nn.Module):
    def __init__(self, cfg, vocab):
        super().__init__()
        d = cfg.d_model
        self.emb, self.pos = nn.Embedding(vocab, d), nn.Embedding(task.max_len(cfg), d)
        self.blocks = nn.ModuleList(
            nn.ModuleList([nn.LayerNorm(d), MLA(d, cfg.n_heads, d // 2), nn.LayerNorm(d),
                           MoE(d, cfg.n_experts, cfg.top_k, cfg.n_expert_groups,
                               cfg.topk_groups)])
            for _ in range(cfg.n_layers))
        self.norm, self.lm_head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)

    def hidden(self, tokens, cache: Optional[invariant.KVCache] = None):
        """Last hidden states after the final norm, [B, T, d] (the lm_head's input).

        Under ``glm_kernels.batch_invariant()``: the batch-invariant path, and ``cache``
        (optional) makes ``tokens`` the positions after the cached ones (decode)."""
        if batch_invariant_enabled():
            with invariant.one_thread():
                return invariant.hidden(self, tokens, cache)
        if cache is not None:
            raise ValueError("TinyLM: a KV cache needs glm_kernels.batch_invariant() (the "
                             "default path recomputes the whole prefix)")
        x = self.emb(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        for n1, attn, n2, moe in self.blocks:
            x = x + attn(n1(x))
            x = x + moe(n2(x))
        return self.norm(x)

    def forward(self, tokens, cache: Optional[invariant.KVCache] = None):
        h = self.hidden(tokens, cache)
        if batch_invariant_enabled():
            with invariant.one_thread():
                return invariant.linear(h, self.lm_head.weight)
        return self.lm_head(h)

    def update_balance_bias(self, rate: float) -> None:
        for *_, moe in self.blocks:
            moe.update_balance_bias(rate)


def head_splits(model: TinyLM) -> dict:
    """Row blocks for Muon Split, parameter name -> (blocks, block_rows): the MLA
    up-projections per head (q_b: one [dh] block per head; kv_b: [dh (k), dh (v)] per head,
    like GLM-5's kv_b 64 x [192, 256]) and the MoE weights per expert."""
    out = {}
    for i, (_, attn, _, moe) in enumerate(model.blocks):
        out[f"blocks.{i}.1.q_b.weight"] = (attn.h, [attn.dh])
        out[f"blocks.{i}.1.kv_b.weight"] = (attn.h, [attn.dh, attn.dh])
        out[f"blocks.{i}.3.up"] = (moe.n_experts, [moe.up.shape[0] // moe.n_experts])
        out[f"blocks.{i}.3.down"] = (moe.n_experts, [moe.down.shape[0] // moe.n_experts])
    return out


def make_optimizer(model, cfg, adamw_lr: float):
    """``glm_kernels.optim.MuonSplit``: Muon per head for the MLA up-projections and per
    expert for the MoE weights, Muon for the other hidden matrices, AdamW (``adamw_lr``) for
    embeddings, the lm_head, norms and biases (``muon_param_groups``' routing)."""
    groups = muon_param_groups(model, head_splits=head_splits(model))
    return MuonSplit(groups, lr=cfg.muon_lr, adamw_lr=adamw_lr,
                     weight_decay=cfg.weight_decay)
