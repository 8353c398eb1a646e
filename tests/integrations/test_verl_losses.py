"""``glm_<name>`` for every policy loss in verl's registry, against verl 0.9.1's own function.

For each name verl registers (read from ``POLICY_LOSS_REGISTRY`` itself, so a name verl adds
fails ``test_every_verl_loss_has_a_glm_twin``), the plug-in and verl's function get the same
inputs, called as verl's actor calls a policy loss, with verl's own config objects
(``ActorConfig``, ``PolicyLossConfig``, ``RolloutCorrectionConfig``) and ``global_batch_info``
filled as verl's ``ppo_loss`` fills it; compared: the loss, its gradient w.r.t. ``log_prob``,
the metric keys and every metric's value. Batches are ragged (prefix masks of random length,
one all-masked row), advantages of both signs, log-ratios wide enough to clip, and IS weights
built by verl's own rollout-correction helper (token TIS, sequence TIS, token IcePop) or none.
``clip_cov`` draws tokens from torch's global generator: both sides get the same seed.

Skipped only when verl is not installed.
"""
import inspect

import pytest
import torch

from tests._compare import assert_close
from tests.integrations._verl_actor import run_ppo_loss

core = pytest.importorskip("verl.trainer.ppo.core_algos", reason="verl missing")
rc = pytest.importorskip("verl.trainer.ppo.rollout_corr_helper", reason="verl missing")
from verl.trainer.config.algorithm import RolloutCorrectionConfig  # noqa: E402
from verl.workers.config import ActorConfig, PolicyLossConfig  # noqa: E402

from glm_kernels.integrations.verl import icepop as plug  # noqa: E402  (registers glm_<name>)
from glm_kernels.integrations.verl import losses as verl_losses  # noqa: E402

TOL = 1e-5
AGG_MODES = plug.AGG_MODES
# verl's own names: the functions verl's modules registered (not ours, not a test's).
VERL_NAMES = tuple(sorted(name for name, fn in core.POLICY_LOSS_REGISTRY.items()
                          if fn.__module__.startswith("verl.")))
TOKEN_NAMES = tuple(name for name in VERL_NAMES if name != "bypass_mode")
WEIGHT_KINDS = ("none", "token_tis", "seq_tis", "icepop")
# verl's rollout-correction presets (every classmethod that builds a RolloutCorrectionConfig).
PRESETS = tuple(sorted(name for name, member in vars(RolloutCorrectionConfig).items()
                       if isinstance(member, classmethod)))
# How verl's ppo_loss fills config.global_batch_info: one micro-batch alone, and one of a
# data-parallel global batch (dp 2, global token / sequence counts, a fixed horizon).
BATCH_INFO = {"local": dict(dp_size=1, batch_num_tokens=None, global_batch_size=None,
                            loss_scale_factor=None),
              "global": dict(dp_size=2, batch_num_tokens=97, global_batch_size=11,
                             loss_scale_factor=17)}


def actor_config(name, *, batch_info="local", correction=None, **overrides):
    """verl's ActorConfig for loss ``name``, with the knobs each loss reads set so that the
    branch it guards is taken on the test batches (clip_cov's candidates outnumber its draw)."""
    policy = PolicyLossConfig(
        loss_mode=name, clip_cov_ratio=0.1, clip_cov_lb=0.0, clip_cov_ub=5.0, kl_cov_ratio=0.1,
        ppo_kl_coef=0.1, dro_beta=0.5,
        rollout_correction=correction if correction is not None else RolloutCorrectionConfig())
    info = BATCH_INFO[batch_info]
    fields = dict(strategy="fsdp", rollout_n=1, ppo_mini_batch_size=1,
                  ppo_micro_batch_size_per_gpu=1, clip_ratio=0.2, clip_ratio_low=0.2,
                  clip_ratio_high=0.28, clip_ratio_c=3.0, tau_pos=1.0, tau_neg=1.05,
                  loss_scale_factor=info["loss_scale_factor"], policy_loss=policy)
    fields.update(overrides)
    cfg = ActorConfig(**fields)
    # verl's ppo_loss (verl/workers/utils/losses.py) writes these four before the call.
    cfg.global_batch_info["dp_size"] = info["dp_size"]
    cfg.global_batch_info["batch_num_tokens"] = info["batch_num_tokens"]
    cfg.global_batch_info["global_batch_size"] = info["global_batch_size"]
    cfg.global_batch_info["loss_scale_factor"] = cfg.loss_scale_factor
    return cfg


def make_batch(seed, b=6, t=13):
    """log pi_theta, pi_old, pi_rollout, advantages, mask: ragged prefix masks, row 3 empty,
    rows drifting from the rollout by different amounts (so verl's rejection presets keep
    some rows and drop others), |log-ratio| up to ~1 (PPO clip and dual clip bind)."""
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(b, t, generator=g) * 3 - 0.05
    drift = torch.tensor([3e-4, 0.05, 0.4, 3e-4, 0.8, 0.1])[:b, None]
    rollout = old + drift * torch.randn(b, t, generator=g)
    # Per-row shifts on top of the token noise: GSPO's / GMPO's sequence ratios clip too.
    shift = torch.tensor([0.3, 0.4, -0.5, 0.0, 0.25, -0.3])[:b, None]
    log_prob = old + 0.3 * torch.randn(b, t, generator=g) + shift
    adv = torch.randn(b, t, generator=g) + torch.randn(b, 1, generator=g)
    lengths = torch.randint(1, t + 1, (b,), generator=g)
    lengths[0] = t
    lengths[3] = 0
    mask = torch.arange(t)[None, :] < lengths[:, None]
    return log_prob, old, rollout, adv, mask


def bypass_batch(seed):
    """bypass mode (old_log_prob = the rollout's): rows drift from log_prob by different
    amounts, so verl's rejection presets keep some rows and drop others, and PPO clips."""
    log_prob, _, _, adv, mask = make_batch(seed)
    g = torch.Generator().manual_seed(seed + 100)
    drift = torch.tensor([3e-4, 0.05, 0.4, 3e-4, 0.8, 1e-3])[:, None]
    rollout = log_prob + drift * torch.randn(log_prob.shape, generator=g)
    return log_prob, rollout, adv, mask


def verl_weights(kind, old, rollout, mask):
    """IS weights from verl's own rollout-correction helper and presets."""
    if kind == "none":
        return None
    preset = {"token_tis": RolloutCorrectionConfig.decoupled_token_is(threshold=2.0),
              "seq_tis": RolloutCorrectionConfig.decoupled_seq_is(threshold=2.0),
              "icepop": RolloutCorrectionConfig.decoupled_token_icepop(
                  threshold=2.0, threshold_lower=0.5)}[kind]
    proto, new_mask, _ = rc.compute_rollout_correction_and_rejection_mask(
        old_log_prob=old, rollout_log_prob=rollout, response_mask=mask.float(),
        rollout_is=preset.rollout_is, rollout_is_threshold=preset.rollout_is_threshold)
    assert torch.equal(new_mask.bool(), mask)
    return proto.batch["rollout_is_weights"]


def magnitude(fn, lp, old, adv, mask, mode, cfg, weights, seed=0):
    """verl's loss with |advantages|: the size of the terms the loss sums (see assert_same)."""
    torch.manual_seed(seed)
    with torch.no_grad():
        return fn(old_log_prob=old, log_prob=lp, advantages=adv.abs(), response_mask=mask,
                  loss_agg_mode=mode, config=cfg, rollout_is_weights=weights)[0]


def run(fn, lp, old, adv, mask, mode, cfg, weights, seed=0):
    x = lp.clone().requires_grad_(True)
    torch.manual_seed(seed)             # clip_cov's randperm: the same draw on both sides
    loss, metrics = fn(old_log_prob=old, log_prob=x, advantages=adv, response_mask=mask,
                       loss_agg_mode=mode, config=cfg, rollout_is_weights=weights)
    loss.backward()
    return loss.detach(), x.grad, metrics


def assert_same(ours, ref, label, magnitude=None):
    """Loss, gradient, metric keys and values. A loss over random-sign advantages cancels far
    below its terms and its rounding error scales with them: with ``magnitude`` (verl's loss
    on |advantages|) the loss is judged against tol x max(|loss|, |magnitude|)."""
    if magnitude is None:
        assert_close(ours[0], ref[0], tol=TOL, name=f"loss {label}")
    else:
        scale = max(abs(float(ref[0])), abs(float(magnitude)))
        assert abs(float(ours[0]) - float(ref[0])) <= TOL * scale, (
            f"loss {label}: {float(ours[0])!r} vs {float(ref[0])!r} (scale {scale:.3e})")
    assert_close(ours[1], ref[1], tol=TOL, name=f"grad {label}")
    assert set(ours[2]) == set(ref[2]), (f"metric keys {label}: {sorted(ours[2])} vs "
                                         f"{sorted(ref[2])}")
    for key, value in ref[2].items():
        assert isinstance(ours[2][key], float), f"{label} {key}: {type(ours[2][key])}"
        assert ours[2][key] == pytest.approx(value, rel=1e-5, abs=1e-6), f"{label} {key}"


def check(theirs, ours, args, label, seed=0):
    """verl's ``theirs`` and the plug-in's ``ours`` on the same (lp, old, adv, mask, mode,
    config, weights) and seed; returns verl's (loss, grad, metrics)."""
    ref = run(theirs, *args, seed=seed)
    assert_same(run(ours, *args, seed=seed), ref, label, magnitude(theirs, *args, seed=seed))
    return ref


def test_every_verl_loss_has_a_glm_twin():
    """Fails when verl registers a name the plug-in does not cover."""
    assert len(VERL_NAMES) >= 12
    assert set(VERL_NAMES) == set(verl_losses.VERL_LOSS_NAMES)
    for name in VERL_NAMES:
        ours = core.get_policy_loss_fn(f"glm_{name}")
        assert ours is verl_losses.POLICY_LOSSES[name]
        assert not ours.__module__.startswith("verl.")
        assert ours is not core.POLICY_LOSS_REGISTRY[name]


def test_never_calls_verls_loss_functions(monkeypatch):
    """The plug-in computes each loss itself: with every verl loss function (module attribute
    and registry entry) replaced by one that raises, each glm_<name> and icepop still run."""
    def refuse(*args, **kwargs):
        raise AssertionError("a verl loss function was called")
    for attr in dir(core):
        if attr.startswith("compute_policy_loss"):
            monkeypatch.setattr(core, attr, refuse)
    for name in VERL_NAMES:
        monkeypatch.setitem(core.POLICY_LOSS_REGISTRY, name, refuse)
    lp, old, rollout, adv, mask = make_batch(11)
    w = verl_weights("icepop", old, rollout, mask)
    for name in [f"glm_{name}" for name in VERL_NAMES] + ["icepop"]:
        cfg = actor_config(name, correction=RolloutCorrectionConfig.bypass_pg_is())
        for weights in (w, None):
            loss, grad, _ = run(core.get_policy_loss_fn(name), lp, old, adv, mask,
                                "token-mean", cfg, weights)
            assert torch.isfinite(loss) and grad.abs().sum() > 0, name
    with pytest.raises(AssertionError, match="verl loss function"):
        run(core.compute_policy_loss_vanilla, lp, old, adv, mask, "token-mean",
            actor_config("vanilla"), w)


def test_verl_imports_the_plug_in_from_its_environment_variable():
    """How verl's Ray workers get the losses (docs/verl.md): ``import verl`` with
    VERL_USE_EXTERNAL_MODULES=glm_kernels.integrations.verl registers every glm_<name> and
    icepop, in a fresh interpreter that imports nothing of glm_kernels itself."""
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "VERL_USE_EXTERNAL_MODULES": "glm_kernels.integrations.verl",
           "VERL_USE_EXTERNAL_PLUGINS": "none",       # not through the entry point
           "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    code = ("import verl\nfrom verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY as r\n"
            "print(' '.join(sorted(k for k in r if k.startswith('glm_') or k == 'icepop')))")
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    names = out.stdout.split()
    assert names == sorted([f"glm_{name}" for name in VERL_NAMES] + ["icepop"]), out.stdout


def test_register_all_under_another_prefix():
    verl_losses.register_all(prefix="glmtest_")
    for name in VERL_NAMES:
        assert core.get_policy_loss_fn(f"glmtest_{name}") is verl_losses.POLICY_LOSSES[name]
    with pytest.raises(ValueError, match="prefix"):
        verl_losses.register_all(prefix="")


@pytest.mark.parametrize("weights", WEIGHT_KINDS)
@pytest.mark.parametrize("name", TOKEN_NAMES)
def test_matches_verl_every_agg_mode(name, weights, any_backend):
    lp, old, rollout, adv, mask = make_batch(1)
    w = verl_weights(weights, old, rollout, mask)
    theirs = core.POLICY_LOSS_REGISTRY[name]
    ours = core.get_policy_loss_fn(f"glm_{name}")
    for mode in AGG_MODES:
        cfg = actor_config(name, loss_agg_mode=mode)
        check(theirs, ours, (lp, old, adv, mask, mode, cfg, w), f"{name}/{weights}/{mode}")


@pytest.mark.parametrize("name", TOKEN_NAMES)
def test_matches_verl_with_global_batch_info(name, any_backend):
    """Data-parallel normalisation: dp_size, global token / sequence counts and a fixed
    loss_scale_factor, as verl's ppo_loss writes them."""
    lp, old, rollout, adv, mask = make_batch(2)
    w = verl_weights("icepop", old, rollout, mask)
    for mode in AGG_MODES:
        cfg = actor_config(name, batch_info="global", loss_agg_mode=mode)
        check(core.POLICY_LOSS_REGISTRY[name], core.get_policy_loss_fn(f"glm_{name}"),
              (lp, old, adv, mask, mode, cfg, w), f"{name}/global/{mode}")


@pytest.mark.parametrize("preset", PRESETS)
def test_bypass_mode_every_preset(preset, any_backend):
    """bypass_mode: old_log_prob is the rollout's; verl's preset in
    policy_loss.rollout_correction picks ppo_clip or reinforce, IS level and rejection."""
    lp, rollout, adv, mask = bypass_batch(3)
    correction = getattr(RolloutCorrectionConfig, preset)()
    for mode in AGG_MODES:
        cfg = actor_config("bypass_mode", correction=correction, loss_agg_mode=mode)
        check(core.POLICY_LOSS_REGISTRY["bypass_mode"], core.get_policy_loss_fn("glm_bypass_mode"),
              (lp, rollout, adv, mask, mode, cfg, None), f"bypass_mode/{preset}/{mode}")


@pytest.mark.parametrize("name", VERL_NAMES)
def test_bf16_log_prob(name, any_backend):
    """log_prob in bf16 (an actor computing log-probs in bf16): verl's math promotes against
    the fp32 old_log_prob; the gradient comes back in bf16 on both sides (docs/design.md 4:
    1e-2)."""
    lp, old, rollout, adv, mask = make_batch(10)
    lp = lp.bfloat16()
    correction = RolloutCorrectionConfig.bypass_pg_token_icepop(threshold=2.0)
    w = None if name == "bypass_mode" else verl_weights("icepop", old, rollout, mask)
    cfg = actor_config(name, correction=correction)
    ref = run(core.POLICY_LOSS_REGISTRY[name], lp, old, adv, mask, "token-mean", cfg, w)
    ours = run(core.get_policy_loss_fn(f"glm_{name}"), lp, old, adv, mask, "token-mean", cfg, w)
    assert ours[1].dtype == ref[1].dtype == torch.bfloat16
    assert_close(ours[0].float(), ref[0].float(), tol=1e-2, name=f"{name} bf16 loss")
    assert_close(ours[1].float(), ref[1].float(), tol=1e-2, name=f"{name} bf16 grad")
    for key, value in ref[2].items():
        assert ours[2][key] == pytest.approx(value, rel=1e-2, abs=1e-3), f"{name} {key}"


@pytest.mark.parametrize("name", ["vanilla", "dppo_tv", "dppo_kl", "gpg", "clip_cov", "kl_cov",
                                  "geo_mean", "dro", "bypass_mode"])
def test_omegaconf_config(name):
    """The losses verl also accepts with an OmegaConf DictConfig (its others assert an
    ActorConfig) give the same with one."""
    omegaconf = pytest.importorskip("omegaconf")
    cfg = omegaconf.OmegaConf.create({
        "clip_ratio": 0.2, "clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "clip_ratio_c": 3.0,
        "global_batch_info": {},
        "policy_loss": {"loss_mode": name, "clip_cov_ratio": 0.1, "clip_cov_lb": 0.0,
                        "clip_cov_ub": 5.0, "kl_cov_ratio": 0.1, "ppo_kl_coef": 0.1,
                        "dro_beta": 0.5,
                        "rollout_correction": {"rollout_is": "token", "rollout_is_threshold": 2.0,
                                               "loss_type": "reinforce"}}})
    lp, old, rollout, adv, mask = make_batch(12)
    w = verl_weights("token_tis", old, rollout, mask)
    check(core.POLICY_LOSS_REGISTRY[name], core.get_policy_loss_fn(f"glm_{name}"),
          (lp, old, adv, mask, "seq-mean-token-sum", cfg, w), f"{name}/DictConfig")


def test_bypass_presets_cover_both_loss_types_and_rejection():
    """The preset sweep above reaches both loss types, IS at both levels and rejection that
    drops rows (else it could pass with a branch never taken)."""
    kinds = {(getattr(RolloutCorrectionConfig, p)().loss_type,
              getattr(RolloutCorrectionConfig, p)().rollout_is) for p in PRESETS}
    assert {("ppo_clip", None), ("reinforce", "token"), ("reinforce", "sequence")} <= kinds
    lp, rollout, _, mask = bypass_batch(3)
    for preset in ("bypass_ppo_clip_geo_rs", "bypass_ppo_clip_k3_rs"):
        correction = getattr(RolloutCorrectionConfig, preset)()
        _, kept, _ = rc.compute_rollout_correction_and_rejection_mask(
            old_log_prob=lp, rollout_log_prob=rollout, response_mask=mask.float(),
            rollout_rs=correction.rollout_rs,
            rollout_rs_threshold=correction.rollout_rs_threshold)
        assert 0 < kept.bool().sum() < mask.sum(), preset


def test_batches_reach_every_branch():
    """The comparisons above can fail: clipping, dual clip, DPPO's masks, Clip-Cov's draw and
    KL-Cov's selection are all active on the test batch (verl's own metrics say so)."""
    lp, old, rollout, adv, mask = make_batch(1)
    cfg = actor_config("vanilla", clip_ratio_c=1.5)
    m = run(core.POLICY_LOSS_REGISTRY["vanilla"], lp, old, adv, mask, "token-mean", cfg, None)[2]
    assert m["actor/pg_clipfrac"] > 0.05 and m["actor/pg_clipfrac_lower"] > 0
    for name in ("dppo_tv", "dppo_kl", "cispo", "geo_mean", "gspo", "clip_cov"):
        m = run(core.POLICY_LOSS_REGISTRY[name], lp, old, adv, mask, "token-mean",
                actor_config(name), None)[2]
        assert m["actor/pg_clipfrac"] > 0, name
    assert (adv[mask] > 0).any() and (adv[mask] < 0).any()
    assert not mask[3].any() and mask.any(-1).sum() == mask.shape[0] - 1


@pytest.mark.parametrize("name", ["vanilla", "dppo_tv", "dppo_kl"])
def test_dual_and_truncation_clip_c(name, any_backend):
    """clip_ratio_c low enough that the dual clip (vanilla) / the ratio truncation (DPPO)
    binds on many tokens."""
    lp, old, rollout, adv, mask = make_batch(4)
    cfg = actor_config(name, clip_ratio_c=1.2)
    w = verl_weights("token_tis", old, rollout, mask)
    ref = check(core.POLICY_LOSS_REGISTRY[name], core.get_policy_loss_fn(f"glm_{name}"),
                (lp, old, adv, mask, "token-mean", cfg, w), f"{name}/clip_c")
    assert ref[2]["actor/pg_clipfrac_lower"] > 0.02


def test_clip_cov_draws_as_verl_does():
    """Same seed -> the same tokens as verl's randperm; another seed -> other tokens (so the
    draw matters on this batch and the equality above is not an accident)."""
    lp, old, _, adv, mask = make_batch(5)
    cfg = actor_config("clip_cov")
    theirs, ours = core.POLICY_LOSS_REGISTRY["clip_cov"], core.get_policy_loss_fn("glm_clip_cov")
    grads = []
    for seed in (0, 1):
        ref = check(theirs, ours, (lp, old, adv, mask, "token-mean", cfg, None),
                    f"clip_cov seed {seed}", seed=seed)
        grads.append(ref[1])
    assert not torch.equal(grads[0], grads[1])
    # The plug-in advances the global generator exactly as verl does.
    torch.manual_seed(7)
    run(theirs, lp, old, adv, mask, "token-mean", cfg, None, seed=7)
    after_verl = torch.rand(3)
    torch.manual_seed(7)
    run(ours, lp, old, adv, mask, "token-mean", cfg, None, seed=7)
    assert torch.equal(torch.rand(3), after_verl)


def test_kl_cov_chooses_verls_tokens_on_every_seed(monkeypatch):
    """KL-Cov's token choice is verl's on 160 batches (sequence TIS weights,
    seq-mean-token-sum: where a loss 1.1e-4 apart from verl's was once read as another token):
    the positions verl's own function hands its KL term (caught at its torch.topk) are exactly
    the tokens ``kl_cov_selection`` marks. The choice reads only log-probs, advantages and the
    mask; a loss differing in the last digits under cancellation is judged by
    ``assert_same``'s magnitude rule, not here."""
    theirs = core.POLICY_LOSS_REGISTRY["kl_cov"]
    caught = []
    real_topk = torch.topk

    def recording_topk(values, k, *args, **kwargs):
        out = real_topk(values, k, *args, **kwargs)
        caught.append(out.indices.clone())
        return out

    for seed in range(160):
        lp, old, rollout, adv, mask = make_batch(seed)
        weights = verl_weights("seq_tis", old, rollout, mask)
        cfg = actor_config("kl_cov", loss_agg_mode="seq-mean-token-sum")
        caught.clear()
        with monkeypatch.context() as patch:
            patch.setattr(core.torch, "topk", recording_topk)
            theirs(old_log_prob=old, log_prob=lp, advantages=adv, response_mask=mask,
                   loss_agg_mode="seq-mean-token-sum", config=cfg, rollout_is_weights=weights)
        assert len(caught) == 1, f"seed {seed}: verl called topk {len(caught)} times"
        valid = torch.nonzero(mask.reshape(-1), as_tuple=True)[0]
        verl_choice = torch.zeros(mask.numel(), dtype=torch.bool)
        verl_choice[valid[caught[0]]] = True
        ours = verl_losses._selection("kl_cov", lp, old, adv, mask, cfg)
        assert torch.equal(ours.reshape(-1), verl_choice), f"seed {seed}"


@pytest.mark.parametrize("name", VERL_NAMES)
def test_verl_ppo_loss_dispatches_to_glm(name):
    """verl's actor-side ppo_loss (verl/workers/utils/losses.py) with loss_mode=glm_<name>
    gives what it gives with loss_mode=<name>: loss, gradient, metrics."""
    pytest.importorskip("verl.workers.utils.losses", reason="verl missing")
    lp, old, rollout, adv, mask = make_batch(6)
    correction = RolloutCorrectionConfig.bypass_pg_is()
    w = verl_weights("token_tis", old, rollout, mask)
    results = []
    for loss_mode in (name, f"glm_{name}"):
        torch.manual_seed(0)
        loss, grad, metrics = run_ppo_loss(actor_config(loss_mode, correction=correction), lp,
                                           old, adv, mask, w)
        results.append((loss, grad, {k: float(v.aggregate()) if hasattr(v, "aggregate") else v
                                     for k, v in metrics.items() if k != "actor/pg_loss"}))
    assert_same(results[1], results[0], f"ppo_loss {name}")


def test_bad_inputs_name_the_argument():
    lp, old, _, adv, mask = make_batch(8)
    cfg = actor_config("gspo")
    fn = core.get_policy_loss_fn("glm_gspo")
    with pytest.raises(ValueError, match="loss_agg_mode"):
        fn(old, lp, adv, mask, "token-avg", cfg)
    with pytest.raises(ValueError, match="advantages"):
        fn(old, lp, adv[:, :-1], mask, "token-mean", cfg)
    with pytest.raises(ValueError, match="config"):
        fn(old, lp, adv, mask, "token-mean", None)
    with pytest.raises(TypeError, match="rollout_is_weights"):
        fn(old, lp, adv, mask, "token-mean", cfg, [1.0])
    data_parallel = actor_config("gspo")
    data_parallel.global_batch_info["dp_size"] = 2          # and no global counts: verl raises
    for mode, key in (("token-mean", "batch_num_tokens"),
                      ("seq-mean-token-mean", "global_batch_size")):
        with pytest.raises(ValueError, match=key):
            core.POLICY_LOSS_REGISTRY["gspo"](old, lp, adv, mask, mode, data_parallel)
        with pytest.raises(ValueError, match=key):
            fn(old, lp, adv, mask, mode, data_parallel)
    with pytest.raises(ValueError, match="dro_beta"):
        core.get_policy_loss_fn("glm_dro")(old, lp, adv, mask, "token-mean",
                                           actor_config("dro", policy_loss=PolicyLossConfig(
                                               loss_mode="dro", dro_beta=None)))
    with pytest.raises(ValueError, match="loss_type"):
        bad = actor_config("bypass_mode", correction=RolloutCorrectionConfig(loss_type="pg"))
        core.get_policy_loss_fn("glm_bypass_mode")(old, lp, adv, mask, "token-mean", bad)


def test_docs_list_every_glm_loss_with_its_config_line():
    import os
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    text = open(os.path.join(root, "docs", "verl.md")).read()
    for name in VERL_NAMES:
        line = f"actor_rollout_ref.actor.policy_loss.loss_mode=glm_{name}"
        assert line in text, line


def test_docs_example_prints_what_the_docs_say(capsys):
    """docs/verl.md's glm_<name> example runs as written and prints its ```text block."""
    import os
    import re
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    text = open(os.path.join(root, "docs", "verl.md")).read()
    section = text[text.index("## Every verl policy loss"):]
    block = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    expected = re.search(r"```text\n(.*?)```", section, re.S).group(1)
    exec(compile(block, "docs/verl.md[glm_<name> example]", "exec"), {"__name__": "docs"})
    assert capsys.readouterr().out == expected


@pytest.mark.parametrize("name", TOKEN_NAMES)
def test_empty_micro_batch_is_zero_where_verl_divides_by_zero(name):
    """The one documented difference: no response token and no global count -- verl's
    token-mean / seq-mean-* loss is 0/0 = NaN, the plug-in's 0 with a 0 gradient; with the
    global counts verl's ppo_loss passes in training both are 0; the metrics agree."""
    lp, old, _, adv, _ = make_batch(9)
    empty = torch.zeros_like(lp, dtype=torch.bool)
    theirs, ours = core.POLICY_LOSS_REGISTRY[name], core.get_policy_loss_fn(f"glm_{name}")
    for mode in AGG_MODES:
        for info in BATCH_INFO:
            cfg = actor_config(name, batch_info=info, loss_agg_mode=mode)
            ref = run(theirs, lp, old, adv, empty, mode, cfg, None)
            got = run(ours, lp, old, adv, empty, mode, cfg, None)
            assert float(got[0]) == 0.0 and not got[1].any(), f"{name}/{mode}/{info}"
            if not torch.isnan(ref[0]):
                assert float(ref[0]) == 0.0 and not ref[1].any(), f"{name}/{mode}/{info}"
            assert set(got[2]) == set(ref[2])
            for key, value in ref[2].items():
                assert got[2][key] == pytest.approx(value, abs=1e-6), f"{name}/{mode} {key}"


def test_signature_is_verls():
    """Each glm_<name> takes verl's function's parameters, in its order, with its defaults
    (gspo / sapo default to seq-mean-token-mean there)."""
    for name in VERL_NAMES:
        ref = inspect.signature(core.POLICY_LOSS_REGISTRY[name]).parameters
        ours = inspect.signature(verl_losses.POLICY_LOSSES[name]).parameters
        assert list(ours) == list(ref), name
        assert [p.default for p in ours.values()] == [p.default for p in ref.values()], name
