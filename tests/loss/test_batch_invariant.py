"""glm_kernels.batch_invariant(): each row's log-prob, entropy, per-token loss and gradient are
bitwise the same alone, in a batch of 64, shuffled, and under any chunking (issue 22)."""
import pytest
import torch

import glm_kernels
from glm_kernels import _row_invariant as _invariant
from glm_kernels.loss import fused_linear_icepop_loss, icepop_loss_from_logits, selective_logprobs
from tests.conftest import DEVICE

ROWS = 64
ALONE = (0, 1, 17, 40, 62, 63)            # rows also computed alone (the interpreter is slow)


def _batch(v, h=24, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(ROWS, h, generator=g).to(dtype)
    weight = (torch.randn(v, h, generator=g) / h ** 0.5).to(dtype)
    ids = torch.randint(0, v, (ROWS,), generator=g)
    logits = (hidden.float() @ weight.float().t() * 3).to(dtype)
    rollout = -torch.rand(ROWS, generator=g) * 3
    adv = torch.randn(ROWS, generator=g)
    mask = torch.rand(ROWS, generator=g) > 0.1
    return [t.to(DEVICE) for t in (hidden, weight, ids, logits, rollout, adv, mask)]


def _layouts(fn, n=ROWS, seed=1):
    """fn(index) -> per-row outputs for rows ``index``; returns them in row order for: the
    whole batch, a shuffled batch, odd-sized slices, and the rows of ALONE one at a time."""
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    stack = lambda parts: [torch.cat(p) for p in zip(*parts)]          # noqa: E731
    outs = {"batch": fn(torch.arange(n))}
    inverse = torch.argsort(perm)
    outs["shuffled"] = [t[inverse] for t in fn(perm)]
    outs["slices"] = stack([fn(torch.arange(s, min(s + 13, n))) for s in range(0, n, 13)])
    outs["alone"] = stack([fn(torch.tensor([i])) for i in ALONE])
    return outs


def _assert_bitwise(outs):
    ref = outs["batch"]
    for name, got in outs.items():
        want = [t[list(ALONE)] for t in ref] if name == "alone" else ref
        for a, b in zip(got, want):
            assert torch.equal(a.view(torch.int32) if a.dtype == torch.float32 else a,
                               b.view(torch.int32) if b.dtype == torch.float32 else b), name


@pytest.mark.parametrize("v,dtype", [(997, torch.float32), (300, torch.bfloat16),
                                     (100, torch.float32)])
def test_selective_logprobs_rows_are_batch_invariant(any_backend, v, dtype):
    _, _, ids, logits, *_ = _batch(v, dtype=dtype)

    def rows(index):
        lp, ent = selective_logprobs(logits[index], ids[index], temperature=0.7,
                                     return_entropy=True)
        return [lp, ent]

    with glm_kernels.batch_invariant():
        _assert_bitwise(_layouts(rows))


@pytest.mark.parametrize("v", [997, 100])
def test_loss_from_logits_rows_are_batch_invariant(any_backend, v):
    """Per-token loss (reduction none: composed path) and each row's logits gradient under
    the fused pass (reduction sum: the gradient of a row is its own)."""
    _, _, ids, logits, rollout, adv, mask = _batch(v, seed=2)

    def rows(index):
        out = []
        for reduction in ("none", "sum"):
            x = logits[index].clone().requires_grad_(True)
            loss = icepop_loss_from_logits(x, ids[index], rollout[index], adv[index],
                                           mask[index], reduction=reduction)
            loss.sum().backward()
            out += [loss.detach().reshape(-1), x.grad] if reduction == "none" else [x.grad]
        return out

    with glm_kernels.batch_invariant():
        _assert_bitwise(_layouts(rows))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_linear_rows_are_batch_invariant(any_backend, dtype):
    """The hidden-state gradient of each row (reduction sum), whatever the batch, its order
    and the chunk size; the GEMMs run on fixed row tiles."""
    hidden, weight, ids, _, rollout, adv, mask = _batch(300, dtype=dtype, seed=3)

    def rows(index, chunk_size=None):
        x = hidden[index].clone().requires_grad_(True)
        loss, m = fused_linear_icepop_loss(x, weight, ids[index], rollout[index], adv[index],
                                           mask[index], reduction="sum",
                                           chunk_size=chunk_size, return_metrics=True)
        loss.backward()
        return [x.grad]

    with glm_kernels.batch_invariant():
        outs = _layouts(rows)
        outs["chunks_of_7"] = rows(torch.arange(ROWS), chunk_size=7)
        outs["chunks_of_100"] = rows(torch.arange(ROWS), chunk_size=100)
        _assert_bitwise(outs)


def test_loss_metrics_per_row_sums_use_the_fixed_order():
    """With batch_invariant() the metrics' per-row sums are tree sums: a row's own log-ppl
    difference is the same alone and in the batch (log_ppl_diff_max of a one-row batch)."""
    g = torch.Generator().manual_seed(5)
    train = -torch.rand(ROWS, 257, generator=g) * 3
    rollout = train + 0.2 * torch.randn(ROWS, 257, generator=g)
    with glm_kernels.batch_invariant():
        whole = glm_kernels.mismatch_metrics(train, rollout)
        worst = int(((rollout - train).double().mean(-1)).argmax())
        alone = glm_kernels.mismatch_metrics(train[worst:worst + 1], rollout[worst:worst + 1])
    assert torch.equal(whole["log_ppl_diff_max"], alone["log_ppl_diff_max"])


def test_tree_sum_and_tiles_by_hand():
    x = torch.tensor([[1.0, 2.0, 3.0, 4.0, 5.0], [1e8, 1.0, -1e8, 1.0, 0.0]])
    # ((1 + 3) + (2 + 4)) + 5 with the halves (1, 2, 3, 4 | 5, 0, 0, 0) added pairwise.
    assert _invariant.tree_sum(x).tolist() == [15.0, 2.0]
    assert _invariant.tree_sum(torch.zeros(3, 0)).tolist() == [0.0, 0.0, 0.0]
    a, b = torch.randn(70, 9), torch.randn(5, 9)
    torch.testing.assert_close(_invariant.matmul_nt(a, b), a @ b.t())
    z = torch.tensor([[0.0, float("-inf")], [float("-inf"), float("-inf")]])
    lse = _invariant.logsumexp(z)
    assert lse[0].item() == 0.0 and lse[1].item() == float("-inf")


def test_switch_is_thread_local_and_validated(monkeypatch):
    import threading
    seen = []
    with glm_kernels.batch_invariant():
        thread = threading.Thread(target=lambda: seen.append(
            glm_kernels.batch_invariant_enabled()))
        thread.start()
        thread.join()
        assert glm_kernels.batch_invariant_enabled()
        with glm_kernels.batch_invariant(False):
            assert not glm_kernels.batch_invariant_enabled()
    assert seen == [False] and not glm_kernels.batch_invariant_enabled()
    with pytest.raises(TypeError, match="enabled"):
        with glm_kernels.batch_invariant("yes"):
            pass


@pytest.mark.parametrize("value,expected", [("1", "True"), ("0", "False"), ("maybe", "Error")])
def test_environment_switch(value, expected):
    import os
    import subprocess
    import sys
    code = ("import glm_kernels\n"
            "try:\n    print(glm_kernels.batch_invariant_enabled())\n"
            "except Exception as e:\n    print('never')\n")
    env = dict(os.environ, GLM_KERNELS_BATCH_INVARIANT=value)
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120)
    if expected == "Error":
        assert run.returncode != 0 and "GLM_KERNELS_BATCH_INVARIANT" in run.stderr
    else:
        assert run.stdout.strip() == expected, run.stderr
