"""A training run's state: everything a checkpoint holds, the open metrics file, and the
guard that keeps signals out of units of work (``stopping.py``)."""
import contextlib
import dataclasses
import json
import os
from typing import Dict, List, Optional

from . import checkpoint
from .config import TrainerConfig
from .log import logger
from .stopping import StopGuard


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
