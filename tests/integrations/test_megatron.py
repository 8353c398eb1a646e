"""MuonSplit inside Megatron-core (glm_kernels.integrations.megatron), against Megatron's code.

Runs where megatron-core 0.19.2 and emerging-optimizers are installed (Python >= 3.12:
``make test-megatron`` builds that venv); skipped elsewhere, naming what is missing.

CPU test harness (never the library): Megatron 0.19.2 creates a few bookkeeping tensors on
CUDA unconditionally -- ``FP32Optimizer._scale``, the grad-norm buffer of
``local_multi_tensor_l2_norm``, the layer-wise optimizer's flags, ``RotaryEmbedding``'s
``inv_freq`` -- so :func:`cpu_bookkeeping` gives those modules a ``torch`` whose
``device="cuda"`` / ``torch.cuda.current_device()`` mean the CPU. Gradient clipping asserts
``torch.cuda.FloatTensor`` grads, so configs here set ``clip_grad=0``. The local spec's
``DotProductAttention`` does not take MLA's ``k_channels`` in 0.19.2, so MLA models get a
parameter-free stand-in for core attention: these tests never run a forward pass, they set
seeded gradients (full tensors, sliced per tensor-parallel rank) and compare optimizer steps.
"""
import contextlib
import importlib
import io
import math
import os
import re
import types
import zlib
from datetime import timedelta

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed (make test-megatron)")
pytest.importorskip("emerging_optimizers",
                    reason="emerging-optimizers is not installed (make test-megatron)")

import torch.distributed as dist  # noqa: E402

from glm_kernels.integrations import megatron as plug  # noqa: E402
from glm_kernels.muon import newton_schulz  # noqa: E402

TOL = 1e-5                                     # docs/design.md 4, fp32
LR, WD = 0.02, 0.1

# ---------------------------------------------------------------------------- harness
_CUDA_BOOKKEEPING_MODULES = (
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.layer_wise_optimizer",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.utils",
    "megatron.core.models.common.embeddings.rotary_pos_embedding",
)


class _CpuTorch(types.ModuleType):
    """``torch`` as those modules see it: device="cuda" and current_device() are the CPU."""

    def __init__(self):
        super().__init__("torch")
        cuda = types.SimpleNamespace(**{k: getattr(torch.cuda, k) for k in dir(torch.cuda)
                                        if not k.startswith("__")})
        cuda.current_device = lambda: "cpu"
        self.cuda = cuda
        for factory in ("tensor", "zeros", "empty", "ones", "full"):
            setattr(self, factory, self._on_cpu(getattr(torch, factory)))

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def _on_cpu(factory):
        def make(*args, **kwargs):
            if "cuda" in str(kwargs.get("device", "")):
                kwargs["device"] = "cpu"
            return factory(*args, **kwargs)
        return make


@contextlib.contextmanager
def cpu_bookkeeping():
    modules = [importlib.import_module(name) for name in _CUDA_BOOKKEEPING_MODULES]
    saved = [m.torch for m in modules]
    for m in modules:
        m.torch = _CpuTorch()
    try:
        yield
    finally:
        for m, original in zip(modules, saved):
            m.torch = original


@contextlib.contextmanager
def megatron_world(tp: int = 1):
    """Megatron's process groups over the gloo world that is already up (tp x dp)."""
    from megatron.core import parallel_state
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    try:
        with cpu_bookkeeping():
            yield
    finally:
        parallel_state.destroy_model_parallel()


@pytest.fixture(scope="module")
def single_process(tmp_path_factory):
    """A one-rank gloo world (Megatron's optimizers read its groups) for this module."""
    if dist.is_initialized():
        pytest.skip("a torch.distributed world is already up in this process")
    path = tmp_path_factory.mktemp("megatron") / "rendezvous"
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=0, world_size=1,
                            timeout=timedelta(seconds=120))
    try:
        with megatron_world(tp=1):
            yield
    finally:
        dist.destroy_process_group()


class _NoCoreAttention(torch.nn.Module):
    """Parameter-free stand-in for MLA's core attention (see the module docstring)."""

    def __init__(self, *args, **kwargs):
        super().__init__()


def gqa_model(**overrides):
    """2 layers, hidden 32, 4 heads in 2 query groups of kv_channels 8, RoPE."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig
    options = dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                   kv_channels=8, ffn_hidden_size=48, use_cpu_initialization=True)
    options.update(overrides)
    return GPTModel(config=TransformerConfig(**options),
                    transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=52,
                    max_sequence_length=16, position_embedding_type="rope")


def mla_model(**overrides):
    """1 layer, hidden 32, 4 heads; q_lora 16, kv_lora 12, nope 8, rope 4, v 6."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import MLATransformerConfig
    options = dict(num_layers=1, hidden_size=32, num_attention_heads=4, q_lora_rank=16,
                   kv_lora_rank=12, qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=6,
                   ffn_hidden_size=48, use_cpu_initialization=True,
                   multi_latent_attention=True, rope_type="rope")
    options.update(overrides)
    spec = get_gpt_layer_local_spec(multi_latent_attention=True)
    spec.submodules.self_attention.submodules.core_attention = _NoCoreAttention
    return GPTModel(config=MLATransformerConfig(**options), transformer_layer_spec=spec,
                    vocab_size=52, max_sequence_length=16, position_embedding_type="rope")


def _tp():
    from megatron.core import parallel_state
    return (parallel_state.get_tensor_model_parallel_rank(),
            parallel_state.get_tensor_model_parallel_world_size())


def seeded_full(name: str, p: torch.Tensor, seed: int) -> torch.Tensor:
    """The full (unsharded) tensor of parameter ``name`` for ``seed``, the same in every
    process and at every tensor-parallel size."""
    rank, world = _tp()
    shape = list(p.shape)
    dim = getattr(p, "partition_dim", -1) if getattr(p, "tensor_model_parallel", False) else -1
    if dim in (0, 1):
        shape[dim] *= world
    gen = torch.Generator().manual_seed(zlib.crc32(f"{name}:{seed}".encode()))
    return torch.randn(shape, generator=gen, dtype=torch.float32)


def local_part(name: str, p: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """This tensor-parallel rank's part of a full tensor (Megatron's contiguous shards)."""
    rank, world = _tp()
    dim = getattr(p, "partition_dim", -1) if getattr(p, "tensor_model_parallel", False) else -1
    if dim not in (0, 1) or world == 1:
        return full
    return full.chunk(world, dim=dim)[rank]


def set_weights(model, seed: int = 0) -> None:
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(local_part(name, p, seeded_full(name, p, seed) * 0.1))


def set_grads(model, seed: int) -> None:
    for name, p in model.named_parameters():
        p.grad = local_part(name, p, seeded_full(name, p, 1000 + seed)).to(p.dtype)


def build(model, **options):
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    config = dict(optimizer="muon_split", lr=LR, weight_decay=WD, clip_grad=0.0,
                  muon_fp32_matmul_prec="highest")
    config.update(options)
    if config["optimizer"] == "muon_split":
        plug.register()
    return get_megatron_optimizer(OptimizerConfig(**config), [model])


def run_steps(model, optimizer, steps: int, first_seed: int = 0) -> dict:
    for k in range(steps):
        set_grads(model, first_seed + k)
        ok, _, _ = optimizer.step()
        assert ok, "Megatron's optimizer reported a failed step"
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def inner_optimizers(optimizer):
    return [o.optimizer for o in getattr(optimizer, "chained_optimizers", [optimizer])]


def routing(model, optimizer) -> dict:
    names = {id(p): n for n, p in model.named_parameters()}
    return {type(o).__name__: sorted(names[id(p)] for g in o.param_groups for p in g["params"])
            for o in inner_optimizers(optimizer)}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


# ---------------------------------------------------------------------------- oracle
def expected_muon_update(w0, grad, blocks, *, scale=lambda r, c: math.sqrt(max(r, c)),
                         extra=1.0):
    """One first step of Muon (zero momentum: the nesterov update of the first step is
    (1 + mu) g, the plain one g; NS normalizes either) on every row block of ``grad``,
    each orthogonalized on its own with the library's single-matrix newton_schulz."""
    out = w0 * (1 - LR * WD)
    start = 0
    for rows in blocks:
        block = grad[start:start + rows]
        o = newton_schulz(block.double(), 5, coefficients=plug.coefficient_schedule(
            "quintic", 5)).float()
        out[start:start + rows] -= LR * extra * scale(rows, grad.shape[1]) * o
        start += rows
    return out


# ---------------------------------------------------------------------------- tests
def test_register_is_idempotent_and_refuses_a_taken_name(single_process):
    first = plug.register()
    assert plug.register() is first
    with pytest.raises(ValueError, match="already TensorParallelMuon"):
        plug.register("muon")
    for bad in ("", "adam", "dist_muon", 3):
        with pytest.raises(ValueError, match="name="):
            plug.register(bad)


def test_routing_is_megatrons_muon_routing(single_process):
    model = gqa_model()
    ours = routing(model, build(model))
    theirs = routing(model, build(model, optimizer="muon"))
    assert ours["MegatronMuonSplit"] == theirs["TensorParallelMuon"]
    assert ours["AdamW"] == theirs["AdamW"]
    assert "output_layer.weight" in ours["AdamW"]
    assert "embedding.word_embeddings.weight" in ours["AdamW"]
    assert all(n.endswith(".weight") for n in ours["MegatronMuonSplit"])
    assert len(ours["MegatronMuonSplit"]) == 8              # qkv, proj, fc1, fc2 per layer


def test_megatron_wrappers_and_scheduler_reach_every_group(single_process):
    from megatron.core.optimizer.optimizer import ChainedOptimizer, FP32Optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    model = gqa_model()
    optimizer = build(model)
    assert isinstance(optimizer, ChainedOptimizer)
    assert all(isinstance(o, FP32Optimizer) for o in optimizer.chained_optimizers)
    ours = next(o for o in inner_optimizers(optimizer) if isinstance(o, plug.MegatronMuonSplit))
    assert len(ours.param_groups) == 1                      # Megatron's group, as it was
    qkv = [p for n, p in model.named_parameters() if n.endswith("linear_qkv.weight")]
    assert sorted(ours.head_splits) == sorted(id(p) for p in qkv)
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=LR, min_lr=LR / 10, lr_warmup_steps=2,
        lr_decay_steps=10, lr_decay_style="cosine", start_wd=WD / 2, end_wd=WD,
        wd_incr_steps=10, wd_incr_style="linear")
    scheduler.step(1)
    for group in ours.param_groups:
        assert group["lr"] == pytest.approx(LR / 2)
        assert group["weight_decay"] == pytest.approx(WD * 0.55)


def one_step(make_model, **options):
    """(weights before, weights after, gradients) of one step from the seeded weights."""
    model = make_model()
    set_weights(model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    after = run_steps(model, build(model, **options), 1)
    set_grads(model, 0)
    return before, after, {n: p.grad for n, p in model.named_parameters()}


def test_gqa_linear_qkv_is_orthogonalized_per_head(single_process):
    w0, after, grads = one_step(gqa_model)
    # query group = 2 heads' Q (8 rows each), then K (8), then V (8); 2 groups
    qkv = "decoder.layers.0.self_attention.linear_qkv.weight"
    want = expected_muon_update(w0[qkv], grads[qkv], [8] * 8)
    assert rel_err(after[qkv], want) < TOL
    fc1 = "decoder.layers.1.mlp.linear_fc1.weight"
    assert rel_err(after[fc1], expected_muon_update(w0[fc1], grads[fc1], [48])) < TOL
    # ... which is not Megatron's per-Q/K/V split: Q of both groups as one matrix, etc.
    _, megatron_split, _ = one_step(gqa_model, optimizer="muon", muon_split_qkv=True)
    assert rel_err(after[qkv] - w0[qkv], megatron_split[qkv] - w0[qkv]) > 0.05


def test_gqa_attention_output_gate_splits_each_heads_gate(single_process):
    qkv = "decoder.layers.0.self_attention.linear_qkv.weight"
    w0, after, grads = one_step(lambda: gqa_model(attention_output_gate=True))
    assert w0[qkv].shape[0] == 2 * (2 * 8 * 2 + 8 + 8)
    assert rel_err(after[qkv], expected_muon_update(w0[qkv], grads[qkv], [8] * 12)) < TOL


def test_mla_up_projections_are_orthogonalized_per_head(single_process):
    w0, after, grads = one_step(mla_model)
    prefix = "decoder.layers.0.self_attention."
    q_up, kv_up = prefix + "linear_q_up_proj.weight", prefix + "linear_kv_up_proj.weight"
    assert rel_err(after[q_up], expected_muon_update(w0[q_up], grads[q_up], [8, 4] * 4)) < TOL
    assert rel_err(after[kv_up],
                   expected_muon_update(w0[kv_up], grads[kv_up], [8, 6] * 4)) < TOL
    down = prefix + "linear_kv_down_proj.weight"            # [kv_lora + rope, hidden]: whole
    assert rel_err(after[down], expected_muon_update(w0[down], grads[down], [16])) < TOL
    # Megatron's own Muon leaves MLA's up-projections whole
    _, theirs, _ = one_step(mla_model, optimizer="muon")
    assert rel_err(theirs[q_up], expected_muon_update(w0[q_up], grads[q_up], [48])) < TOL


CONFIGS = [
    dict(),                                                      # Megatron's defaults
    dict(muon_nesterov=True, muon_coefficient_type="simple", muon_momentum=0.9),
    dict(muon_coefficient_type="polar_express", muon_num_ns_steps=6,
         muon_scale_mode="shape_scaling", muon_extra_scale_factor=0.3),
    dict(muon_coefficient_type="cans", muon_scale_mode="unit_rms_norm"),
    dict(decoupled_weight_decay=False, muon_nesterov=True),
]


@pytest.mark.parametrize("options", CONFIGS, ids=lambda o: ",".join(o) or "defaults")
@pytest.mark.parametrize("make_model", [gqa_model, mla_model], ids=["gqa", "mla"])
def test_split_qkv_false_equals_megatrons_muon(single_process, make_model, options):
    """Three steps of every parameter (Muon and Adam groups) against TensorParallelMuon."""
    results = []
    for name in ("muon", "muon_split"):
        model = make_model()
        set_weights(model)
        results.append(run_steps(model, build(model, optimizer=name, muon_split_qkv=False,
                                              **options), 3))
    theirs, ours = results
    for n in theirs:
        assert rel_err(ours[n], theirs[n]) < TOL, n


def test_matmul_precision_medium_is_bf16_operands(single_process):
    model = gqa_model()
    optimizer = build(model, muon_fp32_matmul_prec="medium")
    ours = next(o for o in inner_optimizers(optimizer) if isinstance(o, plug.MegatronMuonSplit))
    assert ours.ns_config.operand_dtype is None           # the library's bf16 default
    optimizer = build(gqa_model(), muon_fp32_matmul_prec="high")
    ours = next(o for o in inner_optimizers(optimizer) if isinstance(o, plug.MegatronMuonSplit))
    assert ours.ns_config.operand_dtype == torch.float32


@pytest.mark.parametrize("options, error, match", [
    (dict(muon_coefficient_type="custom"), ValueError, "muon_coefficient_type='custom'"),
    (dict(muon_coefficient_type="quartic"), ValueError, "muon_coefficient_type='quartic'"),
    (dict(muon_scale_mode="rms"), ValueError, "muon_scale_mode='rms'"),
    (dict(muon_tp_mode="ring"), ValueError, "muon_tp_mode='ring'"),
    (dict(muon_fp32_matmul_prec="low"), ValueError, "muon_fp32_matmul_prec='low'"),
    (dict(muon_num_ns_steps=0), ValueError, "muon_num_ns_steps"),
    (dict(muon_split_qkv=1), TypeError, "muon_split_qkv"),
    (dict(muon_nesterov="yes"), TypeError, "muon_nesterov"),
    (dict(muon_momentum=1.0), ValueError, "muon_momentum"),
    (dict(muon_extra_scale_factor=float("nan")), ValueError, "muon_extra_scale_factor"),
    (dict(muon_extra_scale_factor="1"), TypeError, "muon_extra_scale_factor"),
    (dict(muon_scalar_optimizer="lion"), ValueError, "muon_scalar_optimizer"),
])
def test_bad_config_is_refused_naming_the_option(single_process, options, error, match):
    with pytest.raises(error, match=match):
        build(gqa_model(), **options)


def test_checkpoint_resumes_bit_for_bit(single_process):
    """state_dict() through Megatron's ChainedOptimizer / FP32Optimizer, saved with
    torch.save(weights_only load), loaded into a fresh model and optimizer: the next steps
    are bitwise those of the run that never stopped."""
    model = mla_model()
    set_weights(model)
    optimizer = build(model, muon_nesterov=True)
    run_steps(model, optimizer, 2)
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, buffer)
    straight = run_steps(model, optimizer, 2, first_seed=2)

    resumed_model = mla_model()
    buffer.seek(0)
    checkpoint = torch.load(buffer, weights_only=True)
    resumed_model.load_state_dict(checkpoint["model"])
    resumed = build(resumed_model, muon_nesterov=True)
    resumed.load_state_dict(checkpoint["optimizer"])
    again = run_steps(resumed_model, resumed, 2, first_seed=2)
    for n in straight:
        assert torch.equal(again[n], straight[n]), n


def test_distributed_checkpoint_state_initialisation(single_process):
    """Megatron's sharded_state_dict(is_loading=True) -- the distributed checkpoint's load
    path -- initialises the state through the entry's init_state_fn before any step: every
    Muon parameter gets a zero momentum buffer of its own shape."""
    model = gqa_model()
    optimizer = build(model)
    ours = next(o for o in inner_optimizers(optimizer) if isinstance(o, plug.MegatronMuonSplit))
    assert len(ours.state) == 0
    optimizer.sharded_state_dict(model.sharded_state_dict(), is_loading=True)
    params = [p for g in ours.param_groups for p in g["params"]]
    assert len(params) == 8 and all(
        torch.equal(ours.state[p]["momentum_buffer"], torch.zeros_like(p)) for p in params)


def test_import_without_megatron_names_what_to_install(monkeypatch):
    import builtins
    real_import = builtins.__import__

    def no_megatron(name, *args, **kwargs):
        if name.startswith("megatron"):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)
    monkeypatch.setattr(builtins, "__import__", no_megatron)
    with pytest.raises(ImportError, match="megatron-core==0.19.2"):
        plug.register()



def test_docs_example_runs_and_prints_what_it_says(single_process, capsys):
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with open(os.path.join(root, "docs", "megatron.md")) as f:
        text = f.read()
    block = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    printed = re.search(r"prints\n\n```text\n(.*?)```", text, re.S).group(1)
    exec(compile(block, "docs/megatron.md", "exec"), {"__name__": "docs_megatron"})
    assert capsys.readouterr().out == printed
