"""Per-token entropy from logits (``selective_logprobs(..., return_entropy=True)``) against the
trainers' own entropy functions, imported from the installed packages: verl 0.9.1's
``entropy_from_logits`` / ``entropy_from_logits_with_chunking`` (the actor's entropy
coefficient) and TRL 1.16's ``entropy_from_logits`` / ``selective_log_softmax_and_entropy`` and
``GRPOTrainer.get_high_entropy_mask`` (``top_entropy_quantile``, ``entropy_coef``). Values and
gradients, with temperature, on both backends, fp32 and bf16.

Temperature: verl's actor divides the logits by T before calling its entropy function, TRL's
``selective_log_softmax_and_entropy`` takes ``temperature``; here the trainers get exactly
what their own code gives them.
"""
import pytest
import torch

from glm_kernels import selective_logprobs
from glm_kernels.testing import rel_error
from tests._compare import TOLERANCES, assert_close
from tests.conftest import DEVICE

verl_functional = pytest.importorskip("verl.utils.torch_functional")
verl_core_algos = pytest.importorskip("verl.trainer.ppo.core_algos")
trl_utils = pytest.importorskip("trl.trainer.utils")
trl_grpo = pytest.importorskip("trl.trainer.grpo_trainer")

FP32 = TOLERANCES[torch.float32]
BF16 = TOLERANCES[torch.bfloat16]


def _batch(b=3, t=6, v=130, *, seed=0, dtype=torch.float32):
    """Logits with entropies spread from near 0 to near log V (a per-row scale), token ids,
    upstream gradients for log-probs and entropy, and a response mask with an all-masked row."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.logspace(-1, 1.2, b * t)[torch.randperm(b * t, generator=g)].reshape(b, t, 1)
    logits = (torch.randn(b, t, v, generator=g) * scale).to(dtype)
    ids = torch.randint(0, v, (b, t), generator=g)
    grad_lp, grad_ent = torch.randn(b, t, generator=g), torch.randn(b, t, generator=g)
    mask = torch.rand(b, t, generator=g) > 0.3
    mask[1] = False                                               # an all-masked row
    return tuple(x.to(DEVICE) for x in (logits, ids, grad_lp, grad_ent, mask))


def _ours(logits, ids, temperature):
    x = logits.detach().clone().requires_grad_(True)
    lp, entropy = selective_logprobs(x, ids, temperature=temperature, return_entropy=True)
    return x, lp, entropy


def _leaf(logits):
    return logits.detach().clone().requires_grad_(True)


TRAINER_ENTROPY = {
    # name -> f(logits / T as the trainer sees them) -> [*S] entropy
    "verl.entropy_from_logits": lambda z: verl_functional.entropy_from_logits(z),
    "verl.entropy_from_logits_with_chunking": lambda z: verl_functional.
    entropy_from_logits_with_chunking(z.reshape(-1, z.shape[-1]), chunk_size=4)
    .reshape(z.shape[:-1]),
    "trl.entropy_from_logits": lambda z: trl_utils.entropy_from_logits(z, chunk_size=4),
}


@pytest.mark.parametrize("name", sorted(TRAINER_ENTROPY))
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_entropy_matches_trainer_fp32(any_backend, name, temperature):
    logits, ids, _, grad_ent, _ = _batch(seed=1)
    x, _, entropy = _ours(logits, ids, temperature)
    (entropy * grad_ent).sum().backward()
    y = _leaf(logits)
    ref = TRAINER_ENTROPY[name](y / temperature)
    (ref * grad_ent).sum().backward()
    assert entropy.dtype == torch.float32 and entropy.shape == ids.shape
    assert_close(entropy, ref, tol=FP32, name=f"entropy vs {name}")
    assert_close(x.grad, y.grad, tol=FP32, name=f"dlogits vs {name}")


@pytest.mark.parametrize("name", sorted(TRAINER_ENTROPY))
def test_entropy_matches_trainer_bf16(any_backend, name):
    """bf16 logits: ours computes in fp32 from the bf16 values, so it equals the trainer's
    function on those same values upcast (fp32 tolerance for the value, bf16 for the bf16
    gradient). verl's ``entropy_from_logits`` itself on bf16 keeps its softmax in bf16: ours
    is closer to the exact entropy than that (the check fails if ours rounds as much)."""
    logits, ids, _, grad_ent, _ = _batch(seed=2, dtype=torch.bfloat16)
    temperature = 0.7
    x, _, entropy = _ours(logits, ids, temperature)
    (entropy * grad_ent).sum().backward()
    y = _leaf(logits.float())
    ref = TRAINER_ENTROPY[name](y / temperature)
    (ref * grad_ent).sum().backward()
    assert x.grad.dtype == torch.bfloat16
    assert_close(entropy, ref, tol=FP32, name=f"entropy vs {name} (upcast)")
    assert_close(x.grad.float(), y.grad, tol=BF16, name=f"dlogits vs {name} (upcast)")
    with torch.no_grad():
        in_bf16 = TRAINER_ENTROPY[name](logits / temperature).float()
    assert rel_error(entropy, ref) <= max(rel_error(in_bf16, ref), FP32)
    assert_close(entropy, in_bf16, tol=3 * BF16, name=f"entropy vs {name} in bf16")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_logprobs_and_entropy_match_trl_one_pass(any_backend, dtype, temperature):
    """TRL's ``selective_log_softmax_and_entropy`` (what its GRPO path computes per token):
    both outputs and the gradient of a loss that uses both."""
    logits, ids, grad_lp, grad_ent, _ = _batch(seed=3, dtype=dtype)
    x, lp, entropy = _ours(logits, ids, temperature)
    ((lp * grad_lp).sum() + (entropy * grad_ent).sum()).backward()
    y = _leaf(logits if dtype == torch.float32 else logits.float())
    lp_ref, ent_ref = trl_utils.selective_log_softmax_and_entropy(y, ids,
                                                                 temperature=temperature)
    ((lp_ref * grad_lp).sum() + (ent_ref * grad_ent).sum()).backward()
    assert_close(lp, lp_ref, tol=FP32, name="log-probs vs TRL")
    assert_close(entropy, ent_ref, tol=FP32, name="entropy vs TRL")
    assert_close(x.grad.float(), y.grad, tol=TOLERANCES[dtype], name="dlogits vs TRL")


@pytest.mark.parametrize("quantile", [0.2, 0.5, 1.0])
def test_top_entropy_quantile_mask_matches_trl(any_backend, quantile):
    """``top_entropy_quantile``: TRL's own ``GRPOTrainer.get_high_entropy_mask`` (run with a
    single-process ``accelerate.Accelerator``, which it uses only to gather across ranks) on
    our entropies selects the tokens it selects on TRL's, all-masked row included."""
    accelerate = pytest.importorskip("accelerate")
    trainer = type("OneProcess", (), {"accelerator": accelerate.Accelerator()})()
    get_mask = trl_grpo.GRPOTrainer.get_high_entropy_mask
    logits, ids, _, _, mask = _batch(b=4, t=16, seed=4)
    _, _, entropy = _ours(logits, ids, 0.8)
    _, ent_ref = trl_utils.selective_log_softmax_and_entropy(logits, ids, temperature=0.8)
    ours = get_mask(trainer, entropy.detach(), mask, 1 - quantile)
    ref = get_mask(trainer, ent_ref, mask, 1 - quantile)
    assert torch.equal(ours, ref)
    assert not ours[1].any()                                    # the all-masked row
    expected = round(quantile * int(mask.sum()))
    assert abs(int(ours.sum()) - expected) <= 1                 # the mask is not all or none


@pytest.mark.parametrize("loss_agg_mode", ["token-mean", "seq-mean-token-sum",
                                           "seq-mean-token-mean"])
def test_verl_entropy_coefficient_term(any_backend, loss_agg_mode):
    """verl's actor: ``policy_loss -= entropy_coeff * agg_loss(entropy, response_mask, mode)``
    with verl's own ``agg_loss``; the entropy bonus's value and gradient from our entropy
    equal those from verl's ``entropy_from_logits`` (ragged mask, an all-masked row)."""
    logits, ids, _, _, mask = _batch(seed=5)
    coeff, temperature = 0.01, 0.9

    def bonus(entropy):
        return -coeff * verl_core_algos.agg_loss(loss_mat=entropy, loss_mask=mask.float(),
                                                 loss_agg_mode=loss_agg_mode)
    x, _, entropy = _ours(logits, ids, temperature)
    ours = bonus(entropy)
    ours.backward()
    y = _leaf(logits)
    ref = bonus(verl_functional.entropy_from_logits(y / temperature))
    ref.backward()
    assert_close(ours, ref, tol=FP32, name="entropy bonus")
    assert_close(x.grad, y.grad, tol=FP32, name="dlogits of the entropy bonus")
    assert x.grad[1].abs().max() == 0                           # masked row: no gradient
