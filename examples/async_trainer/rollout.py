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


def sample_turn(model, toks, live, steps: int, stops, recorder, *, gen=None,
                greedy: bool = False):
    """One assistant turn for a batch of rows: ``steps`` tokens sampled with one forward each
    (no early exit: rows stay aligned), rows in ``live`` until they sample a token in
    ``stops``; the others get ``PAD``. Returns the grown ``toks`` [n, T + steps], the turn's
    ids, fp32 log-probs (0 where not sampled) and mask (1 where sampled), each [n, steps]."""
    stops = torch.tensor(sorted(stops), dtype=toks.dtype, device=toks.device)
    ids, lps, masks = [], [], []
    live = live.clone()
    for _ in range(steps):
        logp = torch.log_softmax(model(toks)[:, -1].float(), -1)
        recorder.step()
        if greedy:
            nxt = kernels.topk(logp, 1).indices                      # ties -> smaller id
        else:
            # Sampled on the CPU with the caller's generator: one seeded stream per process,
            # whatever device the model is on (a [rows, vocab] copy; the vocab is tiny).
            nxt = torch.multinomial(logp.exp().cpu(), 1, generator=gen).to(logp.device)
        lp = logp.gather(-1, nxt).squeeze(-1)
        nxt = torch.where(live, nxt.squeeze(-1), torch.full_like(nxt.squeeze(-1), task.PAD))
        ids.append(nxt)
        lps.append(torch.where(live, lp, torch.zeros_like(lp)))
        masks.append(live.float())
        toks = torch.cat([toks, nxt[:, None]], 1)
        live = live & ~torch.isin(nxt, stops)
    return toks, torch.stack(ids, 1), torch.stack(lps, 1), torch.stack(masks, 1)


@torch.no_grad()
def generate(cfg, model, prompts: List[List[int]], group_size: int, *, gen=None,
             greedy: bool = False, session: str = "rollout") -> List[Dict]:
    """``group_size`` trajectories for each prompt (all prompts of one task, one length).

    Returns one dict per trajectory (prompt-major): ``tokens`` (full stream), ``prompt_len``,
    ``rollout_logprobs`` and ``loss_mask`` (one value per response position; environment and
    padding positions have log-prob 0 and mask 0), ``reward`` and ``routing``: the experts
    every MoE layer routed positions 0 .. len(tokens)-2 to, as a ``glm_kernels.topk``
    routing packet (bytes; None for a model without MoE layers), for routing replay.
    ToRA trajectories (multi-turn sessions, ``tora_task.generate_sessions``) also carry ``session_id`` (``session``
    / row), ``observation``, ``forks`` and ``branches``.
    """
    if not prompts:
        return []
    kinds = {task.task_of(p) for p in prompts}
    if len(kinds) != 1:
        raise ValueError(f"generate: prompts must share one task, got {sorted(kinds)}")
    kind = kinds.pop()
    rows = [p for p in prompts for _ in range(group_size)]
    if kind == "tora":
        from .tora_task import generate_sessions
        return generate_sessions(cfg, model, rows, gen=gen, greedy=greedy, session=session)
    device = next(model.parameters()).device
    toks = torch.tensor(rows, device=device)
    n = toks.shape[0]
    recorder = RoutingRecorder(model)
    live = torch.ones(n, dtype=torch.bool, device=device)
    answer_steps = cfg.num_digits + 1
    lps, masks = [], []
    if kind == "tool":
        # The tool protocol: the first assistant token must be the call (a one-token turn).
        # The environment answers the rows that called; a row that did not has failed.
        toks, first, lp, mask = sample_turn(model, toks, live, 1, (), recorder, gen=gen,
                                            greedy=greedy)
        live = first[:, 0] == task.TOOL_CALL
        span_len = cfg.num_digits + 2
        env = torch.full((n, span_len), task.PAD, dtype=toks.dtype, device=device)
        for i in torch.nonzero(live).flatten().tolist():
            env[i] = torch.tensor(task.observation_span(cfg, rows[i]), device=device)
        toks = torch.cat([toks, env], 1)
        zeros = torch.zeros(n, span_len, device=device)
        lps += [lp, zeros]
        masks += [mask, zeros]
    toks, _, lp, mask = sample_turn(model, toks, live, answer_steps, (task.EOS,), recorder,
                                    gen=gen, greedy=greedy)
    lp_rows = torch.cat(lps + [lp], 1).float().cpu().tolist()
    mask_rows = torch.cat(masks + [mask], 1).cpu().tolist()
    routing = recorder.finish(n)
    prompt_len = len(rows[0])
    out = []
    for i, t in enumerate(toks.cpu().tolist()):
        out.append({"tokens": t, "prompt_len": prompt_len, "rollout_logprobs": lp_rows[i],
                    "loss_mask": mask_rows[i], "task": kind,
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
