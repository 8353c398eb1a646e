"""policy_loss vs verl 0.9.1's own policy-loss functions, forward + backward, side by side.

CPU timing of the torch backend (or the backend the device picks) against the function
verl's actor calls, on the same batch, for every verl registry preset; best of --reps
interleaved runs.
Usage: python benchmarks/bench_policy_loss.py [--rows 32 --length 1024 --reps 5 --threads 1]
"""
import argparse
import time

import torch

import glm_kernels
from glm_kernels.loss import clip_cov_selection, kl_cov_selection

MODES = ["vanilla", "gspo", "gpg", "clip_cov", "kl_cov", "geo_mean", "cispo", "sapo", "dro",
         "dppo_kl", "dppo_tv"]


def _batch(rows, length, device):
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(rows, length, generator=g) * 3 - 0.05
    lp = torch.clamp(old + 0.3 * torch.randn(rows, length, generator=g), max=-1e-3)
    adv = torch.randn(rows, 1, generator=g).expand(rows, length).contiguous()
    lengths = torch.randint(length // 4, length + 1, (rows,), generator=g)
    mask = (torch.arange(length)[None] < lengths[:, None]).float()
    return [t.to(device) for t in (lp, old, adv, mask)]


def _time_pair(first, second, reps):
    """Best-of-reps seconds of each, the two interleaved: on a loaded shared machine the
    minimum is the least disturbed run, and interleaving exposes both to the same load."""
    first(), second()                                      # warm-up
    times = ([], [])
    for _ in range(reps):
        for fn, out in ((first, times[0]), (second, times[1])):
            start = time.perf_counter()
            fn()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            out.append(time.perf_counter() - start)
    return min(times[0]), min(times[1])


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    # One thread: on a loaded shared machine intra-op threads add tens of ms of waiting.
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from verl.trainer.ppo import core_algos as core
    from verl.workers.config import ActorConfig, PolicyLossConfig

    lp, old, adv, mask = _batch(args.rows, args.length, args.device)
    print(f"tokens {lp.numel()}, device {args.device}, backend "
          f"{glm_kernels.select_backend('policy_loss', lp)}, threads {torch.get_num_threads()}")
    print(f"{'preset':10s} {'verl ms':>9s} {'policy_loss ms':>15s} {'ratio':>6s}")
    for mode in MODES:
        cfg = ActorConfig(strategy="fsdp", rollout_n=1, ppo_mini_batch_size=1,
                          ppo_micro_batch_size_per_gpu=1, clip_ratio_low=0.2,
                          clip_ratio_high=0.28, policy_loss=PolicyLossConfig(
                              loss_mode=mode, dro_beta=0.1))
        agg = "seq-mean-token-mean" if mode == "sapo" else "token-mean"
        kwargs = {"vanilla": dict(dual_clip=3.0), "dro": dict(dro_beta=0.1),
                  "dppo_kl": dict(ratio_cap=3.0), "dppo_tv": dict(ratio_cap=3.0)}.get(mode, {})
        fn = core.get_policy_loss_fn(mode)

        def verl_step():
            x = lp.detach().requires_grad_(True)
            loss, _ = fn(old_log_prob=old, log_prob=x, advantages=adv, response_mask=mask,
                         loss_agg_mode=agg, config=cfg)
            loss.backward()

        def glm_step():
            x = lp.detach().requires_grad_(True)
            extra = dict(kwargs)
            if mode == "clip_cov":
                extra["selection"] = clip_cov_selection(x, old, adv, mask)
            if mode == "kl_cov":
                extra["selection"] = kl_cov_selection(x, adv, mask)
            loss, stats = glm_kernels.policy_loss(
                x, old, adv, mask, variant=mode, return_stats=True,
                reduction="row_mean" if mode == "geo_mean" else agg.replace("-", "_"), **extra)
            loss.backward()
            [v.item() for v in stats.values()]            # verl's metrics are floats too

        t_verl, t_glm = _time_pair(verl_step, glm_step, args.reps)
        print(f"{mode:10s} {t_verl * 1e3:9.2f} {t_glm * 1e3:15.2f} {t_glm / t_verl:6.2f}")


if __name__ == "__main__":
    main()
