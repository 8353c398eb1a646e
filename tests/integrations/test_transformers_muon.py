"""muon_param_groups on transformers' MoE models: per-head splits read from the config
(MLA q_b_proj / kv_b_proj, the DSA indexer's wq_b), AdamW for embeddings, norms, biases and
router weights, and 3-D expert stacks orthogonalized expert by expert; a MuonSplit step
equals per-expert and per-head Newton-Schulz by hand."""
import math

import torch

from glm_kernels.muon import HeadSplit, newton_schulz
from glm_kernels.optim import MuonSplit, muon_param_groups
from tests._compare import assert_close
from tests.integrations._tiny_moe import make_model

LR, RMS = 0.1, 0.2


def _groups_by_name(groups):
    return {name: g for g in groups for name in g["param_names"]}


def test_glm5_groups_split_per_head_and_keep_routers_on_adamw():
    model = make_model("glm_moe_dsa")
    by_name = _groups_by_name(muon_param_groups(model))
    attn = "model.layers.1.self_attn."
    assert by_name[attn + "q_b_proj.weight"]["head_split"] == HeadSplit(4, [8, 4])
    assert by_name[attn + "kv_b_proj.weight"]["head_split"] == HeadSplit(4, [8, 8])
    assert by_name[attn + "indexer.wq_b.weight"]["head_split"] == HeadSplit(16, [8])
    for name in ("model.layers.1.mlp.gate.weight", "model.embed_tokens.weight",
                 "lm_head.weight", "model.layers.1.input_layernorm.weight"):
        assert by_name[name]["use_muon"] is False, name
    for name in ("model.layers.1.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.down_proj",
                 attn + "o_proj.weight", attn + "indexer.wk.weight"):
        assert by_name[name]["use_muon"] is True and by_name[name].get("head_split") is None
    assert "model.layers.1.mlp.gate.e_score_correction_bias" not in by_name   # a buffer


def test_qwen3_router_goes_to_adamw():
    by_name = _groups_by_name(muon_param_groups(make_model("qwen3_moe")))
    assert by_name["model.layers.0.mlp.gate.weight"]["use_muon"] is False
    assert by_name["model.layers.0.mlp.experts.gate_up_proj"]["use_muon"] is True


def test_step_is_per_expert_and_per_head_newton_schulz():
    model = make_model("glm_moe_dsa")
    params = dict(model.named_parameters())
    gen = torch.Generator().manual_seed(9)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen)
    before = {n: p.detach().clone() for n, p in params.items()}
    opt = MuonSplit(muon_param_groups(model), lr=LR, momentum=0.0, nesterov=False,
                    weight_decay=0.0)
    opt.step()

    def expect(name, blocks):
        """p - lr * rms * sqrt(max(r, c)) * NS(g) for each block (a slice of the grad)."""
        want = before[name].clone()
        for index in blocks:
            g = params[name].grad[index]
            want[index] -= LR * RMS * math.sqrt(max(g.shape)) * newton_schulz(g)
        assert_close(params[name].detach(), want, tol=1e-5, name=name)

    experts = "model.layers.1.mlp.experts."
    for name in (experts + "gate_up_proj", experts + "down_proj"):
        expect(name, [(e,) for e in range(8)])
    attn = "model.layers.1.self_attn."
    expect(attn + "q_b_proj.weight",
           [slice(h * 12 + a, h * 12 + b) for h in range(4) for a, b in ((0, 8), (8, 12))])
    expect(attn + "indexer.wq_b.weight", [slice(h * 8, h * 8 + 8) for h in range(16)])
    # a flattened [E, 2I * H] orthogonalization is something else entirely
    flat = params[experts + "gate_up_proj"].grad.reshape(8, -1)
    assert not torch.allclose(newton_schulz(flat).view(8, 32, 32),
                              newton_schulz(params[experts + "gate_up_proj"].grad), atol=1e-3)


def test_docs_example_prints_what_the_page_shows(capsys):
    """docs/transformers.md's example (patch, R3 around generate, token_logprobs, MuonSplit)
    runs as written and prints the line the page shows."""
    import os
    import re
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with open(os.path.join(root, "docs", "transformers.md")) as f:
        page = f.read()
    code, shown = re.search(r"```python\n(.*?)```\s*```text\n(.*?)```", page, re.S).groups()
    exec(compile(code, "docs/transformers.md", "exec"), {})
    assert capsys.readouterr().out.splitlines()[-1:] == shown.splitlines()
