"""slime_policy plug-in without slime: against the core's torch reference, both backends.

``examples/slime/check_loss_conformance.py`` compares every option with slime's own code (set
SLIME_SRC; tests/integrations/test_slime_conformance.py). Here the expected side is built from
definitions: log-probs and entropy by torch.log_softmax, the per-token objective by
``glm_kernels.policy_loss`` on the torch backend (the readable reference) with the importance
weights written out from the flags' definitions, reduced by slime's CP = 1 reducer contract
(sum over samples of sum(x_i m_i) / max(d_i, 1), or the masked token sum).
"""
import math
from types import SimpleNamespace

import pytest
import torch

from glm_kernels import force_backend, policy_loss
from glm_kernels.integrations.slime import policy as plug
from glm_kernels.integrations.slime._is import mis_weights


def slime_args(**overrides):
    args = dict(advantage_estimator="grpo", use_rollout_logprobs=False, eps_clip=0.2,
                eps_clip_high=0.28, eps_clip_c=None, use_opsm=False, opsm_delta=1e-4,
                use_tis=False, get_mismatch_metrics=False, custom_tis_function_path=None,
                tis_clip=2.0, tis_clip_low=0.0, custom_pg_loss_reducer_function_path=None,
                calculate_per_token_loss=False, entropy_coef=0.0, use_kl_loss=False,
                kl_loss_coef=0.0, kl_loss_type="k1", use_unbiased_kl=False,
                rollout_temperature=1.0, rollout_top_p=1.0, tensor_model_parallel_size=1,
                context_parallel_size=1, allgather_cp=False)
    args.update(overrides)
    return SimpleNamespace(**args)


def reducer(batch, per_token):
    lengths, masks = batch["response_lengths"], batch["loss_masks"]

    def reduce(x):
        parts = zip(x.split(lengths), masks, batch["rollout_mask_sums"])
        if per_token:
            return sum((x_i * m_i).sum() for x_i, m_i, _ in parts)
        return sum((x_i * m_i).sum() / torch.clamp_min(d_i, 1) for x_i, m_i, d_i in parts)
    return reduce


def make_batch(seed, temperature=1.0, vocab=23, prompts=(4, 2, 6, 3), responses=(5, 1, 7, 4)):
    """A CP = 1 micro-batch (one sample fully masked), its logits and the true log-probs."""
    g = torch.Generator().manual_seed(seed)
    unconcat = [torch.randint(0, vocab, (p + r,), generator=g) for p, r in zip(prompts, responses)]
    total = [p + r for p, r in zip(prompts, responses)]
    logits = torch.randn(1, sum(total) + 3, vocab, generator=g) * 2.0
    rows, end = [], 0
    for t, r in zip(total, responses):
        end += t
        rows.append(torch.arange(end - r - 1, end - 1))
    rows = torch.cat(rows)
    targets = torch.cat([u[-r:] for u, r in zip(unconcat, responses)])
    masks = [(torch.rand(r, generator=g) > 0.2).int() for r in responses]
    masks[2] = torch.zeros_like(masks[2])
    lp = torch.log_softmax(logits[0, rows] / temperature, -1).gather(1, targets[:, None])[:, 0]
    old = [x + 0.06 * (i - 1.5) + 0.2 * torch.randn(x.shape, generator=g)
           for i, x in enumerate(lp.split(list(responses)))]
    old[0][1] += 3.0                                      # a ratio outside every band
    batch = {"unconcat_tokens": unconcat, "total_lengths": total,
             "response_lengths": list(responses), "loss_masks": masks,
             "advantages": [(1.0 if i % 2 else -1.0) * (0.5 + torch.rand(r, generator=g))
                            for i, r in enumerate(responses)],
             "log_probs": old,
             "rollout_log_probs": [o + 0.4 * torch.randn(o.shape, generator=g) for o in old],
             "ref_log_probs": [x + 0.3 * torch.randn(x.shape, generator=g)
                               for x in lp.split(list(responses))],
             "rollout_mask_sums": [m.sum().float() for m in masks]}
    return batch, logits, rows, targets


USER_TIS = f"{__name__}.user_tis"


def user_tis(args, *, pg_loss, train_log_probs, rollout_log_probs, loss_masks, **kwargs):
    """A user's own --custom-tis-function-path hook: clipped ratio, its own metric."""
    w = torch.exp(torch.cat(train_log_probs) - torch.cat(rollout_log_probs)).clamp(0.3, 1.7)
    return pg_loss * w, loss_masks, {"user_w": w}


def user_tis_not_multiplicative(args, *, pg_loss, loss_masks, **kwargs):
    return pg_loss.clamp(max=0.5), loss_masks, {}


def add_top_p(batch, logits, rows, targets, top_p=0.8):
    """slime's replay keys (per-sample ids and offsets) and the dense [N, V] keep-mask they
    mean in slime's loss (the target always kept; sample 1's only token unrecorded: full)."""
    probs = torch.softmax(logits[0, rows], -1)
    order = probs.argsort(-1, descending=True)
    cum = probs.gather(-1, order).cumsum(-1)
    keep = torch.zeros(probs.shape, dtype=torch.bool)
    ids, offsets, start = [], [], 0
    for i, r in enumerate(batch["response_lengths"]):
        sample_ids, sample_offsets = [], [0]
        for j in range(start, start + (0 if i == 1 else r)):
            kept = order[j, :int((cum[j] < top_p).sum()) + 1].tolist()
            sample_ids += kept
            sample_offsets.append(len(sample_ids))
            keep[j, kept] = True
            keep[j, targets[j]] = True
        if i == 1:
            keep[start:start + r] = True
        ids.append(torch.tensor(sample_ids, dtype=torch.int32))
        offsets.append(torch.tensor(sample_offsets, dtype=torch.int32))
        start += r
    batch = dict(batch, rollout_top_p_token_ids=ids, rollout_top_p_token_offsets=offsets)
    return batch, keep


def expected(args, batch, logits, rows, targets, variant, keep=None):
    """(loss, d loss / d logits) from definitions, on the torch backend; ``keep``: the
    top-p keep-mask of the log-probs (the entropy stays over the full vocabulary)."""
    logits = logits.detach().clone().requires_grad_(True)
    logp = torch.log_softmax(logits[0, rows] / args.rollout_temperature, -1)
    entropy = -(logp.exp() * logp).sum(-1)
    if keep is not None:
        logp = torch.log_softmax((logits[0, rows] / args.rollout_temperature).masked_fill(
            ~keep, float("-inf")), -1)
    lp = logp.gather(1, targets[:, None])[:, 0]
    cat = lambda xs: torch.cat([x.float() for x in xs])  # noqa: E731
    old = cat(batch["rollout_log_probs"] if args.use_rollout_logprobs else batch["log_probs"])
    rollout, adv, mask = cat(batch["rollout_log_probs"]), cat(batch["advantages"]), \
        cat(batch["loss_masks"])
    sizes = torch.tensor(batch["response_lengths"])
    seg = torch.repeat_interleave(torch.arange(len(sizes)), sizes)
    weights = torch.ones_like(lp)
    if args.use_tis:
        low, high = (0.3, 1.7) if args.custom_tis_function_path == USER_TIS else \
            (args.tis_clip_low, args.tis_clip)
        weights = torch.exp(cat(batch["log_probs"]) - rollout).clamp(low, high)
    if args.use_opsm:
        n = torch.zeros(len(sizes)).index_add_(0, seg, mask).clamp(min=1)
        seq_kl = (torch.zeros(len(sizes)).index_add_(0, seg, (old - lp.detach()) * mask) / n)
        weights = weights * (1 - ((adv < 0) & (seq_kl[seg] > args.opsm_delta)).float())
    # slime's reducer with per-sample denominators = the samples' mask sums (make_batch's
    # rollout_mask_sums) is the core's seq_mean_token_mean with denominator 1 (a sum over the
    # samples of their token means); per token, the masked sum.
    per_token = args.calculate_per_token_loss
    with force_backend("torch"):
        pg_loss = policy_loss(lp, old, adv, mask, variant=plug.SLIME_VARIANTS[variant],
                              eps_low=args.eps_clip, eps_high=args.eps_clip_high,
                              dual_clip=args.eps_clip_c, token_weights=weights,
                              cu_seqlens=torch.nn.functional.pad(sizes.cumsum(0), (1, 0)),
                              reduction="sum" if per_token else "seq_mean_token_mean",
                              denominator=None if per_token else 1.0)
    reduce = reducer(batch, per_token)
    loss = pg_loss - args.entropy_coef * reduce(entropy)
    if args.use_kl_loss:          # low_var_kl, unbiased: ratio * (e^x - x - 1), x = ref - lp
        x = cat(batch["ref_log_probs"]) - lp
        kl = (torch.exp(lp - old) * (torch.exp(x) - x - 1)).clamp(-10, 10)
        loss = loss + args.kl_loss_coef * reduce(kl)
    loss.backward()
    return loss.detach(), logits.grad


CASES = {
    "ppo clip": ("ppo", {}),
    "dual clip": ("ppo", dict(eps_clip_c=3.0)),
    "gspo": ("gspo", dict(advantage_estimator="gspo", eps_clip=0.05, eps_clip_high=0.08)),
    "gspo dual clip": ("gspo", dict(advantage_estimator="gspo", eps_clip=0.05,
                                    eps_clip_high=0.08, eps_clip_c=1.5)),
    "cispo": ("cispo", dict(advantage_estimator="cispo", eps_clip=1.0, eps_clip_high=0.5)),
    "opsm": ("ppo", dict(use_opsm=True, opsm_delta=0.02)),
    "vanilla tis": ("ppo", dict(use_tis=True, tis_clip_low=0.6, tis_clip=1.5)),
    "rollout logprobs": ("ppo", dict(use_rollout_logprobs=True)),
    "gspo opsm tis kl entropy": ("gspo", dict(
        advantage_estimator="gspo", eps_clip=0.05, eps_clip_high=0.08, use_opsm=True,
        opsm_delta=0.02, use_tis=True, use_kl_loss=True, kl_loss_coef=0.1,
        kl_loss_type="low_var_kl", use_unbiased_kl=True, entropy_coef=0.01)),
    "top-p": ("ppo", dict(rollout_top_p=0.8)),
    "top-p gspo tis entropy": ("gspo", dict(
        rollout_top_p=0.8, advantage_estimator="gspo", eps_clip=0.05, eps_clip_high=0.08,
        use_tis=True, entropy_coef=0.01)),
    "user tis hook": ("ppo", dict(use_tis=True, custom_tis_function_path=USER_TIS)),
    "user tis hook cispo opsm": ("cispo", dict(
        use_tis=True, custom_tis_function_path=USER_TIS, advantage_estimator="cispo",
        eps_clip=1.0, eps_clip_high=0.5, use_opsm=True, opsm_delta=0.02)),
}


@pytest.mark.parametrize("per_token", [False, True])
@pytest.mark.parametrize("case", sorted(CASES))
def test_policy_loss_function_matches_reference(case, per_token, any_backend):
    variant, flags = CASES[case]
    temperature = 0.7 if per_token else 1.0
    args = slime_args(calculate_per_token_loss=per_token, rollout_temperature=temperature,
                      **flags)
    batch, logits, rows, targets = make_batch(3, temperature)
    keep = None
    if args.rollout_top_p != 1.0:
        batch, keep = add_top_p(batch, logits, rows, targets)
    want_loss, want_grad = expected(args, batch, logits, rows, targets, variant, keep)
    logits = logits.detach().clone().requires_grad_(True)
    loss, metrics = plug.policy_loss_function(args, batch, logits,
                                              reducer(batch, per_token))
    loss.backward()
    assert float((loss.detach() - want_loss).abs()) <= 1e-5 * max(1.0, float(want_loss.abs()))
    assert float((logits.grad - want_grad).norm() / want_grad.norm()) <= 1e-5
    assert float(metrics["loss"]) == float(loss.detach())
    keys = {"loss", "pg_loss", "entropy_loss", "pg_clipfrac", "ppo_kl",
            "train_rollout_logprob_abs_diff"}
    if args.use_tis:
        keys |= {"ois", "user_w"} if args.custom_tis_function_path == USER_TIS else \
            {"ois", "tis", "tis_clipfrac", "tis_abs"}
    keys |= {"opsm_clipfrac"} if args.use_opsm else set()
    keys |= {"kl_loss"} if args.use_kl_loss else set()
    assert set(metrics) == keys
    assert all(v.dim() == 0 and not v.requires_grad for v in metrics.values())


def _mis_args(**flags):
    args = dict(use_tis=True, use_rs=False, tis_level="token", rs_level="token",
                tis_mode="truncate", tis_lower_bound=None, tis_upper_bound=2.0,
                rs_lower_bound=None, rs_upper_bound=None, rs_veto_threshold=None,
                tis_batch_normalize=False)
    args.update(flags)
    return SimpleNamespace(**args)


# Two samples: d = train - rollout = [0.1, -0.2, 0.5 (masked out)] and [1.0, 0.9].
MIS_D = torch.tensor([0.1, -0.2, 0.5, 1.0, 0.9])
MIS_MASK = torch.tensor([1.0, 1.0, 0.0, 1.0, 1.0])
MIS_SEG = torch.tensor([0, 0, 0, 1, 1])


def _mis(**flags):
    return mis_weights(_mis_args(**flags), MIS_D.clone(), torch.zeros(5), MIS_MASK, MIS_SEG, 2)


def test_mis_by_hand():
    e = math.exp
    w, kept, _ = _mis()                                   # token truncate at 2
    assert torch.allclose(w, torch.tensor([e(0.1), e(-0.2), 0.0, 2.0, 2.0]))
    assert kept.tolist() == MIS_MASK.tolist()
    w, kept, _ = _mis(tis_level="sequence", tis_mode="mask", tis_lower_bound=0.5,
                      tis_upper_bound=3.0)                # sums -0.1 (kept), 1.9 (e^1.9 > 3)
    assert torch.allclose(w, torch.tensor([e(-0.1), e(-0.1), 0.0, e(1.9), e(1.9)]))
    assert kept.tolist() == [1.0, 1.0, 0.0, 0.0, 0.0]
    w, kept, _ = _mis(tis_level="geometric", tis_mode="clip", tis_lower_bound=0.99,
                      tis_upper_bound=1.5)                # means -0.05 -> 0.99, 0.95 -> 1.5
    assert torch.allclose(w, torch.tensor([0.99, 0.99, 0.0, 1.5, 1.5]))
    w, kept, metrics = _mis(tis_batch_normalize=True)     # token mean over the 4 masked
    mean = (e(0.1) + e(-0.2) + 4.0) / 4
    assert torch.allclose(w, torch.tensor([e(0.1), e(-0.2), 0.0, 2.0, 2.0]) / mean)
    assert torch.allclose(metrics["is_ratio_max_final"][3:], torch.tensor(2.0 / mean))
    assert torch.allclose(metrics["is_ratio_min_final"][:3], torch.tensor(e(-0.2) / mean))


def test_mis_rejection_and_veto():
    d = MIS_D.clone()
    d[1] = -10.0                                          # below log(1e-4): sample 0 vetoed
    args = _mis_args(use_rs=True, rs_upper_bound=2.5, rs_veto_threshold=1e-4)
    w, kept, metrics = mis_weights(args, d, torch.zeros(5), MIS_MASK, MIS_SEG, 2)
    assert kept.tolist() == [0.0, 0.0, 0.0, 0.0, 1.0]     # veto; e^1.0 > 2.5 rejected
    assert metrics["rs_catastrophic_seq_fraction"].tolist() == [1.0, 1.0, 1.0, 0.0, 0.0]
    assert metrics["rs_mask_fraction_high"].tolist() == [0.0, 0.0, 0.0, 1.0, 0.0]
    no_tis, kept, metrics = mis_weights(_mis_args(use_tis=False), d, torch.zeros(5), MIS_MASK,
                                        MIS_SEG, 2)
    assert no_tis is None and kept.tolist() == MIS_MASK.tolist() and "kl" in metrics


def test_mis_tis_function_applies_the_weights():
    args = slime_args(**vars(_mis_args(tis_mode="mask", tis_lower_bound=0.9)))
    pg = torch.arange(1.0, 6.0)
    out, masks, metrics = plug.mis_tis_function(
        args, pg_loss=pg, train_log_probs=[MIS_D[:3], MIS_D[3:]],
        rollout_log_probs=[torch.zeros(3), torch.zeros(2)],
        loss_masks=[MIS_MASK[:3].int(), MIS_MASK[3:].int()], total_lengths=[5, 4],
        response_lengths=[3, 2])
    w, kept, _ = _mis(tis_mode="mask", tis_lower_bound=0.9)
    assert torch.equal(out, pg * w)
    assert [m.tolist() for m in masks] == [kept[:3].tolist(), kept[3:].tolist()]
    assert all(k.startswith("mis_") and v.shape == (5,) for k, v in metrics.items())


@pytest.mark.parametrize("flags, match", [
    (dict(rollout_top_p=0.9), "rollout_top_p_token_ids"),        # the replay keys missing
    (dict(advantage_estimator="dapo"), "advantage-estimator"),
    (dict(use_tis=True, custom_tis_function_path=f"{__name__}.user_tis_not_multiplicative"),
     "custom-tis-function-path"),
    (dict(use_kl_loss=True, kl_loss_type="k4"), "kl-loss-type"),
    (dict(use_tis=True, tis_clip_low=3.0, tis_clip=2.0), "tis-clip-low"),
    (dict(eps_clip_c=0.5), "eps-clip-c"),
])
def test_refuses_what_it_cannot_honour(flags, match):
    batch, logits, _, _ = make_batch(0)
    with pytest.raises(ValueError, match=match):
        plug.policy_loss_function(slime_args(**flags), batch, logits, reducer(batch, False))


def test_kl_loss_needs_ref_log_probs():
    batch, logits, _, _ = make_batch(0)
    batch["ref_log_probs"] = None
    with pytest.raises(ValueError, match="ref_log_probs"):
        plug.policy_loss_function(slime_args(use_kl_loss=True, kl_loss_coef=0.1), batch,
                                  logits, reducer(batch, False))


def test_docs_mis_example_prints_what_it_says(capsys):
    """docs/slime.md's slime_policy example runs as written; each print gives its comment."""
    import os
    import re
    text = open(os.path.join(os.path.dirname(__file__), "..", "..", "docs", "slime.md")).read()
    block = next(b for b in re.findall(r"```python\n(.*?)```", text, re.S)
                 if "slime_policy" in b)
    exec(compile(block, "docs/slime.md", "exec"), {})
    printed = capsys.readouterr().out.splitlines()
    said = [line.split("# ", 1)[1].split(":")[0].strip() for line in block.splitlines()
            if line.startswith("print(")]
    assert printed == said


def user_tis_three_factors(args, *, pg_loss, train_log_probs, rollout_log_probs, loss_masks,
                           **kwargs):
    """pg_loss times three factors: its slope rounds in another order than its value."""
    d = torch.cat(train_log_probs) - torch.cat(rollout_log_probs)
    return pg_loss * torch.exp(d) * 0.3 * torch.exp(-0.5 * d), loss_masks, {}


def user_tis_one_factor(args, *, pg_loss, train_log_probs, rollout_log_probs, loss_masks,
                        **kwargs):
    d = torch.cat(train_log_probs) - torch.cat(rollout_log_probs)
    return pg_loss * (torch.exp(d) * 0.3 * torch.exp(-0.5 * d)), loss_masks, {}


def test_user_tis_hook_with_several_factors_is_accepted():
    batch, logits, _, _ = make_batch(1)
    losses = []
    for hook in ("user_tis_three_factors", "user_tis_one_factor"):
        args = slime_args(use_tis=True, custom_tis_function_path=f"{__name__}.{hook}")
        losses.append(plug.policy_loss_function(args, batch, logits, reducer(batch, False))[0])
    plain = plug.policy_loss_function(slime_args(), batch, logits, reducer(batch, False))[0]
    assert float((losses[0] - losses[1]).abs()) <= 1e-6 * float(losses[1].abs())
    assert float((losses[1] - plain).abs()) > 1e-3          # the weights do act


def test_top_p_replay_packing():
    """slime's per-sample replay -> CSR: an empty recorded nucleus keeps the target alone,
    unrecorded tokens keep nothing (full vocabulary), bad offsets are refused."""
    from glm_kernels.integrations.slime._topp import nucleus_csr
    targets = [torch.tensor([5, 6, 7]), torch.tensor([8, 9])]
    batch = {"rollout_top_p_token_ids": [[1, 2, 3], torch.tensor([4])],
             "rollout_top_p_token_offsets": [[0, 2, 2, 3], torch.tensor([0, 1])]}
    ids, offsets = nucleus_csr(batch, targets, "cpu")
    assert ids.tolist() == [1, 2, 6, 3, 4] and offsets.tolist() == [0, 2, 3, 4, 5, 5]
    batch["rollout_top_p_token_offsets"][0] = [0, 2, 1, 3]
    with pytest.raises(ValueError, match=r"rollout_top_p_token_offsets'\]\[0\] decreases"):
        nucleus_csr(batch, targets, "cpu")
    batch["rollout_top_p_token_offsets"][0] = [0, 2, 2, 9]
    with pytest.raises(ValueError, match="points outside"):
        nucleus_csr(batch, targets, "cpu")
