"""selective_logprobs with a top-p nucleus (keep_token_ids / keep_offsets, CSR): both backends
against the dense-mask oracle (log_softmax over the kept logits, the target always kept, rows
without a nucleus over the full vocabulary, entropy over the full vocabulary), the in-place
backward, vocab-parallel shards (2 gloo ranks), bad input, and torch.compile(fullgraph=True).

slime's own loss with ``--rollout-top-p`` < 1 is compared by examples/slime/
check_loss_conformance.py (tests/integrations/test_slime_conformance.py, with SLIME_SRC).
"""
import warnings

import pytest
import torch
import torch.distributed as dist

import glm_kernels
from glm_kernels.loss import selective_logprobs
from glm_kernels.loss.logprobs._nucleus import reference
from glm_kernels.loss.logprobs.logprobs import logprobs_rows
from tests._compare import TOLERANCES, assert_close
from tests._gloo import run_ranks
from tests.conftest import skip_without_kernels
from tests.test_compile_inductor import COMPILER
from tests.test_compile_inductor import backend as compile_backend  # noqa: F401 (a fixture)

BACKENDS = ("torch",) if torch.cuda.is_available() else ("torch", "interpret")


def _case(rows, v, seed=0, dtype=torch.float32):
    """Logits, targets and a CSR nucleus with every kind of row: target inside its nucleus,
    target outside it (the target still counts), no nucleus (row 1: full vocabulary), a
    one-id nucleus that is the target (row 2: log-prob 0), a large nucleus (row 3)."""
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(rows, v, generator=g) * 3.0).to(dtype)
    ids = torch.randint(0, v, (rows,), generator=g)
    sets = []
    for i in range(rows):
        size = {1: 0, 2: 0, 3: v // 2}.get(i, 1 + i % 7)
        kept = torch.randperm(v, generator=g)[:size].tolist()
        if i == 2:
            kept = [int(ids[i])]
        elif i % 2 == 0 and size and int(ids[i]) not in kept:
            kept[0] = int(ids[i])
        sets.append(kept)
    keep = torch.tensor([x for s in sets for x in s], dtype=torch.int64)
    offsets = torch.tensor([0] + [len(s) for s in sets]).cumsum(0)
    return logits, ids, keep, offsets


def _run(fn, logits, *, entropy, seed=3):
    x = logits.detach().clone().requires_grad_(True)
    out = fn(x)
    lp, ent = out if entropy else (out, None)
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(lp.shape, generator=g)
    w[4 % lp.numel()] = 0.0                                 # a row without upstream gradient
    loss = (w * lp).sum() + (0.0 if ent is None else (0.3 * ent).sum())
    loss.backward()
    return [lp.detach()] + ([] if ent is None else [ent.detach()]), x.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("v,temperature,entropy", [(300, 1.0, True), (37, 0.7, False),
                                                   (37, 1.3, True)])
def test_matches_dense_mask_oracle(any_backend, dtype, v, temperature, entropy):
    logits, ids, keep, offsets = _case(9, v, dtype=dtype)
    got, grad = _run(lambda x: selective_logprobs(
        x, ids, temperature=temperature, return_entropy=entropy, keep_token_ids=keep,
        keep_offsets=offsets), logits, entropy=entropy)
    want, want_grad = _run(lambda x: reference(x, ids, keep, offsets, temperature, entropy),
                           logits, entropy=entropy)
    tol = TOLERANCES[dtype]
    for a, b in zip(got, want):
        assert a.dtype == torch.float32
        assert_close(a, b, tol=tol, name="values")
    assert grad.dtype == dtype
    assert_close(grad.float(), want_grad.float(), tol=tol, name="gradient")
    # The nucleus changes what it should: row 2 keeps only its target, row 1 nothing.
    full = selective_logprobs(logits, ids, temperature=temperature)
    assert got[0][2].abs().item() == 0.0 and got[0][1].item() == full[1].item()
    assert bool((got[0][[0, 3, 5]] > full[[0, 3, 5]]).all())
    zero_row = grad[4].float()
    assert bool((zero_row == 0).all()) or entropy   # w = 0 there: only the entropy term


def test_all_rows_without_nucleus_equal_the_plain_call(any_backend):
    logits, ids, _, _ = _case(5, 40)
    empty = torch.zeros(0, dtype=torch.int64)
    got = _run(lambda x: selective_logprobs(x, ids, return_entropy=True, keep_token_ids=empty,
                                            keep_offsets=torch.zeros(6, dtype=torch.int32)),
               logits, entropy=True)
    plain = _run(lambda x: selective_logprobs(x, ids, return_entropy=True), logits,
                 entropy=True)
    for a, b in zip(got[0] + [got[1]], plain[0] + [plain[1]]):
        assert torch.equal(a, b)


def test_inplace_backward_matches(any_backend):
    logits, ids, keep, offsets = _case(8, 300)
    w = torch.randn(8, generator=torch.Generator().manual_seed(5))
    grads = []
    for inplace in (False, True):
        x = logits.clone().requires_grad_(True)
        feed = x * 1.0 if inplace else x               # the in-place one overwrites its input
        lp, ent = logprobs_rows(feed, ids, inv_temp=1 / 0.9, want_entropy=True,
                                inplace_backward=inplace, keep_ids=keep, keep_offsets=offsets)
        ((w * lp).sum() + ent.sum()).backward()
        grads.append(x.grad)
    assert_close(grads[1], grads[0], tol=1e-6, name="in-place gradient")


@pytest.mark.parametrize("keep,offsets,match", [
    ([1, 2, 3], [0, 1, 2, 3, 3], "keep_offsets must have one entry per row"),
    ([1, 2, 3], [1, 1, 2, 3], "from 0 to len"),
    ([1, 2, 3], [0, 1, 2, 2], "from 0 to len"),
    ([1, 2, 3], [0, 2, 1, 3], "must not decrease"),
    ([1, 2, 50], [0, 1, 2, 3], r"must lie in \[0, 11\)"),
    ([1, -1, 3], [0, 1, 2, 3], r"must lie in \[0, 11\)"),
    ([1, 1, 3], [0, 2, 2, 3], "twice within one row"),
])
def test_bad_nucleus_names_the_argument(keep, offsets, match):
    logits, ids = torch.randn(3, 11), torch.tensor([1, 2, 3])
    with pytest.raises(ValueError, match=match):
        selective_logprobs(logits, ids, keep_token_ids=torch.tensor(keep),
                           keep_offsets=torch.tensor(offsets))


def test_bad_nucleus_types():
    logits, ids = torch.randn(3, 11), torch.tensor([1, 2, 3])
    keep, offsets = torch.tensor([1, 2, 3]), torch.tensor([0, 1, 2, 3])
    with pytest.raises(ValueError, match="pass both or neither"):
        selective_logprobs(logits, ids, keep_token_ids=keep)
    with pytest.raises(TypeError, match="keep_token_ids"):
        selective_logprobs(logits, ids, keep_token_ids=keep.float(), keep_offsets=offsets)
    with pytest.raises(ValueError, match="keep_offsets"):
        selective_logprobs(logits, ids, keep_token_ids=keep, keep_offsets=offsets[None])


# --------------------------------------------------------------------------- torch.compile
def test_compiled_matches_eager(compile_backend):
    logits, ids, keep, offsets = _case(9, 300)

    def step(x):
        lp, ent = selective_logprobs(x, ids, temperature=0.8, return_entropy=True,
                                     keep_token_ids=keep, keep_offsets=offsets)
        lp16 = selective_logprobs(x.to(torch.bfloat16), ids, keep_token_ids=keep.int(),
                                  keep_offsets=offsets.int())
        return (lp * torch.arange(9.0)).sum() + ent.sum() + lp16.sum(), lp, ent, lp16

    def run(fn):
        x = logits.clone().requires_grad_(True)
        outs = fn(x)
        outs[0].backward()
        return [o.detach() for o in outs], x.grad

    eager, eager_grad = run(step)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        compiled, compiled_grad = run(torch.compile(step, fullgraph=True, backend=COMPILER))
    for a, b in zip(compiled, eager):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert_close(a, b, tol=TOLERANCES[torch.bfloat16] if b is eager[3] else 1e-5,
                     name="compiled output")
    assert eager_grad.abs().sum() > 0
    assert_close(compiled_grad, eager_grad, tol=1e-2, name="compiled gradient")


# --------------------------------------------------------------------------- vocab-parallel
def _tp_body(rank, world, out_dir):
    verdicts = {}
    for backend in BACKENDS:
        try:
            with glm_kernels.force_backend(backend):
                logits, ids, keep, offsets = _case(9, 2 * 40, seed=4)
                cols = slice(rank * 40, (rank + 1) * 40)

                def fn(x, group):
                    return selective_logprobs(x, ids, temperature=0.9, return_entropy=True,
                                              tp_group=group, keep_token_ids=keep,
                                              keep_offsets=offsets)
                full_vals, full_grad = _run(lambda x: fn(x, None), logits, entropy=True)
                shard_vals, shard_grad = _run(lambda x: fn(x, dist.group.WORLD),
                                              logits[:, cols].contiguous(), entropy=True)
                for a, b in zip(shard_vals, full_vals):
                    assert_close(a, b, tol=1e-5, name="sharded values")
                assert_close(shard_grad, full_grad[:, cols], tol=1e-5, name="gradient slice")
            verdicts[backend] = "ok"
        except Exception:
            import traceback
            verdicts[backend] = traceback.format_exc(limit=4)
    return verdicts


@pytest.fixture(scope="module")
def tp_verdicts(tmp_path_factory):
    return run_ranks(_tp_body, 2, tmp_path_factory.mktemp("nucleus_tp2"), "nucleus vocab-parallel")


@pytest.mark.parametrize("backend", BACKENDS)
def test_vocab_parallel_shards_equal_unsharded(tp_verdicts, backend):
    if backend != "torch":
        skip_without_kernels()
    failures = {r: v[backend] for r, v in enumerate(tp_verdicts) if v[backend] != "ok"}
    assert not failures, "\n".join(f"rank {r}:\n{m}" for r, m in failures.items())
