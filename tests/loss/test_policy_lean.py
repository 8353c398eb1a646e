"""The lean torch path (``loss/policy/_torch.py``) against the readable reference for the
objectives ``test_policy_loss.test_lean_torch_path_matches_readable_reference`` does not
cover: DPPO (that check, plus a batch where DPPO's band and truncation both bind) and PPO
with / without the dual clip, Clip-Cov and KL-Cov with their selection (loss, gradient,
stats, every reduction, fp32 and bf16, a factor-0 token holding NaN / inf inputs)."""
import zlib

import pytest
import torch

from glm_kernels.loss.policy import _torch as lean_mod
from glm_kernels.loss.policy import _reference as ref_mod
from glm_kernels.loss.policy._spec import POLICY_VARIANTS, PolicyLossSpec, resolve_params
from tests._compare import TOLERANCES, assert_close
from tests.loss import test_policy_loss as policy_tests  # a module: not re-collected

DPPO = [name for name, spec in POLICY_VARIANTS.items()
        if spec.ratio == "token" and spec.objective in ("dppo_tv", "dppo_kl")]


def test_dppo_presets_exist_and_take_the_lean_path():
    assert sorted(DPPO) == ["dppo_kl", "dppo_tv"]
    for name in DPPO:
        assert lean_mod.lean_applies(POLICY_VARIANTS[name], None)


@pytest.mark.parametrize("name", DPPO)
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dppo_lean_matches_readable_reference(name, weighted, dtype):
    policy_tests.test_lean_torch_path_matches_readable_reference(name, weighted, dtype)


@pytest.mark.parametrize("name", DPPO)
def test_dppo_band_and_truncation_bind(name):
    """Both DPPO masks are active on a batch with wide log-ratios: tokens outside the band
    (pg_clipfrac) and inside it with a truncated ratio (pg_clipfrac_lower)."""
    import glm_kernels
    g = torch.Generator().manual_seed(3)
    old = -torch.rand(6, 50, generator=g) * 2 - 0.05
    lp = old + 1.2 * torch.randn(6, 50, generator=g)
    adv = torch.randn(6, 50, generator=g)
    mask = torch.rand(6, 50, generator=g) > 0.2
    with glm_kernels.force_backend("torch"):
        x = lp.clone().requires_grad_(True)
        loss, stats = glm_kernels.policy_loss(x, old, adv, mask, variant=name, ratio_cap=1.5,
                                              return_stats=True)
        loss.backward()
    grad = x.grad
    assert stats["pg_clipfrac"] > 0.05 and stats["pg_clipfrac_lower"] > 0.01
    assert (grad[mask] == 0).any() and (grad[mask] != 0).any()


# (preset, dual clip): the PPO presets with and without verl's clip_ratio_c, the selections.
PPO_CASES = [("vanilla", 3.0), ("vanilla", None), ("bypass_mode", 1.5), ("clip_cov", None),
             ("kl_cov", None), ("gspo", None), ("gspo", 3.0)]


def _run_both(name, batch, dual, weighted, reduction, selection, params, rows=None,
              gate=None):
    """(loss, grad, stats) of the reference and of the lean path on the same flat inputs
    (``rows``: padded [5, 40] unless given; ``gate``: IcePop's, bounds [0.5, 2])."""
    spec = POLICY_VARIANTS[name]
    rows = ref_mod.Rows(200, 5, 40, None, "cpu") if rows is None else rows
    outs = []
    for fn in (ref_mod.policy_loss_reference, lean_mod.lean_policy_loss):
        lp = batch["lp"].reshape(-1).clone().requires_grad_(True)
        extra = dict(dual_clip=dual, selection=selection, gate=gate, gate_low=0.5,
                     gate_high=2.0, rollout=None if gate is None else batch["rollout"].reshape(-1))
        loss, stats = fn(spec, lp, batch["old"].reshape(-1), batch["adv"].reshape(-1),
                         batch["mask"].reshape(-1), rows, eps_low=0.2, eps_high=0.28,
                         token_weights=batch["weights"].reshape(-1) if weighted else None,
                         reduction=reduction, denominator=None,
                         norm_length=40.0 if reduction == "seq_mean_token_sum_norm" else None,
                         loss_scale=0.5, params=params, need_stats=True, **extra)
        upstream = torch.linspace(0.5, 1.5, loss.numel()).reshape(loss.shape)
        (loss * upstream).sum().backward()
        outs.append((loss.detach(), lp.grad.float(), stats))
    return outs


@pytest.mark.parametrize("name,dual", PPO_CASES)
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("extreme", [True, False])
def test_ppo_family_lean_matches_readable_reference(name, dual, weighted, dtype, extreme):
    """PPO-clip (dual clip or not), Clip-Cov, KL-Cov: lean path == reference, every reduction;
    the batch has both advantage signs, an all-masked row, ratios past the clip band and the
    dual clip's cap, and (weighted) a weight-0 token with NaN / inf log-probs that must get
    exactly 0. ``extreme``: two log-ratios of +-25 (past the +-20 clamp; Clip-Cov / KL-Cov
    have none, and their e^25 terms would dominate a norm-relative comparison, so the batch
    without them checks every other token at the same tolerance)."""
    batch = policy_tests.make_batch(zlib.crc32(name.encode()) % 1000, dtype=dtype)
    if not extreme:
        batch["old"][0, 3] = batch["lp"][0, 3].float() - 2.5
        batch["old"][1, 4] = batch["lp"][1, 4].float() + 2.5
    batch["lp"][3, :10] = batch["old"][3, :10] + 1.5          # r = e^1.5 > both dual clips
    batch["adv"][3, :10] = -1.0
    if weighted:
        batch["weights"][0, 5] = 0.0
        batch["mask"][0, 5] = True
        if name != "gspo":   # GSPO: a NaN log-prob makes its whole row's ratio NaN, in both
            batch["lp"][0, 5], batch["old"][0, 5] = float("nan"), float("inf")
    if name == "gspo" and extreme:   # a row whose mean log-ratio passes GSPO's cap of 10
        batch["lp"][4] = batch["old"][4] + 12.0
    spec = POLICY_VARIANTS[name]
    params = resolve_params(spec, {"ppo_kl_coef": 0.7} if name == "kl_cov" else {}, 0.2, 0.28)
    assert lean_mod.lean_applies(spec, None, params)
    selection = batch["selection"].reshape(-1) if name in ("clip_cov", "kl_cov") else None
    tol = TOLERANCES[torch.float32]   # both paths compute in fp32 from the same bf16 inputs
    for reduction in policy_tests.TOKEN_REDUCTIONS:
        (ref_loss, ref_grad, ref_stats), (got_loss, got_grad, got_stats) = _run_both(
            name, batch, dual, weighted, reduction, selection, params)
        if weighted:
            assert torch.isfinite(got_grad).all() and bool(got_grad[5] == 0)
            assert bool(ref_grad[5] == 0)
        assert_close(got_loss, ref_loss, tol=tol, name=f"{name} {reduction} loss")
        assert_close(got_grad, ref_grad, tol=tol, name=f"{name} {reduction} grad")
        # the zeros too: the same tokens, and +0.0 (printed 0.0) where the reference's clamp
        # gives +0.0 on a masked token (off the mask the reference's zeros carry -A's sign)
        zeros = ref_grad == 0
        assert torch.equal(got_grad == 0, zeros), f"{name} {reduction}: zero pattern"
        masked_zeros = zeros & batch["mask"].reshape(-1)
        assert bool(masked_zeros.any()) or name == "kl_cov"
        assert not bool((got_grad[zeros]).signbit().any()), f"{name} {reduction}: -0.0"
        if name not in ("clip_cov", "kl_cov"):   # (a where() off the selection: -A's sign)
            assert not bool(ref_grad[masked_zeros].signbit().any())
        assert set(got_stats) == set(ref_stats)
        for key in ref_stats:
            assert_close(got_stats[key], ref_stats[key], tol=tol, name=f"{name} {key}")
    if name == "vanilla" and dual is not None:     # the batch reaches every PPO branch
        assert got_stats["pg_clipfrac"] > 0 and got_stats["pg_clipfrac_lower"] > 0
    if name == "clip_cov":
        assert got_stats["pg_clipfrac"] > 0
    if name == "gspo" and extreme and not weighted:   # the cap's zero gradient was reached
        assert bool((got_grad.reshape(5, 40)[4] == 0).all())


def test_lean_applies_only_without_delta():
    """TRL's delta (the ratio capped before the clip) and the sequence ratios other than
    GSPO's stop-gradient one keep the reference; the IcePop gate does not."""
    vanilla = POLICY_VARIANTS["vanilla"]
    assert lean_mod.lean_applies(vanilla, None, {"delta": None})
    assert not lean_mod.lean_applies(vanilla, None, {"delta": 1.5})
    assert not lean_mod.lean_applies(vanilla, "decoupled", {"delta": 1.5})
    assert lean_mod.lean_applies(vanilla, "decoupled", {"delta": None})
    assert lean_mod.lean_applies(POLICY_VARIANTS["gspo"], None, {"delta": None})
    for name in ("grpo_sequence", "luspo", "geo_mean", "vespo"):
        assert not lean_mod.lean_applies(POLICY_VARIANTS[name], None, {"delta": None})
    assert lean_mod.lean_applies(PolicyLossSpec("token", "kl_cov", log_ratio_clamp=5.0), None)


@pytest.mark.parametrize("name", ["vanilla", "clip_cov", "kl_cov", "gspo"])
def test_public_op_takes_lean_path_with_dual_clip_and_selection(name, monkeypatch):
    """``policy_loss`` hands the dual clip and the selection to the lean path (no reference
    call), and its result equals the reference's."""
    import glm_kernels
    batch = policy_tests.make_batch(7)
    kwargs = (dict(dual_clip=3.0) if name in ("vanilla", "gspo")
              else dict(selection=batch["selection"]))

    def run():
        x = batch["lp"].clone().requires_grad_(True)
        with glm_kernels.force_backend("torch"):
            loss, stats = glm_kernels.policy_loss(x, batch["old"], batch["adv"], batch["mask"],
                                                  variant=name, token_weights=batch["weights"],
                                                  return_stats=True, **kwargs)
        loss.backward()
        return loss.detach(), x.grad, stats
    lean = run()
    from glm_kernels.loss.policy import policy as policy_mod
    monkeypatch.setattr(policy_mod, "lean_applies", lambda *a, **k: False)
    ref = run()
    monkeypatch.undo()

    def refuse(*a, **k):
        raise AssertionError("the reference ran")
    monkeypatch.setattr(policy_mod, "policy_loss_reference", refuse)
    run()
    assert_close(lean[0], ref[0], tol=TOLERANCES[torch.float32], name="loss")
    assert_close(lean[1], ref[1], tol=TOLERANCES[torch.float32], name="grad")
    for key in ref[2]:
        assert_close(lean[2][key], ref[2][key], tol=TOLERANCES[torch.float32], name=key)


@pytest.mark.parametrize("weighted", [False, True])
def test_gspo_lean_packed_matches_readable_reference(weighted):
    """GSPO's per-row mean log-ratio on the packed (cu_seqlens) layout: lean == reference."""
    batch, cu = policy_tests.pack(policy_tests.make_batch(11))
    lengths = cu[1:] - cu[:-1]
    rows = ref_mod.Rows(int(cu[-1]), len(lengths), None, cu, "cpu")
    spec = POLICY_VARIANTS["gspo"]
    params = resolve_params(spec, {}, 0.2, 0.28)
    tol = TOLERANCES[torch.float32]
    for reduction in policy_tests.TOKEN_REDUCTIONS:
        if reduction == "seq_mean_token_sum_norm":
            continue                                  # padded-only (a row length)
        (ref_loss, ref_grad, ref_stats), (got_loss, got_grad, got_stats) = _run_both(
            "gspo", batch, None, weighted, reduction, None, params, rows=rows)
        assert_close(got_loss, ref_loss, tol=tol, name=f"packed {reduction} loss")
        assert_close(got_grad, ref_grad, tol=tol, name=f"packed {reduction} grad")
        for key in ref_stats:
            assert_close(got_stats[key], ref_stats[key], tol=tol, name=f"packed {key}")


GATED = [("vanilla", 3.0), ("gpg", None), ("sapo", None), ("cispo", None), ("dro", None),
         ("dppo_kl", None), ("clip_cov", None), ("kl_cov", None), ("gspo", None)]


@pytest.mark.parametrize("name,dual", GATED)
@pytest.mark.parametrize("gate", ["coupled", "decoupled"])
@pytest.mark.parametrize("weighted", [False, True])
def test_gated_lean_matches_readable_reference(name, dual, gate, weighted):
    """The IcePop gate on the lean path (the reference's gate_weights as a token factor):
    loss, gradient, stats (pop_frac included) equal to the reference, every reduction; a
    popped token with NaN / inf log-probs gets exactly 0 (the token ratios; GSPO's row mean
    takes every masked token, popped or not, in both)."""
    batch = policy_tests.make_batch(zlib.crc32(f"{name}{gate}".encode()) % 1000)
    batch["old"][0, 3], batch["lp"][0, 3] = -3.0, -2.0    # no +-25 log-ratio: see above
    batch["old"][1, 4], batch["lp"][1, 4] = -2.0, -3.0
    if name != "gspo":        # popped (the gate's log-ratio is NaN / inf), masked, NaN lp
        batch["mask"][0, 5] = True
        batch["lp"][0, 5] = float("nan")
        if gate == "decoupled":
            batch["old"][0, 5] = float("inf")
    spec = POLICY_VARIANTS[name]
    params = resolve_params(spec, dict(policy_tests.PARAMS.get(name, {})) if name in
                            ("dro", "sapo", "dppo_kl") else {}, 0.2, 0.28)
    assert lean_mod.lean_applies(spec, gate, params)
    selection = batch["selection"].reshape(-1) if name in ("clip_cov", "kl_cov") else None
    tol = TOLERANCES[torch.float32]
    for reduction in policy_tests.TOKEN_REDUCTIONS:
        (ref_loss, ref_grad, ref_stats), (got_loss, got_grad, got_stats) = _run_both(
            name, batch, dual, weighted, reduction, selection, params, gate=gate)
        if name != "gspo":
            assert bool(got_grad[5] == 0) and bool(ref_grad[5] == 0)
            assert torch.isfinite(got_grad).all() and torch.isfinite(got_loss).all()
        assert_close(got_loss, ref_loss, tol=tol, name=f"{name} {gate} {reduction} loss")
        assert_close(got_grad, ref_grad, tol=tol, name=f"{name} {gate} {reduction} grad")
        assert set(got_stats) == set(ref_stats)
        for key in ref_stats:
            assert_close(got_stats[key], ref_stats[key], tol=tol, name=f"{name} {key}")
    assert 0.05 < float(got_stats["pop_frac"]) < 0.95    # the gate pops and keeps tokens
