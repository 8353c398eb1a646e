import pytest
import torch

from glm_kernels.loss._logits_reference import selective_logprobs_reference
from glm_kernels.loss.from_logits import icepop_loss_from_logits
from glm_kernels.loss.icepop import icepop_loss
from glm_kernels.loss.logprobs import selective_logprobs
from tests._compare import assert_close


def _logits(n, v, dtype, scale=3.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, v, generator=g) * scale
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("v,temperature", [(300, 1.0), (517, 0.7)])
def test_values_and_grad_match_reference(any_backend, dtype, v, temperature):
    logits = _logits(6, v, dtype)
    ids = torch.randint(0, v, (6,), generator=torch.Generator().manual_seed(1))
    grad = torch.randn(6, generator=torch.Generator().manual_seed(2))
    x = logits.clone().requires_grad_(True)
    out = selective_logprobs(x, ids, temperature=temperature)
    (out * grad).sum().backward()
    xr = logits.clone().requires_grad_(True)
    ref = selective_logprobs_reference(xr, ids, temperature)
    (ref * grad).sum().backward()
    assert out.dtype == torch.float32
    assert_close(out, ref, tol=1e-5, name="logprobs")
    assert_close(x.grad.float(), xr.grad.float(), tol=1e-2 if dtype == torch.bfloat16 else 1e-5,
                 name="dlogits")


def test_large_magnitudes_and_neg_inf(kernel_backend):
    logits = _logits(4, 300, torch.float32, scale=1e4)
    logits[:, 100:180] = float("-inf")   # masked vocab
    logits[2, :] = float("-inf")
    logits[2, 7] = 5.0                   # a row with one finite entry
    ids = torch.tensor([3, 250, 7, 99])
    out = selective_logprobs(logits, ids)
    ref = selective_logprobs_reference(logits, ids)
    assert torch.isfinite(out).all()
    assert_close(out, ref, tol=1e-5, name="logprobs")


def test_from_logits_equals_composition(kernel_backend):
    logits = _logits(2 * 5, 260, torch.float32).reshape(2, 5, 260)
    ids = torch.randint(0, 260, (2, 5), generator=torch.Generator().manual_seed(3))
    lp_ref = selective_logprobs_reference(logits, ids)
    rollout = lp_ref + 0.1 * torch.randn(2, 5, generator=torch.Generator().manual_seed(4))
    adv = torch.randn(2, 5, generator=torch.Generator().manual_seed(5))
    x = logits.clone().requires_grad_(True)
    loss = icepop_loss_from_logits(x, ids, rollout, adv, temperature=1.0, eps_high=0.3)
    loss.backward()
    xr = logits.clone().requires_grad_(True)
    ref = icepop_loss(selective_logprobs_reference(xr, ids), rollout, adv, eps_high=0.3)
    ref.backward()
    assert_close(loss, ref, tol=1e-5, name="loss")
    assert_close(x.grad, xr.grad, tol=1e-4, name="dlogits")


def test_bad_token_ids_raise():
    with pytest.raises(ValueError, match="token_ids"):
        selective_logprobs(torch.zeros(3, 10), torch.tensor([0, 1, 10]))
    with pytest.raises(TypeError, match="token_ids"):
        selective_logprobs(torch.zeros(3, 10), torch.zeros(3))
