"""``glm_bypass_mode``'s own rollout correction against verl 0.9.1's helper.

``verl_rollout_correction.rollout_correction`` replaces verl's
``compute_rollout_correction_and_rejection_mask`` in the bypass-mode loss; here both get the
same (current policy, rollout, mask) and every rollout-correction setting verl's presets use,
plus the ones no preset spells (token IcePop with batch normalisation, sequence IcePop, float
masks, bf16 log-probs): the IS weights, the mask after rejection and every metric (keys and
values) must be verl's. Skipped only when verl is not installed.
"""
import pytest
import torch

rc = pytest.importorskip("verl.trainer.ppo.rollout_corr_helper", reason="verl missing")
from verl.trainer.config.algorithm import RolloutCorrectionConfig  # noqa: E402

from glm_kernels.integrations.verl.rollout_correction import rollout_correction  # noqa: E402
from tests.integrations.test_verl_losses import bypass_batch  # noqa: E402

PRESETS = tuple(sorted(name for name, member in vars(RolloutCorrectionConfig).items()
                       if isinstance(member, classmethod)))
EXTRA = {
    "token_tis_normalized": dict(rollout_is="token", rollout_is_threshold=2.0,
                                 rollout_is_batch_normalize=True),
    "seq_tis_normalized": dict(rollout_is="sequence", rollout_is_threshold=3.0,
                               rollout_is_batch_normalize=True),
    "token_icepop_normalized": dict(rollout_is="token", rollout_is_threshold="0.5_2.0",
                                    rollout_is_batch_normalize=True),
    "seq_icepop": dict(rollout_is="sequence", rollout_is_threshold="0.8_1.5"),
    "token_tis_string": dict(rollout_is="token", rollout_is_threshold="1.5"),
    "token_icepop_and_rs": dict(rollout_is="token", rollout_is_threshold="0.5_2.0",
                                rollout_rs="token_k1,seq_max_k2",
                                rollout_rs_threshold="0.6_1.6,0.5"),
    "no_is": dict(rollout_is=None),
}


def verl_fields(correction):
    if isinstance(correction, dict):
        fields = dict(rollout_is=None, rollout_is_threshold=2.0,
                      rollout_is_batch_normalize=False, rollout_rs=None,
                      rollout_rs_threshold=None)
        fields.update(correction)
        return fields
    return dict(rollout_is=correction.rollout_is,
                rollout_is_threshold=correction.rollout_is_threshold,
                rollout_is_batch_normalize=correction.rollout_is_batch_normalize,
                rollout_rs=correction.rollout_rs,
                rollout_rs_threshold=correction.rollout_rs_threshold)


def compare(lp, rollout, mask, correction, label, rel=1e-5):
    proto, verl_mask, verl_metrics = rc.compute_rollout_correction_and_rejection_mask(
        old_log_prob=lp, rollout_log_prob=rollout, response_mask=mask,
        **verl_fields(correction))
    weights, ours_mask, metrics = rollout_correction(lp, rollout, mask, correction)
    if proto is None:
        assert weights is None, label
    else:
        ref = proto.batch["rollout_is_weights"]
        assert weights.dtype == ref.dtype and weights.shape == ref.shape, label
        on = mask.bool()
        torch.testing.assert_close(weights[on], ref[on], rtol=rel, atol=0, msg=label)
    assert ours_mask.dtype == verl_mask.dtype and torch.equal(ours_mask, verl_mask), label
    assert list(metrics) == list(verl_metrics), label      # same keys, same order
    for key, value in verl_metrics.items():
        assert isinstance(metrics[key], float), f"{label} {key}"
        assert metrics[key] == pytest.approx(value, rel=rel, abs=1e-6), f"{label} {key}"
    return verl_metrics


@pytest.mark.parametrize("preset", PRESETS)
def test_every_preset_matches_verls_helper(preset):
    lp, rollout, _, mask = bypass_batch(3)
    for m in (mask, mask.float()):
        compare(lp, rollout, m, getattr(RolloutCorrectionConfig, preset)(), preset)


@pytest.mark.parametrize("name", sorted(EXTRA))
def test_settings_no_preset_spells(name):
    lp, rollout, _, mask = bypass_batch(4)
    metrics = compare(lp, rollout, mask, EXTRA[name], name)
    if "normalized" in name:
        assert metrics["rollout_corr/rollout_is_batch_norm_factor"] != 1.0
    if name == "token_icepop_and_rs":
        assert 0 < metrics["rollout_corr/rollout_rs_masked_fraction"] < 1


def test_wide_drift_reaches_every_branch():
    """Rows far off the rollout: TIS truncates, IcePop drops, sequence weights hit the +-20
    clamp and the fractions above / below the thresholds are nonzero."""
    lp, rollout, _, mask = bypass_batch(5)
    rollout = rollout.clone()
    rollout[1] += 3.0                    # sum of log-ratios far below -20
    rollout[4] -= 0.4
    for level in ("token", "sequence"):
        metrics = compare(lp, rollout, mask, dict(rollout_is=level, rollout_is_threshold=2.0),
                          level)
        assert metrics["rollout_corr/rollout_is_ratio_fraction_high"] > 0, level
        assert metrics["rollout_corr/rollout_is_ratio_fraction_low"] > 0, level
    metrics = compare(lp, rollout, mask, dict(rollout_is="token",
                                              rollout_is_threshold="0.5_2.0"), "icepop")
    assert metrics["rollout_corr/rollout_is_oob_ratio"] > 0


def test_bf16_log_prob():
    lp, rollout, _, mask = bypass_batch(6)
    for correction in (RolloutCorrectionConfig.bypass_pg_is(),
                       RolloutCorrectionConfig.bypass_pg_token_icepop(threshold=2.0)):
        compare(lp.bfloat16(), rollout, mask, correction, "bf16", rel=1e-2)


def test_errors_are_verls():
    lp, rollout, _, mask = bypass_batch(7)
    empty = torch.zeros_like(mask)
    for correction in (RolloutCorrectionConfig.bypass_ppo_clip(),
                       RolloutCorrectionConfig.bypass_pg_is(),
                       RolloutCorrectionConfig.bypass_ppo_clip_k3_rs()):
        with pytest.raises(ValueError, match="at least one valid token"):
            rollout_correction(lp, rollout, empty, correction)
    with pytest.raises(ValueError, match="rollout_is"):
        rollout_correction(lp, rollout, mask, dict(rollout_is="row"))
    with pytest.raises(ValueError, match="rollout_is_threshold"):
        rollout_correction(lp, rollout, mask, dict(rollout_is="token",
                                                   rollout_is_threshold="a_b"))
    with pytest.raises(ValueError, match="rollout_rs_threshold"):
        rollout_correction(lp, rollout, mask, dict(rollout_rs="token_k1"))
    with pytest.raises(ValueError, match="shape"):
        rollout_correction(lp, rollout[:, 1:], mask, dict(rollout_is="token"))


def test_bypass_loss_does_not_call_verls_combined_helper(monkeypatch):
    """glm_bypass_mode computes the IS weights and metrics itself (verl's rejection helper
    still serves rollout_rs)."""
    core = pytest.importorskip("verl.trainer.ppo.core_algos")
    from tests.integrations.test_verl_losses import actor_config, run

    def refuse(*args, **kwargs):
        raise AssertionError("verl's combined rollout-correction helper was called")
    monkeypatch.setattr(rc, "compute_rollout_correction_and_rejection_mask", refuse)
    lp, rollout, adv, mask = bypass_batch(8)
    for preset in ("bypass_pg_is", "bypass_ppo_clip", "bypass_ppo_clip_k3_rs"):
        cfg = actor_config("bypass_mode", correction=getattr(RolloutCorrectionConfig, preset)())
        loss, grad, metrics = run(core.get_policy_loss_fn("glm_bypass_mode"), lp, rollout, adv,
                                  mask, "token-mean", cfg, None)
        assert torch.isfinite(loss) and grad.abs().sum() > 0
        assert "rollout_corr/kl" in metrics
