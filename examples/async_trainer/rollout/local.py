"""Rollout in one process: sessions run against an in-process engine (``generate``; also
what evaluation uses), and the rollout process loop of ``rollout_backend="process"``.

The rollout process generates with the newest weights it has received (it never waits for
the trainer's current step), records every sampled token's log-prob in fp32 at sampling time
(the trainer never recomputes them: coupled IcePop, the asynchronous TITO case) and puts one
``Sample`` dict per trajectory on the sample queue. It starts no more prompts than the
staleness bound allows (:func:`admitted`).
"""
import multiprocessing
import queue
import signal
import time
from typing import Dict, List

import torch

from ..env import task
from ..log import setup_logging
from ..model import policy
from .sampler import EngineCore
from .sessions import new_session


@torch.no_grad()
def generate(cfg, model, prompts: List[List[int]], group_size: int, *, gen=None,
             greedy: bool = False, session: str = "rollout") -> List[Dict]:
    """``group_size`` trajectories for each prompt (all prompts of one task), in this process:
    the task's session (``rollout/sessions.py``) against an in-process
    :class:`~.sampler.EngineCore`, turn by turn, the environment between turns.

    Returns one dict per trajectory (prompt-major): ``tokens`` (full stream), ``prompt_len``,
    ``rollout_logprobs`` and ``loss_mask`` (one value per response position; environment and
    padding positions have log-prob 0 and mask 0), ``reward``, ``version`` and ``routing``:
    the experts every MoE layer routed positions 0 .. len(tokens)-2 to, as a
    ``glm_kernels.topk`` routing packet (bytes), for
    routing replay. ToRA trajectories also carry ``session_id`` (``session`` / row),
    ``observation``, ``forks`` and ``branches``.
    """
    if not prompts:
        return []
    sess = new_session(cfg, session, prompts, group_size)
    engine = EngineCore(model, batch_invariant=cfg.batch_invariant)
    while not sess.done:
        req = dict(sess.next_turn(), session=session, greedy=greedy)
        sess.feed(engine.turn(req, gen))
    return sess.samples()


def sample_tasks(mix: Dict[str, float], n: int, gen: torch.Generator) -> List[str]:
    """``n`` task names drawn independently with probabilities ``mix`` (sums to 1)."""
    names = sorted(mix)
    probs = torch.tensor([mix[k] for k in names], dtype=torch.float64)
    return [names[i] for i in torch.multinomial(probs, n, replacement=True, generator=gen).tolist()]


def prompts_allowed(version: int, first_version: int, started: int, prompts_per_step: int,
                    max_ahead_steps: int) -> int:
    """Prompts that may start now without breaking the staleness bound (AReaL's admission
    rule): the trainer's step s trains on version ``first_version + s`` and takes
    ``prompts_per_step`` groups, so groups started with ``version`` are consumed by step
    ``version - first_version + max_ahead_steps`` if at most
    ``(version - first_version + max_ahead_steps + 1) * prompts_per_step`` were started
    in all. Groups that finish out of order can still come later: the trainer drops a group
    past the bound (``async_stage``), so the bound holds whatever the timing."""
    return (version - first_version + max_ahead_steps + 1) * prompts_per_step - started


def rollout_worker(cfg, stage_seed: int, mix: Dict[str, float], group_size: int,
                   prompts_per_step: int, weight_rx, sample_q, stop_ev, generated,
                   id_prefix: str) -> None:
    """Rollout process body: generate groups until ``stop_ev`` with the newest weights held,
    at most ``rollout_batch_samples`` at a time and no more than :func:`prompts_allowed`.

    ``weight_rx`` is the receiving end of the weight-sync channel (see ``rollout/weight_sync.py``);
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
    model = policy.new_policy(cfg, cfg.rollout_torch_dtype()).eval()
    prompt_id, first_version = 0, None
    batch_prompts = max(1, cfg.rollout_batch_samples // group_size)
    while not stop_ev.is_set():
        version = weight_rx.poll(model, block=True)    # newest weights; waits only for the first
        if version == 0:
            continue
        first_version = first_version or version
        n = min(batch_prompts, prompts_allowed(version, first_version, prompt_id,
                                               prompts_per_step, cfg.max_ahead_steps))
        if n <= 0:                                     # the staleness bound: newer weights first
            time.sleep(0.05)
            continue
        names = sample_tasks(mix, n, gen)
        prompts = [task.make_prompt(cfg, name, gen) for name in names]
        by_task: Dict[str, list] = {}
        for pid, p in enumerate(prompts):
            by_task.setdefault(task.task_of(p), []).append(pid)
        groups: Dict[int, list] = {}
        for pids in by_task.values():                 # one batched generate per task
            samples = generate(cfg, model, [prompts[i] for i in pids], group_size, gen=gen,
                               session=f"{id_prefix}/{prompt_id + pids[0]}")
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
