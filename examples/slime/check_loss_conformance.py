"""Check glm_kernels' slime loss plug-ins against *your* slime's own loss code.

Loads slime's real ``loss_function`` and ``policy_loss_function`` (with its real
log-prob/entropy computation, ``compute_policy_loss``, ``get_sum_of_sample_mean`` and its
built-in ``icepop_function`` TIS hook) from a checkout, builds micro-batches the way slime's
``get_batch`` does (packed [1, T, V] fp32 logits, per-sample lists), and compares, on the same
batch:

  A. slime: ``--use-tis --custom-tis-function-path slime...icepop_function`` (slime's IcePop)
  B. slime + glm_kernels: ``--use-tis --custom-tis-function-path
     glm_kernels.integrations.slime.icepop_tis_function``
  C. glm_kernels: ``--loss-type custom_loss --custom-loss-function-path
     glm_kernels.integrations.slime.icepop_loss_function``

loss and d loss / d logits, decoupled IcePop (recomputed ``log_probs`` given), at
temperature 1 and 0.7, with and without --calculate-per-token-loss. Then the OPD advantage:
slime's ``compute_advantages_and_returns`` with ``--custom-advantage-function-path
glm_kernels.integrations.slime.opd_log_ratio_advantages --use-opd --opd-kl-coef 0`` against
slime's own OPD penalty on a zero outcome reward (``--opd-kl-coef 1``): both are
A_t = log pi_teacher - log pi_student. Then every loss option slime 624b824 ships
(_policy_options.py: GSPO, CISPO, dual clip, OPSM, vanilla / IcePop / MIS importance sampling,
KL loss, entropy, ...): slime's own policy loss against
``glm_kernels.integrations.slime_policy.policy_loss_function`` (and mis.py against
``mis_tis_function``), loss, gradient and every metric. All of that at TP = CP = 1 in this
process.

Then context parallelism (``--cp-sizes``, default 2 and 3), zigzag and ``--allgather-cp``: one
gloo process per CP rank (slime's ``--allgather-cp`` log-probs go through an all-reduce over
the CP group). Each rank builds its micro-batch with slime's own code: ``get_batch`` (data.py;
the rank's packed token rows, whole ``loss_masks``), ``slice_log_prob_with_cp`` on
``rollout_log_probs`` and ``log_probs`` (as actor.py and the log-prob forward give them) and
``compute_advantages_and_returns`` for the advantages; its logits are the rows of the CP = 1
logits that slime's ``get_batch`` puts on that rank (noise on padding rows). A, B and C are
compared per rank: the gradient of the rank's logits (relative error), and the rank's loss,
whose error is taken relative to sum_r |A_r| (a rank's partial loss can nearly cancel). slime's
A summed over the ranks (loss; gradients put back at their stream rows) must give A at CP = 1.
What processes cannot provide is stood in (``_slime_harness.py``); TP = 1. The losses are
``loss_function``'s, which Megatron's schedule calls: the dispatch on ``--loss-type``, the
reducer, the scaling for the step (one micro-batch of one step here) and for CP.

    python examples/slime/check_loss_conformance.py --slime-src /path/to/slime

Exit status 0 when every comparison is within 1e-5 relative (fp32), 1 otherwise.
"""
from __future__ import annotations

import argparse
import atexit
import os
import shutil
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from types import SimpleNamespace

# slime's compute_policy_loss / compute_approx_kl are torch.compile(dynamic=True)d. On torch
# 2.13 (CPU) Inductor's FX-graph / AOT-autograd caches (on disk, and within one process) gave
# back a graph compiled for other --eps-clip / --eps-clip-c values when the inputs need a
# gradient (clip fraction 0 where eager clips). One slime run has one configuration; this
# check runs many in a process, so slime's side compiles each without those caches, in a
# private directory (set before torch loads; the CP rank processes inherit it).
os.environ["TORCHINDUCTOR_FX_GRAPH_CACHE"] = "0"
os.environ["TORCHINDUCTOR_AUTOGRAD_CACHE"] = "0"
if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="slime-conformance-")
    atexit.register(shutil.rmtree, os.environ["TORCHINDUCTOR_CACHE_DIR"], True)

import torch  # noqa: E402
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _slime_harness import (load_data, load_loss, one_rank_gloo, report_broken_ranks,  # noqa: E402
                            set_parallel)
from _policy_options import (CP_OPTIONS, check_options, cp_option_case, load_mis,  # noqa: E402
                             report_cp_options)

SLIME_ICEPOP = "slime.backends.megatron_utils.loss.icepop_function"
OURS_TIS = "glm_kernels.integrations.slime.icepop_tis_function"
OURS_LOSS = "glm_kernels.integrations.slime.icepop_loss_function"
SIDES = {"A": {}, "B": dict(custom_tis_function_path=OURS_TIS),       # flags on top of A's
         "C": dict(loss_type="custom_loss", custom_loss_function_path=OURS_LOSS)}
TOL = 1e-5
TEMPERATURES, PER_TOKEN = (1.0, 0.7), (False, True)
# A one-sample micro-batch whose response sits in one zigzag chunk / one allgather piece: the
# other CP ranks hold no response token at all (slime's "0 * logits.sum()" path).
PROMPT_HEAVY = dict(prompts=(11,), responses=(1,))
# The keys slime's train forward_step asks get_batch for (model.py), minus the optional ones.
TRAIN_KEYS = ("tokens", "multimodal_train_inputs", "total_lengths", "response_lengths",
              "loss_masks", "log_probs", "ref_log_probs", "values", "advantages", "returns",
              "rollout_log_probs", "teacher_log_probs", "rollout_mask_sums",
              "rollout_top_p_token_ids", "rollout_top_p_token_offsets")   # with top-p < 1
# --data-pad-size-multiplier: slime's default 128 would put these short streams whole on the
# first --allgather-cp rank; with 8 every rank's piece cuts through samples.
PAD_MULTIPLIER = 8
CP_TIMEOUT_S = 600


def slime_args(**overrides):
    args = dict(advantage_estimator="grpo", use_rollout_logprobs=False, log_probs_chunk_size=-1,
                allgather_cp=False, use_opsm=False, eps_clip=0.2, eps_clip_high=0.28,
                eps_clip_c=None, get_mismatch_metrics=False, use_tis=True,
                custom_tis_function_path=SLIME_ICEPOP, custom_pg_loss_reducer_function_path=None,
                calculate_per_token_loss=False, entropy_coef=0.0, use_kl_loss=False,
                rollout_temperature=1.0, rollout_top_p=1.0, tis_clip_low=0.5, tis_clip=2.0,
                context_parallel_size=1, tensor_model_parallel_size=1, loss_type="policy_loss",
                custom_loss_function_path=None, recompute_loss_function=False)
    args.update(overrides)
    return SimpleNamespace(**args)


def micro_batch(seed, vocab=151, prompts=(5, 9, 3, 12), responses=(7, 1, 16, 9), drift=0.4):
    """One micro-batch as slime's get_batch hands it to the loss (CP = 1), its logits, and
    rollout / recomputed log-probs that straddle IcePop's band."""
    g = torch.Generator().manual_seed(seed)
    unconcat = [torch.randint(0, vocab, (p + r,), generator=g) for p, r in zip(prompts, responses)]
    total = [p + r for p, r in zip(prompts, responses)]
    length = sum(total) + (-sum(total)) % 16              # slime pads the packed stream
    logits = torch.randn(1, length, vocab, generator=g) * 3.0
    masks = [(torch.rand(r, generator=g) > 0.15).int() for r in responses]
    noise = lambda r, s: s * torch.randn(r, generator=g)  # noqa: E731
    base = [torch.log_softmax(torch.randn(r, vocab, generator=g), -1)[:, 0] for r in responses]
    batch = {
        "unconcat_tokens": unconcat, "total_lengths": total, "response_lengths": list(responses),
        "loss_masks": masks,
        "advantages": [torch.full((r,), float(torch.randn((), generator=g))) for r in responses],
        "rollout_log_probs": [b + noise(b.numel(), drift) for b in base],
        "log_probs": [b + noise(b.numel(), 0.05) for b in base],
        "rollout_mask_sums": [m.sum().float() for m in masks],
    }
    return batch, logits


def run_side(loss_mod, args, batch, logits):
    """slime's ``loss_function`` (what Megatron's schedule calls: the loss-type dispatch, the
    reducer, the CP scaling, --allgather-cp's zero term) on one micro-batch of a one-micro-batch
    step: (loss, d loss / d logits, metrics)."""
    logits = logits.detach().clone().requires_grad_(True)
    loss, _, log = loss_mod.loss_function(args, batch, 1, len(batch["response_lengths"]), logits)
    loss.backward()
    return loss.detach(), logits.grad, dict(zip(log["keys"], log["values"][1:]))


def check_opd_advantage(loss_mod) -> int:
    failures = 0
    for use_rollout in (False, True):
        batch, _ = micro_batch(7)
        g = torch.Generator().manual_seed(11)
        data = {k: batch[k] for k in ("rollout_log_probs", "log_probs", "loss_masks",
                                      "response_lengths", "total_lengths")}
        data["teacher_log_probs"] = [lp + 0.3 * torch.randn(lp.shape, generator=g)
                                     for lp in batch["log_probs"]]
        data["rewards"] = [0.0] * len(batch["response_lengths"])
        common = dict(use_rollout_logprobs=use_rollout, kl_coef=0.0, use_opd=True,
                      opd_type="sglang", normalize_advantages=False, kl_loss_type="k1")
        ours, theirs = dict(data), dict(data)
        loss_mod.compute_advantages_and_returns(slime_args(
            custom_advantage_function_path="glm_kernels.integrations.slime."
            "opd_log_ratio_advantages", opd_kl_coef=0.0, **common), ours)
        loss_mod.compute_advantages_and_returns(slime_args(
            custom_advantage_function_path=None, opd_kl_coef=1.0, **common), theirs)
        err = rel(torch.cat(ours["advantages"]), torch.cat(theirs["advantages"]))
        failures += not err <= 1e-6
        print(f"OPD advantage (use_rollout_logprobs={use_rollout}): rel err {err:.1e}"
              + ("" if err <= 1e-6 else "  MISMATCH"))
    return failures


def check_top_p_icepop(loss_mod) -> int:
    """A, B and C with --rollout-top-p < 1 (slime's nucleus replay), CP = 1."""
    from _policy_options import add_top_p_replay
    failures = 0
    for top_p, temperature in ((0.9, 1.0), (0.7, 0.7)):
        batch, logits = micro_batch(3)
        batch = add_top_p_replay(batch, logits, temperature, top_p, seed=5)
        a, b, c = compare_sides(loss_mod, batch, logits, rollout_temperature=temperature,
                                rollout_top_p=top_p, calculate_per_token_loss=False)
        errors = {"B loss": rel(b[0], a[0]), "B grad": rel(b[1], a[1]),
                  "C loss": rel(c[0], a[0]), "C grad": rel(c[1], a[1])}
        bad = sorted(k for k, v in errors.items() if not v <= TOL)
        failures += bool(bad)
        print(f"top-p {top_p} IcePop T={temperature}: loss {float(a[0]):+.6f} "
              + " ".join(f"{k} {v:.1e}" for k, v in errors.items())
              + (f"  MISMATCH {bad}" if bad else ""))
    return failures


def rel(a, b):
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def compare_sides(loss_mod, batch, logits, **common):
    """(A, B, C) on one micro-batch: each (loss, logits grad, metrics)."""
    return [run_side(loss_mod, slime_args(**common, **flags), batch, logits)
            for flags in SIDES.values()]


def cases(seeds):
    """(label, micro_batch kwargs, temperature, per_token) of every case."""
    return [(f"T={t} per_token={pt} seed={seed}", dict(seed=seed), t, pt)
            for t in TEMPERATURES for pt in PER_TOKEN for seed in range(seeds)] + \
        [("T=1.0 per_token=False prompt-heavy sample", dict(seed=0, **PROMPT_HEAVY), 1.0, False)]


# ---- context parallelism: one gloo process per CP rank --------------------------------------

def rank_micro_batch(loss_mod, data_mod, batch, logits, allgather, noise_seed):
    """This CP rank's micro-batch and [1, T_local, V] logits as slime builds them (the stand-in
    ``mpu`` already answers this rank), and the packed-stream row of every local row (-1:
    padding)."""
    totals, resps = batch["total_lengths"], batch["response_lengths"]

    def rank_part(values):    # actor._get_rollout_data; get_log_probs_and_entropy's output
        return [loss_mod.slice_log_prob_with_cp(v, t, r) for v, t, r in zip(values, totals, resps)]

    rollout = {"tokens": batch["unconcat_tokens"], "total_lengths": totals,
               "response_lengths": resps, "loss_masks": batch["loss_masks"],
               "rollout_mask_sums": torch.stack(batch["rollout_mask_sums"]),
               "rollout_log_probs": rank_part(batch["rollout_log_probs"]),
               "log_probs": rank_part(batch["log_probs"]),
               **({"ref_log_probs": rank_part(batch["ref_log_probs"])}
                  if batch.get("ref_log_probs") else {}),
               "rewards": [float(adv[0]) for adv in batch["advantages"]],
               # top-p replay: whole responses per sample, as the rollout stores them
               **{k: batch[k] for k in ("rollout_top_p_token_ids",
                                        "rollout_top_p_token_offsets") if k in batch}}
    # GRPO: every response token of a sample gets its reward, on this rank's part (actor.train).
    loss_mod.compute_advantages_and_returns(slime_args(
        kl_coef=0.0, custom_advantage_function_path=None, use_opd=False,
        normalize_advantages=False, allgather_cp=allgather), rollout)
    schedule = [list(range(len(totals)))]
    micro = data_mod.get_batch(data_mod.DataIterator(rollout, schedule), TRAIN_KEYS,
                               PAD_MULTIPLIER, allgather)
    # The same get_batch on tokens that name their stream position says which rows are here.
    starts = torch.tensor([0] + list(totals[:-1])).cumsum(0).tolist()
    numbered = dict(rollout, tokens=[torch.arange(s, s + t) + 1 for s, t in zip(starts, totals)])
    rows = data_mod.get_batch(data_mod.DataIterator(numbered, schedule), TRAIN_KEYS,
                              PAD_MULTIPLIER, allgather)["tokens"][0] - 1
    assert micro["tokens"].shape[1] == rows.numel()
    noise = 3.0 * torch.randn(rows.numel(), logits.shape[-1],
                              generator=torch.Generator().manual_seed(noise_seed))
    local = torch.where((rows >= 0)[:, None], logits[0, rows.clamp(min=0)], noise)
    return micro, local.unsqueeze(0), rows


def cp_case(loss_mod, data_mod, cp, rank, allgather, batch_kwargs, temperature, per_token):
    batch, logits = micro_batch(**batch_kwargs)
    micro, local, rows = rank_micro_batch(loss_mod, data_mod, batch, logits, allgather,
                                          noise_seed=1000 + rank)
    a, b, c = compare_sides(loss_mod, micro, local, rollout_temperature=temperature,
                            calculate_per_token_loss=per_token, context_parallel_size=cp,
                            allgather_cp=allgather)
    # slime's own A over every rank, back on the packed stream, must be A at CP = 1: the sum
    # over ranks divided by CP (loss_function multiplies by CP for Megatron's DP x CP gradient
    # average). Under --allgather-cp each rank's gradient is already that of the loss summed
    # over the ranks (the backward of slime's all-reduce sums them), once per row.
    held = rows >= 0
    stream_grad = torch.zeros_like(logits[0]).index_add_(0, rows[held], a[1][0, held]) / cp
    stream_loss = a[0] / cp
    dist.all_reduce(stream_grad)
    dist.all_reduce(stream_loss)
    return {"losses": {"A": a[0], "B": b[0], "C": c[0]},
            "grad_errors": {"B grad": rel(b[1], a[1]), "C grad": rel(c[1], a[1])},
            "stream_loss": stream_loss,
            "stream_grad": stream_grad if rank == 0 else None,
            "stream_rows": int(held.sum()),
            "response_tokens": sum(int(x.numel()) for x in micro["rollout_log_probs"])}


def cp_worker(rank, cp, slime_src, seeds, out_dir, options=True):
    import warnings
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{os.path.join(out_dir, 'rendezvous')}",
                            rank=rank, world_size=cp, timeout=timedelta(seconds=120))
    results = {}
    try:
        # One-rank TP groups (new_group is collective: every rank creates all of them).
        tp_groups = [dist.new_group([r]) for r in range(cp)]
        loss_mod = load_loss(slime_src)
        data_mod = load_data(slime_src)
        set_parallel(cp_size=cp, cp_rank=rank, cp_group=dist.group.WORLD,
                     tp_group=tp_groups[rank])
        for allgather in (False, True):
            for label, batch_kwargs, temperature, per_token in cases(seeds):
                try:
                    results[(allgather, label)] = cp_case(loss_mod, data_mod, cp, rank,
                                                          allgather, batch_kwargs, temperature,
                                                          per_token)
                except Exception:   # reported per case; a peer left in a collective times out
                    results[(allgather, label)] = {"error": traceback.format_exc(limit=8)}
                # After every case: a collective mismatch can abort this process later.
                torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
        if options:
            load_mis(slime_src)
            helpers = SimpleNamespace(rank_micro_batch=rank_micro_batch, slime_args=slime_args,
                                      run_side=run_side, rel=rel)
            for allgather in (False, True):
                for name in CP_OPTIONS:
                    key = ("option", allgather, name)
                    try:
                        results[key] = cp_option_case(helpers, loss_mod, data_mod, cp, rank,
                                                      allgather, name)
                    except Exception:
                        results[key] = {"error": traceback.format_exc(limit=8)}
                    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()          # nobody tears gloo down while a peer is in a collective
    finally:
        dist.destroy_process_group()


def run_cp_ranks(cp, slime_src, seeds, options=True):
    """Per-rank result dicts of ``cp_worker``; None for a rank that left none (timeout)."""
    with tempfile.TemporaryDirectory() as out_dir:
        context = torch.multiprocessing.start_processes(
            cp_worker, args=(cp, slime_src, seeds, out_dir, options), nprocs=cp, join=False,
            start_method="spawn")
        deadline = time.monotonic() + CP_TIMEOUT_S
        try:
            while not context.join(timeout=2):
                if time.monotonic() > deadline:
                    print(f"CP={cp}: ranks still running after {CP_TIMEOUT_S} s, stopped")
                    break
        except Exception as exc:    # a rank died: its results are missing below
            print(f"CP={cp}: a rank process failed: {exc}")
        for process in context.processes:
            if process.is_alive():
                process.kill()
        per_rank = []
        for rank in range(cp):
            path = os.path.join(out_dir, f"rank{rank}.pt")
            per_rank.append(torch.load(path, weights_only=False) if os.path.exists(path)
                            else None)
    return per_rank


def check_cp(cp, slime_src, seeds, references, options=True) -> int:
    per_rank = run_cp_ranks(cp, slime_src, seeds, options)
    failures = 0
    for allgather in (False, True):
        mode = "allgather-cp" if allgather else "zigzag"
        for label, *_ in cases(seeds):
            head = f"CP={cp} {mode} {label}:"
            results = [r.get((allgather, label)) if r else None for r in per_rank]
            if report_broken_ranks(head, results):
                failures += 1
                continue
            # A rank's loss is a partial sum that can nearly cancel: its error is measured
            # against the size of all the ranks' contributions, sum_r |A_r|.
            scale = sum(abs(r["losses"]["A"]) for r in results).clamp_min(1e-30)
            worst = {f"{side} loss": max(float(abs(r["losses"][side] - r["losses"]["A"]) / scale)
                                         for r in results) for side in ("B", "C")}
            worst.update({k: max(r["grad_errors"][k] for r in results)
                          for k in ("B grad", "C grad")})
            want_loss, want_grad = references[label]
            worst["A vs CP=1 loss"] = rel(results[0]["stream_loss"], want_loss)
            worst["A vs CP=1 grad"] = rel(results[0]["stream_grad"], want_grad[0])
            bad = sorted(k for k, v in worst.items() if not v <= TOL)
            failures += bool(bad)
            rows = "/".join(str(r["stream_rows"]) for r in results)
            tokens = "/".join(str(r["response_tokens"]) for r in results)
            print(f"{head} loss {float(results[0]['stream_loss']):+.6f} (ranks / CP), per rank "
                  f"stream rows {rows}, response tokens {tokens}; worst rank: "
                  + " ".join(f"{k} {v:.1e}" for k, v in worst.items())
                  + (f"  MISMATCH {bad}" if bad else ""))
    if options:
        failures += report_cp_options(cp, per_rank)
    return failures


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slime-src", required=True, help="a slime checkout (holds slime/)")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--cp-sizes", type=int, nargs="*", default=[2, 3],
                        help="context-parallel sizes to check (none: CP = 1 only)")
    parser.add_argument("--skip-options", action="store_true",
                        help="skip the per-option checks of slime_policy.policy_loss_function")
    args = parser.parse_args()
    if any(cp < 2 for cp in args.cp_sizes):
        parser.error(f"--cp-sizes must be >= 2, got {args.cp_sizes}")
    loss_mod = load_loss(args.slime_src)
    failures = 0
    references = {}         # A at CP = 1, the target of the CP ranks' sum
    with one_rank_gloo():
        for label, batch_kwargs, temperature, per_token in cases(args.seeds):
            batch, logits = micro_batch(**batch_kwargs)
            a, b, c = compare_sides(loss_mod, batch, logits, rollout_temperature=temperature,
                                    calculate_per_token_loss=per_token)
            references[label] = (a[0], a[1])
            errors = {"B loss": rel(b[0], a[0]), "B grad": rel(b[1], a[1]),
                      "C loss": rel(c[0], a[0]), "C grad": rel(c[1], a[1])}
            bad = {k: v for k, v in errors.items() if not v <= TOL}
            failures += bool(bad)
            popped = float(c[2]["pop_frac"])
            print(f"{label}: loss {float(a[0]):+.6f} pop_frac(sum over samples) {popped:.3f} "
                  + " ".join(f"{k} {v:.1e}" for k, v in errors.items())
                  + (f"  MISMATCH {sorted(bad)}" if bad else ""))
        failures += check_opd_advantage(loss_mod)
        failures += check_top_p_icepop(loss_mod)
        if not args.skip_options:
            load_mis(args.slime_src)
            failures += check_options(loss_mod, slime_args, run_side, rel)
    for cp in args.cp_sizes:
        failures += check_cp(cp, args.slime_src, args.seeds, references,
                             options=not args.skip_options)
    print("conformance:", "PASS" if not failures else f"FAIL ({failures} cases)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
