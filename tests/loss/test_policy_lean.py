"""The lean torch path's DPPO objectives (``loss/_policy_torch.py``) against the readable
reference: the same check ``test_policy_loss.test_lean_torch_path_matches_readable_reference``
runs for the other lean objectives (loss, gradient, stats, every reduction, a factor-0 token
holding NaN / inf inputs), plus a batch where DPPO's band and truncation both bind."""
import pytest
import torch

from glm_kernels.loss import _policy_torch as lean_mod
from glm_kernels.loss._policy_spec import POLICY_VARIANTS
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
