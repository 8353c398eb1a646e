"""The whole recipe: SFT warm-up, asynchronous GRPO + IcePop per task (each run becomes a
teacher), then on-policy distillation (OPD) of both teachers into the SFT student; the last
stage's model is written as a Hugging Face checkpoint (``<out-dir>/model/``).

RL and OPD stages run rollout on engines that keep generating with the newest weights they
hold while the trainer steps: Ray actors behind a session-affine router with a health
monitor (``rollout/engines.py``; ``rollout_backend`` "ray", the default when ray is
installed) or one spawned process (``rollout.local.rollout_worker``; "process"); samples meet
the trainer in a Data Buffer keyed by prompt instance id.

Recovery (docs/trainer.md, "Recovery"): ``checkpoint.pt`` (tensors and plain data only) is
written every ``checkpoint_every`` steps, at every stage end and on every exit (normal,
SIGINT, SIGTERM, a failure); ``resume=<path>`` continues from it. An optimizer step and its
bookkeeping are one unit that no signal splits (``train/stopping.py``); a rollout process that dies
is restarted from a full weight snapshot (``rollout/supervisor.py``).
"""
import os

import torch

from .config import TrainerConfig
from .log import logger
from .model.hf_checkpoint import save_hf_checkpoint
from .rollout.engines import start_engines
from .train.recipe import (eval_record, new_model, opd_stage, pending_stages, rl_stage,
                           sft_stage, stage_steps)
from .train.run import Run, evals, load_resume, wrap_up
from .train.stopping import StopGuard, exit_code


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
            eval_record(run, stage, model, eval_tasks)
            run.save()
    # The last stage's model as a Hugging Face checkpoint (the one a rollout engine would load).
    final = plan[-1][0]
    run.exported = save_hf_checkpoint(new_model(cfg, run.finished[final]), cfg,
                                      os.path.join(cfg.out_dir, "model"))
    logger.info(f"{final} model saved as a Hugging Face checkpoint in {run.exported}")


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
        cfg, ckpt = load_resume(cfg)
    cfg.validate()
    if ckpt is not None and not pending_stages(cfg, ckpt["finished"], ckpt["records"]):
        # Nothing left to run: no engines, no rollout, no file rewritten.
        logger.info(f"the run in {cfg.resume} is already complete (stages "
                    f"{', '.join(stage_steps(cfg))} finished and evaluated): nothing to do; a "
                    f"resumed run keeps its checkpoint's configuration (start a new run with "
                    f"another --out-dir for more steps)")
        return {"records": ckpt["records"], "trained_ids": ckpt["trained"],
                "evals": evals(ckpt["records"]), "accounting": ckpt["accounting"],
                "interrupted": False, "exit_code": 0, "outputs": [], "config": cfg}
    os.makedirs(cfg.out_dir, exist_ok=True)
    torch.manual_seed(cfg.seed)
    engines = start_engines(cfg) if cfg.use_ray() else None   # before the handlers: ray.init
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
        outputs = wrap_up(run, stop, failure)
        if failure is not None:
            raise failure
    finally:
        guard.restore()
        if engines is not None:
            engines.shutdown()
    code = exit_code(stop) if stop is not None else \
        (128 + guard.received if guard.received is not None else 0)
    return {"records": run.records, "trained_ids": run.trained, "evals": evals(run.records),
            "accounting": run.accounting, "interrupted": code != 0, "exit_code": code,
            "outputs": outputs, "config": cfg}
