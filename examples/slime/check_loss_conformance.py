"""Check glm_kernels' slime loss plug-ins against *your* slime's own loss code.

Loads slime's real ``policy_loss_function`` (with its real log-prob/entropy computation,
``compute_policy_loss``, ``get_sum_of_sample_mean`` and its built-in ``icepop_function`` TIS
hook) from a checkout, builds micro-batches the way slime's ``get_batch`` does (packed
[1, T, V] fp32 logits, per-sample lists), and compares, on the same batch:

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
A_t = log pi_teacher - log pi_student. What a single process
cannot provide is stood in (``_slime_harness.py``); TP = CP = 1.

    python examples/slime/check_loss_conformance.py --slime-src /path/to/slime

Exit status 0 when every comparison is within 1e-5 relative (fp32), 1 otherwise.
"""
from __future__ import annotations

import argparse
import os
import sys
from types import SimpleNamespace

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _slime_harness import load_loss, one_rank_gloo  # noqa: E402

SLIME_ICEPOP = "slime.backends.megatron_utils.loss.icepop_function"
OURS_TIS = "glm_kernels.integrations.slime.icepop_tis_function"


def slime_args(**overrides):
    args = dict(advantage_estimator="grpo", use_rollout_logprobs=False, log_probs_chunk_size=-1,
                allgather_cp=False, use_opsm=False, eps_clip=0.2, eps_clip_high=0.28,
                eps_clip_c=None, get_mismatch_metrics=False, use_tis=True,
                custom_tis_function_path=SLIME_ICEPOP, custom_pg_loss_reducer_function_path=None,
                calculate_per_token_loss=False, entropy_coef=0.0, use_kl_loss=False,
                rollout_temperature=1.0, rollout_top_p=1.0, tis_clip_low=0.5, tis_clip=2.0,
                context_parallel_size=1, tensor_model_parallel_size=1)
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


def run_side(loss_mod, args, batch, logits, use_custom_loss):
    logits = logits.detach().clone().requires_grad_(True)
    reducer = loss_mod.get_sum_of_sample_mean(batch["total_lengths"], batch["response_lengths"],
                                              batch["loss_masks"], batch["rollout_mask_sums"],
                                              args.calculate_per_token_loss)
    if use_custom_loss:
        from glm_kernels.integrations.slime import icepop_loss_function
        loss, metrics = icepop_loss_function(args, batch, logits, reducer)
    else:
        loss, metrics = loss_mod.policy_loss_function(args, batch, logits, reducer)
    loss.backward()
    return loss.detach(), logits.grad, metrics


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


def rel(a, b):
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slime-src", required=True, help="a slime checkout (holds slime/)")
    parser.add_argument("--seeds", type=int, default=3)
    args = parser.parse_args()
    loss_mod = load_loss(args.slime_src)
    failures = 0
    with one_rank_gloo():
        for temperature in (1.0, 0.7):
            for per_token in (False, True):
                for seed in range(args.seeds):
                    batch, logits = micro_batch(seed)
                    common = dict(rollout_temperature=temperature,
                                  calculate_per_token_loss=per_token)
                    a = run_side(loss_mod, slime_args(**common), batch, logits, False)
                    b = run_side(loss_mod, slime_args(custom_tis_function_path=OURS_TIS,
                                                      **common), batch, logits, False)
                    c = run_side(loss_mod, slime_args(**common), batch, logits, True)
                    errors = {"B loss": rel(b[0], a[0]), "B grad": rel(b[1], a[1]),
                              "C loss": rel(c[0], a[0]), "C grad": rel(c[1], a[1])}
                    bad = {k: v for k, v in errors.items() if not v <= 1e-5}
                    failures += bool(bad)
                    popped = float(c[2]["pop_frac"])
                    print(f"T={temperature} per_token={per_token} seed={seed}: loss "
                          f"{float(a[0]):+.6f} pop_frac(sum over samples) {popped:.3f} "
                          + " ".join(f"{k} {v:.1e}" for k, v in errors.items())
                          + (f"  MISMATCH {sorted(bad)}" if bad else ""))
        failures += check_opd_advantage(loss_mod)
    print("conformance:", "PASS" if not failures else f"FAIL ({failures} cases)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
