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
import dataclasses
import os
import time
from typing import Dict, List

import torch
from tqdm.auto import tqdm

from glm_kernels import (group_advantages, icepop_loss_from_logits, opd_advantages,
                         selective_logprobs)

from . import checkpoint, invariant, kernels, task
from .batch import (collate, fused_linear_grpo_loss, icepop_kwargs, invariant_icepop_loss,
                    logprob_gap, policy_step, routing_metrics, sft_sample)
from .async_stage import async_stage
from .behaviour import BehaviourPolicy
from .config import TrainerConfig
from .log import logger
from .model import TinyLM, make_optimizer
from .plot import plot
from .rollout import generate
from .run import Run
from .stopping import StopGuard, exit_code


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
    return make_optimizer(model, cfg, cfg.opd_lr if stage == "opd" else cfg.rl_lr)


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


def rl_stage(run, task_name: str, sft_state, on_step) -> TinyLM:
    cfg, stage = run.cfg, f"rl:{task_name}"
    start, model_state, opt_state = _resume_state(run, stage)
    model = new_model(cfg, model_state if model_state is not None else sft_state)
    opt = stage_optimizer(cfg, stage, model)
    if opt_state is not None:
        opt.load_state_dict(opt_state)
    behaviour = BehaviourPolicy(cfg) if cfg.batch_invariant else None

    def grpo_step(samples):
        rewards = torch.tensor([s["reward"] for s in samples], device=model.emb.weight.device)
        adv = group_advantages(rewards, cfg.group_size)                     # [n * G]
        row_of = {id(s): i for i, s in enumerate(samples)}
        if behaviour is not None:
            behaviour.annotate(samples)
        sums = policy_step(cfg, model, opt, samples, fused_linear_grpo_loss(cfg, adv, row_of))
        return {"reward": float(rewards.mean()), "pop_frac": sums["pop"] / sums["tokens"],
                "clip_frac": sums["clip"] / sums["tokens"],
                "logprob_max_abs_diff": sums["logprob_max_abs_diff"], **routing_metrics(sums)}

    async_stage(run, stage, model, opt, {task_name: 1.0}, cfg.group_size, cfg.prompts_per_step,
                cfg.rl_steps, start, grpo_step, on_step, behaviour)
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
    behaviour = BehaviourPolicy(cfg) if cfg.batch_invariant else None

    def distill_loss(model, mb, batch):
        with invariant.mode(cfg.batch_invariant):
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
        if cfg.batch_invariant:
            loss, metrics, gap = invariant_icepop_loss(cfg, logits, mb, batch, adv)
        else:
            loss, metrics = icepop_loss_from_logits(logits, batch.targets,
                                                    batch.rollout_logprobs, adv,
                                                    batch.loss_mask, **icepop_kwargs(cfg))
            with torch.no_grad():
                gap = logprob_gap(selective_logprobs(logits, batch.targets), batch)
        m = batch.loss_mask
        return loss, metrics, {
            "kl_sampled": float(((batch.rollout_logprobs - teacher_lp) * m).sum()),
            "kl_exact": float((exact_kl * m).sum()), **gap}

    def distill_step(samples):
        if behaviour is not None:
            behaviour.annotate(samples)
        sums = policy_step(cfg, model, opt, samples, distill_loss)
        rec = {"pop_frac": sums["pop"] / sums["tokens"], "clip_frac": sums["clip"] / sums["tokens"],
               "logprob_max_abs_diff": sums["logprob_max_abs_diff"],
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
                cfg.opd_steps, start, distill_step, on_step, behaviour)
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


# The fields a resume takes from its command line; every other one is the checkpoint's.
RESUME_OVERRIDES = ("resume", "out_dir", "progress", "device")


def pending_stages(cfg, finished: dict, records: List[dict]) -> List[str]:
    """The stages of ``cfg`` (in order) a run with ``finished`` stages and ``records`` still
    has to train or to evaluate (what :func:`_stages` would do)."""
    evaluated = {r["stage"] for r in records if r.get("kind") == "eval"}
    return [s for s in stage_steps(cfg) if s not in finished or s not in evaluated]


def _evals(records: List[dict]) -> dict:
    """Stage -> {task: held-out pass rate} of the evaluation records."""
    return {r["stage"]: {k[5:]: v for k, v in r.items() if k.startswith("eval_")}
            for r in records if r.get("kind") == "eval"}


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
        keep = {name: getattr(cfg, name) for name in RESUME_OVERRIDES}
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
    if ckpt is not None and not pending_stages(cfg, ckpt["finished"], ckpt["records"]):
        # Nothing left to run: no engines, no rollout, no file rewritten.
        logger.info(f"the run in {cfg.resume} is already complete (stages "
                    f"{', '.join(stage_steps(cfg))} finished and evaluated): nothing to do; a "
                    f"resumed run keeps its checkpoint's configuration (start a new run with "
                    f"another --out-dir for more steps)")
        return {"records": ckpt["records"], "trained_ids": ckpt["trained"],
                "evals": _evals(ckpt["records"]), "accounting": ckpt["accounting"],
                "interrupted": False, "exit_code": 0, "outputs": [], "config": cfg}
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
    return {"records": run.records, "trained_ids": run.trained, "evals": _evals(run.records),
            "accounting": run.accounting, "interrupted": code != 0, "exit_code": code,
            "outputs": outputs, "config": cfg}
