"""Vocab-parallel (Megatron layout) on CPU: 2 and 4 gloo processes, sharded == unsharded.

One spawn per world size runs every case with both backends (torch, and the Triton kernels
under the interpreter); each rank compares its sharded values and gradient slice with the
unsharded call on the full logits, and writes a verdict per case that the tests read. On two
ranks the three ops also run in one ``torch.compile(fullgraph=True)`` graph (torch backend).
"""
import traceback

import pytest
import torch
import torch.distributed as dist

import glm_kernels
from glm_kernels.loss import (icepop_loss_from_logits, reverse_kl_from_logits,
                              selective_logprobs)
from glm_kernels.loss.logprobs._reference import selective_logprobs_reference
from tests._compare import assert_close
from tests._gloo import run_ranks
from tests.conftest import skip_without_kernels

# CPU processes over gloo; on a CUDA machine the interpreter is off, so the torch path only.
BACKENDS = ("torch",) if torch.cuda.is_available() else ("torch", "interpret")
CASES = ("logprobs_entropy", "logprobs_long_rows", "icepop_fused_vs_sharded",
         "icepop_none_inplace", "reverse_kl", "subgroups")


def _full_logits(v, *, seed, rows=6, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, v, generator=g) * scale
    x[1] *= 3000.0                                     # |z| ~ 1e4
    x[2, v // 3: v // 3 + v // 2] = float("-inf")      # masked vocab across shard borders
    x[3, : v - 3] = float("-inf")                      # only the last shard has mass
    return x


def _ids(v, rows=6, seed=1):
    ids = torch.randint(0, v, (rows,), generator=torch.Generator().manual_seed(seed))
    ids[3] = v - 1
    ids[4] = 0
    return ids


def _run(fn, logits, grad_fn):
    x = logits.clone().requires_grad_(True)
    out = fn(x)
    grad_fn(out).backward()
    values = out if isinstance(out, tuple) else (out,)
    return [o.detach() for o in values], x.grad


def _compare_sharded(fn, grad_fn, logits, group, rank_in_group, world_in_group, tol=1e-5):
    v = logits.shape[-1] // world_in_group
    cols = slice(rank_in_group * v, (rank_in_group + 1) * v)
    full_vals, full_grad = _run(lambda x: fn(x, None), logits, grad_fn)
    shard_vals, shard_grad = _run(lambda x: fn(x, group), logits[..., cols].contiguous(),
                                  grad_fn)
    for i, (a, b) in enumerate(zip(shard_vals, full_vals)):
        finite = torch.isfinite(b)
        same = (a == b) | (torch.isnan(a) & torch.isnan(b))
        assert bool(same[~finite].all()), f"output {i}: non-finite entries differ: {a} vs {b}"
        assert_close(a[finite], b[finite], tol=tol, name=f"output {i}")
    assert_close(shard_grad, full_grad[..., cols], tol=tol, name="gradient slice")


def _weights(n, seed):
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


def _case_logprobs(group, rank, world, v_local, temperature):
    logits = _full_logits(world * v_local, seed=2)
    ids = _ids(world * v_local)
    w1, w2 = _weights(6, 3), _weights(6, 4)

    def fn(x, g):
        return selective_logprobs(x, ids, temperature=temperature,
                                              return_entropy=True, tp_group=g)

    def grad_fn(out):
        lp, ent = out
        finite = torch.isfinite(lp)     # keep the -inf / NaN rows out of the loss
        return (torch.where(finite, lp, 0.0) * w1).sum() + (ent * w2).nan_to_num(0.0).sum()
    _compare_sharded(fn, grad_fn, logits, group, rank, world)
    # And the reference agrees with the unsharded value (and so with every shard).
    lp_ref = selective_logprobs_reference(logits, ids, temperature)
    lp = selective_logprobs(logits, ids, temperature=temperature)
    assert_close(lp[torch.isfinite(lp_ref)], lp_ref[torch.isfinite(lp_ref)], tol=1e-5,
                 name="vs reference")


def _icepop_inputs(v, seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(2, 3, v, generator=g) * 3
    ids = torch.randint(0, v, (2, 3), generator=g)
    lp = selective_logprobs_reference(logits, ids)
    rollout = lp + 0.6 * torch.randn(2, 3, generator=g)
    adv = torch.randn(2, 3, generator=g)
    mask = torch.tensor([[True, True, False], [True, True, True]])
    return logits, ids, rollout, adv, mask


def _case_icepop(group, rank, world, reduction, inplace):
    logits, ids, rollout, adv, mask = _icepop_inputs(world * 70, seed=5)

    def fn(x, g):
        feed = x * 1.0 if inplace else x
        loss, metrics = icepop_loss_from_logits(
            feed, ids, rollout, adv, mask, temperature=0.9, tp_group=g, reduction=reduction,
            inplace_backward=inplace, return_metrics=True)
        return loss, metrics["pop_frac"], metrics["ratio_mean"]

    weights = torch.linspace(0.5, 1.5, 6).reshape(2, 3)
    grad_fn = (lambda out: (out[0] * weights).sum()) if reduction == "none" else \
        (lambda out: out[0] * -2.0)
    _compare_sharded(fn, grad_fn, logits, group, rank, world)


def _case_reverse_kl(group, rank, world):
    student = _full_logits(world * 70, seed=6)
    noise = torch.randn(student.shape, generator=torch.Generator().manual_seed(8))
    teacher = (student + noise * 2).nan_to_num(neginf=-1e30)
    teacher[2] = float("-inf")
    teacher[2, :5] = 1.0                                # student mass where teacher has none
    w = _weights(6, 7)

    def fn(x, g):
        return reverse_kl_from_logits(x, teacher_shard(g), temperature=1.3,
                                                  tp_group=g)

    def teacher_shard(g):
        if g is None:
            return teacher
        v = teacher.shape[-1] // world
        return teacher[:, rank * v:(rank + 1) * v].contiguous()

    def grad_fn(kl):
        return (torch.where(torch.isfinite(kl), kl, 0.0) * w).sum()
    _compare_sharded(fn, grad_fn, student, group, rank, world)


def _case_compiled(group, rank, world):
    """The three ops in one torch.compile(fullgraph=True) graph with ``tp_group`` (the group
    enters their schemas by name, the all-reduces run inside them) equal the eager calls."""
    logits, ids, rollout, adv, mask = _icepop_inputs(world * 70, seed=9)
    teacher = logits + torch.randn(logits.shape, generator=torch.Generator().manual_seed(10))
    cols = slice(rank * 70, (rank + 1) * 70)
    teacher_shard = teacher[..., cols].contiguous()
    w = _weights(6, 11).reshape(2, 3)

    def step(x):
        lp, ent = selective_logprobs(x, ids, temperature=0.9, return_entropy=True,
                                     tp_group=group)
        kl = reverse_kl_from_logits(x, teacher_shard, tp_group=group)
        loss = icepop_loss_from_logits(x * 1.0, ids, rollout, adv, mask, tp_group=group,
                                       reduction="none", inplace_backward=True)
        return (lp * w).sum() + ent.sum() + (kl * w).sum() + loss.sum(), lp, ent, kl, loss

    shard = logits[..., cols].contiguous()
    eager_vals, eager_grad = _run(step, shard, lambda out: out[0])
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    vals, grad = _run(compiled, shard, lambda out: out[0])
    for i, (a, b) in enumerate(zip(vals, eager_vals)):
        assert_close(a, b, tol=1e-5, name=f"compiled output {i}")
    assert_close(grad, eager_grad, tol=1e-5, name="compiled gradient")


def _run_cases(rank, world):
    world_group = dist.group.WORLD
    pairs = [dist.new_group([r, r + 1]) for r in range(0, world, 2)]   # collective: all ranks
    cases = {
        "logprobs_entropy": lambda: _case_logprobs(world_group, rank, world, 70, 0.7),
        "logprobs_long_rows": lambda: _case_logprobs(world_group, rank, world, 300, 1.0),
        "icepop_fused_vs_sharded": lambda: _case_icepop(world_group, rank, world, "token_mean",
                                                        False),
        "icepop_none_inplace": lambda: _case_icepop(world_group, rank, world, "none", True),
        "reverse_kl": lambda: _case_reverse_kl(world_group, rank, world),
        # TP groups of 2 inside a larger world: the rank inside the group decides the shard.
        "subgroups": lambda: _case_logprobs(pairs[rank // 2], rank % 2, 2, 50, 1.1),
    }
    runs = [(name, backend) for name in CASES for backend in BACKENDS]
    if world == 2:      # one compile per rank: the torch backend and two ranks say enough
        cases["compiled"] = lambda: _case_compiled(world_group, rank, world)
        runs.append(("compiled", "torch"))
    verdicts = {}
    for name, backend in runs:
        try:
            with glm_kernels.force_backend(backend):
                cases[name]()
            verdicts[f"{name}[{backend}]"] = "ok"
        except Exception:   # recorded per case; a hung collective is caught by the timeout
            verdicts[f"{name}[{backend}]"] = traceback.format_exc(limit=4)
    return verdicts


def _cases_body(rank, world, out_dir):
    return _run_cases(rank, world)


@pytest.fixture(scope="module", params=[2, 4], ids=["tp2", "tp4"])
def verdicts(request, tmp_path_factory):
    world = request.param
    out_dir = tmp_path_factory.mktemp(f"tp{world}")
    return run_ranks(_cases_body, world, out_dir, "vocab-parallel")


@pytest.mark.parametrize("case", [f"{c}[{b}]" for c in CASES for b in BACKENDS])
def test_sharded_equals_unsharded(verdicts, case):
    if case.endswith("[interpret]"):
        skip_without_kernels()      # the ranks recorded why they could not run it
    failures = {rank: v[case] for rank, v in enumerate(verdicts) if v[case] != "ok"}
    assert not failures, "\n".join(f"rank {r}:\n{msg}" for r, msg in failures.items())


def test_compiled_sharded_equals_eager(verdicts):
    if len(verdicts) != 2:
        pytest.skip("compiled on two ranks only")
    failures = {rank: v["compiled[torch]"] for rank, v in enumerate(verdicts)
                if v["compiled[torch]"] != "ok"}
    assert not failures, "\n".join(f"rank {r}:\n{msg}" for r, msg in failures.items())
