"""Rollout side: batched generation with the tool environment, and the rollout process loop.

The rollout process generates with the newest weights it has received (it never waits for
the trainer), records every sampled token's log-prob in fp32 at sampling time (the trainer
never recomputes them: coupled IcePop, the asynchronous TITO case) and puts one ``Sample``
dict per trajectory on the sample queue.
"""
import multiprocessing
import queue
import signal
from typing import Dict, List

import torch

from . import kernels, task
from .log import setup_logging
from .model import RoutingRecorder, TinyLM


@torch.no_grad()
def generate(cfg, model, prompts: List[List[int]], group_size: int, *, gen=None,
             greedy: bool = False) -> List[Dict]:
    """``group_size`` trajectories for each prompt (all prompts of one task, one length).

    Returns one dict per trajectory (prompt-major): ``tokens`` (full stream), ``prompt_len``,
    ``rollout_logprobs`` and ``loss_mask`` (one value per response position; environment and
    padding positions have log-prob 0 and mask 0), ``reward`` and ``routing``: the experts
    every MoE layer routed positions 0 .. len(tokens)-2 to, as a ``glm_kernels.topk``
    routing packet (bytes; None for a model without MoE layers), for routing replay.
    """
    if not prompts:
        return []
    kinds = {task.task_of(p) for p in prompts}
    if len(kinds) != 1:
        raise ValueError(f"generate: prompts must share one task, got {sorted(kinds)}")
    uses_tool = kinds.pop() == "tool"
    device = next(model.parameters()).device
    rows = [p for p in prompts for _ in range(group_size)]
    toks = torch.tensor(rows, device=device)
    n, prompt_len = toks.shape
    done = torch.zeros(n, dtype=torch.bool, device=device)
    lps, masks = [], []
    policy_steps = cfg.num_digits + 1 + (1 if uses_tool else 0)
    recorder = RoutingRecorder(model)
    for step in range(policy_steps):
        logp = torch.log_softmax(model(toks)[:, -1].float(), -1)
        recorder.step()
        if greedy:
            nxt = kernels.topk(logp, 1).indices                      # ties -> smaller id
        else:
            # Sampled on the CPU with the caller's generator: one seeded stream per process,
            # whatever device the model is on (a [rows, vocab] copy; the vocab is tiny).
            nxt = torch.multinomial(logp.exp().cpu(), 1, generator=gen).to(logp.device)
        lp = logp.gather(-1, nxt).squeeze(-1)
        nxt = nxt.squeeze(-1)
        live = ~done
        nxt = torch.where(live, nxt, torch.full_like(nxt, task.PAD))
        lps.append(torch.where(live, lp, torch.zeros_like(lp)))
        masks.append(live.float())
        toks = torch.cat([toks, nxt[:, None]], 1)
        done = done | (nxt == task.EOS)
        if uses_tool and step == 0:
            # The tool protocol: the first assistant token must be the call. The environment
            # answers the rows that called; a row that did not has failed and stops here.
            called = live & (nxt == task.TOOL_CALL)
            done = done | ~called
            span_len = cfg.num_digits + 2
            env = torch.full((n, span_len), task.PAD, dtype=toks.dtype, device=device)
            for i in torch.nonzero(called).flatten().tolist():
                env[i] = torch.tensor(task.observation_span(cfg, rows[i]), device=device)
            toks = torch.cat([toks, env], 1)
            lps.extend(torch.zeros(n, device=device) for _ in range(span_len))
            masks.extend(torch.zeros(n, device=device) for _ in range(span_len))
    lp_rows = torch.stack(lps, 1).float().cpu().tolist()
    mask_rows = torch.stack(masks, 1).cpu().tolist()
    routing = recorder.finish(n)
    out = []
    for i, t in enumerate(toks.cpu().tolist()):
        out.append({"tokens": t, "prompt_len": prompt_len, "rollout_logprobs": lp_rows[i],
                    "loss_mask": mask_rows[i], "task": task.task_of(t[:prompt_len]),
                    "reward": task.reward(cfg, t, prompt_len), "routing": routing[i]})
    return out


def sample_tasks(mix: Dict[str, float], n: int, gen: torch.Generator) -> List[str]:
    """``n`` task names drawn independently with probabilities ``mix`` (sums to 1)."""
    names = sorted(mix)
    probs = torch.tensor([mix[k] for k in names], dtype=torch.float64)
    return [names[i] for i in torch.multinomial(probs, n, replacement=True, generator=gen).tolist()]


def rollout_worker(cfg, stage_seed: int, mix: Dict[str, float], group_size: int,
                   weight_rx, sample_q, stop_ev, generated, id_prefix: str) -> None:
    """Rollout process body: generate groups until ``stop_ev`` with the newest weights held.

    ``weight_rx`` is the receiving end of the weight-sync channel (see ``weight_sync.py``);
    every group of ``group_size`` samples shares one ``prompt_id`` (the Data Buffer key);
    ``generated`` (a shared counter) counts the samples put on ``sample_q`` (each is counted
    before its put: one cut off by a crash shows up as dropped, never as negative).
    The process stops at ``stop_ev``, and by itself within about a second when the trainer
    is gone (even killed with SIGKILL, which leaves it no chance to stop this process).
    """
    # The trainer owns this process's lifetime (stop_ev): a terminal Ctrl-C goes to it alone.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    stop_ev = _StopOrOrphaned(stop_ev, sample_q)
    setup_logging()
    torch.set_num_threads(1)
    torch.manual_seed(stage_seed)
    gen = torch.Generator().manual_seed(stage_seed + 1)
    model = TinyLM(cfg, task.vocab_size(cfg)).to(cfg.resolved_device(),
                                                  cfg.rollout_torch_dtype()).eval()
    prompt_id = 0
    batch_prompts = max(1, cfg.rollout_batch_samples // group_size)
    while not stop_ev.is_set():
        version = weight_rx.poll(model, block=True)    # newest weights; waits only for the first
        if version == 0:
            continue
        names = sample_tasks(mix, batch_prompts, gen)
        prompts = [task.make_prompt(cfg, name, gen) for name in names]
        by_task: Dict[str, list] = {}
        for pid, p in enumerate(prompts):
            by_task.setdefault(task.task_of(p), []).append(pid)
        groups: Dict[int, list] = {}
        for pids in by_task.values():                 # one batched generate per task
            samples = generate(cfg, model, [prompts[i] for i in pids], group_size, gen=gen)
            for j, s in enumerate(samples):
                groups.setdefault(pids[j // group_size], []).append(s)
        for pid in range(len(prompts)):               # back in prompt order: tasks interleave
            key = f"{id_prefix}/{prompt_id + pid}"
            for j, s in enumerate(groups[pid]):
                s.update(prompt_id=key, sample_id=f"{key}.{j}", version=version)
                with generated.get_lock():
                    generated.value += 1
                if not _put(sample_q, s, stop_ev):
                    with generated.get_lock():
                        generated.value -= 1
                    return
        prompt_id += len(prompts)


class _StopOrOrphaned:
    """``stop_ev.is_set()`` that is also true once the parent (trainer) process has exited;
    then nobody will read ``sample_q`` again, so the process exits without flushing it."""

    def __init__(self, stop_ev, sample_q):
        self._stop, self._q = stop_ev, sample_q
        self._parent = multiprocessing.parent_process()

    def is_set(self) -> bool:
        if self._parent is not None and not self._parent.is_alive():
            self._q.cancel_join_thread()
            return True
        return self._stop.is_set()


def _put(q, item, stop_ev) -> bool:
    """Put on a bounded queue (the back-pressure that bounds staleness) unless stopped."""
    while not stop_ev.is_set():
        try:
            q.put(item, timeout=0.2)
            return True
        except queue.Full:
            continue
    return False
