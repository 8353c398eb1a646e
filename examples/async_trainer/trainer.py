"""The whole recipe: SFT warm-up, asynchronous GRPO + IcePop per task (each run becomes a
teacher), then on-policy distillation (OPD) of both teachers into the SFT student.

RL and OPD stages run rollout on engines that keep generating with the newest weights they
hold while the trainer steps: Ray actors behind a session-affine router with a health
monitor (``engines.py``; ``rollout_backend`` "ray", the default when ray is installed) or one
spawned process (``rollout.rollout_worker``; "process"); samples meet the trainer in a Data
Buffer keyed by prompt instance id.

Recovery (docs/trainer.md, "Recovery"): ``checkpoint.pt`` (tensors and plain data only) is
written every ``checkpoint_every`` steps, at every stage end and on every exit (normal,
SIGINT, SIGTERM, a failure); ``resume=<path>`` continues from it. An optimizer step and its
bookkeeping are one unit that no signal splits (``stopping.py``); a rollout process that dies
is restarted from a full weight snapshot (``supervisor.py``).
"""
import contextlib
import dataclasses
import json
import multiprocessing
import os
import time
from typing import Dict, List, Optional

import torch
from tqdm.auto import tqdm

from glm_kernels import (group_advantages, icepop_loss_from_logits, opd_advantages,
                         selective_logprobs)

from . import checkpoint, kernels, task
from .batch import (collate, fused_linear_grpo_loss, icepop_kwargs, policy_step,
                    routing_metrics, sft_sample)
from .buffer import DataBuffer
from .config import TrainerConfig
from .log import logger
from .model import TinyLM
from .plot import plot
from .rollout import generate
from .stopping import StopGuard, exit_code
from .supervisor import RolloutError, RolloutProcess


class Run:
    """Everything a checkpoint holds, the open metrics file, and the guard that keeps signals
    out of units of work (``stopping.py``)."""

    def __init__(self, cfg: TrainerConfig, ckpt: Optional[dict] = None,
                 guard: Optional[StopGuard] = None, on_rollout=None, engines=None):
        self.cfg = cfg
        self.engines = engines      # engines.EngineGroup (rollout_backend ray) or None
        self.guard = guard if guard is not None else StopGuard()
        self.on_rollout = on_rollout
        ckpt = ckpt or {}
        self.records: List[dict] = ckpt.get("records", [])
        self.finished: Dict[str, dict] = ckpt.get("finished", {})   # stage -> model state
        self.trained: Dict[str, list] = ckpt.get("trained", {})     # stage -> sample ids
        self.accounting: Dict[str, dict] = ckpt.get("accounting", {})
        self.global_step: int = ckpt.get("global_step", 0)
        self.rollout_procs: int = ckpt.get("rollout_procs", 0)
        self.resume_point = (ckpt["stage"], ckpt["step"], ckpt["model"], ckpt["optimizer"]) \
            if "stage" in ckpt else None
        self.current = None                                         # (stage, model, opt, step)
        self.stepping = False       # inside an optimizer step: the live state may be torn
        self.saved: Optional[str] = None      # where the last checkpoint of this run stands
        self.path = os.path.join(cfg.out_dir, "checkpoint.pt")
        # Rewritten from the checkpoint's records on resume: steps logged after the last
        # checkpoint are run again and must not appear twice.
        self._file = open(os.path.join(cfg.out_dir, "metrics.jsonl"), "w")
        self._file.writelines(json.dumps(rec) + "\n" for rec in self.records)
        self._file.flush()

    def log(self, rec: dict) -> None:
        self.records.append(rec)
        self._file.write(json.dumps(rec) + "\n")
        self._file.flush()
        if not self.cfg.progress or rec.get("kind") != "train":
            logger.info(" ".join(f"{k}={_fmt(v)}" for k, v in rec.items()))

    def where(self) -> str:
        if self.current is None:
            return "between stages"
        return f"stage {self.current[0]}, step {self.current[3]}"

    def save(self) -> Optional[str]:
        """Write ``checkpoint.pt`` atomically from the live state; None (and the last one
        stays) when the trainer failed inside an optimizer step, whose state may be torn."""
        if self.stepping:
            return None
        state = {"config": dataclasses.asdict(self.cfg), "records": self.records,
                 "finished": self.finished, "trained": self.trained,
                 "accounting": self.accounting, "global_step": self.global_step,
                 "rollout_procs": self.rollout_procs}
        if self.current is not None:
            stage, model, opt, step = self.current
            state.update(stage=stage, step=step, model=checkpoint.tensors(model.state_dict()),
                         optimizer=opt.state_dict() if opt is not None else None)
        elif self.resume_point is not None:
            # Not resumed into yet (a failure on the way there): the stage state it holds is
            # written back, never dropped -- the demo resumes from the file it writes.
            stage, step, model_state, opt_state = self.resume_point
            state.update(stage=stage, step=step, model=model_state, optimizer=opt_state)
        checkpoint.save(self.path, state)
        self.saved = self.where()
        return self.path

    @contextlib.contextmanager
    def step(self):
        """One optimizer step with all its bookkeeping (step counters, trained ids, weight
        publish, metrics record, ``run.current``) as a unit: no signal lands inside it, and
        a checkpoint falls due at its end (``checkpoint_every``)."""
        with self.guard.atomic():
            self.stepping = True
            yield
            self.stepping = False
            every = self.cfg.checkpoint_every
            if every and self.current is not None and self.current[3] % every == 0:
                self.save()

    def finish(self, stage: str, model) -> None:
        """Mark ``stage`` finished with ``model``'s weights, as one unit."""
        with self.guard.atomic():
            self.finished[stage] = checkpoint.tensors(model.state_dict())
            self.current = None

    def close(self) -> None:
        self._file.close()


def _fmt(v):
    return f"{v:.4g}" if isinstance(v, float) else v


def new_model(cfg, state=None) -> TinyLM:
    model = TinyLM(cfg, task.vocab_size(cfg)).to(cfg.resolved_device())
    if state is not None:
        model.load_state_dict(state)
    return model


@torch.no_grad()
def evaluate(cfg, model, task_name: str) -> float:
    """Greedy pass rate on held-out prompts (the same prompts for every model)."""
    gen = torch.Generator().manual_seed(10_000 + task.TASKS.index(task_name))
    prompts = [task.make_prompt(cfg, task_name, gen) for _ in range(cfg.eval_prompts)]
    was_training = model.training
    model.eval()
    samples = generate(cfg, model, prompts, 1, greedy=True)
    model.train(was_training)
    return sum(s["reward"] for s in samples) / len(samples)


def _eval_record(run, stage, model, tasks) -> dict:
    rec = {"kind": "eval", "stage": stage, "global_step": run.global_step}
    rec.update({f"eval_{t}": evaluate(run.cfg, model, t) for t in tasks})
    run.log(rec)
    return rec


def _resume_state(run, stage):
    if run.resume_point is not None and run.resume_point[0] == stage:
        _, step, model_state, opt_state = run.resume_point
        run.resume_point = None
        return step, model_state, opt_state
    return 0, None, None


def stage_optimizer(cfg, stage: str, model):
    """The optimizer a stage trains ``model`` with (also a resume's dry run of its state)."""
    if stage == "sft":
        return torch.optim.AdamW(model.parameters(), lr=cfg.sft_lr)
    return kernels.make_optimizer(model, cfg, cfg.opd_lr if stage == "opd" else cfg.rl_lr)


def stage_steps(cfg) -> Dict[str, int]:
    """Stage name -> optimizer steps, every stage of this config in order."""
    steps = {"sft": cfg.sft_steps}
    steps.update({f"rl:{n}": cfg.rl_steps for n in cfg.task_list()})
    if cfg.opd_steps:
        steps["opd"] = cfg.opd_steps
    return steps


def sft_stage(run, on_step) -> TinyLM:
    cfg = run.cfg
    start, model_state, opt_state = _resume_state(run, "sft")
    model = new_model(cfg, model_state)
    opt = stage_optimizer(cfg, "sft", model)
    if opt_state is not None:
        opt.load_state_dict(opt_state)
    names = cfg.sft_order()
    run.current = ("sft", model, opt, start)
    for step in tqdm(range(start, cfg.sft_steps), desc="sft", disable=not cfg.progress,
                     initial=start, total=cfg.sft_steps):
        with run.step():
            gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)
            prompts = [task.make_prompt(cfg, names[i % len(names)], gen)
                       for i in range(cfg.sft_batch)]
            batch = collate([sft_sample(cfg, p) for p in prompts], model.emb.weight.device)
            lp = selective_logprobs(model(batch.inputs), batch.targets)
            loss = -(lp * batch.loss_mask).sum() / batch.loss_mask.sum()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            model.update_balance_bias(cfg.balance_bias_rate)
            run.global_step += 1
            run.current = ("sft", model, opt, step + 1)
            run.log({"kind": "train", "stage": "sft", "step": step + 1,
                     "global_step": run.global_step, "sft_loss": float(loss.detach())})
        if on_step:
            on_step("sft", step + 1)
    return model


def async_stage(run, stage: str, model, opt, mix: Dict[str, float], group_size: int,
                prompts_per_step: int, steps: int, start: int, step_fn, on_step) -> None:
    """Consume ready groups from a rollout process, step, push weights; ``steps`` in all.

    A rollout process that dies is replaced by a new one that starts from a full weight
    snapshot; ``cfg.rollout_restarts`` deaths in a row (no optimizer step between) are
    replaced, one more raises ``RolloutError``. Whatever happens, the process is stopped and
    every sample it generated is accounted for (trained, unconsumed or dropped) on the way out.
    """
    cfg, guard = run.cfg, run.guard
    run.current = (stage, model, opt, start)
    if start >= steps:
        return
    ctx = multiprocessing.get_context("spawn")
    # Back-pressure: the rollout may run at most ``max_ahead_steps`` steps' worth of samples
    # ahead of the trainer, which bounds staleness (weight versions behind) near that number.
    queue_size = max(1, cfg.max_ahead_steps) * prompts_per_step * group_size
    buf, held, deaths, rollout = DataBuffer(group_size), [], 0, None
    trained = run.trained.setdefault(stage, [])
    acc = run.accounting.setdefault(stage, {})
    for key in ("generated", "trained", "unconsumed", "dropped"):
        acc.setdefault(key, 0)

    def launch(version: int) -> None:       # inside a unit: the handle exists before start()
        nonlocal rollout
        run.rollout_procs += 1
        tag = f"{stage}/{run.rollout_procs}"
        if run.engines is not None:
            from .ray_rollout import RayRollout
            rollout = RayRollout(run.engines, cfg, tag, cfg.seed * 7919 + run.rollout_procs, mix,
                                 group_size, queue_size, health_interval=cfg.health_interval,
                                 max_restarts=cfg.rollout_restarts)
            first = rollout.start(guard, model)
            logger.info(f"{stage}: rollout {tag} on {len(run.engines.alive())} Ray engine actors "
                        f"({', '.join(run.engines.alive())}); weight sync v{first.version} "
                        f"{first.payload_bytes} bytes per engine "
                        f"({'full snapshot' if first.full else 'zstd delta'})")
            return
        rollout = RolloutProcess(cfg, ctx, tag, cfg.seed * 7919 + run.rollout_procs, mix,
                                 group_size, queue_size, version)
        first = rollout.start(guard, model)
        logger.info(f"{stage}: rollout process {tag} (pid {rollout.pid}); weight sync "
                    f"v{first.version} (full snapshot) {first.payload_bytes} bytes, later "
                    f"versions are zstd deltas")
        if run.on_rollout:
            run.on_rollout(stage, rollout.pid)

    def retire() -> None:
        nonlocal rollout
        counts, rollout = rollout.shutdown(), None
        for key, n in counts.items():
            acc[key] += n

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
                        groups += buf.pop_ready(prompts_per_step - len(groups))
            samples = [s for g in groups for s in g]
            with run.step():
                rec = step_fn(samples)
                trained += [s["sample_id"] for s in samples]
                held = []
                trained_on = rollout.sender.version  # the weights this gradient was taken on
                version, stats = rollout.sender.send(model)
                run.global_step += 1
                run.current = (stage, model, opt, step + 1)
                rec.update(kind="train", stage=stage, step=step + 1, global_step=run.global_step,
                           staleness=trained_on - sum(s["version"] for s in samples) / len(samples),
                           weight_version=version, bytes_synced=stats.payload_bytes,
                           changed_elements=stats.changed, step_s=time.perf_counter() - t0)
                if any("forks" in s for s in samples):     # multi-turn (ToRA) sessions
                    rec.update(trajectory_forks=sum(s.get("forks", 0) for s in samples),
                               branches_trained=sum(len(s.get("branches", ()))
                                                    for s in samples))
                if run.engines is not None:
                    rec.update(rollout.stats())
                    rollout.step_done()
                    while rollout.events:
                        run.log({"kind": "event", "stage": stage, "step": step + 1,
                                 "global_step": run.global_step, **rollout.events.pop(0)})
                run.log(rec)
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
        with guard.atomic():                # stopping the process and the accounting: one unit
            if rollout is not None:
                retire()
            acc["unconsumed"] += buf.pending() + sum(len(g) for g in held)
            acc["trained"] = len(trained)


def rl_stage(run, task_name: str, sft_state, on_step) -> TinyLM:
    cfg, stage = run.cfg, f"rl:{task_name}"
    start, model_state, opt_state = _resume_state(run, stage)
    model = new_model(cfg, model_state if model_state is not None else sft_state)
    opt = stage_optimizer(cfg, stage, model)
    if opt_state is not None:
        opt.load_state_dict(opt_state)

    def grpo_step(samples):
        rewards = torch.tensor([s["reward"] for s in samples], device=model.emb.weight.device)
        adv = group_advantages(rewards, cfg.group_size)                     # [n * G]
        row_of = {id(s): i for i, s in enumerate(samples)}
        sums = policy_step(cfg, model, opt, samples, fused_linear_grpo_loss(cfg, adv, row_of))
        return {"reward": float(rewards.mean()), "pop_frac": sums["pop"] / sums["tokens"],
                "clip_frac": sums["clip"] / sums["tokens"], **routing_metrics(sums)}

    async_stage(run, stage, model, opt, {task_name: 1.0}, cfg.group_size, cfg.prompts_per_step,
                cfg.rl_steps, start, grpo_step, on_step)
    return model


def opd_stage(run, sft_state, teachers: Dict[str, TinyLM], on_step) -> TinyLM:
    """Each prompt is supervised by the teacher of its task: A_t = sg(log pi_T - log pi_S)."""
    cfg, stage = run.cfg, "opd"
    start, model_state, opt_state = _resume_state(run, stage)
    model = new_model(cfg, model_state if model_state is not None else sft_state)
    opt = stage_optimizer(cfg, stage, model)
    if opt_state is not None:
        opt.load_state_dict(opt_state)
    for t in teachers.values():
        t.eval().requires_grad_(False)

    def distill_loss(model, mb, batch):
        logits = model(batch.inputs)
        teacher_lp = torch.zeros_like(batch.rollout_logprobs)
        exact_kl = torch.zeros_like(batch.rollout_logprobs)
        for name in {s["task"] for s in mb}:
            rows = torch.tensor([b for b, s in enumerate(mb) if s["task"] == name],
                                device=logits.device)
            with torch.no_grad():
                t_logits = teachers[name](batch.inputs[rows])
                teacher_lp[rows] = selective_logprobs(t_logits, batch.targets[rows])
                exact_kl[rows] = kernels.reverse_kl(logits[rows].detach(), t_logits)
        adv = opd_advantages(batch.rollout_logprobs, teacher_lp, form="log_ratio")  # [B, T]
        loss, metrics = icepop_loss_from_logits(logits, batch.targets, batch.rollout_logprobs,
                                                adv, batch.loss_mask, **icepop_kwargs(cfg))
        m = batch.loss_mask
        return loss, metrics, {
            "kl_sampled": float(((batch.rollout_logprobs - teacher_lp) * m).sum()),
            "kl_exact": float((exact_kl * m).sum())}

    def distill_step(samples):
        sums = policy_step(cfg, model, opt, samples, distill_loss)
        rec = {"pop_frac": sums["pop"] / sums["tokens"], "clip_frac": sums["clip"] / sums["tokens"],
               "reverse_kl": sums["kl_exact"] / sums["tokens"],
               "reverse_kl_sampled": sums["kl_sampled"] / sums["tokens"],
               "reward": sum(s["reward"] for s in samples) / len(samples),
               **routing_metrics(sums)}
        for name in teachers:               # outcome reward: logged, never trained on
            got = [s["reward"] for s in samples if s["task"] == name]
            if got:
                rec[f"reward_{name}"] = sum(got) / len(got)
        return rec

    async_stage(run, stage, model, opt, cfg.opd_mix(), 1, cfg.opd_prompts_per_step,
                cfg.opd_steps, start, distill_step, on_step)
    return model


def _stages(run, on_step) -> None:
    """Every stage not finished yet, each followed by its evaluation (also run on resume for
    a stage that finished without one: the run stopped during it)."""
    cfg, names = run.cfg, run.cfg.task_list()
    plan = [("sft", names, lambda: sft_stage(run, on_step))]
    plan += [(f"rl:{n}", [n], lambda n=n: rl_stage(run, n, run.finished["sft"], on_step))
             for n in names]
    if cfg.opd_steps:
        plan.append(("opd", names, lambda: opd_stage(
            run, run.finished["sft"],
            {n: new_model(cfg, run.finished[f"rl:{n}"]) for n in names}, on_step)))
    for stage, eval_tasks, run_stage in plan:
        model = None
        if stage not in run.finished:
            model = run_stage()
            run.finish(stage, model)
        if not any(r.get("kind") == "eval" and r["stage"] == stage for r in run.records):
            model = model if model is not None else new_model(cfg, run.finished[stage])
            _eval_record(run, stage, model, eval_tasks)
            run.save()


def _wrap_up(run, stop, failure) -> List[str]:
    """The exit path (signals only noted meanwhile): checkpoint, metrics file, plot, and log
    lines saying what was written (only that). Returns the names of the files written."""
    outputs, path = ["metrics.jsonl"], None
    try:
        path = run.save()
    except Exception as err:        # e.g. a full disk: say so, never claim the file
        logger.error(f"checkpoint not written ({type(err).__name__}: {err})")
    run.close()
    try:
        png = plot(run.cfg, run.records)
    except Exception as err:
        png = None
        logger.warning(f"metrics.png not written ({type(err).__name__}: {err})")
    if png:
        outputs.append("metrics.png")
    if path or run.saved:
        outputs.append("checkpoint.pt")
    logger.info(f"outputs in {run.cfg.out_dir}: {', '.join(outputs)}")
    if stop is None and failure is None:
        return outputs
    if stop is not None:
        what = f"interrupted ({stop.args[0] if stop.args else 'KeyboardInterrupt'})"
    else:
        what = f"failed ({type(failure).__name__})"
    if path:
        logger.warning(f"{what}: checkpoint written to {path} ({run.saved}); continue with "
                       f"--resume {path}")
    elif run.saved:
        logger.warning(f"{what} inside an optimizer step: {run.path} keeps the last consistent "
                       f"state ({run.saved}); continue with --resume {run.path}")
    else:
        logger.warning(f"{what}: no checkpoint written")
    return outputs


def _start_engines(cfg):
    """The run's Ray engine actors (``engines.EngineGroup``), started and answering."""
    from .engines import EngineGroup
    t0 = time.perf_counter()
    group = EngineGroup(cfg, cfg.engines, address=cfg.ray_address, seed=cfg.seed)
    try:
        pids = group.wait_ready()
    except BaseException:
        group.shutdown()
        raise
    where = f"Ray cluster at {cfg.ray_address}" if cfg.ray_address else "a local Ray instance"
    logger.info(f"rollout: {len(pids)} engine actors on {where} (pids "
                f"{', '.join(str(p) for p in pids.values())}; node "
                f"{group.ray.get_runtime_context().get_node_id()}), ready in "
                f"{time.perf_counter() - t0:.1f} s")
    return group


def train(cfg: TrainerConfig, *, on_step=None, on_rollout=None) -> dict:
    """Run every stage (or what is left of them when resuming); returns the run's summary.

    Every exit path writes ``checkpoint.pt``: a normal finish; SIGINT / SIGTERM (handled
    between units of work: the summary has ``interrupted`` and ``exit_code`` 130 / 143); a
    failure (``RolloutError`` or any exception: re-raised after the checkpoint). Rollout
    processes are stopped on every path. ``on_step(stage, step)`` is called after every
    optimizer step and ``on_rollout(stage, pid)`` after every rollout process start (tests
    use them to interrupt the run and to kill rollout processes).
    """
    ckpt = None
    if cfg.resume:
        ckpt = checkpoint.load(cfg.resume)
        keep = {"resume": cfg.resume, "out_dir": cfg.out_dir, "progress": cfg.progress,
                "device": cfg.device}
        known = {f.name for f in dataclasses.fields(TrainerConfig)}
        unknown = sorted(set(ckpt["config"]) - known)
        if unknown:
            raise checkpoint.CheckpointError(f"config.resume: {cfg.resume!r} has config fields "
                                             f"this trainer does not know: {unknown}")
        try:
            cfg = TrainerConfig(**{**ckpt["config"], **keep}).validate()
        except (TypeError, ValueError) as err:
            raise checkpoint.CheckpointError(f"config.resume: {cfg.resume!r}: {err}") from None
        # Every field checked before anything is applied or written (a refused resume leaves
        # the checkpoint it came from untouched).
        checkpoint.validate(ckpt, cfg.resume, stage_steps(cfg), new_model(cfg).state_dict(),
                            lambda stage: stage_optimizer(cfg, stage, new_model(cfg)))
    cfg.validate()
    os.makedirs(cfg.out_dir, exist_ok=True)
    torch.manual_seed(cfg.seed)
    engines = _start_engines(cfg) if cfg.use_ray() else None   # before the handlers: ray.init
    guard = StopGuard().install()                               # sets its own SIGTERM handler
    try:
        run = Run(cfg, ckpt, guard, on_rollout, engines)
        stop = failure = None
        try:
            _stages(run, on_step)
            guard.stopping()
        except KeyboardInterrupt as err:        # SIGINT, SIGTERM (stopping.Interrupted)
            guard.stopping()
            stop = err
        except BaseException as err:
            guard.stopping()
            failure = err
        outputs = _wrap_up(run, stop, failure)
        if failure is not None:
            raise failure
    finally:
        guard.restore()
        if engines is not None:
            engines.shutdown()
    code = exit_code(stop) if stop is not None else \
        (128 + guard.received if guard.received is not None else 0)
    evals = {r["stage"]: {k[5:]: v for k, v in r.items() if k.startswith("eval_")}
             for r in run.records if r.get("kind") == "eval"}
    return {"records": run.records, "trained_ids": run.trained, "evals": evals,
            "accounting": run.accounting, "interrupted": code != 0, "exit_code": code,
            "outputs": outputs, "config": cfg}
