"""Every loss option of slime 624b824: slime's own policy loss against glm_kernels' plug-ins.

Used by check_loss_conformance.py. For each option set (the flags slime's
``policy_loss_function`` reads: --advantage-estimator grpo / ppo / gspo / cispo, --eps-clip-c,
--use-opsm, --use-tis with slime's vanilla TIS, its IcePop hook and mis.py's MIS in every
tis/rs level and mode, veto and batch normalisation, --get-mismatch-metrics, --use-kl-loss
with every --kl-loss-type and --use-unbiased-kl, --entropy-coef, --use-rollout-logprobs,
--custom-pg-loss-reducer-function-path) slime's real ``loss_function`` runs on one
micro-batch:

  A. slime: ``--loss-type policy_loss`` (its own compute_policy_loss / compute_gspo_kl /
     compute_cispo_loss / compute_opsm_mask / TIS hooks / compute_approx_kl);
  B. slime with ``--custom-tis-function-path glm_kernels.integrations.slime_policy.
     mis_tis_function`` in place of mis.py (MIS option sets only);
  C. glm_kernels: ``--loss-type custom_loss --custom-loss-function-path
     glm_kernels.integrations.slime_policy.policy_loss_function``, same flags.

Compared: the loss, d loss / d logits and every metric slime reports (same keys, same values).
The batch is ragged (response lengths 1 to 16, one sample with every token masked), its
advantages of both signs and varying per token, the recomputed old log-probs near the policy's
with a few tokens 3 nats off (ratios outside every clip band), one token 10 nats under the
rollout's (MIS's veto), rollout_mask_sums summed over groups of two samples (slime's
per-rollout denominators).
"""
from __future__ import annotations

import os

import torch

OURS_LOSS = "glm_kernels.integrations.slime_policy.policy_loss_function"
OURS_MIS = "glm_kernels.integrations.slime_policy.mis_tis_function"
SLIME_MIS = "slime_mis.compute_mis_weights_with_cp"         # mis.py, loaded by load_mis
SLIME_ICEPOP = "slime.backends.megatron_utils.loss.icepop_function"
USER_TIS = f"{__name__}.clipped_ratio_tis"          # a user's own TIS hook (below)
TOL = 1e-5

MIS_DEFAULTS = dict(use_tis=True, use_rs=False, tis_level="token", rs_level="token",
                    tis_mode="truncate", tis_lower_bound=0.5, tis_upper_bound=2.0,
                    rs_lower_bound=None, rs_upper_bound=None, rs_veto_threshold=None,
                    tis_batch_normalize=False, custom_tis_function_path=SLIME_MIS)


def mis(**flags):
    return dict(MIS_DEFAULTS, **flags)


# (name, flags on top of check_loss_conformance.slime_args with use_tis=False)
OPTIONS = [
    ("grpo ppo clip", {}),
    ("ppo estimator, per-token advantages", dict(advantage_estimator="ppo")),
    ("dual clip --eps-clip-c 3", dict(eps_clip_c=3.0)),
    ("gspo", dict(advantage_estimator="gspo", eps_clip=0.05, eps_clip_high=0.08)),
    ("gspo dual clip", dict(advantage_estimator="gspo", eps_clip=0.05, eps_clip_high=0.08,
                            eps_clip_c=1.5)),
    ("cispo canonical", dict(advantage_estimator="cispo", eps_clip=1.0, eps_clip_high=0.5)),
    ("cispo two-sided", dict(advantage_estimator="cispo", eps_clip=0.2, eps_clip_high=0.28)),
    ("opsm", dict(use_opsm=True, opsm_delta=0.02)),
    ("vanilla tis", dict(use_tis=True, custom_tis_function_path=None, tis_clip_low=0.0)),
    ("vanilla tis, low bound", dict(use_tis=True, custom_tis_function_path=None,
                                    tis_clip_low=0.6, tis_clip=1.5)),
    ("icepop hook", dict(use_tis=True, custom_tis_function_path=SLIME_ICEPOP,
                         tis_clip_low=0.5, tis_clip=2.0)),
    ("glm_kernels icepop hook", dict(use_tis=True, tis_clip_low=0.5, tis_clip=2.0,
                                     custom_tis_function_path="glm_kernels.integrations.slime."
                                                              "icepop_tis_function")),
    ("mis token truncate", mis()),
    ("mis token clip", mis(tis_mode="clip")),
    ("mis token mask + rs + veto", mis(tis_mode="mask", use_rs=True,
                                       rs_veto_threshold=1e-4)),
    ("mis sequence truncate", mis(tis_level="sequence", tis_upper_bound=3.0)),
    ("mis sequence mask", mis(tis_level="sequence", tis_mode="mask", tis_lower_bound=0.3,
                              tis_upper_bound=3.0)),
    ("mis geometric mask (MIS-Geo)", mis(tis_level="geometric", tis_mode="mask",
                                         tis_lower_bound=0.9, tis_upper_bound=1.1)),
    ("mis token truncate + seq rs + batch norm", mis(
        use_rs=True, rs_level="sequence", rs_lower_bound=0.2, rs_upper_bound=5.0,
        tis_batch_normalize=True)),
    ("mis sequence clip + batch norm", mis(tis_level="sequence", tis_mode="clip",
                                           tis_lower_bound=0.4, tis_upper_bound=2.5,
                                           tis_batch_normalize=True)),
    ("mismatch metrics only (mis.py, no --use-tis)", mis(use_tis=False,
                                                          get_mismatch_metrics=True)),
    ("kl loss k1", dict(use_kl_loss=True, kl_loss_coef=0.1, kl_loss_type="k1")),
    ("kl loss k2", dict(use_kl_loss=True, kl_loss_coef=0.1, kl_loss_type="k2")),
    ("kl loss k3", dict(use_kl_loss=True, kl_loss_coef=0.1, kl_loss_type="k3")),
    ("kl loss low_var_kl", dict(use_kl_loss=True, kl_loss_coef=0.1,
                                kl_loss_type="low_var_kl")),
    ("kl loss low_var_kl unbiased", dict(use_kl_loss=True, kl_loss_coef=0.1,
                                         kl_loss_type="low_var_kl", use_unbiased_kl=True)),
    ("kl loss k3 unbiased", dict(use_kl_loss=True, kl_loss_coef=0.1, kl_loss_type="k3",
                                 use_unbiased_kl=True)),
    ("entropy coef", dict(entropy_coef=0.01)),
    ("use rollout logprobs", dict(use_rollout_logprobs=True)),
    ("custom pg reducer", dict(custom_pg_loss_reducer_function_path=f"{__name__}."
                                                                     "token_sum_reducer")),
    ("gspo + opsm + mis rs + kl + entropy", dict(
        mis(tis_mode="mask", use_rs=True, rs_veto_threshold=1e-4),
        advantage_estimator="gspo", eps_clip=0.05, eps_clip_high=0.08, use_opsm=True,
        opsm_delta=0.02, use_kl_loss=True, kl_loss_coef=0.05, kl_loss_type="low_var_kl",
        entropy_coef=0.01)),
    ("top-p 0.9", dict(rollout_top_p=0.9)),
    ("top-p 0.7 + icepop hook + kl + entropy", dict(
        rollout_top_p=0.7, use_tis=True, custom_tis_function_path=SLIME_ICEPOP,
        tis_clip_low=0.5, tis_clip=2.0, use_kl_loss=True, kl_loss_coef=0.1,
        kl_loss_type="low_var_kl", entropy_coef=0.01)),
    ("top-p 0.8 gspo + mis", dict(mis(tis_mode="mask", use_rs=True, rs_veto_threshold=1e-4),
                                  rollout_top_p=0.8, advantage_estimator="gspo",
                                  eps_clip=0.05, eps_clip_high=0.08)),
    ("user tis hook", dict(use_tis=True, custom_tis_function_path=USER_TIS)),
    ("user tis hook, mismatch metrics only", dict(get_mismatch_metrics=True,
                                                  custom_tis_function_path=USER_TIS)),
    ("user tis hook + gspo + opsm", dict(
        use_tis=True, custom_tis_function_path=USER_TIS, advantage_estimator="gspo",
        eps_clip=0.05, eps_clip_high=0.08, use_opsm=True, opsm_delta=0.02)),
    ("user tis hook + gspo + opsm + custom reducer", dict(
        use_tis=True, custom_tis_function_path=USER_TIS, advantage_estimator="gspo",
        eps_clip=0.05, eps_clip_high=0.08, use_opsm=True, opsm_delta=0.02,
        custom_pg_loss_reducer_function_path=f"{__name__}.token_sum_reducer")),
    ("cispo + vanilla tis + kl unbiased", dict(
        advantage_estimator="cispo", eps_clip=1.0, eps_clip_high=0.5, use_tis=True,
        custom_tis_function_path=None, use_kl_loss=True, kl_loss_coef=0.1,
        kl_loss_type="k2", use_unbiased_kl=True)),
]


def clipped_ratio_tis(args, *, pg_loss, train_log_probs, rollout_log_probs, loss_masks,
                      total_lengths, response_lengths, **kwargs):
    """A user's --custom-tis-function-path: the train / rollout ratio clipped to [0.3, 1.7],
    tokens whose |log-ratio| exceeds 1.5 rejected (new whole-response masks, gathered over
    CP as mis.py does), two metrics of its own (this rank's tokens)."""
    from slime.backends.megatron_utils.cp_utils import all_gather_with_cp
    local = [t - r for t, r in zip(train_log_probs, rollout_log_probs)]
    log_ratio = torch.cat(local)
    weights = torch.exp(log_ratio).clamp(0.3, 1.7)
    whole = [all_gather_with_cp(d, t, r) for d, t, r in zip(local, total_lengths,
                                                            response_lengths)]
    masks = [m * (d.abs() <= 1.5).to(m.dtype) for m, d in zip(loss_masks, whole)]
    metrics = {"user_tis": weights.clone(), "user_rejected": (log_ratio.abs() > 1.5).float()}
    return pg_loss * weights, masks, metrics



def add_top_p_replay(batch, logits, temperature, top_p, seed):
    """slime's rollout top-p replay keys: each response token's nucleus (the smallest set of
    most likely ids reaching top_p of the sampling distribution), ids and per-sample offsets
    as slime's rollout stores them; with the cases slime's code handles specially: a sampled
    token outside its nucleus, an empty recorded nucleus, a sample whose last tokens have no
    recorded nucleus."""
    g = torch.Generator().manual_seed(seed)
    probs = torch.softmax(logits[0] / temperature, -1)
    order = probs.argsort(-1, descending=True)
    cum = probs.gather(-1, order).cumsum(-1)
    ids_all, offsets_all, end = [], [], 0
    for i, (tokens, t, r) in enumerate(zip(batch["unconcat_tokens"], batch["total_lengths"],
                                           batch["response_lengths"])):
        end += t
        ids, offsets = [], [0]
        recorded = r - 2 if i == 2 else r             # sample 2: last two tokens unrecorded
        for j, row in enumerate(range(end - r - 1, end - r - 1 + recorded)):
            size = int((cum[row] < top_p).sum()) + 1
            kept = order[row, :size].tolist()
            target = int(tokens[t - r + j])
            if target not in kept and float(torch.rand((), generator=g)) < 0.7:
                kept.append(target)                    # the rest: target outside its nucleus
            if i == 0 and j == 1:
                kept = []                              # an empty recorded nucleus
            ids += kept
            offsets.append(len(ids))
        ids_all.append(torch.tensor(ids, dtype=torch.int32))
        offsets_all.append(torch.tensor(offsets, dtype=torch.int32))
    return dict(batch, rollout_top_p_token_ids=ids_all, rollout_top_p_token_offsets=offsets_all)


def token_sum_reducer(total_lengths, response_lengths, loss_masks, calculate_per_token_loss):
    """A user's --custom-pg-loss-reducer-function-path: the masked token sum."""
    def reduce(x):
        return sum((x_i * m_i).sum() for x_i, m_i in zip(x.split(response_lengths), loss_masks))
    return reduce


def load_mis(slime_src: str):
    """slime's examples/train_infer_mismatch_helper/mis.py as module ``slime_mis``."""
    from _slime_harness import load_file
    path = os.path.join(slime_src, "examples", "train_infer_mismatch_helper", "mis.py")
    if not os.path.isfile(path):
        raise SystemExit(f"--slime-src {slime_src!r}: no {path} (THUDM/slime 624b824)")
    return load_file("slime_mis", path)


def option_batch(seed, temperature, vocab=97, prompts=(5, 9, 3, 12, 4, 6),
                 responses=(7, 1, 16, 9, 5, 11)):
    """A CP = 1 micro-batch as slime's get_batch hands it over, and its [1, T, V] logits."""
    g = torch.Generator().manual_seed(seed)
    unconcat = [torch.randint(0, vocab, (p + r,), generator=g) for p, r in zip(prompts, responses)]
    total = [p + r for p, r in zip(prompts, responses)]
    length = sum(total) + (-sum(total)) % 16
    logits = torch.randn(1, length, vocab, generator=g) * 2.0
    # The policy's own log-probs, to put old / rollout / ref near them.
    logp = torch.log_softmax(logits[0] / temperature, -1)
    current, end = [], 0
    for tokens, t, r in zip(unconcat, total, responses):
        end += t
        current.append(logp[end - r - 1:end - 1].gather(1, tokens[-r:, None])[:, 0])
    masks = [(torch.rand(r, generator=g) > 0.2).int() for r in responses]
    masks[3] = torch.zeros_like(masks[3])                   # an all-masked sample
    old, rollout, ref, adv = [], [], [], []
    for i, lp in enumerate(current):
        shift = 0.06 * (i - 2.5)                            # sequence log-ratios of both signs
        o = lp + shift + 0.15 * torch.randn(lp.shape, generator=g)
        far = torch.rand(lp.shape, generator=g) < 0.12      # ratios outside every clip band
        o = torch.where(far, o + 3.0 * torch.sign(torch.randn(lp.shape, generator=g)), o)
        old.append(o)
        ro = o + 0.3 * torch.randn(lp.shape, generator=g)
        if i == 2:
            ro[4] = o[4] + 10.0                             # catastrophic token: MIS veto
        rollout.append(ro)
        ref.append(lp + 0.4 * torch.randn(lp.shape, generator=g))
        sign = 1.0 if i % 2 == 0 else -1.0
        adv.append(sign * (0.5 + torch.rand(lp.shape, generator=g)))
    group = [m.sum().float() for m in masks]
    mask_sums = [group[i] + group[i ^ 1] for i in range(len(masks))]
    batch = {"unconcat_tokens": unconcat, "total_lengths": total,
             "response_lengths": list(responses), "loss_masks": masks, "advantages": adv,
             "log_probs": old, "rollout_log_probs": rollout, "ref_log_probs": ref,
             "rollout_mask_sums": mask_sums}
    return batch, logits


def _scalar_err(ours, theirs, scale):
    """|ours - slime| / max(|slime|, scale): slime's scalars are sums over samples (or tokens,
    with --calculate-per-token-loss) of O(1) terms that can cancel to near 0, so the error is
    taken against the number of terms summed when that is larger."""
    return float((ours - theirs).abs() / theirs.abs().clamp(min=scale))


def check_options(loss_mod, slime_args, run_side, rel) -> int:
    """Run every option set; print one line each; return the number that failed."""
    failures = 0
    for name, flags in OPTIONS:
        for temperature, per_token in ((1.0, False), (0.7, True)):
            batch, logits = option_batch(len(name), temperature)
            if flags.get("rollout_top_p", 1.0) != 1.0:
                batch = add_top_p_replay(batch, logits, temperature, flags["rollout_top_p"],
                                         len(name))
            common = dict(dict(use_tis=False, custom_tis_function_path=None,
                               kl_loss_type="k1", kl_loss_coef=0.0, use_unbiased_kl=False,
                               opsm_delta=1e-4), **flags)
            common.update(rollout_temperature=temperature, calculate_per_token_loss=per_token)
            sides = {"A": slime_args(**common),
                     "C": slime_args(**dict(common, loss_type="custom_loss",
                                            custom_loss_function_path=OURS_LOSS))}
            if common.get("custom_tis_function_path") == SLIME_MIS:
                sides["B"] = slime_args(**dict(common, custom_tis_function_path=OURS_MIS))
            out = {k: run_side(loss_mod, a, batch, logits) for k, a in sides.items()}
            a_loss, a_grad, a_metrics = out["A"]
            errors, bad = {}, []
            terms = float(sum(int(m.sum()) for m in batch["loss_masks"])) if per_token else \
                float(len(batch["loss_masks"]))
            for side in sorted(k for k in out if k != "A"):
                loss, grad, metrics = out[side]
                errors[f"{side} loss"] = _scalar_err(loss, a_loss, 1.0)
                errors[f"{side} grad"] = rel(grad, a_grad)
                if set(metrics) != set(a_metrics):
                    bad.append(f"{side} metric keys: missing {sorted(set(a_metrics) - set(metrics))}"
                               f" extra {sorted(set(metrics) - set(a_metrics))}")
                shared = set(metrics) & set(a_metrics)
                errors[f"{side} metrics"] = max(
                    (_scalar_err(metrics[k], a_metrics[k], terms) for k in shared), default=0.0)
                bad += [f"{side} {k}" for k in sorted(shared)
                        if not _scalar_err(metrics[k], a_metrics[k], terms) <= TOL]
            bad += [k for k, v in errors.items() if k.endswith(("loss", "grad")) and not v <= TOL]
            failures += bool(bad)
            print(f"option {name} T={temperature} per_token={per_token}: loss "
                  f"{float(a_loss):+.6f}, {len(a_metrics)} metrics; "
                  + " ".join(f"{k} {v:.1e}" for k, v in errors.items())
                  + (f"  MISMATCH {bad}" if bad else ""))
    return failures


# ---- context parallelism: the option sets whose slime code gathers whole responses ----------

CP_OPTIONS = ("gspo dual clip", "opsm", "mis sequence mask", "mis token mask + rs + veto",
              "cispo + vanilla tis + kl unbiased", "gspo + opsm + mis rs + kl + entropy",
              "top-p 0.8 gspo + mis", "user tis hook + gspo + opsm")


def _option_flags(name, **extra):
    flags = dict(use_tis=False, custom_tis_function_path=None, kl_loss_type="k1",
                 kl_loss_coef=0.0, use_unbiased_kl=False, opsm_delta=1e-4)
    flags.update(dict(OPTIONS)[name])
    flags.update(extra)
    return flags


def cp_option_case(h, loss_mod, data_mod, cp, rank, allgather, name):
    """One rank's A (slime) and C (glm_kernels) for option set ``name``; ``h`` holds the main
    script's rank_micro_batch, slime_args, run_side and rel."""
    batch, logits = option_batch(len(name), 1.0)
    top_p = dict(OPTIONS)[name].get("rollout_top_p", 1.0)
    if top_p != 1.0:
        batch = add_top_p_replay(batch, logits, 1.0, top_p, len(name))
    micro, local, _ = h.rank_micro_batch(loss_mod, data_mod, batch, logits, allgather,
                                         noise_seed=2000 + rank)
    common = _option_flags(name, context_parallel_size=cp, allgather_cp=allgather)
    a = h.run_side(loss_mod, h.slime_args(**common), micro, local)
    c = h.run_side(loss_mod, h.slime_args(**dict(common, loss_type="custom_loss",
                                                 custom_loss_function_path=OURS_LOSS)),
                   micro, local)
    return {"A": a[0], "C": c[0], "grad": h.rel(c[1], a[1]), "A metrics": a[2],
            "C metrics": c[2]}


def report_cp_options(cp, per_rank) -> int:
    """Print one line per (CP mode, option set) from the ranks' results; the failures."""
    from _slime_harness import report_broken_ranks
    failures = 0
    for allgather in (False, True):
        for name in CP_OPTIONS:
            head = f"CP={cp} {'allgather-cp' if allgather else 'zigzag'} option {name}:"
            results = [r.get(("option", allgather, name)) if r else None for r in per_rank]
            if report_broken_ranks(head, results):
                failures += 1
                continue
            # A rank's loss and metrics are partial sums: errors against sum_r |A_r| (>= 1).
            scale = max(float(sum(abs(r["A"]) for r in results)), 1.0)
            worst = {"C loss": max(float(abs(r["C"] - r["A"])) for r in results) / scale,
                     "C grad": max(r["grad"] for r in results)}
            keys = set(results[0]["A metrics"])
            bad = [] if all(set(r["C metrics"]) == keys for r in results) else ["metric keys"]
            metric_worst = 0.0
            for key in keys & set(results[0]["C metrics"]):
                key_scale = max(float(sum(abs(r["A metrics"][key]) for r in results)), 1.0)
                err = max(float(abs(r["C metrics"][key] - r["A metrics"][key]))
                          for r in results) / key_scale
                metric_worst = max(metric_worst, err)
                bad += [f"C {key}"] if not err <= TOL else []
            worst["C metrics"] = metric_worst
            bad += [k for k in ("C loss", "C grad") if not worst[k] <= TOL]
            failures += bool(bad)
            print(f"{head} loss over ranks {float(sum(r['A'] for r in results)):+.6f}; worst "
                  f"rank: " + " ".join(f"{k} {v:.1e}" for k, v in worst.items())
                  + (f"  MISMATCH {bad}" if bad else ""))
    return failures
