"""verl policy losses: verl 0.9.1's own function vs the glm_kernels plug-in, fwd+bwd, one run.

Each row times, on the same random batch (ragged mask, both advantage signs, IcePop weights
from verl's own rollout-correction helper where the row says so), one forward + backward of

* ``verl``  -- verl's registered function (``POLICY_LOSS_REGISTRY[name]``),
* ``glm``   -- the plug-in registered for it (``glm_<name>``, or ``icepop``),

called exactly as verl's actor calls a policy loss. On CPU, times are medians of process CPU
time (user + sys, all threads; a machine shared with other jobs disturbs it less than wall
time) over repeats after warm-up, single-threaded torch; on CUDA, ``do_bench`` medians
(``_common.time_fn``). The ratio is glm / verl.

    GLM_KERNELS_BACKEND=torch python benchmarks/bench_verl_losses.py --cpu
    GLM_KERNELS_BACKEND=torch python benchmarks/bench_verl_losses.py --cpu --only icepop
    python benchmarks/bench_verl_losses.py          # GPU when there is one: 4M tokens
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

import torch  # noqa: E402

from _common import default_device, time_fn  # noqa: E402

try:              # run_all / gpu_check import every bench: say so instead of failing there
    from verl.trainer.config.algorithm import RolloutCorrectionConfig
    from verl.trainer.ppo import core_algos
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_rejection_mask
    from verl.workers.config import ActorConfig, PolicyLossConfig

    import glm_kernels.integrations.verl as plug
    VERL_MISSING = None
except ImportError as exc:
    VERL_MISSING = f"verl not importable ({exc})"


def make_batch(tokens: int, row: int = 512, seed: int = 0, device: str = "cpu"):
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
    tensors = (log_prob, old, adv, mask, proto.batch["rollout_is_weights"])
    return tuple(t.to(device) for t in tensors)


def actor_config(name: str) -> "ActorConfig":
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


def step(fn, batch, config, weights, seeded=False):
    log_prob, old, adv, mask, _ = batch

    def run():
        x = log_prob.detach().requires_grad_(True)
        if seeded:                # clip_cov draws from the global generator (~0.1 ms a seed)
            torch.manual_seed(0)
        loss, _ = fn(old_log_prob=old, log_prob=x, advantages=adv, response_mask=mask,
                     loss_agg_mode="token-mean", config=config, rollout_is_weights=weights)
        loss.backward()
    return run


def measure(tokens: int, repeats: int, device: str, only=None) -> dict:
    """Print and return the table: {row: {"verl_s", "glm_s", "ratio"}}."""
    batch = make_batch(tokens, device=device)
    weights = batch[4]
    rows = [("icepop", "vanilla", "icepop", weights)]
    for name in plug.VERL_LOSS_NAMES:
        rows.append((name, name, f"glm_{name}", None))
        if name != "bypass_mode":
            rows.append((f"{name}+icepop_w", name, f"glm_{name}", weights))
    clock = "CPU time, 1 thread" if device == "cpu" else f"do_bench on {device}"
    print(f"backend={os.environ.get('GLM_KERNELS_BACKEND', 'auto')} tokens="
          f"{int(batch[3].sum())} masked of {batch[3].numel()}, {clock}")
    print(f"{'row':<22}{'verl ms':>10}{'glm ms':>10}{'glm/verl':>10}")
    results = {}
    for label, verl_name, glm_name, w in rows:
        if only is not None and label not in only:
            continue
        config = actor_config(verl_name)
        timed = []
        for fn_name in (verl_name, glm_name):
            fn = step(core_algos.get_policy_loss_fn(fn_name), batch, config, w,
                      seeded=verl_name == "clip_cov")
            timed.append(cpu_time(fn, repeats) if device == "cpu"
                         else time_fn(fn, device=device))
        theirs, ours = timed
        results[label] = {"verl_s": theirs, "glm_s": ours, "ratio": ours / theirs}
        print(f"{label:<22}{theirs * 1e3:>10.2f}{ours * 1e3:>10.2f}{ours / theirs:>10.2f}")
    return results


def run(quick: bool = False, cpu: bool = False) -> dict:
    if VERL_MISSING:
        print(f"skipped: {VERL_MISSING}")
        return {"skipped": VERL_MISSING}
    device = "cpu" if cpu else default_device()
    if device == "cpu":
        torch.set_num_threads(1)
    tokens = 32768 if quick or device == "cpu" else 1 << 22
    return {"device": device, "tokens": tokens,
            "rows": measure(tokens, 5 if quick else 15, device)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--cpu", action="store_true")
    parser.add_argument("--only", default=None, help="comma-separated row names")
    args = parser.parse_args()
    device = "cpu" if args.cpu else default_device()
    if device == "cpu":
        torch.set_num_threads(1)
    tokens = args.tokens or (32768 if device == "cpu" else 1 << 22)
    measure(tokens, args.repeats, device,
            None if args.only is None else set(args.only.split(",")))


if __name__ == "__main__":
    main()
