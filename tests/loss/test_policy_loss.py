"""policy_loss: the Triton kernels (interpreter on CPU, compiled on GPU) against the readable
torch reference on every preset, both layouts, every reduction and both IcePop gate modes;
the IcePop presets against icepop_loss; hand-computed values; argument checks; Inductor.

verl's own functions are the oracle of tests/loss/test_policy_loss_verl.py.
"""
import math
import shutil
import warnings
import zlib

import pytest
import torch

import glm_kernels
from glm_kernels import POLICY_VARIANTS, PolicyLossSpec, policy_loss
from glm_kernels.loss.policy import _reference as ref_mod
from glm_kernels.loss.policy.policy import STATS_KEYS
from tests._compare import TOLERANCES, assert_close, assert_sum_close
from tests.conftest import DEVICE, skip_without_kernels, KERNEL_BACKEND

FP32 = TOLERANCES[torch.float32]
TOKEN_REDUCTIONS = ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum",
                    "seq_mean_token_sum_norm", "sum", "none"]
GEO_REDUCTIONS = ["row_mean", "sum", "none"]
PARAMS = {"dro": {"dro_beta": 0.3}, "vanilla": {"dual_clip": 3.0},
          "bypass_mode": {"dual_clip": 3.0}, "luspo": {"delta": 1.5},
          "sapo": {"tau_pos": 1.2, "tau_neg": 2.0}, "dppo_kl": {"ratio_cap": 1.5},
          "dppo_tv": {"ratio_cap": 1.5}, "trl_cispo": {"cispo_min": 0.0, "cispo_max": 1.3}}
ROW_LENGTHS = [29, 1, 0, 17, 40]         # the packed layout's rows (an empty one included)


def make_batch(seed, rows=5, length=40, *, dtype=torch.float32):
    """Padded [rows, length] log-probs with both advantage signs, an all-masked row, tokens
    far outside every clip band and log-ratios past the +-20 clamp; lp <= 0 (probabilities)."""
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(rows, length, generator=g) * 3 - 0.05
    lp = torch.clamp(old + 0.5 * torch.randn(rows, length, generator=g), max=-1e-3)
    rollout = old + 0.6 * torch.randn(rows, length, generator=g)
    adv = torch.randn(rows, length, generator=g)
    mask = torch.rand(rows, length, generator=g) > 0.25
    mask[2] = False                                  # an all-masked row
    old[0, 3], lp[0, 3] = -30.0, -5.0                # log-ratio +25 (clamped at 20)
    old[1, 4], lp[1, 4] = -5.0, -30.0                # log-ratio -25
    mask[0, 3] = mask[1, 4] = True
    weights = torch.rand(rows, length, generator=g) + 0.5
    selection = torch.rand(rows, length, generator=g) > 0.7
    return dict(lp=lp.to(dtype), old=old, adv=adv, mask=mask, rollout=rollout,
                weights=weights, selection=selection)


def pack(batch):
    """The padded batch's first ROW_LENGTHS[b] tokens of each row, concatenated, + cu_seqlens."""
    idx = torch.cat([torch.arange(b * 40, b * 40 + n) for b, n in enumerate(ROW_LENGTHS)])
    cu = torch.tensor([0] + list(torch.tensor(ROW_LENGTHS).cumsum(0).tolist()))
    return {k: v.reshape(-1)[idx] for k, v in batch.items()}, cu


def to_device(d):
    return {k: v.to(DEVICE) for k, v in d.items()}


def run(name, batch, *, reduction, gate=None, weights=False, cu_seqlens=None, per_seq_adv=False,
        spec=None, **extra):
    """(loss, grad of a weighted sum of the loss, stats) of policy_loss on ``batch``."""
    b = to_device(batch)
    lp = b["lp"].clone().requires_grad_(True)
    kwargs = dict(PARAMS.get(name, {}))
    kwargs.update(extra)
    spec = POLICY_VARIANTS[name] if spec is None else spec
    if spec.objective in ("clip_cov", "kl_cov"):
        kwargs["selection"] = b["selection"]
    if gate is not None:
        kwargs.update(gate=gate, rollout_logprobs=b["rollout"], gate_low=0.5, gate_high=2.0)
    if "seq_is" in kwargs:
        kwargs["rollout_logprobs"] = b["rollout"]
    if cu_seqlens is not None:
        kwargs["cu_seqlens"] = cu_seqlens.to(DEVICE)
        if reduction == "seq_mean_token_sum_norm":
            kwargs["norm_length"] = 40.0
    adv = b["adv"]
    if per_seq_adv:
        adv = adv[:, 0].contiguous()
    loss, stats = policy_loss(lp, b["old"], adv, b["mask"], variant=spec,
                              token_weights=b["weights"] if weights else None,
                              reduction=reduction, return_stats=True, **kwargs)
    upstream = torch.linspace(0.5, 1.5, loss.numel(), device=loss.device).reshape(loss.shape)
    (loss * upstream).sum().backward()
    return loss.detach(), lp.grad.detach(), stats


def magnitude(name, batch, reduction, **kw):
    """The reduction of |per-token terms| (|per-sequence losses| for geo_mean): what a signed
    sum's fp32 rounding error scales with."""
    spec = POLICY_VARIANTS[name]
    if spec.ratio == "sequence":
        # the same forward values with the gradient stopped at the mean: "none" is defined
        spec = PolicyLossSpec("sequence_stopgrad", spec.objective,
                              log_ratio_clamp=spec.log_ratio_clamp)
    with glm_kernels.force_backend("torch"):
        terms = run(name, batch, reduction="none", spec=spec, **kw)[0].abs()
    if reduction == "none":
        return terms
    if POLICY_VARIANTS[name].ratio == "geo_mean":
        return terms.sum()
    # every token normaliser is at least 1: the token sum bounds each reduction
    return terms.sum()


def check_against_reference(name, batch, reduction, **kw):
    with glm_kernels.force_backend("torch"):
        ref_loss, ref_grad, ref_stats = run(name, batch, reduction=reduction, **kw)
    got_loss, got_grad, got_stats = run(name, batch, reduction=reduction, **kw)
    if reduction == "none":
        assert_close(got_loss, ref_loss, tol=FP32, name=f"{name} loss")
    else:
        scale = magnitude(name, batch, reduction, **{k: v for k, v in kw.items()})
        err = (got_loss.double() - ref_loss.double()).abs().item()
        assert err <= FP32 * max(scale.item(), abs(ref_loss.item())) + 1e-7, (
            f"{name} {reduction}: {got_loss.item()} vs {ref_loss.item()}")
    assert torch.isfinite(got_grad).all()
    assert_close(got_grad, ref_grad, tol=FP32, name=f"{name} grad")
    extra = {"phi_mean"} if POLICY_VARIANTS[name].objective == "vespo" else set()
    assert set(got_stats) == set(STATS_KEYS) | extra == set(ref_stats)
    for key, value in ref_stats.items():
        assert abs(got_stats[key].item() - value.item()) <= FP32 * max(1.0, abs(value.item())), (
            f"{name} {key}: {got_stats[key].item()} vs {value.item()}")
    return ref_loss, ref_grad


def _reductions(name):
    if POLICY_VARIANTS[name].ratio == "geo_mean":
        return GEO_REDUCTIONS
    if POLICY_VARIANTS[name].ratio == "sequence":
        return TOKEN_REDUCTIONS[:-1]            # its Jacobian is not diagonal: no "none"
    return TOKEN_REDUCTIONS


CASES = [(name, gate) for name in POLICY_VARIANTS for gate in (None, "coupled", "decoupled")]


@pytest.mark.parametrize("name,gate", CASES, ids=[f"{n}-{g}" for n, g in CASES])
@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_kernel_matches_reference(kernel_backend, name, gate, layout):
    seed = zlib.crc32(repr((name, gate, layout)).encode()) % 1000
    batch = make_batch(seed)
    cu = None
    if layout == "packed":
        batch, cu = pack(batch)
    # Every reduction over the three gate modes, half of them per case (the interpreter is slow).
    offset = (None, "coupled", "decoupled").index(gate)
    for i, reduction in enumerate(_reductions(name)):
        if (i + offset) % 2 == 0 or len(_reductions(name)) <= 3:
            check_against_reference(name, batch, reduction, gate=gate, weights=i % 2 == 1,
                                    cu_seqlens=cu)


@pytest.mark.parametrize("name", ["vanilla", "gspo", "geo_mean", "grpo_sequence", "sapo"])
def test_per_sequence_advantages(any_backend, name):
    """advantages [B] equal the same values broadcast over each row."""
    batch = make_batch(7)
    batch["adv"] = batch["adv"][:, :1].expand(-1, 40).contiguous()
    reduction = POLICY_VARIANTS[name].default_reduction
    full = run(name, batch, reduction=reduction)
    per_seq = run(name, batch, reduction=reduction, per_seq_adv=True)
    assert_close(per_seq[0], full[0], tol=FP32, name="loss")
    assert_close(per_seq[1], full[1], tol=FP32, name="grad")


def test_reference_gradient_is_autograd_of_its_loss():
    """The torch backend's gradient is autograd's of the reference loss, checked in float64
    by finite differences on a sequence variant (the gradient reaches the whole row)."""
    batch = make_batch(3, rows=3, length=6)
    batch["old"][0, 3], batch["old"][1, 4] = batch["lp"][0, 3] - 0.1, batch["lp"][1, 4] + 0.1
    mask = batch["mask"]
    mask[2] = True
    rows = ref_mod.Rows(18, 3, 6, None, "cpu")

    def loss_of(lp):
        spec = POLICY_VARIANTS["grpo_sequence"]
        return ref_mod.policy_loss_reference(
            spec, lp, batch["old"].double().reshape(-1), batch["adv"].double().reshape(-1),
            mask.reshape(-1), rows, eps_low=0.2, eps_high=0.28, dual_clip=None,
            token_weights=None, rollout=None, gate=None, gate_low=0.5, gate_high=2.0,
            selection=None, reduction="seq_mean_token_mean", denominator=None,
            norm_length=None, loss_scale=1.0, params={"delta": None})[0]
    lp = batch["lp"].double().reshape(-1).requires_grad_(True)
    # the reference computes in fp32 (as the kernels): compare its gradient to finite
    # differences at fp32-level accuracy
    loss_of(lp).backward()
    eps = 1e-2
    for t in (0, 1, 7, 12):
        plus, minus = lp.detach().clone(), lp.detach().clone()
        plus[t] += eps
        minus[t] -= eps
        numeric = (loss_of(plus) - loss_of(minus)).item() / (2 * eps)
        assert abs(lp.grad[t].item() - numeric) < 1e-3 * max(1.0, abs(numeric)), t


def test_hand_computed_vanilla_and_gspo():
    lp = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    old = torch.tensor([[-1.0, -1.0, -1.0]])
    adv = torch.tensor([[1.0, -1.0, 2.0]])
    with glm_kernels.force_backend("torch"):
        loss = policy_loss(lp, old, adv, variant="vanilla", eps_low=0.2, eps_high=0.28,
                           reduction="sum")
    r = [1.0, math.exp(-1.0), math.exp(0.5)]
    # token 0: -1; token 1 (A<0, r < 0.8): max(-r * -1, -0.8 * -1) = 0.8; token 2: -1.28 * 2
    expected = -1.0 + 0.8 - 2 * 1.28
    assert abs(loss.item() - expected) < 1e-6
    loss.backward()
    assert torch.allclose(lp.grad, torch.tensor([[-r[0] * 1.0, 0.0, 0.0]]), atol=1e-6)
    lp.grad = None
    with glm_kernels.force_backend("torch"):
        loss = policy_loss(lp, old, adv, variant="gspo", reduction="token_mean")
    s = math.exp((0.0 - 1.0 + 0.5) / 3)                      # sequence ratio exp(mean)
    terms = [max(-a * s, -a * min(max(s, 0.8), 1.28)) for a in (1.0, -1.0, 2.0)]
    assert abs(loss.item() - sum(terms) / 3) < 1e-6


@pytest.mark.parametrize("mode", ["coupled", "decoupled"])
@pytest.mark.parametrize("reduction", ["token_mean", "seq_mean_token_mean", "sum", "none"])
def test_vanilla_with_gate_is_icepop(any_backend, mode, reduction):
    """The family's PPO objective with the gate equals icepop_loss (coupled: old = rollout)."""
    batch = to_device(make_batch(11))
    lp1 = batch["lp"].clone().requires_grad_(True)
    lp2 = batch["lp"].clone().requires_grad_(True)
    old = batch["rollout"] if mode == "coupled" else batch["old"]
    ice = glm_kernels.icepop_loss(lp1, batch["rollout"], batch["adv"], batch["mask"],
                                  old_logprobs=None if mode == "coupled" else old,
                                  gate_low=0.5, gate_high=2.0, reduction=reduction)
    fam = policy_loss(lp2, old, batch["adv"], batch["mask"], variant="vanilla", gate=mode,
                      rollout_logprobs=batch["rollout"], gate_low=0.5, gate_high=2.0,
                      reduction=reduction)
    if reduction == "none":
        assert_close(fam.detach(), ice.detach(), tol=FP32, name="loss")
    else:
        terms = glm_kernels.icepop_loss(batch["lp"], batch["rollout"], batch["adv"],
                                        batch["mask"],
                                        old_logprobs=None if mode == "coupled" else old,
                                        gate_low=0.5, gate_high=2.0, reduction="none")
        assert_sum_close(fam, ice, terms.abs().sum(), tol=FP32, name="loss")
    ice.sum().backward()
    fam.sum().backward()
    assert_close(lp2.grad, lp1.grad, tol=FP32, name="grad")


def test_denominator_loss_scale_and_norm_length(any_backend):
    batch = make_batch(5)
    base = run("vanilla", batch, reduction="token_mean")[0]
    tokens = batch["mask"].sum().item()
    scaled = run("vanilla", batch, reduction="token_mean", denominator=2.0 * tokens,
                 loss_scale=3.0)[0]
    assert_close(scaled, base * 1.5, tol=FP32, name="denominator x loss_scale")
    tensor_den = run("vanilla", batch, reduction="token_mean",
                     denominator=torch.tensor(2.0 * tokens))[0]
    assert_close(tensor_den, base * 0.5, tol=FP32, name="tensor denominator")
    norm = run("vanilla", batch, reduction="seq_mean_token_sum_norm", norm_length=10.0)[0]
    plain = run("vanilla", batch, reduction="seq_mean_token_sum")[0]
    assert_close(norm, plain / 10.0, tol=FP32, name="norm_length")


def test_bf16_logprobs(any_backend):
    batch = make_batch(9)
    with glm_kernels.force_backend("torch"):
        ref = run("gspo", batch, reduction="token_mean")
    batch16 = dict(batch, lp=batch["lp"].to(torch.bfloat16))
    ref16 = run("gspo", dict(batch, lp=batch16["lp"].float()), reduction="token_mean")
    got = run("gspo", batch16, reduction="token_mean")
    assert got[1].dtype == torch.bfloat16
    assert_close(got[0], ref16[0], tol=FP32, name="bf16 loss (same rounded inputs)")
    assert_close(got[1].float(), ref16[1], tol=TOLERANCES[torch.bfloat16], name="bf16 grad")
    assert_close(got[0], ref[0], tol=TOLERANCES[torch.bfloat16], name="bf16 vs fp32 loss")


def test_fully_masked_batch_gives_zero(any_backend):
    batch = make_batch(2)
    batch["mask"][:] = False
    for name in ("vanilla", "gspo", "grpo_sequence", "vespo"):
        loss, grad, stats = run(name, batch, reduction="token_mean")
        assert loss.item() == 0.0 and bool((grad == 0).all()), name
        assert stats["pg_clipfrac"].item() == 0.0 and stats["pop_frac"].item() == 0.0


@pytest.mark.parametrize("shape", [(0, 5), (3, 0), (0,)])
def test_empty_inputs(any_backend, shape):
    for name in ("vanilla", "gspo", "geo_mean", "grpo_sequence"):
        lp = torch.zeros(shape, device=DEVICE, requires_grad=True)
        zeros = torch.zeros(shape, device=DEVICE)
        loss = policy_loss(lp, zeros, zeros, variant=name,
                           reduction=POLICY_VARIANTS[name].default_reduction)
        loss.backward()
        assert loss.item() == 0.0 and lp.grad.shape == lp.shape, name


def _good():
    b = make_batch(1, rows=3, length=5)
    b = {k: v[:2] for k, v in b.items()}
    return dict(logprobs=b["lp"], old_logprobs=b["old"], advantages=b["adv"],
                loss_mask=b["mask"])


@pytest.mark.parametrize("change,error,name", [
    (dict(logprobs=[1.0]), TypeError, "logprobs"),
    (dict(logprobs=torch.zeros(2, 5, dtype=torch.float64)), TypeError, "logprobs"),
    (dict(logprobs=torch.zeros(2, 5, 1)), ValueError, "logprobs"),
    (dict(old_logprobs=torch.zeros(2, 4)), ValueError, "old_logprobs"),
    (dict(advantages=torch.zeros(3)), ValueError, "advantages"),
    (dict(loss_mask=torch.zeros(2, 4)), ValueError, "loss_mask"),
    (dict(variant="nope"), ValueError, "variant"),
    (dict(variant=3), TypeError, "variant"),
    (dict(eps_low=1.5), ValueError, "eps_low"),
    (dict(eps_high=-0.1), ValueError, "eps_high"),
    (dict(dual_clip=0.5), ValueError, "dual_clip"),
    (dict(variant="cispo", dual_clip=3.0), ValueError, "dual_clip"),
    (dict(token_weights=torch.ones(2, 4)), ValueError, "token_weights"),
    (dict(gate="both"), ValueError, "gate"),
    (dict(gate="coupled"), ValueError, "rollout_logprobs"),
    (dict(rollout_logprobs=torch.zeros(2, 5)), ValueError, "gate"),
    (dict(gate="coupled", rollout_logprobs=torch.zeros(2, 5), gate_low=3.0, gate_high=2.0),
     ValueError, "gate_low"),
    (dict(cu_seqlens=torch.tensor([0, 5])), ValueError, "cu_seqlens"),
    (dict(reduction="mean"), ValueError, "reduction"),
    (dict(reduction="row_mean"), ValueError, "reduction"),
    (dict(variant="geo_mean", reduction="token_mean"), ValueError, "reduction"),
    (dict(variant="grpo_sequence", reduction="none"), ValueError, "none"),
    (dict(reduction="sum", denominator=2.0), ValueError, "denominator"),
    (dict(denominator=-1.0), ValueError, "denominator"),
    (dict(norm_length=3.0), ValueError, "norm_length"),
    (dict(loss_scale=float("nan")), ValueError, "loss_scale"),
    (dict(selection=torch.ones(2, 5, dtype=torch.bool)), ValueError, "selection"),
    (dict(variant="clip_cov", selection=torch.ones(2, 5)), TypeError, "selection"),
    (dict(variant="dro"), ValueError, "dro_beta"),
    (dict(variant="sapo", tau_pos=0.0), ValueError, "tau_pos"),
    (dict(variant="sapo", delta=2.0), TypeError, "delta"),
    (dict(tau_pos=1.0), TypeError, "tau_pos"),
    (dict(variant="vespo", k_pos="2"), TypeError, "k_pos"),
    (dict(return_stats=1), TypeError, "return_stats"),
    (dict(return_stats="yes"), TypeError, "return_stats"),
])
def test_bad_inputs_name_the_argument(change, error, name):
    args = dict(_good(), **change)
    with pytest.raises(error, match=name):
        policy_loss(args.pop("logprobs"), args.pop("old_logprobs"), args.pop("advantages"),
                    args.pop("loss_mask"), **args)


def test_spec_checks():
    with pytest.raises(ValueError, match="ratio"):
        PolicyLossSpec(ratio="tokens")
    with pytest.raises(ValueError, match="objective"):
        PolicyLossSpec(objective="a2c")
    with pytest.raises(ValueError, match="geo_mean"):
        PolicyLossSpec(ratio="geo_mean", objective="cispo")
    with pytest.raises(ValueError, match="vespo"):
        PolicyLossSpec(ratio="token", objective="vespo")
    with pytest.raises(ValueError, match="token"):
        PolicyLossSpec(ratio="sequence", objective="dro")
    with pytest.raises(ValueError, match="log_ratio_clamp"):
        PolicyLossSpec(log_ratio_clamp=-1.0)
    spec = PolicyLossSpec("sequence_stopgrad", "sapo", seq_log_ratio_max=5.0)
    batch = make_batch(4)
    with glm_kernels.force_backend("torch"):
        a = policy_loss(batch["lp"], batch["old"], batch["adv"], batch["mask"], variant=spec)
    assert torch.isfinite(a)


HAS_CXX = any(shutil.which(n) for n in ("g++", "c++", "clang++"))
COMPILER = "inductor" if (HAS_CXX or torch.cuda.is_available()) else "aot_eager"


@pytest.mark.parametrize("backend", ["torch", KERNEL_BACKEND])
@pytest.mark.parametrize("name,reduction", [("vanilla", "token_mean"),
                                            ("geo_mean", "row_mean"),
                                            ("grpo_sequence", "seq_mean_token_sum"),
                                            ("cispo", "none")])
def test_compile_fullgraph_matches_eager(backend, name, reduction):
    """torch.compile(fullgraph=True) with Inductor (aot_eager without a C++ compiler), forward
    and backward, equal to eager; the packed layout and the gate ride along."""
    check_compiled_matches_eager(backend, name, reduction)


def check_compiled_matches_eager(backend, name, reduction, extra_kwargs=lambda batch, cu: {}):
    """Compile policy_loss (packed rows, decoupled gate, token weights, stats) and compare
    forward and backward with eager; ``extra_kwargs(batch, cu)`` adds keyword arguments."""
    if backend != "torch":
        skip_without_kernels()
    batch, cu = pack(make_batch(21))
    extra = extra_kwargs(batch, cu)
    b = to_device(batch)
    cu = cu.to(DEVICE)

    def step(lp):
        loss, stats = policy_loss(lp, b["old"], b["adv"], b["mask"], variant=name,
                                  gate="decoupled", rollout_logprobs=b["rollout"],
                                  token_weights=b["weights"], cu_seqlens=cu,
                                  reduction=reduction, return_stats=True,
                                  **PARAMS.get(name, {}), **extra)
        return loss.sum(), stats["pg_clipfrac"], stats["ppo_kl"]

    def go(fn):
        lp = b["lp"].clone().requires_grad_(True)
        outs = fn(lp)
        outs[0].backward()
        return [o.detach() for o in outs], lp.grad

    torch._dynamo.reset()
    with glm_kernels.force_backend(backend):
        eager, eager_grad = go(step)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            compiled, compiled_grad = go(torch.compile(step, fullgraph=True, backend=COMPILER))
    for a, e in zip(compiled, eager):
        assert_close(a, e, tol=FP32, name="compiled output")
    assert eager_grad.abs().sum() > 0
    assert_close(compiled_grad, eager_grad, tol=FP32, name="compiled grad")


def test_docs_policy_loss_examples_run(any_backend):
    """docs/policy_loss.md's examples print what the page says, on both backends."""
    import doctest
    import os
    path = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "policy_loss.md")
    result = doctest.testfile(path, module_relative=False,
                              optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0, result


@pytest.mark.parametrize("ratio,objective,reduction", [
    ("token", "ppo", "token_mean"), ("token", "cispo", "none"),
    ("sequence_stopgrad", "ppo", "seq_mean_token_mean"), ("geo_mean", "ppo", "none"),
    ("sequence", "sapo", "seq_mean_token_sum")])
def test_opcheck_custom_op(kernel_backend, ratio, objective, reduction):
    """The custom op's schema, fake kernel (shapes and strides), autograd registration and
    AOT dispatch, as torch.library checks them."""
    from glm_kernels.loss.policy import policy
    b = to_device(make_batch(31, rows=3, length=8))
    flat = {k: v.reshape(-1).contiguous() for k, v in b.items()}
    lp = flat["lp"].clone().requires_grad_(True)
    args = (lp, flat["old"], flat["adv"], flat["mask"], flat["weights"], flat["rollout"],
            None, None, None, ratio, objective, "decoupled", reduction,
            [20.0 if ratio != "sequence" else 0.0, float("nan"), 0.5, 2.0, 0.2, 0.28, 1.0,
             1.0, 1.0, 0.0, 0.0, 0.0],
            [1.0, 1.05, 0.0, 0.0] if objective == "sapo" else [0.7, 1.3, 0.0, 0.0],
            False, False, 3, 8, True)
    torch.library.opcheck(policy._policy_op, args,
                          test_utils=("test_schema", "test_faketensor",
                                      "test_autograd_registration"))


@pytest.mark.parametrize("weighted", [False, True])
def test_vespo_weight_is_trls_gamma_weight(any_backend, weighted):
    """The vespo preset's per-token loss is -phi A lp with phi from TRL 1.16's own
    GRPOTrainer.get_gamma_weights (sequence advantages, as TRL's trainer passes them)."""
    trl_grpo = pytest.importorskip("trl.trainer.grpo_trainer")
    batch = make_batch(41)
    batch["adv"] = batch["adv"][:, :1].expand(-1, 40).contiguous()
    is_ratio = batch["weights"] if weighted else None
    loss, _, stats = run("vespo", batch, reduction="none", weights=weighted)
    loss = loss.cpu()
    phi = trl_grpo.GRPOTrainer.get_gamma_weights(
        advantages=batch["adv"][:, :1], log_ratio_per_token=batch["lp"] - batch["old"],
        mask=batch["mask"].float(), importance_sampling_ratio=is_ratio)
    expected = torch.where(batch["mask"], -phi * batch["adv"] * batch["lp"], 0.0)
    assert phi.unique().numel() > 2            # the rows' weights differ: a real comparison
    assert_close(loss, expected, tol=FP32, name="vespo per-token loss")
    # TRL logs vespo/phi_seq_mean: the mean of phi over the rows (the empty row included)
    assert abs(stats["phi_mean"].item() - phi.mean().item()) <= FP32 * phi.mean().item()


@pytest.mark.parametrize("name", ["vanilla", "grpo_sequence", "gspo", "geo_mean", "cispo"])
def test_seq_is_kernel_matches_reference(kernel_backend, name):
    """Sequence IS composed with the gate, packed rows: kernels (the weight reduced inside the
    sequence kernel, every preset) vs the torch reference (a torch row reduction before it).
    Every preset, layout and gate mode: tests/loss/test_policy_seq_is.py."""
    batch, cu = pack(make_batch(51))
    reduction = POLICY_VARIANTS[name].default_reduction
    check_against_reference(name, batch, reduction, gate="coupled", cu_seqlens=cu,
                            weights=True, seq_is="mask", seq_is_high=3.0, seq_is_low=0.2)
    # this batch's row weights are 2e-9 .. 0.5: a bound of 0.4 truncates some, keeps others
    check_against_reference(name, batch, reduction, cu_seqlens=cu, seq_is="truncate",
                            seq_is_high=0.4)


@pytest.mark.parametrize("change,error,name", [
    (dict(seq_is="both"), ValueError, "seq_is"),
    (dict(seq_is="truncate"), ValueError, "rollout_logprobs"),
    (dict(seq_is="truncate", rollout_logprobs=torch.zeros(2, 5), seq_is_high=0.0),
     ValueError, "seq_is_high"),
    (dict(seq_is="truncate", rollout_logprobs=torch.zeros(2, 5), seq_is_low=0.5),
     ValueError, "seq_is_low"),
    (dict(seq_is_low=0.5), ValueError, "seq_is_low"),
    (dict(seq_is="mask", rollout_logprobs=torch.zeros(2, 5), seq_is_low=3.0),
     ValueError, "seq_is_low"),
    (dict(variant="vespo", seq_is="mask", rollout_logprobs=torch.zeros(2, 5)),
     ValueError, "vespo"),
])
def test_bad_seq_is_names_the_argument(change, error, name):
    args = dict(_good(), **change)
    with pytest.raises(error, match=name):
        policy_loss(args.pop("logprobs"), args.pop("old_logprobs"), args.pop("advantages"),
                    args.pop("loss_mask"), **args)


TOKEN_PRESETS = [n for n, s in POLICY_VARIANTS.items() if s.ratio == "token"]


@pytest.mark.parametrize("name", TOKEN_PRESETS)
def test_zero_factor_tokens_with_nonfinite_inputs_contribute_nothing(any_backend, name):
    """A token whose weight is 0 (token_weights == 0, or popped by the gate) adds exactly 0 to
    the loss and the gradient even with inf / NaN inputs (verl's IcePop weights zero popped
    tokens; their log-probs may be anything)."""
    batch = make_batch(61)
    zero_w = torch.zeros_like(batch["mask"])
    zero_w[0, 5:8] = zero_w[3, 1] = True
    zero_w &= batch["mask"]
    zero_w[0, 5] = zero_w[0, 6] = zero_w[0, 7] = True
    batch["mask"][0, 5:8] = True
    batch["weights"] = torch.where(zero_w, 0.0, batch["weights"])
    clean = run(name, batch, reduction="token_mean", weights=True, gate="decoupled")
    dirty = dict(batch)
    for key, value in (("lp", float("nan")), ("old", float("inf")), ("adv", float("nan"))):
        dirty[key] = batch[key].clone()
        dirty[key][0, 5 + ("lp", "old", "adv").index(key)] = value
    got = run(name, dirty, reduction="token_mean", weights=True, gate="decoupled")
    assert torch.isfinite(got[0]) and torch.isfinite(got[1]).all()
    assert_close(got[0], clean[0], tol=FP32, name="loss")
    assert bool((got[1][0, 5:8] == 0).all())
    assert_close(got[1], clean[1], tol=FP32, name="grad")


LEAN_PRESETS = [n for n, s in POLICY_VARIANTS.items()
                if s.ratio == "token" and s.objective in ("reinforce", "dro", "sapo", "cispo")]


@pytest.mark.parametrize("name", LEAN_PRESETS)
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lean_torch_path_matches_readable_reference(name, weighted, dtype):
    """The torch backend's lean path (loss + hand-written per-token gradient, one autograd
    node) equals the readable autograd reference: loss, gradient and stats, every reduction,
    with a factor-0 token holding NaN / inf inputs when weighted."""
    from glm_kernels.loss.policy import _torch as lean_mod
    from glm_kernels.loss.policy._spec import resolve_params
    batch = make_batch(zlib.crc32(name.encode()) % 1000, dtype=dtype)
    if weighted:
        batch["weights"][0, 5] = 0.0
        batch["mask"][0, 5] = True
        batch["lp"][0, 5], batch["old"][0, 5] = float("nan"), float("inf")
    spec = POLICY_VARIANTS[name]
    params = resolve_params(spec, dict(PARAMS.get(name, {})), 0.2, 0.28)
    rows = ref_mod.Rows(200, 5, 40, None, "cpu")
    assert lean_mod.lean_applies(spec, None)     # gated: tests/loss/test_policy_lean.py
    from tests.loss.test_policy_lean import _run_both     # imports this module: not at the top
    for reduction in TOKEN_REDUCTIONS:
        (ref_loss, ref_grad, ref_stats), (got_loss, got_grad, got_stats) = _run_both(
            name, batch, None, weighted, reduction, None, params, rows)
        if weighted:                                # token (0, 5): factor 0, NaN / inf inputs
            assert torch.isfinite(got_grad).all() and bool(got_grad[5] == 0)
        assert_close(got_loss, ref_loss, tol=FP32, name=f"{name} {reduction} loss")
        assert_close(got_grad, ref_grad, tol=FP32, name=f"{name} {reduction} grad")
        assert set(got_stats) == set(ref_stats)
        for key in ref_stats:
            assert_close(got_stats[key], ref_stats[key], tol=FP32, name=f"{name} {key}")
