"""Every policy-loss variant, fwd+bwd: the trainer's own torch code vs glm_kernels, one run.

For each name in verl's ``POLICY_LOSS_REGISTRY`` two rows (without IS weights, and ``+is_w``
with IcePop token weights made by verl's own rollout-correction helper), plus ``icepop``, all
timed in the same run on the same padded batch (rows of 512 tokens, ragged lengths, one
advantage per row, both signs):

* ``verl``        -- verl's own registered function (eager torch), called as verl's actor calls
  it;
* ``glm_plugin``  -- the loss ``glm_kernels.integrations.verl`` registers for it (``glm_<name>``,
  or ``icepop``), the same call: its time includes the plug-in's work around the kernel
  (verl's config, Clip-Cov / KL-Cov selection, verl's metric dict);
* ``policy_loss`` -- ``glm_kernels.policy_loss(variant=<name>)`` alone, the fused family
  (Clip-Cov / KL-Cov with no tokens selected);
* ``icepop``      -- ``glm_kernels.icepop_loss`` decoupled (old and rollout log-probs, the GLM
  recipe's loss) on the same tensors: the fused kernel every variant is measured against.

The TRL-only presets get the ``policy_loss`` and ``icepop`` columns: TRL computes its losses
inside ``GRPOTrainer._compute_loss``, not in a function that can be timed alone
(``bench_trl.py`` times the trainer's step against ours).

Goals (issue 23): a token-level variant costs <= 1.05x fused IcePop, a sequence-level one
<= 1.2x (``policy_loss/icepop``, ``goal_met``), and no variant is slower than the trainer's
own code (``plugin/verl`` <= 1).

Floor: 17 B/token (read log-probs, old log-probs, advantages in fp32 and the bool mask, write
the fp32 gradient; 21 with IS weights) over the copy bandwidth measured in the same run. No
variant touches a [T, V] tensor: they take log-probs.

CPU timing: one torch thread, median process CPU time (a shared machine's wall clock also
counts waiting for a core); GPU: ``do_bench`` medians. Every provider is timed once per round,
round after round (``GLM_BENCH_ROUNDS``, default 3; ``--quick``: 1), so a slow spell of a
shared machine lands on all of them: a figure is the median over rounds, a ratio's range
(``plugin/verl_range``) is over the rounds' own ratios. The note ``icepop/vanilla`` compares
``icepop_loss`` with the vanilla preset's ``policy_loss``.

    python benchmarks/bench_losses.py            # GPU: 4M tokens (1M with --quick)
    python benchmarks/bench_losses.py --cpu      # CPU: 32K tokens, torch backend
"""
from __future__ import annotations

import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

import glm_kernels  # noqa: E402
from glm_kernels import _dispatch  # noqa: E402

ROW = 512
BYTES_PER_TOKEN = 4 + 4 + 4 + 1 + 4
SEQUENCE_LEVEL = {"gspo", "geo_mean", "luspo", "vespo", "grpo_sequence"}
TRL_ONLY = ("trl_cispo", "trl_sapo", "luspo", "vespo", "grpo_sequence")
VERL_NAMES = ("vanilla", "gspo", "gpg", "clip_cov", "kl_cov", "geo_mean", "cispo", "sapo", "dro",
              "dppo_kl", "dppo_tv", "bypass_mode")
CORE_PARAMS = {"dro": dict(dro_beta=0.1)}
ROUNDS = int(os.environ.get("GLM_BENCH_ROUNDS", "3"))   # interleaved rounds (--quick: 1)


def _verl():
    """verl's pieces, or the reason they are missing (verl is an optional dependency)."""
    try:
        from verl.trainer.config.algorithm import RolloutCorrectionConfig
        from verl.trainer.ppo import core_algos
        from verl.trainer.ppo.rollout_corr_helper import (
            compute_rollout_correction_and_rejection_mask)
        from verl.workers.config import ActorConfig, PolicyLossConfig

        import glm_kernels.integrations.verl  # noqa: F401  (registers glm_<name>, icepop)
    except Exception as exc:
        return None, f"verl not importable ({type(exc).__name__}: {str(exc)[:100]})"

    def icepop_weights(old, rollout, mask):
        preset = RolloutCorrectionConfig.decoupled_token_icepop(threshold=2.0,
                                                                threshold_lower=0.5)
        proto, _, _ = compute_rollout_correction_and_rejection_mask(
            old_log_prob=old, rollout_log_prob=rollout, response_mask=mask.float(),
            rollout_is=preset.rollout_is, rollout_is_threshold=preset.rollout_is_threshold)
        return proto.batch["rollout_is_weights"]

    def config(name):
        # Enough Clip-Cov / KL-Cov tokens selected (1 %) that the selection is timed too.
        policy = PolicyLossConfig(loss_mode=name, dro_beta=0.1, clip_cov_ratio=0.01,
                                  clip_cov_lb=0.0, kl_cov_ratio=0.01,
                                  rollout_correction=RolloutCorrectionConfig.bypass_pg_is())
        return ActorConfig(strategy="fsdp", rollout_n=1, ppo_mini_batch_size=1,
                           ppo_micro_batch_size_per_gpu=1, clip_ratio_low=0.2,
                           clip_ratio_high=0.28, policy_loss=policy)
    return dict(registry=core_algos.POLICY_LOSS_REGISTRY, config=config,
                icepop_weights=icepop_weights), None


def make_batch(tokens: int, device: str, seed: int = 0):
    """(log_prob, old, rollout, advantages, bool mask), [tokens / 512, 512]."""
    gen = torch.Generator().manual_seed(seed)
    rows = max(tokens // ROW, 1)
    old = -torch.rand(rows, ROW, generator=gen) * 3 - 0.05
    rollout = old + 0.3 * torch.randn(rows, ROW, generator=gen)
    log_prob = old + 0.2 * torch.randn(rows, ROW, generator=gen)
    adv = torch.randn(rows, 1, generator=gen).expand(rows, ROW).contiguous()
    lengths = torch.randint(ROW // 4, ROW + 1, (rows,), generator=gen)
    mask = torch.arange(ROW)[None, :] < lengths[:, None]
    return tuple(t.to(device) for t in (log_prob, old, rollout, adv, mask))


def _fwd_bwd(loss_fn, log_prob, seeded=False):
    def step():
        x = log_prob.detach().requires_grad_(True)
        if seeded:   # Clip-Cov draws from torch's global generator: the same tokens every step
            torch.manual_seed(0)
        loss_fn(x).backward()
    return step


def run(quick: bool = False, cpu: bool = False) -> dict:
    device = "cpu" if cpu or not torch.cuda.is_available() else "cuda"
    if device == "cpu":
        torch.set_num_threads(1)
    tokens = 1 << 15 if device == "cpu" else (1 << 20 if quick else 1 << 22)
    repeats = 5 if quick else 11
    rounds = 1 if quick else ROUNDS
    log_prob, old, rollout, adv, mask = make_batch(tokens, device)
    bandwidth = _common.copy_bandwidth(device)
    notes = {}
    verl, why = _verl()
    if why:
        notes["verl"] = why
    steps = {}                        # (row label, provider) -> fwd+bwd step

    def add(key, fn, seeded=False):
        step = _fwd_bwd(fn, log_prob, seeded)
        try:
            step()                    # a provider that fails is reported, not hidden
        except Exception as exc:
            notes[f"{key[1]}[{key[0]}]"] = f"{type(exc).__name__}: {str(exc)[:160]}"
            return
        steps[key] = step

    add(("icepop", "icepop"), lambda x: glm_kernels.icepop_loss(x, rollout, adv, mask,
                                                                old_logprobs=old))
    weights = verl["icepop_weights"](old, rollout, mask) if verl else None
    cases = [("icepop", "vanilla", "icepop", weights)]
    for name in VERL_NAMES:
        cases.append((name, name, f"glm_{name}", None))
        if name != "bypass_mode":           # bypass_mode makes its own weights
            cases.append((f"{name}+is_w", name, f"glm_{name}", weights))
    cases += [(name, name, None, None) for name in TRL_ONLY]
    for label, variant, plugin, w in cases:
        if label != "icepop" and variant in glm_kernels.POLICY_VARIANTS:
            params = CORE_PARAMS.get(variant, {})
            add((label, "policy_loss"), lambda x, variant=variant, w=w, params=params:
                glm_kernels.policy_loss(x, old, adv, mask, variant=variant, token_weights=w,
                                        **params))
        if verl and plugin is not None:
            config = verl["config"](variant)
            for key, fn_name in (("verl", variant), ("glm_plugin", plugin)):
                fn = verl["registry"].get(fn_name)
                if fn is None:
                    notes[f"{key}[{label}]"] = f"{fn_name} is not registered"
                    continue
                add((label, key), lambda x, fn=fn, config=config, w=w: fn(
                    old_log_prob=old, log_prob=x, advantages=adv, response_mask=mask,
                    loss_agg_mode="token-mean", config=config, rollout_is_weights=w)[0],
                    seeded=variant == "clip_cov")
    # Interleaved rounds: every provider once per round, so a slow spell of a shared machine
    # lands on all of them; each figure is the median over rounds of per-round medians, and
    # each ratio's range is over the rounds' own ratios.
    per_round = {key: [] for key in steps}
    for _ in range(rounds):
        for key, step in steps.items():
            per_round[key].append(_common.time_fn(step, device=device, repeats=repeats,
                                                  process_clock=device == "cpu"))
    med = {key: statistics.median(times) for key, times in per_round.items()}

    def ratio(a, b):
        if a not in per_round or b not in per_round:
            return None, None
        values = [x / y for x, y in zip(per_round[a], per_round[b])]
        return statistics.median(values), f"{min(values):.2f}-{max(values):.2f}"

    rows = []
    icepop_key = ("icepop", "icepop")
    for label, variant, plugin, w in cases:
        level = "sequence" if variant in SEQUENCE_LEVEL else "token"
        floor_s = tokens * (BYTES_PER_TOKEN + (4 if w is not None else 0)) / bandwidth
        row = {"variant": label, "level": level, "floor_us": floor_s * 1e6}
        for provider in ("verl", "glm_plugin", "policy_loss"):
            if (label, provider) in med:
                row[f"{provider}_us"] = med[(label, provider)] * 1e6
        if icepop_key in med:
            row["icepop_us"] = med[icepop_key] * 1e6
        core, core_range = ratio((label, "policy_loss"), icepop_key)
        if core is not None:
            row["policy_loss/icepop"] = core
            row["goal_met"] = core <= (1.2 if level == "sequence" else 1.05)
            row["policy_loss/floor"] = med[(label, "policy_loss")] / floor_s
        row["plugin/verl"], row["plugin/verl_range"] = ratio((label, "glm_plugin"),
                                                             (label, "verl"))
        rows.append(row)
    icepop_vs_vanilla, spread = ratio(icepop_key, ("vanilla", "policy_loss"))
    if icepop_vs_vanilla is not None:
        notes["icepop/vanilla"] = (f"icepop_loss (decoupled) / policy_loss(vanilla) = "
                                   f"{icepop_vs_vanilla:.2f} (rounds {spread})")
    backend = _dispatch.select_backend("policy_loss", log_prob)
    clock = "process CPU time, 1 thread" if device == "cpu" else "do_bench"
    columns = ["variant", "level", "floor_us", "verl_us", "glm_plugin_us", "plugin/verl",
               "plugin/verl_range", "policy_loss_us", "icepop_us", "policy_loss/icepop",
               "goal_met", "policy_loss/floor"]
    _common.print_table(
        f"policy losses fwd+bwd, {tokens} tokens ({int(mask.sum())} masked) on {device}, "
        f"{clock}, median of {rounds} interleaved rounds x {repeats} repeats (glm_kernels "
        f"backend: {backend}; copy bandwidth {bandwidth / 1e9:.1f} GB/s measured)", rows,
        columns)
    result = {"benchmark": "losses", "device": device, "glm_kernels_backend": backend,
              "tokens": tokens, "clock": clock, "rounds": rounds, "repeats": repeats,
              "copy_bandwidth_Bps": bandwidth, "rows": rows, "notes": notes,
              "fallbacks": _dispatch.fallbacks_logged(), "env": _common.environment()}
    return _common.finish(result, notes, {})


if __name__ == "__main__":
    _common.main(__doc__, run)
