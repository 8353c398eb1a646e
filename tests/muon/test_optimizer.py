"""MuonSplit and muon_param_groups: routing, one step by hand, AdamW parity, state round trip,
tensor-parallel shards (2 gloo processes), bad input."""
import math
import os

import pytest
import torch
import torch.distributed as dist

import glm_kernels
from glm_kernels.muon import HeadSplit, _reference, resolve_coefficients
from glm_kernels.optim import MuonSplit, muon_param_groups
from tests._compare import TOLERANCES, assert_close
from tests._gloo import run_ranks
from tests.conftest import DEVICE
from tests.muon._tiny_model import TinyMLAModel, loss_fn

TOL32 = TOLERANCES[torch.float32]
TOL_BF16 = TOLERANCES[torch.bfloat16]
HEAD_SPLITS = {"q_b_proj": HeadSplit(2, [6, 2]), "kv_b_proj": HeadSplit(2, [6, 4])}


def _groups_by_name(groups):
    return {name: group for group in groups for name in group["param_names"]}


@pytest.mark.parametrize("megatron", [False, True])
def test_routing_rules(megatron):
    model = TinyMLAModel(megatron=megatron)
    groups = muon_param_groups(model)            # "auto": splits from model.config
    by_name = _groups_by_name(groups)
    assert set(by_name) == {n for n, _ in model.named_parameters()}
    q_up, kv_up = ("linear_q_up_proj", "linear_kv_up_proj") if megatron else \
        ("q_b_proj", "kv_b_proj")
    attn = "layers.0.self_attn."
    # embeddings and the output head: AdamW with decay; vectors: AdamW without decay
    for name in ("embed_tokens.weight", "lm_head.weight"):
        assert not by_name[name]["use_muon"] and "weight_decay" not in by_name[name]
    for name in ("norm.weight", "layers.0.input_layernorm.weight", attn + "q_a_layernorm.weight",
                 "layers.0.mlp.0.bias", attn + ("linear_proj" if megatron else "o_proj") + ".bias"):
        assert not by_name[name]["use_muon"] and by_name[name]["weight_decay"] == 0.0
    # MLA up-projections per head ([nope, rope] and [nope, v]); other matrices whole
    assert by_name[attn + q_up + ".weight"]["head_split"] == HeadSplit(2, [6, 2])
    assert by_name[attn + kv_up + ".weight"]["head_split"] == HeadSplit(2, [6, 4])
    for name in ("layers.0.mlp.0.weight", "layers.0.mlp.2.weight",
                 attn + ("linear_q_down_proj" if megatron else "q_a_proj") + ".weight"):
        assert by_name[name]["use_muon"] and "head_split" not in by_name[name]
    assert all(g["params"] for g in groups)


def test_routing_options():
    model = TinyMLAModel()
    model.lm_head.weight = model.embed_tokens.weight            # tied: stays with the embedding
    by_name = _groups_by_name(muon_param_groups(model, head_splits=None,
                                                decay_vectors=True))
    assert "lm_head.weight" not in by_name and not by_name["embed_tokens.weight"]["use_muon"]
    assert "head_split" not in by_name["layers.0.self_attn.q_b_proj.weight"]
    assert "weight_decay" not in by_name["norm.weight"]
    untied = TinyMLAModel()
    by_name = _groups_by_name(muon_param_groups(untied, output_head="muon"))
    assert by_name["lm_head.weight"]["use_muon"]
    # explicit dict with full parameter names and (num_heads, block_rows) tuples
    by_name = _groups_by_name(muon_param_groups(
        untied, {"layers.0.self_attn.q_b_proj.weight": (2, [8])}))
    assert by_name["layers.0.self_attn.q_b_proj.weight"]["head_split"] == HeadSplit(2, [8])
    assert "head_split" not in by_name["layers.0.self_attn.kv_b_proj.weight"]
    assert _groups_by_name(muon_param_groups(untied, "glm5"))[
        "layers.0.self_attn.q_b_proj.weight"]["head_split"] == HeadSplit(64, [192, 64])


def test_routing_auto_needs_config_for_mla_names():
    model = TinyMLAModel()
    del model.config
    with pytest.raises(ValueError, match="head_splits"):
        muon_param_groups(model)
    with pytest.raises(ValueError, match="output_head"):
        muon_param_groups(model, None, output_head="sgd")


def _hand_step(params, grads, bufs, adam, *, lr, adamw_lr, wd, mom, rms, step, splits):
    """Expected parameters after one step, from the written-out update rules."""
    out = {}
    sched = resolve_coefficients("jordan", 5)
    for name, p in params.items():
        g = grads[name]
        if name in adam:                           # AdamW
            m, v = adam[name]
            b1, b2 = 0.9, 0.95
            m = b1 * m + (1 - b1) * g
            v = b2 * v + (1 - b2) * g * g
            adam[name] = (m, v)
            decay = wd if p.dim() >= 2 else 0.0
            denom = (v / (1 - b2 ** step)).sqrt() + 1e-8
            out[name] = p * (1 - adamw_lr * decay) - adamw_lr * (m / (1 - b1 ** step)) / denom
            continue
        bufs[name] = mom * bufs[name] + g
        u = g + mom * bufs[name]
        split = next((s for key, s in splits.items() if key in name), None)
        rows = split.block_rows if split else [u.shape[0]]
        heads = split.num_heads if split else 1
        o = torch.empty_like(u)
        for start, r in _reference.head_blocks(rows, heads):
            block = u[start:start + r]
            o[start:start + r] = (_reference.newton_schulz_reference(block, sched)
                                  * rms * math.sqrt(max(block.shape)))
        out[name] = p * (1 - lr * wd) - lr * o
    return out


def test_two_steps_by_hand():
    torch.manual_seed(0)
    model = TinyMLAModel()
    lr, adamw_lr, wd, mom, rms = 0.02, 3e-3, 0.1, 0.95, 0.2
    opt = MuonSplit(muon_param_groups(model), lr=lr, adamw_lr=adamw_lr, weight_decay=wd,
                    momentum=mom, rms_scale=rms)
    adam_names = {n for g in opt.param_groups if not g["use_muon"] for n in g["param_names"]}
    bufs = {n: torch.zeros_like(p) for n, p in model.named_parameters() if n not in adam_names}
    adam = {n: (torch.zeros_like(p), torch.zeros_like(p))
            for n, p in model.named_parameters() if n in adam_names}
    with glm_kernels.force_backend("torch"):
        for step in (1, 2):
            opt.zero_grad()
            loss_fn(model, seed=step).backward()
            params = {n: p.detach().clone() for n, p in model.named_parameters()}
            grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
            expected = _hand_step(params, grads, bufs, adam, lr=lr, adamw_lr=adamw_lr, wd=wd,
                                  mom=mom, rms=rms, step=step, splits=HEAD_SPLITS)
            opt.step()
            for name, p in model.named_parameters():
                assert_close(p.detach(), expected[name], tol=TOL32, name=f"{name} step {step}")
                assert not torch.equal(p.detach(), params[name]), name


def test_adamw_groups_match_torch_adamw():
    torch.manual_seed(1)
    a, b = torch.nn.Linear(6, 5), torch.nn.Linear(6, 5)
    b.load_state_dict(a.state_dict())
    ours = MuonSplit([{"params": a.parameters(), "use_muon": False}], lr=1e-2, weight_decay=0.1)
    ref = torch.optim.AdamW(b.parameters(), lr=1e-2, betas=(0.9, 0.95), eps=1e-8,
                            weight_decay=0.1)
    for seed in range(3):
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(seed))
        for model, opt in ((a, ours), (b, ref)):
            opt.zero_grad()
            model(x).square().sum().backward()
            opt.step()
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert_close(pa.detach(), pb.detach(), tol=TOL32, name="adamw")


def test_state_dict_round_trip(tmp_path):
    torch.manual_seed(2)

    def make():
        model = TinyMLAModel()
        return model, MuonSplit(muon_param_groups(model), lr=0.02, adamw_lr=1e-3)
    model_a, opt_a = make()
    for seed in range(2):
        opt_a.zero_grad()
        loss_fn(model_a, seed).backward()
        opt_a.step()
    path = tmp_path / "opt.pt"
    torch.save({"model": model_a.state_dict(), "opt": opt_a.state_dict()}, path)
    saved = torch.load(path, weights_only=True)           # plain data only (HeadSplit as dict)
    model_b, opt_b = make()
    model_b.load_state_dict(saved["model"])
    opt_b.load_state_dict(saved["opt"])
    assert [g.get("head_split") for g in opt_b.param_groups] == \
        [g.get("head_split") for g in opt_a.param_groups]
    for model, opt in ((model_a, opt_a), (model_b, opt_b)):
        opt.zero_grad()
        loss_fn(model, 7).backward()
        opt.step()
    for (name, pa), pb in zip(model_a.named_parameters(), model_b.parameters()):
        assert torch.equal(pa, pb), name


def test_kernel_backend_step_matches_reference(kernel_backend, monkeypatch):
    """The Triton path of one step against the same step with the reference NS emulating its
    precision (bf16 products, fp32 accumulation)."""
    torch.manual_seed(3)
    model_t, model_k = TinyMLAModel(), TinyMLAModel()
    model_k.load_state_dict(model_t.state_dict())
    start = {n: p.detach().clone() for n, p in model_t.named_parameters()}
    opt_t = MuonSplit(muon_param_groups(model_t), lr=0.02)
    loss_fn(model_k).backward()
    model_k.to(DEVICE)                       # the kernel path runs on the GPU when there is one
    opt_k = MuonSplit(muon_param_groups(model_k), lr=0.02)
    with glm_kernels.force_backend(kernel_backend):
        opt_k.step()
    model_k.cpu()
    bf16_iterations = _reference.standard_iterations
    monkeypatch.setattr(_reference, "standard_iterations",
                        lambda X, schedule: bf16_iterations(X, schedule, torch.bfloat16))
    with glm_kernels.force_backend("torch"):
        loss_fn(model_t).backward()
        opt_t.step()
    for (name, pt), pk in zip(model_t.named_parameters(), model_k.parameters()):
        assert_close(pk.detach() - start[name], pt.detach() - start[name], tol=TOL_BF16,
                     name=f"update of {name}")


def test_bad_arguments():
    model = TinyMLAModel()
    with pytest.raises(ValueError, match="mixes matrices and vectors"):
        MuonSplit(model.parameters(), lr=0.02)
    with pytest.raises(ValueError, match="use_muon=True"):
        MuonSplit([{"params": [model.norm.weight], "use_muon": True}], lr=0.02)
    with pytest.raises(ValueError, match="momentum"):
        MuonSplit(model.lm_head.parameters(), lr=0.02, momentum=1.0)
    with pytest.raises(ValueError, match="whole heads"):
        MuonSplit([{"params": [model.lm_head.weight], "head_split": HeadSplit(3, [5])}], lr=1)
    with pytest.raises(ValueError, match="coefficients"):
        MuonSplit([{"params": [model.lm_head.weight], "ns_coefficients": "foo"}], lr=1)
    with pytest.raises(ValueError, match="ns_method"):
        MuonSplit([{"params": [model.lm_head.weight], "ns_method": "svd"}], lr=1)
    with pytest.raises(TypeError, match="head_split"):
        MuonSplit([{"params": [model.lm_head.weight], "head_split": "q"}], lr=1)
    with pytest.raises(ValueError, match="ns_steps must be an int >= 1, got 0"):
        MuonSplit(model.lm_head.parameters(), lr=0.02, ns_steps=0)
    with pytest.raises(TypeError, match="ns_steps"):
        MuonSplit(model.lm_head.parameters(), lr=0.02, ns_steps="5")
    with pytest.raises(ValueError, match="param group 0 ns_steps"):
        MuonSplit([{"params": [model.lm_head.weight], "ns_steps": -1}], lr=1)


# ----------------------------------------------------------------- tensor parallel (gloo)
HEADS, ROWS, COLS = 4, (6, 2), 10


def _full_tensors():
    gen = torch.Generator().manual_seed(11)
    rows = HEADS * sum(ROWS)
    return (torch.randn(rows, COLS, generator=gen), torch.randn(rows, COLS, generator=gen),
            torch.randn(rows, COLS, generator=gen))


def _run_steps(weight, grads, split):
    param = torch.nn.Parameter(weight.clone())
    opt = MuonSplit([{"params": [param], "head_split": split}], lr=0.05)
    for g in grads:
        param.grad = g.clone()
        opt.step()
    return param.detach()


def _tp_body(rank, world, out_dir):
    with glm_kernels.force_backend("torch"):
        weight, g1, g2 = _full_tensors()
        rows = weight.shape[0] // world          # column-parallel: whole heads per rank
        shard = slice(rank * rows, (rank + 1) * rows)
        local = _run_steps(weight[shard], [g1[shard], g2[shard]], HeadSplit(HEADS, ROWS))
        gathered = [torch.empty_like(local) for _ in range(world)]
        dist.all_gather(gathered, local)
        if rank == 0:
            torch.save(torch.cat(gathered), os.path.join(out_dir, "sharded.pt"))
    return {"rows": rows}


def test_tensor_parallel_shards_equal_unsharded(tmp_path):
    run_ranks(_tp_body, 2, tmp_path, "MuonSplit TP")
    sharded = torch.load(tmp_path / "sharded.pt")
    with glm_kernels.force_backend("torch"):
        weight, g1, g2 = _full_tensors()
        full = _run_steps(weight, [g1, g2], HeadSplit(HEADS, ROWS))
    assert_close(sharded, full, tol=TOL32, name="sharded vs unsharded")
