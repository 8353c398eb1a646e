"""Tiny causal transformer: MLA-style attention (q_b / kv_b up-projections) and MoE FFN."""
import torch
import torch.nn as nn
import torch.nn.functional as F
from glm_kernels._dispatch import warn_once


def route(logits, k):
    """Top-k expert routing. glm_kernels.moe_route has not landed: plain stable torch.sort."""
    warn_once("example.moe_route", "examples.async_trainer: glm_kernels.moe_route not available; "
              "using torch.sort(stable=True) top-k routing")
    scores = torch.sigmoid(logits)
    idx = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]
    w = scores.gather(-1, idx)
    return w / w.sum(-1, keepdim=True), idx


class MLA(nn.Module):
    def __init__(self, d, h, rank):
        super().__init__()
        self.h, self.dh = h, d // h
        self.q_a, self.q_b = nn.Linear(d, rank, bias=False), nn.Linear(rank, d, bias=False)
        self.kv_a, self.kv_b = nn.Linear(d, rank, bias=False), nn.Linear(rank, 2 * d, bias=False)
        self.o = nn.Linear(d, d, bias=False)

    def forward(self, x):
        B, T, D = x.shape
        q = self.q_b(self.q_a(x)).view(B, T, self.h, self.dh).transpose(1, 2)
        k, v = self.kv_b(self.kv_a(x)).view(B, T, self.h, 2 * self.dh).transpose(1, 2).chunk(2, -1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(B, T, D))


class MoE(nn.Module):
    def __init__(self, d, n_experts, k):
        super().__init__()
        self.k = k
        self.router = nn.Linear(d, n_experts, bias=False)
        self.up = nn.Parameter(torch.randn(n_experts, d, 2 * d) * d ** -0.5)
        self.down = nn.Parameter(torch.randn(n_experts, 2 * d, d) * (2 * d) ** -0.5)

    def forward(self, x):
        w, idx = route(self.router(x), self.k)                       # [B,T,k]
        h = torch.einsum("btd,edf->btef", x, self.up).relu()
        y = torch.einsum("btef,efd->bted", h, self.down)             # all experts (tiny model)
        return (y.gather(2, idx[..., None].expand(*idx.shape, x.shape[-1])) * w[..., None]).sum(2)


class TinyLM(nn.Module):
    def __init__(self, cfg, vocab, max_len=32):
        super().__init__()
        d = cfg.d_model
        self.emb, self.pos = nn.Embedding(vocab, d), nn.Embedding(max_len, d)
        self.blocks = nn.ModuleList(nn.ModuleList([nn.LayerNorm(d), MLA(d, cfg.n_heads, d // 2),
                                                   nn.LayerNorm(d), MoE(d, cfg.n_experts, cfg.top_k)])
                                    for _ in range(cfg.n_layers))
        self.norm, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)

    def forward(self, tokens):
        x = self.emb(tokens) + self.pos(torch.arange(tokens.shape[1]))
        for n1, attn, n2, moe in self.blocks:
            x = x + attn(n1(x))
            x = x + moe(n2(x))
        return self.head(self.norm(x))


def token_logprobs(model, tokens):
    """fp32 log p(tokens[:, t+1] | tokens[:, :t+1]) -> [B, T-1]."""
    logits = model(tokens[:, :-1]).float()
    return torch.log_softmax(logits, -1).gather(-1, tokens[:, 1:, None]).squeeze(-1)
