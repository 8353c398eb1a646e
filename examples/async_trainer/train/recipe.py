"""The recipe's stages, one function each: SFT, RL (asynchronous GRPO + IcePop) on one task,
and OPD of the task teachers into the SFT student; the held-out evaluation after each; the model
and optimizer every stage starts from (``trainer.py`` runs them in order)."""
from typing import Dict, List

import torch
from tqdm.auto import tqdm

from glm_kernels import (group_advantages, icepop_loss_from_logits, opd_advantages,
                         selective_logprobs)
from glm_kernels.integrations.transformers import token_logprobs

from .. import kernels
from ..env import task
from ..model import policy
from ..rollout.local import generate
from .batch import (collate, fused_linear_grpo_loss, icepop_kwargs, invariant_icepop_loss,
                    logprob_gap, policy_step, real_positions, routing_metrics, sft_sample)
from .behaviour import BehaviourPolicy
from .stages import async_stage


def new_model(cfg, state=None):
    """The policy (``model/policy.py``: GLM-5's architecture), fp32, ``state`` loaded if given."""
    return policy.new_policy(cfg, state=state)


def held_out_prompts(cfg, task_name: str) -> List[List[int]]:
    """The evaluation's prompts of ``task_name`` (the same for every model and run)."""
    gen = torch.Generator().manual_seed(10_000 + task.TASKS.index(task_name))
    return [task.make_prompt(cfg, task_name, gen) for _ in range(cfg.eval_prompts)]


@torch.no_grad()
def evaluate(cfg, model, task_name: str) -> float:
    """Greedy pass rate on held-out prompts (the same prompts for every model)."""
    prompts = held_out_prompts(cfg, task_name)
    was_training = model.training
    model.eval()
    samples = generate(cfg, model, prompts, 1, greedy=True)
    model.train(was_training)
    return sum(s["reward"] for s in samples) / len(samples)


def eval_record(run, stage, model, tasks) -> dict:
    rec = {"kind": "eval", "stage": stage, "global_step": run.global_step}
    rec.update({f"eval_{t}": evaluate(run.cfg, model, t) for t in tasks})
    run.log(rec)
    return rec


def resume_state(run, stage):
    if run.resume_point is not None and run.resume_point[0] == stage:
        _, step, model_state, opt_state = run.resume_point
        run.resume_point = None
        return step, model_state, opt_state
    return 0, None, None


def stage_optimizer(cfg, stage: str, model):
    """The optimizer a stage trains ``model`` with (also a resume's dry run of its state)."""
    if stage == "sft":
        return torch.optim.AdamW(model.parameters(), lr=cfg.sft_lr)
    return policy.make_optimizer(model, cfg, cfg.opd_lr if stage == "opd" else cfg.rl_lr)


def stage_steps(cfg) -> Dict[str, int]:
    """Stage name -> optimizer steps, every stage of this config in order."""
    steps = {"sft": cfg.sft_steps}
    steps.update({f"rl:{n}": cfg.rl_steps for n in cfg.task_list()})
    if cfg.opd_steps:
        steps["opd"] = cfg.opd_steps
    return steps


def sft_stage(run, on_step):
    cfg = run.cfg
    start, model_state, opt_state = resume_state(run, "sft")
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
            samples = [sft_sample(cfg, p) for p in prompts]
            batch = collate(samples, policy.device_of(model))
            with policy.train_routing(model, None, batch.tokens.shape[1], False,
                                      real_positions(samples, batch, whole=True)) as route:
                lp = token_logprobs(model, batch.tokens)    # of tokens 1.., no fp32 logits
            loss = -(lp * batch.loss_mask).sum() / batch.loss_mask.sum()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            policy.update_balance_bias(model, route.load, cfg.balance_bias_rate)
            run.global_step += 1
            run.current = ("sft", model, opt, step + 1)
            run.log({"kind": "train", "stage": "sft", "step": step + 1,
                     "global_step": run.global_step, "sft_loss": float(loss.detach())})
        if on_step:
            on_step("sft", step + 1)
    return model


def rl_stage(run, task_name: str, sft_state, on_step):
    cfg, stage = run.cfg, f"rl:{task_name}"
    start, model_state, opt_state = resume_state(run, stage)
    model = new_model(cfg, model_state if model_state is not None else sft_state)
    opt = stage_optimizer(cfg, stage, model)
    if opt_state is not None:
        opt.load_state_dict(opt_state)
    behaviour = BehaviourPolicy(cfg) if cfg.batch_invariant else None

    def grpo_step(samples):
        rewards = torch.tensor([s["reward"] for s in samples], device=policy.device_of(model))
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


def opd_stage(run, sft_state, teachers: Dict[str, torch.nn.Module], on_step):
    """Each prompt is supervised by the teacher of its task: A_t = sg(log pi_T - log pi_S)."""
    cfg, stage = run.cfg, "opd"
    start, model_state, opt_state = resume_state(run, stage)
    model = new_model(cfg, model_state if model_state is not None else sft_state)
    opt = stage_optimizer(cfg, stage, model)
    if opt_state is not None:
        opt.load_state_dict(opt_state)
    for t in teachers.values():
        t.eval().requires_grad_(False)
    behaviour = BehaviourPolicy(cfg) if cfg.batch_invariant else None

    def distill_loss(model, mb, batch):
        with policy.batch_invariant(cfg.batch_invariant):
            logits = policy.logits(model, batch.inputs)
        teacher_lp = torch.zeros_like(batch.rollout_logprobs)
        exact_kl = torch.zeros_like(batch.rollout_logprobs)
        for name in {s["task"] for s in mb}:
            rows = torch.tensor([b for b, s in enumerate(mb) if s["task"] == name],
                                device=logits.device)
            with torch.no_grad():
                t_logits = policy.logits(teachers[name], batch.inputs[rows])
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


def pending_stages(cfg, finished: dict, records: List[dict]) -> List[str]:
    """The stages of ``cfg`` (in order) a run with ``finished`` stages and ``records`` still
    has to train or to evaluate (what :func:`_stages` would do)."""
    evaluated = {r["stage"] for r in records if r.get("kind") == "eval"}
    return [s for s in stage_steps(cfg) if s not in finished or s not in evaluated]
