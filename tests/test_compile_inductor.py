"""Every public op under ``torch.compile(fullgraph=True)`` with the default Inductor backend,
forward and backward, equal to eager (docs/design.md 4), on the torch backend and the Triton
kernels.

Trainers compile their step with Inductor, which (unlike ``aot_eager``) asserts that every
custom op returns exactly the strides its fake kernel announced and lowers the code around
the ops itself. One graph per op holds a call per dtype the op takes and per mask kind (bool
and 0/1 float), so the whole module costs one Inductor compile per op. CPU Inductor needs a
C++ compiler: without one the tests run ``aot_eager`` and say so in their id.
"""
import shutil
import warnings

import pytest
import torch

import glm_kernels
from glm_kernels import HeadSplit
from tests._compare import TOLERANCES, assert_close
from tests.conftest import KERNEL_BACKEND, skip_without_kernels

HAS_CXX = any(shutil.which(name) for name in ("g++", "c++", "clang++"))
COMPILER = "inductor" if (HAS_CXX or torch.cuda.is_available()) else "aot_eager"
FLOATS = (torch.float32, torch.bfloat16, torch.float16)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(params=["torch", KERNEL_BACKEND], ids=lambda b: f"{b}-{COMPILER}")
def backend(request):
    if request.param != "torch":
        skip_without_kernels()
    torch._dynamo.reset()
    with glm_kernels.force_backend(request.param):
        yield request.param


def _tol(t: torch.Tensor) -> float:
    return TOLERANCES.get(t.dtype, 0.0)   # integer outputs (ids, counts) compare exactly


def check_compiled_matches_eager(step, leaves, differentiable=True):
    """step(*leaves) -> tuple of tensors, the first a scalar to differentiate: the compiled
    outputs and every float leaf's gradient equal eager's (per-dtype tolerance, ints exact).
    ``differentiable=False``: ops without a gradient (the optimizer's orthogonalization)."""
    def run(fn):
        mine = [t.detach().clone().requires_grad_(differentiable and t.is_floating_point())
                for t in leaves]
        outs = fn(*mine)
        if outs[0].requires_grad:
            outs[0].backward()
        return [o.detach() for o in outs], [t.grad for t in mine]

    eager_out, eager_grads = run(step)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        compiled_out, compiled_grads = run(torch.compile(step, fullgraph=True,
                                                         backend=COMPILER))
    assert len(compiled_out) == len(eager_out)
    for i, (a, b) in enumerate(zip(compiled_out, eager_out)):
        assert a.dtype == b.dtype and a.shape == b.shape, f"output {i}: {a.dtype}{tuple(a.shape)}"
        assert_close(a, b, tol=_tol(b), name=f"compiled output {i}")
    for i, (a, b) in enumerate(zip(compiled_grads, eager_grads)):
        assert (a is None) == (b is None), f"leaf {i}: gradient present in one run only"
        if b is not None:
            assert torch.isfinite(b.float()).all() and b.abs().sum() > 0, f"leaf {i}: no gradient"
            assert_close(a, b, tol=_tol(b), name=f"compiled grad of leaf {i}")


def _lp_batch(shape, seed):
    """(rollout, advantages, bool mask, 0/1 float mask) beside log-probs of ``shape``."""
    g = torch.Generator().manual_seed(seed)
    rollout = -torch.rand(shape, generator=g) * 2 - 0.1
    adv = torch.randn(shape, generator=g)
    mask = torch.rand(shape, generator=g) > 0.2
    return (t.to(DEVICE) for t in (rollout, adv, mask, mask.float()))


def _randn(shape, seed, dtype=torch.float32, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale).to(dtype=dtype, device=DEVICE)


def test_icepop_loss(backend):
    rollout, adv, mask, fmask = _lp_batch((3, 9), seed=1)
    leaves = [(rollout + _randn((3, 9), 2, scale=0.3)).to(dt) for dt in FLOATS]

    def step(*lps):
        outs = []
        for lp in lps:
            for m in (mask, fmask):
                loss, metrics = glm_kernels.icepop_loss(lp, rollout.to(lp.dtype), adv, m,
                                                        reduction="seq_mean_token_mean",
                                                        return_metrics=True)
                outs += [loss, metrics["pop_frac"], metrics["clip_frac"]]
            outs.append(glm_kernels.icepop_loss(lp, rollout, adv, mask, reduction="none",
                                                old_logprobs=rollout + 0.05).sum())
        return (sum(o for o in outs[0::2]),) + tuple(outs)
    check_compiled_matches_eager(step, leaves)


# Plain torch ops (no custom op, no kernel): under the kernels' backend Inductor would compile
# the very same graph a second time (~1 min of CI for nothing).
@pytest.mark.parametrize("backend", ["torch"], indirect=True, ids=[f"torch-{COMPILER}"])
def test_mismatch_metrics_and_advantages(backend):
    rollout, adv, mask, fmask = _lp_batch((4, 7), seed=3)
    train = rollout + _randn((4, 7), 4, scale=0.2)
    rewards = _randn((8,), 5)

    def step(train_lp, student):
        outs = [glm_kernels.group_advantages(rewards, group_size=4),
                glm_kernels.opd_advantages(student, rollout, form="log_ratio"),
                glm_kernels.opd_advantages(student, rollout, form="kl_penalty", advantages=adv,
                                           coef=0.5)]
        for dt in FLOATS:
            for m in (mask, fmask):
                # bf16/fp16 inputs arrive in their dtype: a cast inside the graph may be fused
                # away by Inductor (it keeps fp32 where eager rounds), which is not the op's
                # behaviour under test.
                lp = train_lp if dt == torch.float32 else low_precision[dt]
                metrics = glm_kernels.mismatch_metrics(lp, rollouts[dt], m)
                outs += [metrics[key] for key in sorted(metrics)]
        return (outs[1].sum(),) + tuple(outs)
    low_precision = {dt: train.to(dt) for dt in FLOATS[1:]}
    rollouts = {dt: rollout.to(dt) for dt in FLOATS}
    check_compiled_matches_eager(step, [train, train + 0.1])


def _logits_batch(rows, vocab, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (rows,), generator=g).to(DEVICE)
    return ids, _randn((rows, vocab), seed + 1, scale=2.0)


def _rollout_near(logits, ids, seed):
    """Rollout log-probs within the IcePop gate of the logits' own (most tokens kept)."""
    own = logits.float().log_softmax(-1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    return own + _randn(own.shape, seed, scale=0.2)


def test_selective_logprobs_and_reverse_kl(backend):
    ids, logits = _logits_batch(6, 37, seed=6)
    teacher = _randn((6, 37), 8)
    leaves = [logits.to(dt) for dt in FLOATS]

    def step(*xs):
        outs = []
        for x in xs:
            lp, ent = glm_kernels.selective_logprobs(x, ids, temperature=0.9,
                                                     return_entropy=True)
            outs += [lp, ent]
            outs.append(glm_kernels.reverse_kl_from_logits(x, teacher.to(x.dtype),
                                                           temperature=1.5))
        return (sum(o.sum() for o in outs),) + tuple(outs)
    check_compiled_matches_eager(step, leaves)


@pytest.mark.parametrize("inplace_backward", [False, True])
def test_icepop_loss_from_logits(backend, inplace_backward):
    ids, logits = _logits_batch(2 * 5, 29, seed=9)
    ids = ids.reshape(2, 5)
    _, adv, mask, fmask = _lp_batch((2, 5), seed=10)
    leaves = [logits.reshape(2, 5, 29).to(dt) for dt in FLOATS]
    rollout = _rollout_near(leaves[0], ids, seed=11)

    def step(*xs):
        outs = []
        for x in xs:
            for m in (mask, fmask):
                # inplace_backward writes the gradient into its logits: each call gets its own
                x_in = x * 1.0 if inplace_backward else x
                loss, metrics = glm_kernels.icepop_loss_from_logits(
                    x_in, ids, rollout, adv, m, reduction="seq_mean_token_mean",
                    inplace_backward=inplace_backward, return_metrics=True)
                outs += [loss, metrics["pop_frac"]]
        return (sum(outs[0::2]),) + tuple(outs)
    check_compiled_matches_eager(step, leaves)


def test_fused_linear_icepop_loss(backend):
    ids, _ = _logits_batch(2 * 5, 23, seed=11)
    ids = ids.reshape(2, 5)
    _, adv, mask, fmask = _lp_batch((2, 5), seed=12)
    leaves = []
    for i, dt in enumerate(FLOATS):
        leaves += [_randn((2, 5, 8), 13, dt), _randn((23, 8), 20, dt, scale=0.5)]
    rollout = _rollout_near(leaves[0].float() @ leaves[1].float().t(), ids, seed=14)

    def step(*tensors):
        outs = []
        for hidden, weight in zip(tensors[0::2], tensors[1::2]):
            for m in (mask, fmask):
                outs.append(glm_kernels.fused_linear_icepop_loss(hidden, weight, ids, rollout,
                                                                 adv, m, chunk_size=3))
        return (sum(outs),) + tuple(outs)
    check_compiled_matches_eager(step, leaves)


def test_policy_loss(backend):
    """A token-ratio preset with the IcePop gate and a sequence-ratio one (GSPO) with stats:
    both kernels of the family in one graph."""
    old, adv, mask, fmask = _lp_batch((3, 9), seed=30)
    rollout = old + _randn((3, 9), 31, scale=0.3)
    leaves = [(old + _randn((3, 9), 32, scale=0.3)).to(dt) for dt in FLOATS]

    def step(*lps):
        outs = []
        for lp in lps:
            for m in (mask, fmask):
                outs.append(glm_kernels.policy_loss(
                    lp, old, adv, m, variant="vanilla", dual_clip=3.0, gate="decoupled",
                    rollout_logprobs=rollout))
                loss, stats = glm_kernels.policy_loss(lp, old, adv[:, 0], m, variant="gspo",
                                                      return_stats=True)
                outs += [loss, stats["pg_clipfrac"]]
        return (sum(outs[0::3]) + sum(outs[1::3]),) + tuple(outs)
    check_compiled_matches_eager(step, leaves)


def test_kl_penalty_loss(backend):
    ref, _, mask, fmask = _lp_batch((3, 9), seed=33)
    leaves = [(ref + _randn((3, 9), 34, scale=0.5)).to(dt) for dt in FLOATS]

    def step(*lps):
        outs = []
        for lp in lps:
            for m in (mask, fmask):
                outs.append(glm_kernels.kl_penalty_loss(
                    log_prob=lp, ref_log_prob=ref, response_mask=m, kl_penalty="low_var_kl",
                    loss_agg_mode="seq-mean-token-mean"))
            outs.append(glm_kernels.kl_penalty_terms(lp, ref, kl_penalty="k3",
                                                     clamp=False).sum())
        return (sum(outs),) + tuple(outs)
    check_compiled_matches_eager(step, leaves)


def test_fused_linear_logprobs(backend):
    ids, _ = _logits_batch(2 * 5, 23, seed=35)
    ids = ids.reshape(2, 5)
    leaves = []
    for dt in FLOATS:
        leaves += [_randn((2, 5, 8), 36, dt), _randn((23, 8), 37, dt, scale=0.5)]

    def step(*tensors):
        outs = []
        for hidden, weight in zip(tensors[0::2], tensors[1::2]):
            logprobs, entropy = glm_kernels.fused_linear_logprobs(
                hidden, weight, ids, return_entropy=True, chunk_size=3)
            outs += [logprobs.sum() + 0.1 * entropy.sum(), logprobs, entropy]
        return (sum(outs[0::3]),) + tuple(outs)
    check_compiled_matches_eager(step, leaves)


TOPK_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int32,
               torch.int64)


def test_topk(backend):
    base = _randn((3, 45), 30, scale=4.0).round()      # ties: the index order decides
    leaves = [base.to(dt) for dt in TOPK_DTYPES]
    lengths = torch.tensor([45, 7, 0], device=DEVICE)

    def step(*xs):
        outs = []
        for x in xs:
            values, indices = glm_kernels.topk(x, 5)
            outs += [values, indices]
            outs += list(glm_kernels.topk(x, 4, largest=False, sorted=False, lengths=lengths))
        grad_terms = [o.float().sum() for o in outs[0::4] if o.is_floating_point()]
        return (sum(grad_terms),) + tuple(outs)
    check_compiled_matches_eager(step, leaves)


def test_moe_route(backend):
    logits = _randn((6, 16), 31)
    bias = _randn((16,), 32, scale=0.1)
    replay = torch.stack([torch.randperm(16)[:4] for _ in range(6)]).to(DEVICE)
    leaves = [logits.to(dt) for dt in FLOATS]

    def step(*xs):
        outs = []
        for x in xs:
            outs += list(glm_kernels.moe_route(x, 4, bias=bias, n_group=4, topk_group=2))
            outs += list(glm_kernels.moe_route(x, 4, scoring="softmax", renormalize=False,
                                               scaling_factor=2.5))
            outs += list(glm_kernels.moe_route(x, 4, replay_ids=replay, return_mismatch=True))
        return (sum(o.sum() for o in outs if o.is_floating_point()),) + tuple(outs)
    check_compiled_matches_eager(step, leaves)


def test_newton_schulz_and_muon_split(backend):
    grads = [_randn((2, 8, 12), 40 + i, dt) for i, dt in enumerate(FLOATS)]
    stacked = _randn((2 * 5, 12), 45)
    split = HeadSplit(2, [3, 2])

    def step(*gs):
        outs = [glm_kernels.newton_schulz(g, coefficients="polar_express") for g in gs]
        outs.append(glm_kernels.newton_schulz(gs[0].transpose(-1, -2), method="gram"))
        outs.append(glm_kernels.muon_split_orthogonalize(stacked, split))
        return (outs[0].sum(),) + tuple(outs)
    check_compiled_matches_eager(step, grads, differentiable=False)
