"""policy_loss against verl 0.9.1's own policy losses (``verl.trainer.ppo.core_algos``).

Every POLICY_LOSS_REGISTRY function is called exactly as verl's actor calls it
(``old_log_prob=, log_prob=, advantages=, response_mask=, loss_agg_mode=, config=,
rollout_is_weights=``) with an ``ActorConfig`` built as verl builds it (``global_batch_info``
filled the way verl's workers fill it), and compared with ``policy_loss`` on the matching
preset: loss, gradient w.r.t. log_prob and every metric verl reports, for every
``loss_agg_mode``, with and without ``rollout_is_weights``, on both backends. Clip-Cov draws
its tokens from the torch generator: the same seed before each call selects the same tokens.
"""
import zlib

import pytest
import torch

import glm_kernels
from glm_kernels import policy_loss
from glm_kernels.loss import clip_cov_selection, kl_cov_selection
from tests._compare import TOLERANCES, assert_close
from tests.conftest import DEVICE

core = pytest.importorskip("verl.trainer.ppo.core_algos", reason="verl is not installed")
rc = pytest.importorskip("verl.trainer.ppo.rollout_corr_helper")
from verl.trainer.config.algorithm import RolloutCorrectionConfig  # noqa: E402
from verl.workers.config import ActorConfig, PolicyLossConfig  # noqa: E402

FP32 = TOLERANCES[torch.float32]
AGG_MODES = ["token-mean", "token-sum", "seq-mean-token-mean", "seq-mean-token-sum",
             "seq-mean-token-sum-norm"]
REGISTRY = ["vanilla", "gspo", "gpg", "clip_cov", "kl_cov", "geo_mean", "cispo", "sapo",
            "dro", "dppo_kl", "dppo_tv"]
LOW, HIGH, DUAL = 0.2, 0.28, 3.0
POLICY = dict(dro_beta=0.3, clip_cov_ratio=0.2, kl_cov_ratio=0.1, ppo_kl_coef=0.1)
# verl's workers fill global_batch_info per step (verl/workers/utils/losses.py); dp_size = 2
GLOBAL_INFO = dict(dp_size=2, batch_num_tokens=250, global_batch_size=12, loss_scale_factor=64)


def test_registry_is_covered():
    # verl's own entries (glm_kernels.integrations.verl, once imported, adds its own)
    own = {name for name, fn in core.POLICY_LOSS_REGISTRY.items()
           if not fn.__module__.startswith("glm_kernels")}
    assert own == set(REGISTRY) | {"bypass_mode"}
    assert own <= set(glm_kernels.POLICY_VARIANTS)


def actor_config(mode, rollout_correction=None, **global_info):
    policy = PolicyLossConfig(loss_mode=mode, **POLICY, **(
        {} if rollout_correction is None else {"rollout_correction": rollout_correction}))
    cfg = ActorConfig(strategy="fsdp", rollout_n=1, ppo_mini_batch_size=1,
                      ppo_micro_batch_size_per_gpu=1, clip_ratio=LOW, clip_ratio_low=LOW,
                      clip_ratio_high=HIGH, clip_ratio_c=DUAL, policy_loss=policy,
                      tau_pos=1.0, tau_neg=1.05)
    cfg.global_batch_info.update(global_info)
    return cfg


def make_batch(seed, rows=6, length=31):
    """Ragged rows (one all-masked), both advantage signs, ratios far outside the clip band,
    log-ratios past +-20; lp <= 0."""
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(rows, length, generator=g) * 3 - 0.05
    lp = torch.clamp(old + 0.5 * torch.randn(rows, length, generator=g), max=-1e-3)
    rollout = old + 0.4 * torch.randn(rows, length, generator=g)
    adv = torch.randn(rows, length, generator=g)
    lengths = torch.randint(1, length + 1, (rows,), generator=g)
    mask = torch.arange(length)[None, :] < lengths[:, None]
    mask[3] = False
    old[0, 0], lp[0, 0] = -27.0, -4.0                 # log-ratio +23
    old[1, 0], lp[1, 0] = -4.0, -27.0                 # log-ratio -23
    mask[:2, 0] = True
    weights = torch.rand(rows, length, generator=g) + 0.5
    return lp, old, rollout, adv, mask.float(), weights


def core_kwargs(mode, agg, info, length):
    """policy_loss's reduction arguments for verl's loss_agg_mode and global_batch_info."""
    dp = info.get("dp_size", 1)
    if mode == "geo_mean":                          # verl: torch.mean over rows, agg unused
        return dict(reduction="row_mean")
    if mode == "sapo":                              # verl forces seq-mean-token-mean
        agg = "seq-mean-token-mean"
    if agg == "token-mean":
        tokens = info.get("batch_num_tokens")
        return dict(reduction="token_mean",
                    denominator=None if tokens is None else tokens / dp)
    if agg == "token-sum":
        return dict(reduction="sum", loss_scale=float(dp))
    seqs = info.get("global_batch_size")
    out = dict(reduction=agg.replace("-", "_"), denominator=None if seqs is None else seqs / dp)
    if agg == "seq-mean-token-sum-norm":
        out["norm_length"] = float(info.get("loss_scale_factor") or length)
    return out


def variant_params(mode, lp, old, adv, mask):
    if mode in ("vanilla", "bypass_mode"):
        return dict(dual_clip=DUAL)
    if mode == "dro":
        return dict(dro_beta=POLICY["dro_beta"])
    if mode in ("dppo_kl", "dppo_tv"):
        return dict(ratio_cap=DUAL)
    if mode == "sapo":
        return dict(tau_pos=1.0, tau_neg=1.05)
    if mode == "kl_cov":
        return dict(ppo_kl_coef=POLICY["ppo_kl_coef"],
                    selection=kl_cov_selection(lp, adv, mask,
                                               kl_cov_ratio=POLICY["kl_cov_ratio"]))
    if mode == "clip_cov":
        torch.manual_seed(1234)                      # the seed verl's call below draws from
        return dict(selection=clip_cov_selection(lp, old, adv, mask, eps_low=LOW,
                                                 eps_high=HIGH,
                                                 clip_cov_ratio=POLICY["clip_cov_ratio"]))
    return {}


def compare(verl_out, mine, lp_verl, lp_mine, magnitude):
    (v_loss, v_metrics), (m_loss, m_stats) = verl_out, mine
    budget = FP32 * max(abs(v_loss.item()), magnitude) + 1e-7
    assert abs(m_loss.item() - v_loss.item()) <= budget, (m_loss.item(), v_loss.item())
    (v_grad,) = torch.autograd.grad(v_loss, lp_verl)
    (m_grad,) = torch.autograd.grad(m_loss, lp_mine)
    assert_close(m_grad.cpu(), v_grad, tol=FP32, name="grad")
    # actor/* are the loss's metrics; bypass_mode adds its rollout-correction helper's own
    actor = {k.split("/", 1)[1]: v for k, v in v_metrics.items() if k.startswith("actor/")}
    assert set(actor) <= set(m_stats), set(actor) - set(m_stats)
    for name, value in actor.items():
        got = m_stats[name].item()
        assert abs(got - value) <= FP32 * max(1.0, abs(value)), (name, got, value)


@pytest.mark.parametrize("mode", REGISTRY)
@pytest.mark.parametrize("agg", AGG_MODES)
@pytest.mark.parametrize("weighted", [False, True], ids=["no_is", "rollout_is"])
def test_matches_verl(any_backend, mode, agg, weighted):
    lp, old, _, adv, mask, weights = make_batch(zlib.crc32(f"{mode}{agg}".encode()) % 1000)
    info = GLOBAL_INFO if agg != "token-mean" or weighted else {}
    is_weights = weights if weighted else None
    lp_verl = lp.clone().requires_grad_(True)
    extra = variant_params(mode, lp, old, adv, mask)
    torch.manual_seed(1234)
    verl_out = core.get_policy_loss_fn(mode)(
        old_log_prob=old, log_prob=lp_verl, advantages=adv, response_mask=mask,
        loss_agg_mode=agg, config=actor_config(mode, **info), rollout_is_weights=is_weights)
    if mode in ("clip_cov", "kl_cov") and "selection" in extra:
        assert extra["selection"].any(), "the batch must select some tokens"
    on = lambda t: None if t is None else t.to(DEVICE)   # noqa: E731
    lp_mine = lp.to(DEVICE).requires_grad_(True)
    red = core_kwargs(mode, agg, info, lp.shape[-1])
    extra = {k: on(v) if isinstance(v, torch.Tensor) else v for k, v in extra.items()}
    mine = policy_loss(lp_mine, on(old), on(adv), on(mask), variant=mode, eps_low=LOW,
                       eps_high=HIGH, token_weights=on(is_weights), return_stats=True,
                       **red, **extra)
    with torch.no_grad():
        terms = policy_loss(lp_mine, on(old), on(adv), on(mask), variant=mode, eps_low=LOW,
                            eps_high=HIGH, token_weights=on(is_weights), reduction="none",
                            **extra)
    magnitude = terms.abs().sum().item() * info.get("dp_size", 1)
    compare(verl_out, mine, lp_verl, lp_mine, magnitude)


@pytest.mark.parametrize("preset,variant", [
    ("bypass_ppo_clip", "bypass_mode"),
    ("bypass_pg_is", "bypass_mode_reinforce"),
    ("bypass_pg_token_icepop", "bypass_mode_reinforce"),
])
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-sum"])
def test_bypass_mode_matches_verl(any_backend, preset, variant, agg):
    """verl's bypass_mode: old_log_prob is the rollout's; its rollout-correction helper (which
    the integration calls too) gives the IS weights and mask that policy_loss takes."""
    lp, _, rollout, adv, mask, _ = make_batch(17)
    corr = getattr(RolloutCorrectionConfig, preset)()
    lp_verl = lp.clone().requires_grad_(True)
    verl_out = core.get_policy_loss_fn("bypass_mode")(
        old_log_prob=rollout, log_prob=lp_verl, advantages=adv, response_mask=mask,
        loss_agg_mode=agg, config=actor_config("bypass_mode", corr), rollout_is_weights=None)
    proto, eff_mask, _ = rc.compute_rollout_correction_and_rejection_mask(
        old_log_prob=lp, rollout_log_prob=rollout, response_mask=mask,
        rollout_is=corr.rollout_is, rollout_is_threshold=corr.rollout_is_threshold,
        rollout_is_batch_normalize=corr.rollout_is_batch_normalize, rollout_rs=corr.rollout_rs,
        rollout_rs_threshold=corr.rollout_rs_threshold)
    weights = proto.batch["rollout_is_weights"] if proto is not None else None
    if corr.loss_type == "ppo_clip":
        weights = None                               # verl: the clip handles the ratio
    lp_mine = lp.to(DEVICE).requires_grad_(True)
    kwargs = dict(variant=variant, eps_low=LOW, eps_high=HIGH,
                  token_weights=None if weights is None else weights.to(DEVICE),
                  **core_kwargs(variant, agg, {}, lp.shape[-1]),
                  **variant_params(variant, lp, rollout, adv, mask))
    mine = policy_loss(lp_mine, rollout.to(DEVICE), adv.to(DEVICE), eff_mask.to(DEVICE),
                       return_stats=True, **kwargs)
    with torch.no_grad():
        kwargs.update(reduction="none", denominator=None, loss_scale=1.0)
        kwargs.pop("norm_length", None)
        terms = policy_loss(lp_mine, rollout.to(DEVICE), adv.to(DEVICE), eff_mask.to(DEVICE),
                            **kwargs)
    compare(verl_out, mine, lp_verl, lp_mine, terms.abs().sum().item())


@pytest.mark.parametrize("mode,threshold", [("truncate", 2.0), ("mask", "0.5_2.0")])
@pytest.mark.parametrize("variant", ["vanilla", "gspo", "geo_mean"])
def test_sequence_is_matches_verl_weights(any_backend, mode, threshold, variant):
    """seq_is= equals feeding verl's own sequence-level weights (rollout_is="sequence",
    compute_rollout_correction_weights) to verl's loss as rollout_is_weights."""
    lp, old, rollout, adv, mask, _ = make_batch(23)
    rollout = old + 0.05 * torch.randn(old.shape, generator=torch.Generator().manual_seed(2))
    weights, _ = rc.compute_rollout_correction_weights(
        log_ratio=old - rollout, response_mask=mask, rollout_is="sequence",
        rollout_is_threshold=threshold)
    mine_weights = glm_kernels.loss.sequence_is_weights(old, rollout, mask, mode=mode,
                                                        high=2.0, low=0.5 if mode == "mask"
                                                        else None)
    assert_close(mine_weights * mask, weights, tol=FP32, name="weights")
    assert (weights[mask.bool()] < 2.0).any() and (weights[mask.bool()] != 1.0).any()
    agg = "seq-mean-token-mean"
    lp_verl = lp.clone().requires_grad_(True)
    verl_out = core.get_policy_loss_fn(variant)(
        old_log_prob=old, log_prob=lp_verl, advantages=adv, response_mask=mask,
        loss_agg_mode=agg, config=actor_config(variant), rollout_is_weights=weights)
    on = lambda t: t.to(DEVICE)   # noqa: E731
    lp_mine = on(lp).requires_grad_(True)
    kwargs = dict(variant=variant, eps_low=LOW, eps_high=HIGH, rollout_logprobs=on(rollout),
                  seq_is=mode, seq_is_high=2.0, seq_is_low=0.5 if mode == "mask" else None,
                  **core_kwargs(variant, agg, {}, lp.shape[-1]),
                  **variant_params(variant, lp, old, adv, mask))
    mine = policy_loss(lp_mine, on(old), on(adv), on(mask), return_stats=True, **kwargs)
    with torch.no_grad():
        kwargs["reduction"] = "none"
        terms = policy_loss(lp_mine, on(old), on(adv), on(mask), **kwargs)
    compare(verl_out, mine, lp_verl, lp_mine, terms.abs().sum().item())
