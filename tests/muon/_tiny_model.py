"""A tiny GLM-5-shaped MLA language model for the optimizer tests (HF or Megatron names)."""
from types import SimpleNamespace

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class MLAttention(nn.Module):
    """MLA projections only (no softmax needed to exercise the optimizer): q/kv down and up."""

    def __init__(self, hidden, heads, q_rank, kv_rank, nope, rope, v, megatron=False):
        super().__init__()
        names = (("linear_q_down_proj", "linear_q_up_proj", "linear_kv_down_proj",
                  "linear_kv_up_proj", "linear_proj") if megatron else
                 ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"))
        self.names = names
        self.heads, self.nope, self.rope, self.v = heads, nope, rope, v
        setattr(self, names[0], nn.Linear(hidden, q_rank, bias=False))
        self.q_a_layernorm = RMSNorm(q_rank)
        setattr(self, names[1], nn.Linear(q_rank, heads * (nope + rope), bias=False))
        setattr(self, names[2], nn.Linear(hidden, kv_rank + rope, bias=False))
        self.kv_a_layernorm = RMSNorm(kv_rank)
        setattr(self, names[3], nn.Linear(kv_rank, heads * (nope + v), bias=False))
        setattr(self, names[4], nn.Linear(heads * v, hidden, bias=True))

    def forward(self, x):
        q_down, q_up, kv_down, kv_up, out = (getattr(self, n) for n in self.names)
        b, t, _ = x.shape
        q = q_up(self.q_a_layernorm(q_down(x))).view(b, t, self.heads, -1)
        kv_a = kv_down(x)
        kv = kv_up(self.kv_a_layernorm(kv_a[..., :-self.rope])).view(b, t, self.heads, -1)
        k_nope, v = kv[..., :self.nope], kv[..., self.nope:]
        k = torch.cat([k_nope, kv_a[..., -self.rope:, None].transpose(-1, -2)
                       .expand(b, t, self.heads, self.rope)], -1)
        gate = torch.sigmoid((q * k).sum(-1, keepdim=True) / q.shape[-1] ** 0.5)
        return out((gate * v).reshape(b, t, -1))


class TinyMLAModel(nn.Module):
    """embedding -> [norm, MLA, norm, MLP with biases] x layers -> norm -> lm_head."""

    def __init__(self, vocab=32, hidden=16, heads=2, q_rank=12, kv_rank=8, nope=6, rope=2,
                 v=4, layers=1, megatron=False):
        super().__init__()
        self.config = SimpleNamespace(num_attention_heads=heads, qk_nope_head_dim=nope,
                                      qk_rope_head_dim=rope, v_head_dim=v)
        self.embed_tokens = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList()
        for _ in range(layers):
            block = nn.Module()
            block.input_layernorm = RMSNorm(hidden)
            block.self_attn = MLAttention(hidden, heads, q_rank, kv_rank, nope, rope, v,
                                          megatron)
            block.post_attention_layernorm = RMSNorm(hidden)
            block.mlp = nn.Sequential(nn.Linear(hidden, 2 * hidden), nn.SiLU(),
                                      nn.Linear(2 * hidden, hidden))
            self.layers.append(block)
        self.norm = RMSNorm(hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, tokens):
        x = self.embed_tokens(tokens)
        for block in self.layers:
            x = x + block.self_attn(block.input_layernorm(x))
            x = x + block.mlp(block.post_attention_layernorm(x))
        return self.lm_head(self.norm(x))


def loss_fn(model, seed=0):
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, model.lm_head.out_features, (2, 5), generator=gen)
    logits = model(tokens)
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                             tokens[:, 1:].reshape(-1))
