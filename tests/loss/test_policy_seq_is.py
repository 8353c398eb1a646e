"""Sequence TIS / MIS (``policy_loss(seq_is=...)``) inside the sequence kernel, every preset.

On the kernel backends each preset reduces the sequence weight w_b in the sequence kernel
(token-ratio presets run there under ``seq_is``; GMPO takes a phase 0), with no torch pass
before it: the kernels against the torch backend (``loss/policy/_reference.py`` with
``loss/policy/sequence_is.py``'s token weights) on every preset x {truncate, mask} x
{padded with an
all-masked row, packed with an empty row} x IcePop gate {off, coupled, decoupled}; verl
0.9.1's own losses fed verl's own ``compute_rollout_correction_weights(rollout_is=
"sequence")``; rows with w_b = 0 and inf / NaN inputs; Inductor.
"""
import zlib

import pytest
import torch

import glm_kernels
from glm_kernels import POLICY_VARIANTS, policy_loss
from glm_kernels.loss.policy import policy as policy_mod
from glm_kernels.loss import sequence_is_weights
from tests._compare import TOLERANCES, assert_close
from tests.conftest import DEVICE, KERNEL_BACKEND, LazyKernels
from tests.loss.test_policy_loss import (PARAMS, _reductions, check_against_reference,
                                         check_compiled_matches_eager, make_batch, pack, run,
                                         to_device)

_policy_kernels = LazyKernels("glm_kernels.loss.policy._kernels")
FP32 = TOLERANCES[torch.float32]
SEQ_IS_PRESETS = [n for n, s in POLICY_VARIANTS.items() if s.objective != "vespo"]
GATES = [None, "coupled", "decoupled"]       # the order only picks each case's reductions


def seq_is_bounds(batch, cu, mode):
    """seq_is_high (and seq_is_low for "mask") between this batch's row weights, so that the
    largest row is truncated / masked (and the smallest masked) while others stay as they are:
    a check where the bounds do nothing, or everything, could not fail on a wrong bound."""
    old, rollout, mask = batch["old"], batch["rollout"], batch["mask"]
    w = sequence_is_weights(old, rollout, mask, cu_seqlens=cu, mode="truncate", high=1e30)
    rows = (w.reshape(w.shape[0], -1)[:, 0] if cu is None else
            torch.stack([w[s] if e > s else torch.tensor(1.0)
                         for s, e in zip(cu[:-1].tolist(), cu[1:].tolist())]))
    distinct = rows.unique()                               # sorted
    assert distinct.numel() >= 4, rows
    high = float((distinct[-1] * distinct[-2]).sqrt())
    if mode == "truncate":
        return dict(seq_is="truncate", seq_is_high=high)
    low = float((distinct[0] * distinct[1]).sqrt())
    return dict(seq_is="mask", seq_is_high=high, seq_is_low=low)


# preset x mode x layout x gate off / on; "on" alternates coupled / decoupled so that each
# (mode, layout) pair meets both gate modes across the presets (the interpreter is slow)
CASES = [(name, mode, layout, gate)
         for i, name in enumerate(SEQ_IS_PRESETS)
         for j, mode in enumerate(["truncate", "mask"])
         for k, layout in enumerate(["padded", "packed"])
         for gate in (None, ("coupled", "decoupled")[(i + j + k) % 2])]


@pytest.mark.parametrize("name,mode,layout,gate", CASES, ids=["-".join(map(str, c))
                                                               for c in CASES])
def test_seq_is_kernel_matches_reference(kernel_backend, name, mode, layout, gate):
    """Kernel (sequence IS reduced in the sequence kernel) vs the torch backend: loss,
    gradient and stats; every reduction over the gate modes (half of them per case)."""
    seed = zlib.crc32(repr((name, gate, mode, layout)).encode()) % 1000
    batch = make_batch(seed)
    cu = None
    if layout == "packed":
        batch, cu = pack(batch)
    bounds = seq_is_bounds(batch, cu, mode)
    offset = GATES.index(gate) + (mode == "mask")
    reductions = _reductions(name)
    for i, reduction in enumerate(reductions):
        if (i + offset) % 2 == 0 or len(reductions) <= 3:
            check_against_reference(name, batch, reduction, gate=gate, weights=i % 2 == 1,
                                    cu_seqlens=cu, **bounds)


@pytest.mark.parametrize("name", SEQ_IS_PRESETS)
def test_kernel_path_makes_no_token_weight_tensor(kernel_backend, monkeypatch, name):
    """On the kernel backends no preset goes through the torch pre-pass (the [N] weight
    tensor of loss/policy/sequence_is.py); the result still depends on the sequence weights."""
    def forbidden(*args, **kwargs):
        raise AssertionError("seq_is_token_weights called on the kernel backend")
    batch, cu = pack(make_batch(71))
    bounds = seq_is_bounds(batch, cu, "mask")
    reduction = POLICY_VARIANTS[name].default_reduction
    plain = run(name, batch, reduction=reduction, cu_seqlens=cu)
    monkeypatch.setattr(policy_mod, "seq_is_token_weights", forbidden)
    weighted = run(name, batch, reduction=reduction, cu_seqlens=cu, **bounds)
    assert not torch.equal(weighted[1], plain[1])


@pytest.mark.parametrize("name", [n for n in SEQ_IS_PRESETS
                                  if POLICY_VARIANTS[n].ratio in ("token",
                                                                  "sequence_stopgrad")])
@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_masked_out_rows_with_nonfinite_inputs_contribute_nothing(any_backend, name, layout):
    """MIS: a row whose weight falls outside [low, high] adds exactly 0 to the loss and the
    gradient, even with a NaN log-prob, an inf old log-prob and a NaN advantage in it."""
    batch = make_batch(83)
    cu = None
    if layout == "packed":
        batch, cu = pack(batch)
    bounds = seq_is_bounds(batch, cu, "mask")
    w = sequence_is_weights(batch["old"], batch["rollout"], batch["mask"], cu_seqlens=cu,
                            mode="mask", high=bounds["seq_is_high"], low=bounds["seq_is_low"])
    dropped = (w == 0) & batch["mask"]
    # (old is the same in both runs: its inf would also move the row's own IS weight)
    positions = dropped.nonzero()[:3]
    assert positions.shape[0] == 3, "the batch must have a dropped row with 3 masked tokens"
    reduction = POLICY_VARIANTS[name].default_reduction
    clean = run(name, batch, reduction=reduction, cu_seqlens=cu, **bounds)
    dirty = {k: v.clone() for k, v in batch.items()}
    for pos, (key, value) in zip(positions, (("lp", float("nan")), ("adv", float("nan")),
                                             ("lp", -float("inf")))):
        dirty[key][tuple(pos.tolist())] = value
    got = run(name, dirty, reduction=reduction, cu_seqlens=cu, **bounds)
    assert torch.isfinite(got[0]) and torch.isfinite(got[1]).all()
    assert_close(got[0], clean[0], tol=FP32, name="loss")
    assert bool((got[1].cpu()[dropped] == 0).all())
    assert_close(got[1], clean[1], tol=FP32, name="grad")


@pytest.mark.parametrize("mode", ["truncate", "mask"])
@pytest.mark.parametrize("variant", ["vanilla", "gspo", "gpg", "clip_cov", "kl_cov",
                                     "geo_mean", "cispo", "sapo", "dro", "dppo_kl", "dppo_tv"])
def test_matches_verl_with_its_sequence_weights(any_backend, mode, variant):
    """seq_is= on every verl registry loss equals verl's own loss fed verl's own sequence
    weights (compute_rollout_correction_weights, rollout_is="sequence") as
    rollout_is_weights: loss, gradient and metrics; the aggregation mode varies by loss."""
    verl_tests = pytest.importorskip("tests.loss.test_policy_loss_verl")
    core, rc = verl_tests.core, verl_tests.rc
    lp, old, _, adv, mask, _ = verl_tests.make_batch(zlib.crc32(variant.encode()) % 1000)
    rollout = old + 0.1 * torch.randn(old.shape, generator=torch.Generator().manual_seed(5))
    # rows 0 and 1 (token 0 masked in both): w_0 pushed up past 2, w_1 down below 0.5
    rollout[0, 0] -= 1.5
    rollout[1, 0] += 1.5
    threshold, low = (2.0, None) if mode == "truncate" else ("0.5_2.0", 0.5)
    weights, _ = rc.compute_rollout_correction_weights(
        log_ratio=old - rollout, response_mask=mask, rollout_is="sequence",
        rollout_is_threshold=threshold)
    rows = weights.max(-1).values                       # one value per row (0: masked out)
    live = mask.bool().any(-1)
    # the rows' weights must be bounded on some rows and kept on others
    assert (rows[live] < 2.0).any() and (rows[live] != 1.0).any()
    assert ((rows[live] == 2.0) | (rows[live] == 0.0)).any(), rows
    agg = verl_tests.AGG_MODES[zlib.crc32((variant + mode).encode()) % len(verl_tests.AGG_MODES)]
    extra = verl_tests.variant_params(variant, lp, old, adv, mask)
    lp_verl = lp.clone().requires_grad_(True)
    torch.manual_seed(1234)
    verl_out = core.get_policy_loss_fn(variant)(
        old_log_prob=old, log_prob=lp_verl, advantages=adv, response_mask=mask,
        loss_agg_mode=agg, config=verl_tests.actor_config(variant), rollout_is_weights=weights)
    on = lambda t: t.to(DEVICE) if isinstance(t, torch.Tensor) else t   # noqa: E731
    lp_mine = on(lp).requires_grad_(True)
    kwargs = dict(variant=variant, eps_low=verl_tests.LOW, eps_high=verl_tests.HIGH,
                  rollout_logprobs=on(rollout), seq_is=mode, seq_is_high=2.0, seq_is_low=low,
                  **verl_tests.core_kwargs(variant, agg, {}, lp.shape[-1]),
                  **{k: on(v) for k, v in extra.items()})
    mine = policy_loss(lp_mine, on(old), on(adv), on(mask), return_stats=True, **kwargs)
    with torch.no_grad():
        kwargs.update(reduction="none", denominator=None)
        kwargs.pop("norm_length", None)
        kwargs.pop("loss_scale", None)
        terms = policy_loss(lp_mine, on(old), on(adv), on(mask), **kwargs)
    verl_tests.compare(verl_out, mine, lp_verl, lp_mine, terms.abs().sum().item())


@pytest.mark.parametrize("backend", ["torch", KERNEL_BACKEND])
@pytest.mark.parametrize("name,reduction", [("vanilla", "seq_mean_token_mean"),
                                            ("geo_mean", "row_mean"), ("cispo", "none")])
def test_compile_fullgraph_matches_eager(backend, name, reduction):
    """torch.compile(fullgraph=True) with Inductor (aot_eager without a C++ compiler) of
    policy_loss with seq_is, packed rows and the gate, forward and backward, equal to eager."""
    check_compiled_matches_eager(backend, name, reduction,
                                 lambda batch, cu: seq_is_bounds(batch, cu, "mask"))


@pytest.mark.parametrize("name", ["vanilla", "dro", "gspo", "geo_mean"])
def test_bf16_logprobs(any_backend, name):
    """bf16 log-probs with seq_is: the same loss as fp32 on the same rounded inputs, the
    gradient in bf16 within the bf16 tolerance."""
    batch = make_batch(9)
    bounds = seq_is_bounds(batch, None, "truncate")
    reduction = POLICY_VARIANTS[name].default_reduction
    batch16 = dict(batch, lp=batch["lp"].to(torch.bfloat16))
    with glm_kernels.force_backend("torch"):
        ref16 = run(name, dict(batch, lp=batch16["lp"].float()), reduction=reduction,
                    **PARAMS.get(name, {}), **bounds)
    got = run(name, batch16, reduction=reduction, **PARAMS.get(name, {}), **bounds)
    assert got[1].dtype == torch.bfloat16
    assert_close(got[0], ref16[0], tol=FP32, name="bf16 loss (same rounded inputs)")
    assert_close(got[1].float(), ref16[1], tol=TOLERANCES[torch.bfloat16], name="bf16 grad")


@pytest.mark.parametrize("name", ["vanilla", "cispo", "kl_cov", "gspo", "geo_mean",
                                  "grpo_sequence"])
def test_per_sequence_advantages_packed(any_backend, name):
    """advantages [B] on packed rows with seq_is (the sequence kernel reads them per row, no
    spread) equal the same values broadcast over each row."""
    batch = make_batch(7)
    batch["adv"] = batch["adv"][:, :1].expand(-1, 40).contiguous()
    packed, cu = pack(batch)
    bounds = seq_is_bounds(packed, cu, "mask")
    reduction = POLICY_VARIANTS[name].default_reduction
    full = run(name, packed, reduction=reduction, cu_seqlens=cu, **bounds)
    per_seq = dict(packed, adv=batch["adv"][:, 0].contiguous())
    got = run(name, per_seq, reduction=reduction, cu_seqlens=cu, **bounds)
    assert_close(got[0], full[0], tol=FP32, name="loss")
    assert_close(got[1], full[1], tol=FP32, name="grad")


@pytest.mark.parametrize("name", SEQ_IS_PRESETS)
def test_empty_and_fully_masked_inputs(any_backend, name):
    """No tokens, or no masked token: loss 0, gradient 0 and stats 0 (every w_b is
    exp(0) = 1, and nothing is weighted)."""
    reduction = POLICY_VARIANTS[name].default_reduction
    for shape in [(0, 5), (3, 0), (0,)]:
        lp = torch.zeros(shape, device=DEVICE, requires_grad=True)
        zeros = torch.zeros(shape, device=DEVICE)
        loss = policy_loss(lp, zeros, zeros, variant=name, reduction=reduction,
                           rollout_logprobs=zeros, seq_is="mask", **PARAMS.get(name, {}))
        loss.backward()
        assert loss.item() == 0.0 and lp.grad.shape == lp.shape, (name, shape)
    batch = make_batch(2)
    batch["mask"][:] = False
    loss, grad, stats = run(name, batch, reduction=reduction, seq_is="truncate",
                            seq_is_high=1.5)
    assert loss.item() == 0.0 and bool((grad == 0).all()), name
    assert all(v.item() == 0.0 for k, v in stats.items() if k != "phi_mean"), stats


@pytest.mark.parametrize("ratio,objective,reduction", [
    ("token", "ppo", "none"), ("token", "cispo", "seq_mean_token_mean"),
    ("geo_mean", "ppo", "row_mean"), ("sequence_stopgrad", "ppo", "token_mean")])
def test_opcheck_custom_op_with_seq_is(kernel_backend, ratio, objective, reduction):
    """The custom op with the sequence IS floats (the sequence kernel's row layout for token
    ratios too): schema, fake kernel (shapes and strides), autograd registration."""
    b = to_device(make_batch(31, rows=3, length=8))
    flat = {k: v.reshape(-1).contiguous() for k, v in b.items()}
    lp = flat["lp"].clone().requires_grad_(True)
    args = (lp, flat["old"], flat["adv"], flat["mask"], flat["weights"], flat["rollout"],
            None, None, None, ratio, objective, "decoupled", reduction,
            [20.0, float("nan"), 0.5, 2.0, 0.2, 0.28, 1.0, 1.0, 1.0, 2.0, 0.3, 3.0],
            [0.7, 1.3, 0.0, 0.0], False, False, 3, 8, True)
    torch.library.opcheck(policy_mod._policy_op, args,
                          test_utils=("test_schema", "test_faketensor",
                                      "test_autograd_registration"))


@pytest.mark.parametrize("name", ["vanilla", "kl_cov", "dppo_tv", "gpg"])
@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_rows_shared_by_several_programs(kernel_backend, name, layout):
    """Few long rows: token ratios under seq_is split each row over several programs (each
    reduces the whole row's w_b and takes every S-th chunk); equal to the torch backend, on
    rows of more chunks than programs too (packed row 0: 6 chunks for 2 programs)."""
    batch = make_batch(zlib.crc32(name.encode()) % 1000, rows=4, length=1500)
    # rollout close to old: row sums of ~1000 tokens stay inside the +-20 clamp
    noise = torch.randn(batch["old"].shape, generator=torch.Generator().manual_seed(3))
    batch["rollout"] = batch["old"] + 0.05 * noise
    cu = None
    if layout == "packed":
        lengths = [1500, 10, 0, 300]
        idx = torch.cat([torch.arange(b * 1500, b * 1500 + n) for b, n in enumerate(lengths)])
        batch = {k: v.reshape(-1)[idx] for k, v in batch.items()}
        cu = torch.tensor([0, 1500, 1510, 1510, 1810])
    n = batch["lp"].numel()
    block = 256 if KERNEL_BACKEND == "interpret" else 1024
    if KERNEL_BACKEND == "interpret":
        assert _policy_kernels.row_splits(n, 4, block, torch.device("cpu"), True) >= 2
    for reduction, gate in (("token_mean", None), ("seq_mean_token_mean", "decoupled"),
                            ("none", "coupled")):
        bounds = seq_is_bounds(batch, cu, "mask" if gate else "truncate")
        check_against_reference(name, batch, reduction, gate=gate, weights=gate is not None,
                                cu_seqlens=cu, **bounds)
