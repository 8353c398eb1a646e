"""slime's own policy loss vs glm_kernels.integrations.slime_policy.policy_loss_function, fwd+bwd.

Both run on the same packed micro-batch ([1, T, V] fp32 logits, as slime asserts), called as
slime's ``loss_function`` calls a policy loss (``func(args, batch, logits, sum_of_sample_mean)``
with slime's own reducer), torch backend, one CPU thread, CPU process time (the machine is
shared: wall time would measure the neighbours). slime's code comes from a checkout:

    SLIME_SRC=/path/to/slime PYTHONPATH=. python benchmarks/bench_slime_loss.py \\
        [--tokens 4096] [--vocab 32768] [--top-p 1.0 [--nucleus 64]] [--entropy-coef 0]
        [--repeats 3]

Prints one line per configuration: slime ms, ours ms, ours / slime.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples", "slime"))


def batch_of(tokens: int, vocab: int, samples: int, prompt: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    total = tokens // samples
    resp = total - prompt
    unconcat = [torch.randint(0, vocab, (total,), generator=g) for _ in range(samples)]
    logits = torch.randn(1, total * samples, vocab, generator=g) * 2.0
    masks = [(torch.rand(resp, generator=g) > 0.1).int() for _ in range(samples)]
    lp = [torch.randn(resp, generator=g) * 0.5 - 2.0 for _ in range(samples)]
    batch = {"unconcat_tokens": unconcat, "total_lengths": [total] * samples,
             "response_lengths": [resp] * samples, "loss_masks": masks,
             "advantages": [torch.full((resp,), float(torch.randn((), generator=g)))
                            for _ in range(samples)],
             "log_probs": lp, "rollout_log_probs": [x + 0.1 for x in lp],
             "rollout_mask_sums": [m.sum().float() for m in masks]}
    return batch, logits


def add_nucleus(batch, logits, size):
    """slime's replay keys with a nucleus of the ``size`` most likely ids per response token
    (a peaked LM's top-p nucleus is tens of ids; these random logits are flat, so a true
    top-p cut would keep most of the vocabulary)."""
    ids, offsets, end = [], [], 0
    for total, resp in zip(batch["total_lengths"], batch["response_lengths"]):
        end += total
        top = logits[0, end - resp - 1:end - 1].topk(size, -1).indices
        ids.append(top.reshape(-1).int())
        offsets.append(torch.arange(0, resp * size + 1, size, dtype=torch.int32))
    return dict(batch, rollout_top_p_token_ids=ids, rollout_top_p_token_offsets=offsets)


def timed(fn, logits, repeats):
    best = float("inf")
    for _ in range(repeats + 1):                        # the first run compiles / warms up
        x = logits.detach().clone().requires_grad_(True)
        start = time.process_time()
        loss, _ = fn(x)
        loss.backward()
        best = min(best, time.process_time() - start)
        del x, loss
    return best * 1e3


def measure(slime_src: str, tokens: int = 4096, vocab: int = 32768, samples: int = 8,
            prompt: int = 128, top_p: float = 1.0, nucleus: int = 64,
            entropy_coef: float = 0.0, repeats: int = 3) -> dict:
    """slime's policy loss and ours, fwd+bwd, on one batch: best-of-``repeats`` CPU ms each."""
    torch.set_num_threads(1)
    from _slime_harness import load_loss, one_rank_gloo
    from check_loss_conformance import slime_args

    from glm_kernels import force_backend
    from glm_kernels.integrations.slime.policy import policy_loss_function
    loss_mod = load_loss(slime_src)
    batch, logits = batch_of(tokens, vocab, samples, prompt)
    if top_p != 1.0:
        batch = add_nucleus(batch, logits, nucleus)
    args = slime_args(use_tis=False, custom_tis_function_path=None, rollout_top_p=top_p,
                      kl_loss_type="k1", kl_loss_coef=0.0, use_unbiased_kl=False,
                      opsm_delta=1e-4, entropy_coef=entropy_coef)
    reduce = loss_mod.get_sum_of_sample_mean(batch["total_lengths"], batch["response_lengths"],
                                             batch["loss_masks"], batch["rollout_mask_sums"],
                                             False)
    with one_rank_gloo(), force_backend("torch"):
        slime_ms = timed(lambda x: loss_mod.policy_loss_function(args, batch, x, reduce),
                         logits, repeats)
        ours_ms = timed(lambda x: policy_loss_function(args, batch, x, reduce), logits,
                        repeats)
    result = {"tokens": tokens, "vocab": vocab, "top_p": top_p, "entropy_coef": entropy_coef,
              "slime_ms": round(slime_ms, 1), "glm_kernels_ms": round(ours_ms, 1),
              "ours_over_slime": round(ours_ms / slime_ms, 3)}
    print(f"T={tokens} V={vocab} top_p={top_p} entropy_coef={entropy_coef}: slime "
          f"{slime_ms:.0f} ms, glm_kernels {ours_ms:.0f} ms, ours/slime {ours_ms / slime_ms:.2f}")
    return result


def run(quick: bool = False, cpu: bool = False) -> dict:
    """For run_all / gpu_check: the default and the top-p configuration when SLIME_SRC names
    a slime checkout (slime is not pip-installable), else a visible skip. CPU, torch backend
    (slime's loss is measured against the torch path its users run on CPU)."""
    slime_src = os.environ.get("SLIME_SRC")
    if not slime_src:
        reason = "skipped: SLIME_SRC is not set (a checkout of THUDM/slime 624b824)"
        print(reason)
        return {"skipped": reason}
    size = dict(tokens=1024, vocab=8192, repeats=1) if quick else {}
    return {"default": measure(slime_src, **size),
            "top_p": measure(slime_src, top_p=0.9, **size)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--nucleus", type=int, default=64, help="ids per token with --top-p")
    parser.add_argument("--entropy-coef", type=float, default=0.0)
    parser.add_argument("--repeats", type=int, default=3)
    opts = parser.parse_args()
    slime_src = os.environ.get("SLIME_SRC")
    if not slime_src:
        raise SystemExit("set SLIME_SRC to a slime checkout (THUDM/slime 624b824)")
    measure(slime_src, opts.tokens, opts.vocab, opts.samples, opts.prompt, opts.top_p,
            opts.nucleus, opts.entropy_coef, opts.repeats)


if __name__ == "__main__":
    main()
