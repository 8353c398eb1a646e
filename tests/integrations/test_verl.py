"""verl plug-in against verl's own code (verl 0.9.1): its ``vanilla`` PPO loss fed the IcePop
weights of its own rollout-correction helper (``decoupled_token_icepop``), its ``agg_loss`` in
every ``loss_agg_mode``, its registry, and the formula written out here.

Skipped only when verl is not installed; CI installs it (README, the ``[integrations]`` extra).
"""
import math

import pytest
import torch

from glm_kernels.integrations.verl import icepop as plug
from tests._compare import assert_close
from tests.integrations._verl_actor import run_ppo_loss

PIP = plug.INSTALL_HINT
core = pytest.importorskip("verl.trainer.ppo.core_algos", reason=f"verl missing: {PIP}")
rc = pytest.importorskip("verl.trainer.ppo.rollout_corr_helper", reason=f"verl missing: {PIP}")
from verl.trainer.config.algorithm import RolloutCorrectionConfig  # noqa: E402
from verl.workers.config import ActorConfig, PolicyLossConfig  # noqa: E402

TOL = 1e-5
LO, HI = 0.5, 2.0


def actor_config(*, clip=0.2, low=0.2, high=0.28, dual=3.0, gate="0.5_2.0", **batch_info):
    policy = PolicyLossConfig(loss_mode="icepop", rollout_correction=RolloutCorrectionConfig(
        rollout_is="token", rollout_is_threshold=gate))
    cfg = ActorConfig(strategy="fsdp", rollout_n=1, ppo_mini_batch_size=1,
                      ppo_micro_batch_size_per_gpu=1, clip_ratio=clip, clip_ratio_low=low,
                      clip_ratio_high=high, clip_ratio_c=dual, policy_loss=policy)
    cfg.global_batch_info.update(batch_info)
    return cfg


def make_batch(seed, b=5, t=23, *, edge=True, empty_row=True):
    """log pi_theta, pi_old, pi_rollout with tokens exactly on the gate and clip bounds."""
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(b, t, generator=g) * 3 - 0.05
    rollout = old + 0.5 * torch.randn(b, t, generator=g)
    lp = old + 0.25 * torch.randn(b, t, generator=g)
    adv = torch.randn(b, t, generator=g)
    mask = torch.rand(b, t, generator=g) > 0.25
    if edge:
        # ratio k = exp(old - rollout) exactly 0.5 / 2.0 (gate bounds, both kept), and
        # r = exp(lp - old) exactly 0.8 / 1.28 (clip bounds).
        old[0, 0], old[0, 1] = -1.0, -0.75               # dyadic: the differences are exact
        rollout[0, 0], rollout[0, 1] = old[0, 0] - math.log(2.0), old[0, 1] + math.log(2.0)
        lp[1, 0], lp[1, 1] = old[1, 0] + math.log(0.8), old[1, 1] + math.log(1.28)
        lp[2, 2], adv[2, 2] = old[2, 2] + math.log(0.8), -1.0
        mask[:2, :2] = True
    if empty_row:
        mask[3] = False
    return lp, old, rollout, adv, mask


def verl_decoupled_weights(old, rollout, mask, gate="0.5_2.0"):
    """verl's own decoupled token IcePop weights (RolloutCorrectionConfig.decoupled_token_icepop)."""
    preset = RolloutCorrectionConfig.decoupled_token_icepop(threshold=2.0, threshold_lower=0.5)
    assert preset.rollout_is == "token" and preset.rollout_is_threshold == gate
    proto, new_mask, _ = rc.compute_rollout_correction_and_rejection_mask(
        old_log_prob=old, rollout_log_prob=rollout, response_mask=mask.float(),
        rollout_is=preset.rollout_is, rollout_is_threshold=preset.rollout_is_threshold)
    assert torch.equal(new_mask.bool(), mask)      # IcePop keeps the mask, zeroes weights
    return proto.batch["rollout_is_weights"]


def run(fn, lp, old, adv, mask, mode, cfg, weights):
    x = lp.clone().requires_grad_(True)
    loss, metrics = fn(old_log_prob=old, log_prob=x, advantages=adv, response_mask=mask,
                       loss_agg_mode=mode, config=cfg, rollout_is_weights=weights)
    loss.backward()
    return loss.detach(), x.grad, metrics


def formula(lp, old, adv, mask, mode, *, weights=None, gate=(LO, HI), eps=(0.2, 0.28), c=3.0):
    """docs/design.md 3.1 IcePop with verl's dual clip and aggregation, written out."""
    lp = lp.clone().requires_grad_(True)
    r = torch.exp((lp - old).clamp(-20, 20))
    if weights is None:                                 # coupled: gate on sg(rho)
        rho = r.detach()
        w = ((rho >= gate[0]) & (rho <= gate[1])).float()
    else:
        w = weights
    keep = mask & (w != 0)
    a = torch.where(keep, adv, torch.zeros_like(adv))
    r = torch.where(keep, r, torch.ones_like(r))
    term = torch.maximum(-r * a, -r.clamp(1 - eps[0], 1 + eps[1]) * a)
    term = torch.where(a < 0, torch.minimum(term, -a * c), term)
    ell = torch.where(keep, w * term, torch.zeros_like(term))
    m = mask.float()
    if mode == "token-mean":
        loss = ell.sum() / m.sum()
    elif mode == "token-sum":
        loss = ell.sum()
    else:
        rows = m.sum(-1)
        valid = rows > 0
        seq = ell.sum(-1) / (rows + 1e-8) if mode == "seq-mean-token-mean" else ell.sum(-1)
        loss = seq[valid].sum() / valid.sum()
        if mode == "seq-mean-token-sum-norm":
            loss = loss / mask.shape[-1]
    loss.backward()
    return loss.detach(), lp.grad


def test_registered_in_verl_registry():
    assert core.get_policy_loss_fn("icepop") is plug.icepop_policy_loss
    plug.register("icepop_test_name")
    assert core.get_policy_loss_fn("icepop_test_name") is plug.icepop_policy_loss


@pytest.mark.parametrize("mode", plug.AGG_MODES)
@pytest.mark.parametrize("seed", [0, 1])
def test_decoupled_matches_verl_vanilla_with_its_icepop_weights(mode, seed, any_backend):
    lp, old, rollout, adv, mask = make_batch(seed)
    cfg = actor_config()
    w = verl_decoupled_weights(old, rollout, mask)
    assert (w[mask] == 0).any() and (w[mask] != 0).any()
    assert w[0, 0] == 2.0 and w[0, 1] == 0.5            # on the bounds: kept (inclusive)
    ours = run(plug.icepop_policy_loss, lp, old, adv, mask, mode, cfg, w)
    ref = run(core.compute_policy_loss_vanilla, lp, old, adv, mask, mode, cfg, w)
    assert_close(ours[0], ref[0], tol=TOL, name=f"loss {mode}")
    assert_close(ours[1], ref[1], tol=TOL, name=f"grad {mode}")
    for key in ("actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower"):
        assert ours[2][key] == pytest.approx(ref[2][key], rel=1e-5, abs=1e-6), key
    expected_pop = float((mask & (w == 0)).sum() / mask.sum())
    assert ours[2]["actor/pop_frac"] == pytest.approx(expected_pop)
    written = formula(lp, old, adv, mask, mode, weights=w)
    assert_close(ours[0], written[0], tol=TOL, name="loss vs formula")
    assert_close(ours[1], written[1], tol=TOL, name="grad vs formula")


@pytest.mark.parametrize("mode", plug.AGG_MODES)
def test_coupled_matches_verl_bypass_gate(mode, any_backend):
    """Coupled (bypass / TITO): old_log_prob is the rollout. verl's helper, called as its
    bypass_mode loss calls it (current policy vs rollout), gives the gate; its vanilla loss with
    that 0/1 gate as weights is coupled IcePop with verl's clip and aggregation."""
    lp, _, rollout, adv, mask = make_batch(3)
    rollout[0, 0], rollout[0, 1] = -1.0, -0.75
    lp[0, 0], lp[0, 1] = rollout[0, 0] + math.log(2.0), rollout[0, 1] - math.log(2.0)
    cfg = actor_config()
    raw = verl_decoupled_weights(lp, rollout, mask)     # rho * 1[lo <= rho <= hi]
    gate = (raw > 0).float()
    assert gate[0, 0] == 1 and gate[0, 1] == 1 and (gate[mask] == 0).any()
    ours = run(plug.icepop_policy_loss, lp, rollout, adv, mask, mode, cfg, None)
    ref = run(core.compute_policy_loss_vanilla, lp, rollout, adv, mask, mode, cfg, gate)
    assert_close(ours[0], ref[0], tol=TOL, name=f"loss {mode}")
    assert_close(ours[1], ref[1], tol=TOL, name=f"grad {mode}")
    assert ours[2]["actor/pop_frac"] == pytest.approx(float((mask & (gate == 0)).sum()
                                                             / mask.sum()))
    # The train-inference mismatch, against verl's own off-policy metrics of the same tokens.
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_corr_metrics_from_logprobs
    theirs = compute_rollout_corr_metrics_from_logprobs(lp.double(), rollout.double(),
                                                        mask.double())
    assert theirs
    for key, value in theirs.items():
        ours_value = ours[2]["actor/" + key.split("/", 1)[1]]
        assert ours_value == pytest.approx(value, rel=1e-5, abs=1e-6), key
    written = formula(lp, rollout, adv, mask, mode)
    assert_close(ours[0], written[0], tol=TOL, name="loss vs formula")
    assert_close(ours[1], written[1], tol=TOL, name="grad vs formula")


@pytest.mark.parametrize("coupled", [False, True])
def test_dual_clip_in_the_kernel_matches_verl_vanilla(coupled, any_backend):
    """clip_ratio_c = 1.2: many negative-advantage tokens hit verl's dual-clip cap, which the
    kernel applies (no torch pass after it); loss, gradient and pg_clipfrac_lower agree."""
    lp, old, rollout, adv, mask = make_batch(4)
    cfg = actor_config(dual=1.2)
    if coupled:
        old = rollout
        weights, ours_w = (verl_decoupled_weights(lp, rollout, mask) > 0).float(), None
    else:
        weights = ours_w = verl_decoupled_weights(old, rollout, mask)
    mode = "token-mean"
    ours = run(plug.icepop_policy_loss, lp, old, adv, mask, mode, cfg, ours_w)
    ref = run(core.compute_policy_loss_vanilla, lp, old, adv, mask, mode, cfg, weights)
    assert ref[2]["actor/pg_clipfrac_lower"] > 0.02       # the cap binds: the check can fail
    assert_close(ours[0], ref[0], tol=TOL, name="loss")
    assert_close(ours[1], ref[1], tol=TOL, name="grad")
    assert ours[2]["actor/pg_clipfrac_lower"] == pytest.approx(
        ref[2]["actor/pg_clipfrac_lower"], rel=1e-6)


def test_gate_bounds_from_verl_config():
    lp, _, rollout, adv, mask = make_batch(4, edge=False, empty_row=False)
    narrow = actor_config(gate="0.9_1.1")
    assert plug.gate_bounds(narrow) == (0.9, 1.1)
    assert plug.gate_bounds(actor_config(gate=2.0)) == plug.DEFAULT_GATE   # TIS spelling
    ours = run(plug.icepop_policy_loss, lp, rollout, adv, mask, "token-mean", narrow, None)
    written = formula(lp, rollout, adv, mask, "token-mean", gate=(0.9, 1.1))
    assert_close(ours[0], written[0], tol=TOL, name="loss")
    assert_close(ours[1], written[1], tol=TOL, name="grad")
    with pytest.raises(ValueError, match="rollout_is_threshold"):
        plug.gate_bounds(actor_config(gate="a_b"))


def test_popped_tokens_with_inf_nan_contribute_nothing(any_backend):
    lp, old, rollout, adv, mask = make_batch(5)
    w = verl_decoupled_weights(old, rollout, mask)
    popped = mask & (w == 0)
    assert popped.sum() >= 2
    lp_bad, old_bad = lp.clone(), old.clone()
    idx = popped.nonzero()
    lp_bad[idx[0, 0], idx[0, 1]] = float("nan")
    old_bad[idx[1, 0], idx[1, 1]] = float("-inf")
    adv_bad = adv.clone()
    adv_bad[idx[0, 0], idx[0, 1]] = float("inf")
    cfg = actor_config()
    clean = run(plug.icepop_policy_loss, lp, old, adv, mask, "token-mean", cfg, w)
    dirty = run(plug.icepop_policy_loss, lp_bad, old_bad, adv_bad, mask, "token-mean", cfg, w)
    assert torch.isfinite(dirty[0]) and torch.isfinite(dirty[1]).all()
    assert_close(dirty[0], clean[0], tol=TOL, name="loss")
    assert_close(dirty[1], clean[1], tol=TOL, name="grad")
    assert (dirty[1][popped] == 0).all()
    # verl's own vanilla loss turns the NaN into a NaN loss (0 * NaN): the plug-in does not.
    assert torch.isnan(run(core.compute_policy_loss_vanilla, lp_bad, old_bad, adv_bad, mask,
                           "token-mean", cfg, w)[0])


def test_coupled_popped_tokens_with_inf_nan_contribute_nothing(any_backend):
    """Coupled: a NaN log-prob gives a NaN ratio, which the gate pops; an inf advantage on a
    token outside the gate: both contribute 0, as the finite batch without them."""
    lp, _, rollout, adv, mask = make_batch(5)
    rho = torch.exp(lp - rollout)
    popped = mask & ((rho < LO) | (rho > HI))
    assert popped.sum() >= 2
    idx = popped.nonzero()
    lp_bad, adv_bad = lp.clone(), adv.clone()
    lp_bad[idx[0, 0], idx[0, 1]] = float("nan")
    adv_bad[idx[1, 0], idx[1, 1]] = float("inf")
    cfg = actor_config()
    clean = run(plug.icepop_policy_loss, lp, rollout, adv, mask, "seq-mean-token-mean", cfg, None)
    dirty = run(plug.icepop_policy_loss, lp_bad, rollout, adv_bad, mask, "seq-mean-token-mean",
                cfg, None)
    assert torch.isfinite(dirty[0]) and torch.isfinite(dirty[1]).all()
    assert_close(dirty[0], clean[0], tol=TOL, name="loss")
    assert_close(dirty[1], clean[1], tol=TOL, name="grad")
    assert (dirty[1][popped] == 0).all()


@pytest.mark.parametrize("mode", plug.AGG_MODES)
def test_empty_mask_and_global_batch_info(mode):
    lp, old, rollout, adv, mask = make_batch(6, edge=False, empty_row=False)
    w = verl_decoupled_weights(old, rollout, mask)
    empty = torch.zeros_like(mask)
    # verl's data-parallel normalisation: global token / sequence counts from the trainer.
    cfg = actor_config(dp_size=2, batch_num_tokens=40, global_batch_size=9)
    for m in (mask, empty):
        ours = run(plug.icepop_policy_loss, lp, old, adv, m, mode, cfg, w)
        ref = run(core.compute_policy_loss_vanilla, lp, old, adv, m, mode, cfg, w)
        assert_close(ours[0], ref[0], tol=TOL, name=f"loss {mode}")
        assert_close(ours[1], ref[1], tol=TOL, name=f"grad {mode}")
    assert float(run(plug.icepop_policy_loss, lp, old, adv, empty, mode, cfg, w)[0]) == 0.0


def test_verl_ppo_loss_dispatches_to_icepop():
    """verl's actor-side ``ppo_loss`` (verl/workers/utils/losses.py) on a batch laid out as its
    engine hands it (padded prompts/responses, packed per-position log-probs): it looks the
    loss up by ``config.policy_loss.loss_mode`` and calls it with its keyword arguments."""
    pytest.importorskip("verl.workers.utils.losses", reason=f"verl missing: {PIP}")
    lp, old, rollout, adv, mask = make_batch(7, edge=False, empty_row=False)
    w = verl_decoupled_weights(old, rollout, mask)
    cfg = actor_config()
    loss, grad, metrics = run_ppo_loss(cfg, lp, old, adv, mask, w)
    ref = run(plug.icepop_policy_loss, lp, old, adv, mask, "token-mean", cfg, w)
    assert_close(loss, ref[0], tol=TOL, name="ppo_loss")
    assert_close(grad, ref[1], tol=TOL, name="ppo_loss grad")
    assert "actor/pop_frac" in metrics


def test_bad_inputs_name_the_argument():
    lp, old, _, adv, mask = make_batch(8, edge=False)
    cfg = actor_config()
    with pytest.raises(ValueError, match="loss_agg_mode"):
        plug.icepop_policy_loss(old, lp, adv, mask, "token-avg", cfg)
    with pytest.raises(ValueError, match="advantages"):
        plug.icepop_policy_loss(old, lp, adv[:, :-1], mask, "token-mean", cfg)
    with pytest.raises(ValueError, match="config"):
        plug.icepop_policy_loss(old, lp, adv, mask, "token-mean", None)
    with pytest.raises(ValueError, match="clip_ratio_c"):
        plug.icepop_policy_loss(old, lp, adv, mask, "token-mean", actor_config(dual=0.5))
    with pytest.raises(TypeError, match="rollout_is_weights"):
        plug.icepop_policy_loss(old, lp, adv, mask, "token-mean", cfg, [1.0])


def test_docs_example_runs():
    """docs/verl.md's python block runs as written and prints what it says."""
    import os
    import re
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    text = open(os.path.join(root, "docs", "verl.md")).read()
    block = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    namespace = {}
    exec(compile(block, "docs/verl.md", "exec"), namespace)
    assert round(namespace["metrics"]["actor/pop_frac"], 4) == 0.3333
    grad = namespace["log_prob"].grad[0]
    assert grad[1] == 0 and grad[3] == 0 and grad[0] != 0 and grad[2] != 0


def test_missing_verl_names_the_pip_line(monkeypatch):
    import sys
    monkeypatch.setitem(sys.modules, "verl.trainer.ppo", None)    # as if verl were absent
    with pytest.raises(ImportError, match="pip install --no-deps 'verl==0.9.1'"):
        plug.register()
