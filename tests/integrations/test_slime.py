"""slime plug-ins on CPU, fed batches shaped as slime builds them.

Batch layout taken from THUDM/slime @ 624b824: slime/backends/megatron_utils/data.py
(``get_batch``: packed ``tokens`` [1, T_padded], ``unconcat_tokens``, per-sample lists),
slime/backends/megatron_utils/actor.py (``loss_masks`` as int tensors, log-probs fp32,
``rollout_mask_sums`` fp32), slime/backends/megatron_utils/cp_utils.py (the CP = 1
``sum_of_sample_mean``: sum over samples of sum(x_i * m_i) / max(denominator_i, 1)).
"""
from types import SimpleNamespace

import pytest
import torch

from glm_kernels.integrations.slime import icepop as plug
from glm_kernels.loss.mismatch.mismatch import mismatch_from_tokens


def slime_args(**overrides):
    args = dict(use_rollout_logprobs=False, tis_clip=2.0, tis_clip_low=0.5, eps_clip=0.2,
                eps_clip_high=0.28, rollout_temperature=1.0, tensor_model_parallel_size=1,
                context_parallel_size=1, allgather_cp=False, calculate_per_token_loss=False,
                use_kl_loss=False, entropy_coef=0.0, use_opd=False, opd_kl_coef=1.0)
    args.update(overrides)
    return SimpleNamespace(**args)


def make_sum_of_sample_mean(response_lengths, loss_masks, denominators):
    def reduce(x):
        total = x.new_zeros(())
        for x_i, m_i, d_i in zip(x.split(response_lengths), loss_masks, denominators):
            total = total + (x_i * m_i).sum() / torch.clamp_min(d_i, 1)
        return total
    return reduce


def slime_batch(seed, *, vocab=37, prompts=(5, 3, 7), responses=(4, 6, 1), pad_multiple=16,
                with_old=False, temperature=1.0, drift=0.3):
    """A micro-batch as get_batch hands it to the loss (CP = 1), plus its [1, T, V] logits."""
    g = torch.Generator().manual_seed(seed)
    unconcat = [torch.randint(0, vocab, (p + r,), generator=g) for p, r in zip(prompts, responses)]
    total_lengths = [p + r for p, r in zip(prompts, responses)]
    packed = torch.cat(unconcat)
    pad = (-packed.numel()) % pad_multiple
    tokens = torch.nn.functional.pad(packed, (0, pad)).unsqueeze(0)
    logits = torch.randn(1, tokens.shape[1], vocab, generator=g) * 2.0
    true_lp, end = [], 0
    for toks, total, resp in zip(unconcat, total_lengths, responses):
        end += total
        rows = torch.log_softmax(logits[0, end - resp - 1:end - 1] / temperature, -1)
        true_lp.append(rows.gather(-1, toks[-resp:, None]).squeeze(-1))
    loss_masks = [(torch.rand(r, generator=g) > 0.2).int() for r in responses]
    batch = {
        "tokens": tokens, "unconcat_tokens": unconcat, "total_lengths": total_lengths,
        "response_lengths": list(responses), "loss_masks": loss_masks,
        "advantages": [torch.full((r,), float(torch.randn((), generator=g))) for r in responses],
        "rollout_log_probs": [lp + drift * torch.randn(lp.shape, generator=g) for lp in true_lp],
        "log_probs": ([lp + 0.1 * torch.randn(lp.shape, generator=g) for lp in true_lp]
                      if with_old else None),
        "ref_log_probs": None, "values": None, "returns": None, "teacher_log_probs": None,
        "rollout_mask_sums": [m.sum().float() for m in loss_masks],
        "multimodal_train_inputs": None,
    }
    return batch, logits.requires_grad_(True), true_lp


def hand_icepop(lp, rollout, adv, old=None, lo=0.5, hi=2.0, eps_low=0.2, eps_high=0.28,
                dual_clip=None):
    """docs/design.md 3.1 written out token by token (fp64); dual clip as slime's
    compute_policy_loss
    applies --eps-clip-c."""
    lp, rollout, adv = lp.double(), rollout.double(), adv.double()
    if old is None:
        ratio = torch.exp(lp - rollout)
        gate = ((ratio.detach() >= lo) & (ratio.detach() <= hi)).double()
    else:
        k = torch.exp(old.double() - rollout)
        gate = k * ((k >= lo) & (k <= hi)).double()
        ratio = torch.exp(lp - old.double())
    ppo = torch.maximum(-ratio * adv, -ratio.clamp(1 - eps_low, 1 + eps_high) * adv)
    if dual_clip is not None:
        ppo = torch.where(adv < 0, torch.minimum(-dual_clip * adv, ppo), ppo)
    return gate * ppo


@pytest.mark.parametrize("with_old", [False, True])
@pytest.mark.parametrize("temperature,eps_clip_c", [(1.0, None), (0.7, None), (1.0, 1.1)])
def test_loss_function_matches_icepop_by_hand(with_old, temperature, eps_clip_c, any_backend):
    batch, logits, true_lp = slime_batch(3, with_old=with_old, temperature=temperature)
    args = slime_args(rollout_temperature=temperature, eps_clip_c=eps_clip_c)
    reduce = make_sum_of_sample_mean(batch["response_lengths"], batch["loss_masks"],
                                     batch["rollout_mask_sums"])
    loss, metrics = plug.icepop_loss_function(args, batch, logits, reduce)

    leaf = logits.detach().clone().requires_grad_(True)
    lps, end = [], 0
    for toks, total, resp in zip(batch["unconcat_tokens"], batch["total_lengths"],
                                 batch["response_lengths"]):
        end += total
        rows = torch.log_softmax(leaf[0, end - resp - 1:end - 1].double() / temperature, -1)
        lps.append(rows.gather(-1, toks[-resp:, None]).squeeze(-1))
    old = torch.cat(batch["log_probs"]) if with_old else None
    per_token = hand_icepop(torch.cat(lps), torch.cat(batch["rollout_log_probs"]),
                            torch.cat(batch["advantages"]), old, dual_clip=eps_clip_c)
    if eps_clip_c is not None:           # the cap binds on some token: the check can fail
        assert not torch.equal(per_token, hand_icepop(
            torch.cat(lps), torch.cat(batch["rollout_log_probs"]),
            torch.cat(batch["advantages"]), old))
    expected = reduce(per_token)
    expected.backward()
    loss.backward()
    torch.testing.assert_close(loss.double(), expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(logits.grad.double(), leaf.grad.double(), rtol=1e-4, atol=1e-6)
    # Only rows that predict a response token get a gradient (prompt interior and padding: 0).
    feeding = torch.zeros(logits.shape[1], dtype=torch.bool)
    end = 0
    for total, resp in zip(batch["total_lengths"], batch["response_lengths"]):
        end += total
        feeding[end - resp - 1:end - 1] = True
    assert float(logits.grad[0, ~feeding].abs().sum()) == 0.0
    assert set(metrics) >= {"loss", "pg_loss", "entropy_loss", "pop_frac", "clip_frac",
                            "train_rollout_logprob_abs_diff"}
    assert all(v.dim() == 0 and not v.requires_grad for v in metrics.values())
    assert 0.0 <= float(metrics["pop_frac"]) <= len(batch["response_lengths"])


@pytest.mark.parametrize("with_old", [False, True])
@pytest.mark.parametrize("per_token", [False, True])
def test_loss_function_reports_the_mismatch_metrics(with_old, per_token, any_backend):
    """The kernel's micro-batch means times the sample (token) count, so that slime's
    sum / samples (tokens) averages them; log_ppl_diff is slime's per-sample mean."""
    batch, logits, true_lp = slime_batch(11, with_old=with_old)
    batch["rollout_log_probs"][2][0] = float("nan")            # rollout-side: not in M
    args = slime_args(calculate_per_token_loss=per_token)
    reduce = make_sum_of_sample_mean(batch["response_lengths"], batch["loss_masks"],
                                     batch["rollout_mask_sums"])
    _, metrics = plug.icepop_loss_function(args, batch, logits, reduce)
    train = torch.cat(batch["log_probs"] if with_old else true_lp)
    rollout = torch.cat(batch["rollout_log_probs"])
    mask = torch.cat(batch["loss_masks"])
    ref = mismatch_from_tokens(train, rollout, mask, gate_low=0.5, gate_high=2.0,
                               also_finite=torch.cat(true_lp) if with_old else None)
    weight = int(mask.sum()) if per_token else len(batch["response_lengths"])
    for key in plug.TOKEN_MISMATCH_KEYS:
        torch.testing.assert_close(metrics[key], ref[key] * weight, rtol=1e-4, atol=1e-5)
    finite = torch.isfinite(rollout)
    expected_seq = reduce(torch.where(finite, rollout - train, 0.0))
    torch.testing.assert_close(metrics["log_ppl_diff"], expected_seq, rtol=1e-5, atol=1e-6)
    assert all(v.dim() == 0 and not v.requires_grad for v in metrics.values())


def test_loss_function_pop_frac_counts_the_gate():
    batch, logits, true_lp = slime_batch(5, drift=0.0)
    # Sample 1's tokens drift far from the policy: every one of them is popped.
    batch["rollout_log_probs"][1] = true_lp[1] + 3.0
    batch["loss_masks"] = [torch.ones(r, dtype=torch.int) for r in batch["response_lengths"]]
    batch["rollout_mask_sums"] = [torch.tensor(float(r)) for r in batch["response_lengths"]]
    reduce = make_sum_of_sample_mean(batch["response_lengths"], batch["loss_masks"],
                                     batch["rollout_mask_sums"])
    loss, metrics = plug.icepop_loss_function(slime_args(), batch, logits, reduce)
    assert float(metrics["pop_frac"]) == pytest.approx(1.0)      # one whole sample popped
    loss.backward()
    start = batch["total_lengths"][0] + batch["total_lengths"][1] - batch["response_lengths"][1] - 1
    assert float(logits.grad[0, start:start + batch["response_lengths"][1]].abs().sum()) == 0.0


def test_loss_function_logs_opd_reverse_kl_and_rejects_unsupported_flags():
    batch, logits, true_lp = slime_batch(7)
    batch["teacher_log_probs"] = [lp - 0.25 for lp in true_lp]
    reduce = make_sum_of_sample_mean(batch["response_lengths"], batch["loss_masks"],
                                     batch["rollout_mask_sums"])
    _, metrics = plug.icepop_loss_function(slime_args(), batch, logits, reduce)
    expected = reduce(torch.full((sum(batch["response_lengths"]),), 0.25))
    torch.testing.assert_close(metrics["opd_reverse_kl"], expected, rtol=1e-5, atol=1e-6)
    # --entropy-coef: the fused entropy of selective_logprobs enters the loss like slime's.
    loss0, m0 = plug.icepop_loss_function(slime_args(), batch, logits, reduce)
    loss1, m1 = plug.icepop_loss_function(slime_args(entropy_coef=0.01), batch, logits, reduce)
    ent = []
    end = 0
    for total, resp in zip(batch["total_lengths"], batch["response_lengths"]):
        end += total
        p = torch.softmax(logits.detach()[0, end - resp - 1:end - 1].double(), -1)
        ent.append(-(p * p.log()).sum(-1))
    expected_entropy = reduce(torch.cat(ent))
    torch.testing.assert_close(m0["entropy_loss"].double(), expected_entropy, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(loss1, loss0 - 0.01 * m0["entropy_loss"], rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match="use-kl-loss"):
        plug.icepop_loss_function(slime_args(use_kl_loss=True), batch, logits, reduce)
    with pytest.raises(ValueError, match="tis-clip-low"):
        plug.icepop_loss_function(slime_args(tis_clip_low=3.0), batch, logits, reduce)
    with pytest.raises(ValueError, match="rollout_log_probs"):
        plug.icepop_loss_function(slime_args(), {**batch, "rollout_log_probs": None}, logits,
                                  reduce)
    short = {**batch, "advantages": [a[:-1] if a.numel() > 1 else a for a in batch["advantages"]]}
    with pytest.raises(ValueError, match="lengths disagree"):
        plug.icepop_loss_function(slime_args(), short, logits, reduce)


def test_tis_function_is_the_icepop_gate(any_backend):
    g = torch.Generator().manual_seed(11)
    lengths = [3, 5]
    old = [torch.randn(n, generator=g) for n in lengths]
    k = torch.tensor([1.0, 0.3, 2.0, 0.5, 2.5, 1.7, 0.49, 1.0])       # exp(old - rollout)
    rollout = list((torch.cat(old) - k.log()).split(lengths))
    pg_loss = torch.randn(8, generator=g)
    pg_loss[4] = float("nan")                                        # popped: must give 0
    masks = [torch.ones(n, dtype=torch.int) for n in lengths]
    out, out_masks, metrics = plug.icepop_tis_function(
        slime_args(), pg_loss=pg_loss, train_log_probs=old, rollout_log_probs=rollout,
        loss_masks=masks, total_lengths=[7, 9], response_lengths=lengths)
    kept = (k >= 0.5) & (k <= 2.0)
    torch.testing.assert_close(out, torch.where(kept, pg_loss * k, torch.zeros(8)),
                               rtol=1e-5, atol=1e-6)
    assert out_masks is masks and torch.isfinite(out).all()
    assert metrics["tis_pop"].tolist() == (~kept).float().tolist()
    torch.testing.assert_close(metrics["tis"], torch.where(kept, k, torch.zeros(8)), rtol=1e-5,
                               atol=1e-6)
    with pytest.raises(ValueError, match="lengths disagree"):
        plug.icepop_tis_function(slime_args(), pg_loss=pg_loss[:7], train_log_probs=old,
                                 rollout_log_probs=rollout, loss_masks=masks)


def test_opd_log_ratio_advantages_fill_rollout_data():
    g = torch.Generator().manual_seed(2)
    student = [torch.randn(n, generator=g) for n in (4, 2)]
    teacher = [torch.randn(n, generator=g) for n in (4, 2)]
    data = {"log_probs": student, "teacher_log_probs": teacher, "rewards": [1.0, 0.0]}
    plug.opd_log_ratio_advantages(slime_args(use_opd=True, opd_kl_coef=0.0), data)
    for a, r, s, t in zip(data["advantages"], data["returns"], student, teacher):
        torch.testing.assert_close(a, t - s)
        assert r is a and a.dtype == torch.float32
    rollout = {"rollout_log_probs": student, "teacher_log_probs": teacher}
    plug.opd_log_ratio_advantages(slime_args(use_rollout_logprobs=True), rollout)
    torch.testing.assert_close(rollout["advantages"][1], teacher[1] - student[1])
    with pytest.raises(ValueError, match="opd-kl-coef 0"):
        plug.opd_log_ratio_advantages(slime_args(use_opd=True, opd_kl_coef=1.0), data)
    with pytest.raises(ValueError, match="teacher_log_probs"):
        plug.opd_log_ratio_advantages(slime_args(), {"log_probs": student})


def test_integrations_package_is_import_light():
    import subprocess
    import sys
    code = ("import sys, glm_kernels.integrations, glm_kernels.integrations.slime; "
            "bad = [m for m in ('slime', 'sglang', 'megatron') if m in sys.modules]; "
            "print(bad); sys.exit(1 if bad else 0)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_docs_first_example_runs():
    """docs/slime.md's first python block runs as written and prints what it says."""
    import os
    import re
    text = open(os.path.join(os.path.dirname(__file__), "..", "..", "docs", "slime.md")).read()
    block = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    namespace = {}
    exec(compile(block, "docs/slime.md", "exec"), namespace)
    assert set(namespace["metrics"]) == {"clip_frac", "entropy_loss", "loss", "pg_loss",
                                         "pop_frac", "train_rollout_logprob_abs_diff",
                                         "log_ppl_diff", *plug.TOKEN_MISMATCH_KEYS}
    assert namespace["weighted"].tolist() == [1.0] * 3 + [0.0] * 5
    grad = namespace["logits"].grad[0]
    assert float(grad[7 + 2 - 1:7 + 7 - 1].abs().sum()) > 0 and float(grad[14:].abs().sum()) == 0
