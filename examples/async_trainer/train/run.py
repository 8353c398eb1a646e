"""A training run's state: everything a checkpoint holds, the open metrics file, and the
guard that keeps signals out of units of work (``train/stopping.py``)."""
import contextlib
import dataclasses
import json
import os
from typing import Dict, List, Optional, Tuple

from . import checkpoint
from ..config import TrainerConfig
from ..log import logger
from ..plot import plot
from .recipe import new_model, stage_optimizer, stage_steps
from .stopping import StopGuard

# The fields a resume takes from its command line; every other one is the checkpoint's.
RESUME_OVERRIDES = ("resume", "out_dir", "progress", "device")


def load_resume(cfg: TrainerConfig) -> Tuple[TrainerConfig, dict]:
    """The checkpoint ``cfg.resume`` names and the configuration the run continues with (the
    checkpoint's, but for ``RESUME_OVERRIDES``), every field checked before anything is applied
    or written: a refused resume leaves the checkpoint it came from untouched."""
    ckpt = checkpoint.load(cfg.resume)
    keep = {name: getattr(cfg, name) for name in RESUME_OVERRIDES}
    known = {f.name for f in dataclasses.fields(TrainerConfig)}
    unknown = sorted(set(ckpt["config"]) - known)
    if unknown:
        raise checkpoint.CheckpointError(f"config.resume: {cfg.resume!r} has config fields "
                                         f"this trainer does not know: {unknown}")
    try:
        resumed = TrainerConfig(**{**ckpt["config"], **keep}).validate()
    except (TypeError, ValueError) as err:
        raise checkpoint.CheckpointError(f"config.resume: {cfg.resume!r}: {err}") from None
    checkpoint.validate(ckpt, resumed.resume, stage_steps(resumed),
                        new_model(resumed).state_dict(),
                        lambda stage: stage_optimizer(resumed, stage, new_model(resumed)))
    return resumed, ckpt


class Run:
    """Everything a checkpoint holds, the open metrics file, and the guard that keeps signals
    out of units of work (``train/stopping.py``)."""

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
        self.exported: Optional[str] = None   # <out-dir>/model/ once written (the run ended)
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


def evals(records: List[dict]) -> dict:
    """Stage -> {task: held-out pass rate} of the evaluation records."""
    return {r["stage"]: {k[5:]: v for k, v in r.items() if k.startswith("eval_")}
            for r in records if r.get("kind") == "eval"}


def wrap_up(run, stop, failure) -> List[str]:
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
    if run.exported:
        outputs.append("model/")
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
