"""The asynchronous stage loop (RL and OPD): groups from the rollout (Ray engines or one
process) meet the trainer in the Data Buffer; each optimizer step publishes the new weights.

Staleness (weight versions between the one a group was generated with and the one the
gradient is taken on) never exceeds ``max_ahead_steps``: the rollout starts no more prompts
than that allows (``rollout.local.prompts_allowed``), and a group that still comes too late (groups
finish out of order) is dropped here, counted as ``stale``, never trained.
"""
import multiprocessing
import time
from typing import Dict, List

from tqdm.auto import tqdm

from ..rollout.buffer import DataBuffer
from .checkpoint import ACCOUNTING
from ..log import logger
from ..model import policy
from ..rollout.supervisor import RolloutError, RolloutProcess


def staleness(trained_on: int, group: List[dict]) -> int:
    """Versions between the oldest weights any sample of ``group`` was generated with and
    ``trained_on``."""
    return trained_on - min(s["version"] for s in group)


def async_stage(run, stage: str, model, opt, mix: Dict[str, float], group_size: int,
                prompts_per_step: int, steps: int, start: int, step_fn, on_step,
                behaviour=None) -> None:
    """Consume ready groups from the rollout, step, push weights; ``steps`` in all.
    ``behaviour`` (a ``behaviour.BehaviourPolicy``, batch-invariant mode) is told every
    version published, so that it can recompute each sample's log-probs with its weights.

    A rollout process that dies is replaced by a new one that starts from a full weight
    snapshot; ``cfg.rollout_restarts`` deaths in a row (no optimizer step between) are
    replaced, one more raises ``RolloutError``. Whatever happens, the rollout is stopped and
    every sample it generated is accounted for (trained, unconsumed, stale or dropped) on the
    way out; engine restarts are logged whenever they happen, the last ones at the stage end.
    """
    cfg, guard = run.cfg, run.guard
    run.current = (stage, model, opt, start)
    if start >= steps:
        return
    ctx = multiprocessing.get_context("spawn")
    # Back-pressure of the rollout process's queue: ``max_ahead_steps`` steps' worth of
    # samples beyond the step being assembled (the admission rule bounds the rest).
    queue_size = max(1, cfg.max_ahead_steps) * prompts_per_step * group_size
    buf, held, deaths, rollout = DataBuffer(group_size), [], 0, None
    trained = run.trained.setdefault(stage, [])
    acc = run.accounting.setdefault(stage, {})
    for key in ACCOUNTING:
        acc.setdefault(key, 0)

    def launch(version: int) -> None:       # inside a unit: the handle exists before start()
        _launch(version)
        if behaviour is not None:           # the version the new rollout starts from
            behaviour.remember(rollout.sender.version, model)

    def _launch(version: int) -> None:
        nonlocal rollout
        run.rollout_procs += 1
        tag = f"{stage}/{run.rollout_procs}"
        if run.engines is not None:
            from ..rollout.ray_rollout import RayRollout
            rollout = RayRollout(run.engines, cfg, tag, cfg.seed * 7919 + run.rollout_procs, mix,
                                 group_size, prompts_per_step,
                                 health_interval=cfg.health_interval,
                                 max_restarts=cfg.rollout_restarts)
            first = rollout.start(guard, model)
            logger.info(f"{stage}: rollout {tag} on {len(run.engines.alive())} Ray engine actors "
                        f"({', '.join(run.engines.alive())}); weight sync v{first.version} "
                        f"{first.payload_bytes} bytes per engine "
                        f"({'full snapshot' if first.full else 'zstd delta'})")
            return
        rollout = RolloutProcess(cfg, ctx, tag, cfg.seed * 7919 + run.rollout_procs, mix,
                                 group_size, prompts_per_step, queue_size, version)
        first = rollout.start(guard, model)
        logger.info(f"{stage}: rollout process {tag} (pid {rollout.pid}); weight sync "
                    f"v{first.version} (full snapshot) {first.payload_bytes} bytes, later "
                    f"versions are zstd deltas")
        if run.on_rollout:
            run.on_rollout(stage, rollout.pid)

    def log_events(source) -> None:
        """The engine restarts ``source`` (a RayRollout) has noticed, as metrics events."""
        while getattr(source, "events", None):
            run.log({"kind": "event", "stage": stage, "step": run.current[3],
                     "global_step": run.global_step, **source.events.pop(0)})

    def retire() -> None:
        nonlocal rollout
        counts, rollout = rollout.shutdown(), None
        for key, n in counts.items():
            acc[key] += n

    def take_ready(want: int) -> list:
        """Up to ``want`` complete groups within the staleness bound; later ones dropped."""
        out = []
        for g in buf.pop_ready(want):
            behind = staleness(rollout.sender.version, g)
            if behind <= cfg.max_ahead_steps:
                out.append(g)
                continue
            acc["stale"] += len(g)
            logger.info(f"{stage}: group {g[0]['prompt_id']} dropped: {behind} versions "
                        f"stale (max_ahead_steps={cfg.max_ahead_steps})")
        return out

    try:
        with guard.atomic():
            launch(0)
        bar = tqdm(range(start, steps), desc=stage, disable=not cfg.progress, initial=start,
                   total=steps)
        for step in bar:
            t0 = time.perf_counter()
            groups = held = []              # popped from the buffer, not trained yet
            while len(groups) < prompts_per_step:
                if not rollout.alive() and run.engines is not None:
                    raise RolloutError(f"{stage}: {rollout.error} (config.rollout_restarts="
                                       f"{cfg.rollout_restarts})")
                if not rollout.alive():
                    with guard.atomic():
                        deaths += 1
                        pid, code = rollout.pid, rollout.proc.exitcode
                        version = rollout.sender.version
                        retire()
                        if deaths > cfg.rollout_restarts:
                            raise RolloutError(
                                f"{stage}: the rollout process died {deaths} times in a row "
                                f"(last: pid {pid}, exit code {code}) with no optimizer step "
                                f"between; stopping (config.rollout_restarts="
                                f"{cfg.rollout_restarts})")
                        logger.warning(f"{stage}: rollout process pid {pid} died (exit code "
                                       f"{code}) at step {step}; restarting it from a full "
                                       f"weight snapshot (restart {deaths} of "
                                       f"{cfg.rollout_restarts} in a row)")
                        run.log({"kind": "event", "event": "rollout_restart", "stage": stage,
                                 "step": step, "global_step": run.global_step,
                                 "exit_code": code})
                        launch(version)
                    continue
                with guard.atomic():        # taken off the queue and buffered: one unit
                    sample = rollout.get(timeout=0.25)
                    if sample is not None:
                        buf.add(sample)
                        groups += take_ready(prompts_per_step - len(groups))
            samples = [s for g in groups for s in g]
            with run.step():
                trained_on = rollout.sender.version  # the weights this gradient is taken on
                behind = [staleness(trained_on, g) for g in groups]
                lr_factor = policy.schedule_lr(opt, cfg, step, steps)
                rec = step_fn(samples)
                rec["lr_factor"] = lr_factor
                trained += [s["sample_id"] for s in samples]
                held = []
                version, stats = rollout.sender.send(model)
                if behaviour is not None:
                    behaviour.remember(version, model)
                run.global_step += 1
                run.current = (stage, model, opt, step + 1)
                rec.update(kind="train", stage=stage, step=step + 1, global_step=run.global_step,
                           staleness=sum(behind) / len(behind), staleness_max=max(behind),
                           weight_version=version, bytes_synced=stats.payload_bytes,
                           changed_elements=stats.changed, step_s=time.perf_counter() - t0)
                if any("forks" in s for s in samples):     # multi-turn (ToRA) sessions
                    rec.update(trajectory_forks=sum(s.get("forks", 0) for s in samples),
                               branches_trained=sum(len(s.get("branches", ()))
                                                    for s in samples))
                if run.engines is not None:
                    rec.update(rollout.stats())
                    rollout.step_done()
                run.log(rec)
                log_events(rollout)
            deaths = 0
            if run.engines is not None and run.global_step == cfg.kill_engine_at:
                victim = run.engines.kill()
                logger.warning(f"{stage}: killed engine actor {victim} after global step "
                               f"{run.global_step} (--kill-engine-at); the health monitor "
                               f"replaces it")
            bar.set_postfix(reward=f"{rec['reward']:.2f}", pop=f"{rec['pop_frac']:.3f}",
                            stale=f"{rec['staleness']:.1f}", refresh=False)
            if on_step:
                on_step(stage, step + 1)
    finally:
        with guard.atomic():                # stopping the rollout and the accounting: one unit
            if rollout is not None:
                last = rollout
                retire()
                log_events(last)            # restarts noticed after the last step

            acc["unconsumed"] += buf.pending() + sum(len(g) for g in held)
            acc["trained"] = len(trained)
