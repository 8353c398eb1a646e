"""One stage's rollout over the Ray engines (``engines.EngineGroup``): the trainer's handle.

:class:`RayRollout` has the interface of ``supervisor.RolloutProcess``. Three threads:

* the pump (the only one that submits, collects and re-queues): every engine has its own
  queue of turns (sessions placed on it by the router wait there for their next turn) and
  one slot (one turn in flight: a weight update waits behind at most one turn). Whenever
  an engine's slot is free it takes its queue's next turn, or else a new session starts on
  it (the router's bounded-load placement), as far as the staleness bound allows: a turn
  never waits while its engine is free, and no engine idles while sessions could start;
* the environment pool: between two turns of a session it runs the tool, the sandbox and
  the trajectory manager (``rollout/sessions.py``), so the pump never waits on them;
* the health monitor: pings the engines every ``health_interval`` seconds and reports a
  dead or hung one to the pump, which has it replaced and re-queues its turns (the samples
  are counted only when a session ends: never lost, never trained twice).
"""
import itertools
import queue
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Deque, Dict, List, Optional

import torch

from ..env import task
from .engines import EngineError, EngineGroup
from ..log import logger
from .local import prompts_allowed, sample_tasks
from .sessions import new_session


class RayRollout:
    """One stage's rollout over an :class:`EngineGroup`; the interface of
    ``supervisor.RolloutProcess`` (``start``, ``get``, ``alive``, ``shutdown``, ``sender``).

    Prompts start ``max(1, rollout_batch_samples // group_size // n_engines)`` at a time
    (fewer when the staleness bound, ``rollout.local.prompts_allowed`` with ``prompts_per_step``
    and ``cfg.max_ahead_steps``, admits fewer), each of a task drawn from the mix; the
    prompts of one task make one session.
    """

    def __init__(self, group: EngineGroup, cfg, tag: str, seed: int, mix: Dict[str, float],
                 group_size: int, prompts_per_step: int, *, health_interval: float = 1.0,
                 request_timeout: float = 60.0, max_restarts: int = 3, env_workers: int = 2):
        self.group, self.cfg, self.tag = group, cfg, tag
        self.mix, self.group_size, self.prompts_per_step = mix, group_size, prompts_per_step
        self.health_interval, self.request_timeout = health_interval, request_timeout
        self.max_restarts = max_restarts
        self.gen = torch.Generator().manual_seed(seed)
        self.seed = seed
        self.outbox: "queue.Queue[dict]" = queue.Queue()
        self.sessions: Dict[str, object] = {}         # live sessions (sessions.Session)
        self.prompt_ids: Dict[str, List[str]] = {}
        self.prompts: Dict[str, list] = {}            # session -> its prompts (a restart)
        self.sessions_restarted = 0                   # batch-invariant: version not held
        self.queues: Dict[str, Deque[str]] = {}       # engine -> sessions whose turn waits
        self.inflight: Dict[object, dict] = {}        # ref -> the turn sent (engine, session)
        self.ready_at: Dict[str, float] = {}          # session -> when its turn was ready
        self.moved_turn: Dict[str, bool] = {}         # session -> its waiting turn moved
        self.env_jobs: List[tuple] = []               # (session, future) in the env pool
        self.first_version: Optional[int] = None
        self.started_prompts = 0
        self.generated = self.received = self.requeued = 0
        self.continued = self.found = self.reused_tokens = 0   # affinity, from the engines
        self.turns_moved = 0                          # turns whose engine had left
        self._wait_s, self._waits = 0.0, 0
        self._idle_s: Dict[str, float] = {}
        self._idle_from: Dict[str, float] = {}
        self.restarts_in_row = 0
        self.error: Optional[BaseException] = None
        self._stop = threading.Event()
        self._mu = threading.Lock()                   # inflight and metrics: pump / others
        self._suspects: "queue.SimpleQueue[tuple]" = queue.SimpleQueue()
        self._env = ThreadPoolExecutor(env_workers, thread_name_prefix=f"env {tag}")
        self._seeds = itertools.count(1)
        self.events: List[dict] = []                  # engine restarts, for the metrics
        self._threads: List[threading.Thread] = []
        self._next_prompt = 0
        self.sender = self                            # trainer code calls rollout.sender.*
        n = len(group.alive())
        self.prompts_per_session = max(1, cfg.rollout_batch_samples // group_size // n)
        self.dtype = cfg.rollout_torch_dtype()

    # -- the RolloutProcess interface ------------------------------------------------------
    @property
    def version(self) -> int:
        return self.group.version

    @property
    def pid(self):
        return None

    def send(self, model):
        return self.group.publish(model, self.dtype)

    def start(self, guard, model):
        _, stats = self.send(model)          # full snapshot (a new stage: every link full)
        self.first_version = self.group.version
        now = time.monotonic()
        for eid in self.group.alive():
            self.queues[eid] = deque()
            self._idle_from[eid] = now
        self._threads = [threading.Thread(target=self._pump, name=f"pump {self.tag}",
                                          daemon=True),
                         threading.Thread(target=self._monitor, name=f"health {self.tag}",
                                          daemon=True)]
        for t in self._threads:
            t.start()
        return stats

    def alive(self) -> bool:
        return self.error is None

    def get(self, timeout: float):
        try:
            sample = self.outbox.get(timeout=timeout)
        except queue.Empty:
            return None
        self.received += 1
        return sample

    def shutdown(self, grace_s: float = 10.0) -> Dict[str, int]:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=grace_s)
        self._env.shutdown(wait=True, cancel_futures=True)
        drained = 0
        while True:
            try:
                self.outbox.get_nowait()
            except queue.Empty:
                break
            drained += 1
        # Sessions not finished were never counted as generated: nothing to drop.
        return {"generated": self.generated, "unconsumed": drained,
                "dropped": self.generated - self.received - drained}

    def stats(self) -> dict:
        """Metrics since the last call (queue wait, idle time) and in all (the rest):
        ``affinity_hit_rate`` is the fraction of later turns (not moved off a dead engine)
        whose engine still held the session's prefix (None before any)."""
        now = time.monotonic()
        with self.group.lock:
            load = self.group.router.snapshot()
        with self._mu:
            for eid, t in self._idle_from.items():
                if t is not None:
                    self._idle_s[eid] = self._idle_s.get(eid, 0.0) + now - t
                    self._idle_from[eid] = now
            idle = {e: round(self._idle_s.get(e, 0.0), 3) for e in self._idle_from}
            self._idle_s = {}
            wait = self._wait_s / self._waits if self._waits else 0.0
            self._wait_s, self._waits = 0.0, 0
            rate = self.found / self.continued if self.continued else None
        return {"engine_load": load, "affinity_hit_rate": rate,
                "turns_moved": self.turns_moved, "prefix_reused_tokens": self.reused_tokens,
                "queue_wait_s": wait, "engine_idle_s": idle,
                "engine_restarts": self.group.restarts, "samples_requeued": self.requeued}

    def step_done(self) -> None:
        """An optimizer step happened: engine failures are no longer 'in a row'."""
        self.restarts_in_row = 0

    # -- the pump ---------------------------------------------------------------------------
    def _pump(self) -> None:
        ray = self.group.ray
        try:
            while not self._stop.is_set():
                while True:                            # engines the monitor found bad
                    try:
                        eid, why = self._suspects.get_nowait()
                    except queue.Empty:
                        break
                    self._fail_engine(eid, why)
                self._collect_env()
                self._fill()
                refs = list(self.inflight)
                if not refs:
                    time.sleep(0.01)
                    continue
                ready, rest = ray.wait(refs, num_returns=1, timeout=0.02)
                if ready and rest:
                    ready += ray.wait(rest, num_returns=len(rest), timeout=0)[0]
                for ref in ready:
                    self._finish(ref)
        except BaseException as err:                # surfaces as alive() False
            self.error = err
            logger.error(f"rollout {self.tag}: pump failed ({type(err).__name__}: {err})")

    def _busy(self, eid: str) -> bool:
        return any(r["engine"] == eid for r in self.inflight.values())

    def _fill(self) -> None:
        """Every free engine takes its next waiting turn, or a new session."""
        alive = self.group.alive()
        for eid in alive:
            q = self.queues.setdefault(eid, deque())
            if q and not self._busy(eid):
                self._submit(q.popleft(), eid)
        idle = {e for e in alive if not self._busy(e) and not self.queues[e]}
        while idle:
            n = min(self.prompts_per_session, prompts_allowed(
                self.group.version, self.first_version, self.started_prompts,
                self.prompts_per_step, self.cfg.max_ahead_steps))
            if n <= 0:
                return                              # the staleness bound: newer weights first
            for sid in self._new_sessions(n):
                with self.group.lock:
                    eid = self.group.router.start(sid, free=idle)
                self.ready_at[sid] = time.monotonic()
                if eid in idle:
                    idle.discard(eid)
                    self._submit(sid, eid)
                else:                               # no free engine left: its engine's queue
                    self.queues.setdefault(eid, deque()).append(sid)

    def _new_sessions(self, n: int) -> List[str]:
        """``n`` prompts, each of a task drawn from the mix (so a training step mixes tasks
        as the rollout process's batches do), as one session per task."""
        by_task: Dict[str, list] = {}
        for name in sample_tasks(self.mix, n, self.gen):
            by_task.setdefault(name, []).append(task.make_prompt(self.cfg, name, self.gen))
        out = []
        for prompts in by_task.values():
            k = len(prompts)
            sid = f"{self.tag}/s{self._next_prompt}"
            self.prompt_ids[sid] = [f"{self.tag}/{self._next_prompt + i}" for i in range(k)]
            self._next_prompt += k
            self.started_prompts += k
            self.sessions[sid] = new_session(self.cfg, sid, prompts, self.group_size)
            self.prompts[sid] = prompts
            out.append(sid)
        return out

    def _submit(self, sid: str, eid: str) -> None:
        sess = self.sessions[sid]
        req = dict(sess.next_turn(), session=sid, seed=self.seed * 1_000_003 + next(self._seeds))
        with self.group.lock:
            ref = self.group.actors[eid].turn.remote(req)
        now = time.monotonic()
        with self._mu:
            self.inflight[ref] = {"session": sid, "engine": eid, "t0": now,
                                  "rows": len(req["rows"]), "continued": sess.turns > 0,
                                  "moved": self.moved_turn.pop(sid, False)}
            self._wait_s += now - self.ready_at.pop(sid, now)
            self._waits += 1
            if self._idle_from.get(eid) is not None:
                self._idle_s[eid] = self._idle_s.get(eid, 0.0) + now - self._idle_from[eid]
            self._idle_from[eid] = None

    def _finish(self, ref) -> None:
        with self._mu:
            info = self.inflight.pop(ref, None)
            if info is not None and not self._busy(info["engine"]):
                self._idle_from[info["engine"]] = time.monotonic()
        if info is None:
            return
        try:
            res = self.group.ray.get(ref)
        except Exception as err:      # the engine died under it: its turn runs again
            self._fail_engine(info["engine"], f"{type(err).__name__} in a turn", also=[info])
            return
        if res.get("missing_version") is not None:
            self._restart_session(info["session"], info["engine"], res["missing_version"])
            return
        with self._mu:
            if info["continued"] and not info["moved"]:
                self.continued += 1
                self.found += bool(res["session_found"])
            self.reused_tokens += res["reused_tokens"]
        sess = self.sessions[info["session"]]
        self.env_jobs.append((info["session"], self._env.submit(sess.feed, res,
                                                                res["version"])))

    def _restart_session(self, sid: str, eid: str, version: int) -> None:
        """Batch-invariant mode: engine ``eid`` no longer holds the weights ``version`` the
        session's earlier turns ran on (a replacement engine, or a version evicted): the
        session starts over on the current weights, so every turn of it has one version."""
        self.sessions[sid] = new_session(self.cfg, sid, self.prompts[sid], self.group_size)
        self.sessions_restarted += 1
        logger.info(f"rollout {self.tag}: session {sid} starts over (engine {eid} no longer "
                    f"holds its weights v{version})")
        with self.group.lock:
            target, _ = self.group.router.route(sid)
        self.ready_at[sid] = time.monotonic()
        self.queues.setdefault(target, deque()).append(sid)

    def _collect_env(self) -> None:
        """Sessions whose environment step is done: the next turn queued on the session's
        engine, or the session's samples out."""
        running = []
        for sid, job in self.env_jobs:
            if not job.done():
                running.append((sid, job))
                continue
            job.result()                              # an environment bug stops the rollout
            sess = self.sessions[sid]
            if sess.done:
                self._emit(sid, sess)
                continue
            with self.group.lock:
                eid, moved = self.group.router.route(sid)
            self.moved_turn[sid] = moved
            self.turns_moved += moved
            self.ready_at[sid] = time.monotonic()
            self.queues.setdefault(eid, deque()).append(sid)
        self.env_jobs = running

    def _emit(self, sid: str, sess) -> None:
        samples = sess.samples()
        ids = self.prompt_ids.pop(sid)
        for k, s in enumerate(samples):
            pid = ids[k // self.group_size]
            s.update(prompt_id=pid, sample_id=f"{pid}.{k % self.group_size}",
                     engine=self.group.router.engine_of(sid))
        with self.group.lock:
            self.group.router.end_session(sid)
        del self.sessions[sid]
        self.prompts.pop(sid, None)
        for s in samples:
            self.generated += 1
            self.outbox.put(s)

    def _fail_engine(self, eid: str, why: str, also=()) -> None:
        """Replace engine ``eid`` (once); its turns in flight (and ``also``: one the pump
        already took off) are sent again, the sessions waiting for it move."""
        with self.group.lock:
            gone = eid not in self.group.actors
        with self._mu:
            lost = [self.inflight.pop(ref) for ref, r in list(self.inflight.items())
                    if r["engine"] == eid] + list(also)
        waiting = self.queues.pop(eid, deque())
        new = None
        if not gone:
            self.restarts_in_row += 1
            if self.restarts_in_row > self.max_restarts:
                raise EngineError(f"rollout {self.tag}: {self.restarts_in_row} engine failures "
                                  f"in a row with no optimizer step between (last: {eid}, "
                                  f"{why}; max_restarts={self.max_restarts})")
            new = self.group.replace(eid, why)
            self.queues[new] = deque()
            with self._mu:
                self._idle_from.pop(eid, None)
                self._idle_from[new] = time.monotonic()
        for info in lost:
            self.requeued += info["rows"]
            self.moved_turn[info["session"]] = True
        now = time.monotonic()
        for sid in [info["session"] for info in lost] + list(waiting):
            with self.group.lock:
                target, _ = self.group.router.route(sid)
            self.moved_turn[sid] = True
            self.turns_moved += 1
            self.ready_at.setdefault(sid, now)
            self.queues.setdefault(target, deque()).append(sid)
        if lost:
            logger.info(f"rollout {self.tag}: {len(lost)} turns re-queued ({why} on engine "
                        f"{eid}), {len(waiting)} waiting turns moved")
        if not gone:
            self.events.append({"event": "engine_restart", "engine": eid, "replacement": new,
                                "reason": why, "requeued_requests": len(lost),
                                "requeued_samples": sum(i["rows"] for i in lost),
                                "moved_turns": len(waiting)})

    def _monitor(self) -> None:
        try:
            while not self._stop.wait(self.health_interval):
                bad = {eid: "no answer to a health ping" for eid in self.group.check()}
                now = time.monotonic()
                with self.group.lock:                 # a request's clock starts when its
                    ready = dict(self.group.ready_at)   # engine has started
                with self._mu:
                    for r in self.inflight.values():
                        if r["engine"] in ready and \
                                now - max(r["t0"], ready[r["engine"]]) > self.request_timeout:
                            bad.setdefault(r["engine"], f"a request ran past "
                                                        f"{self.request_timeout:g} s")
                for eid, why in bad.items():
                    self._suspects.put((eid, why))
        except BaseException as err:
            self.error = err
            logger.error(f"rollout {self.tag}: {err}")
