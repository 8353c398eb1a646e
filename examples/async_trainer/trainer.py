"""The whole recipe: SFT warm-up, asynchronous GRPO + IcePop per task (each run becomes a
teacher), then on-policy distillation (OPD) of both teachers into the SFT student.

RL and OPD stages run rollout in a separate process (``rollout.rollout_worker``) that keeps
generating with the newest weights it holds while the trainer steps; samples meet the trainer
in a Data Buffer keyed by prompt instance id. Ctrl-C at any point writes ``checkpoint.pt``
(model, optimizer, stage, step and every finished stage's weights); ``resume=<path>``
continues from it.
"""
import dataclasses
import json
import multiprocessing
import os
import queue
import time
from typing import Dict, List, Optional

import torch
from tqdm.auto import tqdm

from glm_kernels import (group_advantages, icepop_loss_from_logits, opd_advantages,
                         selective_logprobs)

from . import kernels, task
from .batch import (collate, fused_linear_grpo_loss, icepop_kwargs, policy_step,
                    routing_metrics, sft_sample)
from .buffer import DataBuffer
from .config import TrainerConfig
from .log import logger
from .model import TinyLM
from .plot import plot
from .rollout import generate, rollout_worker
from .weight_sync import WeightSender


class Run:
    """Everything a checkpoint holds, plus the open metrics file."""

    def __init__(self, cfg: TrainerConfig, ckpt: Optional[dict] = None):
        self.cfg = cfg
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
        path = os.path.join(cfg.out_dir, "metrics.jsonl")
        self._file = open(path, "a" if ckpt else "w")

    def log(self, rec: dict) -> None:
        self.records.append(rec)
        self._file.write(json.dumps(rec) + "\n")
        self._file.flush()
        if not self.cfg.progress or rec.get("kind") == "eval":
            logger.info(" ".join(f"{k}={_fmt(v)}" for k, v in rec.items()))

    def save(self, path: Optional[str] = None) -> str:
        path = path or os.path.join(self.cfg.out_dir, "checkpoint.pt")
        state = {"config": dataclasses.asdict(self.cfg), "records": self.records,
                 "finished": self.finished, "trained": self.trained,
                 "accounting": self.accounting, "global_step": self.global_step,
                 "rollout_procs": self.rollout_procs}
        if self.current is not None:
            stage, model, opt, step = self.current
            state.update(stage=stage, step=step, model=model.state_dict(),
                         optimizer=opt.state_dict() if opt is not None else None)
        tmp = path + ".tmp"
        torch.save(state, tmp)
        os.replace(tmp, path)          # a Ctrl-C during the write cannot leave half a file
        return path

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


def sft_stage(run, on_step) -> TinyLM:
    cfg = run.cfg
    start, model_state, opt_state = _resume_state(run, "sft")
    model = new_model(cfg, model_state)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.sft_lr)
    if opt_state is not None:
        opt.load_state_dict(opt_state)
    names = cfg.task_list()
    for step in tqdm(range(start, cfg.sft_steps), desc="sft", disable=not cfg.progress,
                     initial=start, total=cfg.sft_steps):
        run.current = ("sft", model, opt, step)
        gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)
        prompts = [task.make_prompt(cfg, names[i % len(names)], gen) for i in range(cfg.sft_batch)]
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
    run.current = None
    return model


def _drain(q) -> int:
    n = 0
    while True:
        try:
            q.get_nowait()
        except queue.Empty:
            return n
        n += 1


def async_stage(run, stage: str, model, opt, mix: Dict[str, float], group_size: int,
                prompts_per_step: int, steps: int, start: int, step_fn, on_step) -> None:
    """Consume ready groups from a rollout process, step, push weights; ``steps`` in all."""
    cfg = run.cfg
    ctx = multiprocessing.get_context("spawn")
    sender = WeightSender(ctx, cfg.rollout_torch_dtype())
    # Back-pressure: the rollout may run at most ``max_ahead_steps`` steps' worth of samples
    # ahead of the trainer, which bounds staleness (weight versions behind) near that number.
    sample_q = ctx.Queue(maxsize=max(1, cfg.max_ahead_steps) * prompts_per_step * group_size)
    stop, generated = ctx.Event(), ctx.Value("q", 0)
    run.rollout_procs += 1
    proc = ctx.Process(target=rollout_worker, daemon=True,
                       args=(cfg, cfg.seed * 7919 + run.rollout_procs, mix, group_size,
                             sender.receiver(), sample_q, stop, generated,
                             f"{stage}/{run.rollout_procs}"))
    proc.start()
    _, first = sender.send(model)             # version 1: the full snapshot
    logger.info(f"{stage}: weight sync v1 (full snapshot) {first.payload_bytes} bytes; later "
                f"versions are zstd deltas")
    buf, received, held = DataBuffer(group_size), 0, []
    trained = run.trained.setdefault(stage, [])
    try:
        bar = tqdm(range(start, steps), desc=stage, disable=not cfg.progress, initial=start,
                   total=steps)
        for step in bar:
            run.current = (stage, model, opt, step)
            t0 = time.perf_counter()
            groups = held = []              # popped from the buffer, not trained yet
            while len(groups) < prompts_per_step:
                if not proc.is_alive():
                    raise RuntimeError(f"{stage}: the rollout process died (exit code "
                                       f"{proc.exitcode})")
                try:
                    buf.add(sample_q.get(timeout=1.0))
                except queue.Empty:
                    continue
                received += 1
                groups += buf.pop_ready(prompts_per_step - len(groups))
            samples = [s for g in groups for s in g]
            rec = step_fn(samples)
            trained += [s["sample_id"] for s in samples]
            held = []
            trained_on = sender.version         # the weights this step's gradient was taken on
            version, stats = sender.send(model)
            run.global_step += 1
            run.current = (stage, model, opt, step + 1)
            rec.update(kind="train", stage=stage, step=step + 1, global_step=run.global_step,
                       staleness=trained_on - sum(s["version"] for s in samples) / len(samples),
                       weight_version=version, bytes_synced=stats.payload_bytes,
                       changed_elements=stats.changed, step_s=time.perf_counter() - t0)
            run.log(rec)
            bar.set_postfix(reward=f"{rec['reward']:.2f}", pop=f"{rec['pop_frac']:.3f}",
                            stale=f"{rec['staleness']:.1f}", refresh=False)
            if on_step:
                on_step(stage, step + 1)
    finally:
        stop.set()
        unconsumed = buf.pending() + sum(len(g) for g in held)
        deadline = time.time() + 30
        while proc.is_alive() and time.time() < deadline:
            unconsumed += _drain(sample_q)     # keep the pipe open so the worker can exit
            proc.join(timeout=0.05)
        if proc.is_alive():
            proc.terminate()
        unconsumed += _drain(sample_q)
        acc = run.accounting.setdefault(stage, {"generated": 0, "trained": 0, "unconsumed": 0})
        acc["generated"] += generated.value
        acc["trained"] = len(trained)
        acc["unconsumed"] += unconsumed


def rl_stage(run, task_name: str, sft_state, on_step) -> TinyLM:
    cfg, stage = run.cfg, f"rl:{task_name}"
    start, model_state, opt_state = _resume_state(run, stage)
    model = new_model(cfg, model_state if model_state is not None else sft_state)
    opt = kernels.make_optimizer(model, cfg, cfg.rl_lr)
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
    run.current = None
    return model


def opd_stage(run, sft_state, teachers: Dict[str, TinyLM], on_step) -> TinyLM:
    """Each prompt is supervised by the teacher of its task: A_t = sg(log pi_T - log pi_S)."""
    cfg, stage = run.cfg, "opd"
    start, model_state, opt_state = _resume_state(run, stage)
    model = new_model(cfg, model_state if model_state is not None else sft_state)
    opt = kernels.make_optimizer(model, cfg, cfg.opd_lr)
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
    run.current = None
    return model


def train(cfg: TrainerConfig, *, on_step=None) -> dict:
    """Run every stage (or what is left of them when resuming); returns the run's summary.

    ``on_step(stage, step)`` is called after every optimizer step (tests use it to interrupt).
    """
    ckpt = None
    if cfg.resume:
        if not os.path.isfile(cfg.resume):
            raise FileNotFoundError(f"config.resume: no checkpoint at {cfg.resume!r}")
        ckpt = torch.load(cfg.resume, map_location="cpu", weights_only=False)
        keep = {"resume": cfg.resume, "out_dir": cfg.out_dir, "progress": cfg.progress,
                "device": cfg.device}
        cfg = TrainerConfig(**{**ckpt["config"], **keep})
    cfg.validate()
    os.makedirs(cfg.out_dir, exist_ok=True)
    torch.manual_seed(cfg.seed)
    run = Run(cfg, ckpt)
    names = cfg.task_list()
    interrupted = False
    try:
        if "sft" not in run.finished:
            model = sft_stage(run, on_step)
            run.finished["sft"] = model.state_dict()
            _eval_record(run, "sft", model, names)
        sft_state = run.finished["sft"]
        for name in names:
            stage = f"rl:{name}"
            if stage not in run.finished:
                model = rl_stage(run, name, sft_state, on_step)
                run.finished[stage] = model.state_dict()
                _eval_record(run, stage, model, [name])
        if cfg.opd_steps and "opd" not in run.finished:
            teachers = {n: new_model(cfg, run.finished[f"rl:{n}"]) for n in names}
            model = opd_stage(run, sft_state, teachers, on_step)
            run.finished["opd"] = model.state_dict()
            _eval_record(run, "opd", model, names)
    except KeyboardInterrupt:
        interrupted = True
        path = run.save()
        logger.warning(f"interrupted: checkpoint written to {path}; continue with "
                       f"--resume {path}")
    else:
        run.current = None
        run.save()
    finally:
        run.close()
    plot(cfg, run.records)
    evals = {r["stage"]: {k[5:]: v for k, v in r.items() if k.startswith("eval_")}
             for r in run.records if r.get("kind") == "eval"}
    return {"records": run.records, "trained_ids": run.trained, "evals": evals,
            "accounting": run.accounting, "interrupted": interrupted, "config": cfg}
