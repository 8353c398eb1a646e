"""verl policy losses: verl 0.9.1's own function vs the glm_kernels plug-in, fwd+bwd, one run.

Each row times, on the same random batch (ragged mask, both advantage signs, IcePop weights
from verl's own rollout-correction helper where the row says so), one forward + backward of

* ``verl``  -- verl's registered function (``POLICY_LOSS_REGISTRY[name]``),
* ``glm``   -- the plug-in registered for it (``glm_<name>``, or ``icepop``),

called exactly as verl's actor calls a policy loss. Times are medians of process CPU time
(user + sys, all threads; a machine shared with other jobs disturbs it less than wall time)
over repeats after warm-up, single-threaded torch. The ratio is glm / verl.

    GLM_KERNELS_BACKEND=torch python benchmarks/bench_verl_losses.py
    GLM_KERNELS_BACKEND=torch python benchmarks/bench_verl_losses.py --only icepop --tokens 65536
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import torch  # noqa: E402

from verl.trainer.config.algorithm import RolloutCorrectionConfig  # noqa: E402
from verl.trainer.ppo import core_algos  # noqa: E402
from verl.trainer.ppo.rollout_corr_helper import (  # noqa: E402
    compute_rollout_correction_and_rejection_mask)
from verl.workers.config import ActorConfig, PolicyLossConfig  # noqa: E402

import glm_kernels.integrations.verl as plug  # noqa: E402


def make_batch(tokens: int, row: int = 512, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    b = max(tokens // row, 1)
    old = -torch.rand(b, row, generator=g) * 3 - 0.05
    rollout = old + 0.3 * torch.randn(b, row, generator=g)
    log_prob = old + 0.2 * torch.randn(b, row, generator=g)
    adv = torch.randn(b, 1, generator=g).expand(b, row).contiguous()
    lengths = torch.randint(row // 4, row + 1, (b,), generator=g)
    mask = torch.arange(row)[None, :] < lengths[:, None]
    preset = RolloutCorrectionConfig.decoupled_token_icepop(threshold=2.0, threshold_lower=0.5)
    proto, _, _ = compute_rollout_correction_and_rejection_mask(
        old_log_prob=old, rollout_log_prob=rollout, response_mask=mask.float(),
        rollout_is=preset.rollout_is, rollout_is_threshold=preset.rollout_is_threshold)
    return log_prob, old, adv, mask, proto.batch["rollout_is_weights"]


def actor_config(name: str) -> ActorConfig:
    policy = PolicyLossConfig(loss_mode=name, dro_beta=0.1, clip_cov_ratio=0.01, clip_cov_lb=0.0,
                              kl_cov_ratio=0.01,
                              rollout_correction=RolloutCorrectionConfig.bypass_pg_is())
    return ActorConfig(strategy="fsdp", rollout_n=1, ppo_mini_batch_size=1,
                       ppo_micro_batch_size_per_gpu=1, clip_ratio_low=0.2, clip_ratio_high=0.28,
                       policy_loss=policy)


def cpu_time(fn, repeats: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.process_time()
        fn()
        times.append(time.process_time() - start)
    return statistics.median(times)


def step(fn, batch, config, weights):
    log_prob, old, adv, mask, _ = batch

    def run():
        x = log_prob.detach().requires_grad_(True)
        torch.manual_seed(0)      # clip_cov draws from the global generator
        loss, _ = fn(old_log_prob=old, log_prob=x, advantages=adv, response_mask=mask,
                     loss_agg_mode="token-mean", config=config, rollout_is_weights=weights)
        loss.backward()
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--only", default=None, help="comma-separated row names")
    args = parser.parse_args()
    torch.set_num_threads(1)
    batch = make_batch(args.tokens)
    weights = batch[4]
    rows = [("icepop", "vanilla", "icepop", weights)]
    for name in getattr(plug, "VERL_LOSS_NAMES", ()):
        rows.append((name, name, f"glm_{name}", None))
        if name != "bypass_mode":
            rows.append((f"{name}+icepop_w", name, f"glm_{name}", weights))
    wanted = None if args.only is None else set(args.only.split(","))
    print(f"backend={os.environ.get('GLM_KERNELS_BACKEND', 'auto')} tokens="
          f"{int(batch[3].sum())} masked of {batch[3].numel()}, CPU time, 1 thread")
    print(f"{'row':<22}{'verl ms':>10}{'glm ms':>10}{'glm/verl':>10}")
    for label, verl_name, glm_name, w in rows:
        if wanted is not None and label not in wanted:
            continue
        config = actor_config(verl_name)
        theirs = cpu_time(step(core_algos.get_policy_loss_fn(verl_name), batch, config, w),
                          args.repeats)
        ours = cpu_time(step(core_algos.get_policy_loss_fn(glm_name), batch, config, w),
                        args.repeats)
        print(f"{label:<22}{theirs * 1e3:>10.2f}{ours * 1e3:>10.2f}{ours / theirs:>10.2f}")


if __name__ == "__main__":
    main()
