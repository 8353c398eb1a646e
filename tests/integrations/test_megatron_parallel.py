"""MuonSplit in Megatron-core across processes: tensor parallel 2 vs 1, layer-wise data
parallel 2 vs one process (gloo, CPU; the harness of test_megatron.py).

Every rank builds the same tiny GQA / MLA GPTModel from seeded full tensors (its tensor-
parallel part of them), takes seeded gradients the same way, and steps; the reference is the
same model at TP = 1 built in the same rank, so the comparison is on identical inputs.

Layer-wise distributed optimizer: Megatron 0.19.2's ``LayerWiseDistributedOptimizer`` shards
whole parameters over the data-parallel ranks (``shard_params``, run by
``get_megatron_optimizer`` here as in training), steps each rank's share and re-assembles the
parameters with an all-gather of unequal sizes. Its own ``step()`` cannot run here: gloo has
no all-gather of unequal sizes, and with fp32 parameters it chains the raw torch optimizers,
which lack the wrapper API its ``step`` calls (``prepare_grads``; only bf16 wraps them, in
``Float16OptimizerWithFloat16Params``, which needs CUDA tensors) -- Megatron's own Muon fails
the same way. So the test drives it: Megatron's sharding as built, each chained optimizer's
``step()`` on this rank's share, then Megatron's ``broadcast_params`` (each parameter from the
rank that stepped it). bf16 and the real all-gather are in ``benchmarks/gpu_check.py``.
"""
import torch

from tests._gloo import run_ranks
from tests.integrations.test_megatron import (TOL, build, expected_muon_update, gqa_model,
                                              local_part, megatron_world, mla_model, rel_err,
                                              run_steps, set_grads, set_weights)

MODELS = {"gqa": gqa_model, "mla": mla_model}
# (model, OptimizerConfig options): every sharded matrix gathered (duplicated / distributed)
WHOLE_CASES = [
    ("gqa", dict(muon_tp_mode="duplicated")),
    ("gqa", dict(muon_tp_mode="distributed", muon_split_qkv=False, muon_nesterov=True)),
    ("mla", dict(muon_tp_mode="distributed")),
    ("mla", dict(muon_tp_mode="duplicated", muon_coefficient_type="polar_express")),
]


def _compare(model, reference, verdicts, key, skip=()):
    for name, p in model.named_parameters():
        if name in skip:
            continue
        want = local_part(name, p, reference[name])
        verdicts[f"{key}|{name}"] = {"rel": rel_err(p.detach(), want),
                                     "exact": bool(torch.equal(p.detach(), want))}


def _tp_body(rank, world, out_dir):
    verdicts = {}
    for model_name, options in WHOLE_CASES:
        make = MODELS[model_name]
        key = f"{model_name}:{options}"
        with megatron_world(tp=1):
            reference = make()
            set_weights(reference)
            want = run_steps(reference, build(reference, **options), 2)
        with megatron_world(tp=2):
            model = make()
            set_weights(model)
            run_steps(model, build(model, **options), 2)
            _compare(model, want, verdicts, key)
    # blockwise (Megatron's default): head splits still equal TP = 1; every other sharded
    # matrix is orthogonalized as its own matrix, checked against the single-matrix oracle
    for model_name, make in MODELS.items():
        key = f"{model_name}:blockwise"
        with megatron_world(tp=1):
            reference = make()
            set_weights(reference)
            want = run_steps(reference, build(reference), 1)
        with megatron_world(tp=2):
            model = make()
            set_weights(model)
            w0 = {n: p.detach().clone() for n, p in model.named_parameters()}
            optimizer = build(model)
            run_steps(model, optimizer, 1)
            set_grads(model, 0)
            ours = next(o.optimizer for o in optimizer.chained_optimizers
                        if hasattr(o.optimizer, "tp_mode"))
            split = set(ours.head_splits)
            whole = {n for n, p in model.named_parameters() if id(p) not in split
                     and any(p is q for g in ours.param_groups for q in g["params"])
                     and getattr(p, "partition_dim", -1) in (0, 1)}
            _compare(model, want, verdicts, key, skip=whole)
            for n, p in model.named_parameters():
                if n in whole:
                    oracle = expected_muon_update(w0[n], p.grad, [p.shape[0]])
                    verdicts[f"{key}|shard|{n}"] = {"rel": rel_err(p.detach(), oracle),
                                                    "exact": False}
            verdicts[f"{key}|counts"] = {"split": len(split), "whole_sharded": len(whole)}
    return verdicts


def test_tensor_parallel_2_equals_1(tmp_path):
    per_rank = run_ranks(_tp_body, 2, tmp_path, "megatron TP=2")
    for verdicts in per_rank:
        counts = {k: v for k, v in verdicts.items() if k.endswith("|counts")}
        assert counts and all(c["split"] >= 1 and c["whole_sharded"] >= 2
                              for c in counts.values()), counts
        bad = {k: v for k, v in verdicts.items()
               if not k.endswith("|counts") and not v["rel"] < TOL}
        assert not bad, bad
        # gathered matrices and local heads: bitwise what one process computes (CPU, fp32)
        inexact = [k for k, v in verdicts.items() if "|shard|" not in k
                   and not k.endswith("|counts") and not v["exact"]]
        assert not inexact, inexact[:5]


def _layer_wise_body(rank, world, out_dir):
    from megatron.core.optimizer.layer_wise_optimizer import LayerWiseDistributedOptimizer
    verdicts = {}
    for model_name, make in MODELS.items():
        with megatron_world(tp=1):                    # data parallel 2
            reference = make()
            set_weights(reference)
            want = run_steps(reference, build(reference, muon_nesterov=True), 3)
            model = make()
            set_weights(model)
            optimizer = build(model, muon_nesterov=True,
                              use_layer_wise_distributed_optimizer=True)
            layer_wise = [o for o in [optimizer, *getattr(optimizer, "chained_optimizers", [])]
                          if isinstance(o, LayerWiseDistributedOptimizer)]
            assert len(layer_wise) == 1, type(optimizer)
            layer_wise = layer_wise[0]
            owned = sum(len(g["params"]) for o in layer_wise.chained_optimizers
                        for g in o.param_groups)
            for step in range(3):                     # its step, driven (see the docstring)
                set_grads(model, step)
                for base in layer_wise.chained_optimizers:
                    base.step()
                layer_wise.broadcast_params()
            _compare(model, want, verdicts, model_name)
            verdicts[f"{model_name}|owned"] = {"rel": 0.0, "exact": True, "count": owned,
                                              "total": sum(1 for _ in model.parameters())}
    return verdicts


def test_layer_wise_data_parallel_2_equals_one_process(tmp_path):
    per_rank = run_ranks(_layer_wise_body, 2, tmp_path, "megatron layer-wise DP=2")
    for model_name in MODELS:
        owned = [v[f"{model_name}|owned"]["count"] for v in per_rank]
        total = per_rank[0][f"{model_name}|owned"]["total"]
        assert all(0 < n < total for n in owned), owned      # really sharded
    for verdicts in per_rank:
        bad = {k: v for k, v in verdicts.items() if not v["exact"]}
        assert not bad, {k: v["rel"] for k, v in bad.items()}

