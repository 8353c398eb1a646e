"""One stage's rollout over the Ray engines (``engines.EngineGroup``): the trainer's handle.

:class:`RayRollout` has the interface of ``supervisor.RolloutProcess``: a pump thread keeps
requests in flight (bounded: the back-pressure that bounds staleness), a health-monitor
thread polls the engines every ``health_interval`` seconds and has a dead or hung one
replaced (its in-flight requests submitted again: samples re-queued, never lost and never
trained twice), ``get()`` hands the trainer samples, ``shutdown()`` accounts for them.
"""
import queue
import threading
import time
from typing import Dict, List, Optional

import torch

from . import task
from .engines import EngineError, EngineGroup
from .log import logger


class RayRollout:
    """One stage's rollout over an :class:`EngineGroup`; the interface of
    ``supervisor.RolloutProcess`` (``start``, ``get``, ``alive``, ``shutdown``, ``sender``).

    Requests: ``max(1, rollout_batch_samples // group_size // n_engines)`` prompts each, one
    session per request (a multi-turn task sends every turn of it to the same engine).
    At most ``queue_size`` samples plus one request buffered or in flight (the back-pressure
    that bounds staleness: the rollout process holds a whole batch beyond its queue), and at
    least one request per engine.
    """

    def __init__(self, group: EngineGroup, cfg, tag: str, seed: int, mix: Dict[str, float],
                 group_size: int, queue_size: int, *, health_interval: float = 1.0,
                 request_timeout: float = 60.0, max_restarts: int = 3):
        self.group, self.cfg, self.tag = group, cfg, tag
        self.mix, self.group_size, self.queue_size = mix, group_size, queue_size
        self.health_interval, self.request_timeout = health_interval, request_timeout
        self.max_restarts = max_restarts
        self.gen = torch.Generator().manual_seed(seed)
        self.seed = seed
        self.outbox: "queue.Queue[dict]" = queue.Queue()
        self.inflight: Dict[object, dict] = {}        # ref -> request (with its engine)
        self.pending: List[dict] = []                 # requests to (re)submit
        self.generated = self.received = self.requeued = 0
        self.restarts_in_row = 0
        self.error: Optional[BaseException] = None
        self._stop = threading.Event()
        self._mu = threading.Lock()                   # inflight / pending: pump and monitor
        self._fail_mu = threading.Lock()
        self.events: List[dict] = []                  # engine restarts, for the metrics
        self._threads: List[threading.Thread] = []
        self._next_prompt = 0
        self._next_req = 0
        self.sender = self                            # trainer code calls rollout.sender.*
        # A rollout batch split over the engines; one request's worth beyond the queue.
        n = len(group.alive())
        self.prompts_per_request = max(1, cfg.rollout_batch_samples // group_size // n)
        self.request_samples = self.prompts_per_request * group_size
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
        drained = 0
        while True:
            try:
                self.outbox.get_nowait()
            except queue.Empty:
                break
            drained += 1
        # Requests still in flight were never counted as generated: nothing to drop.
        return {"generated": self.generated, "unconsumed": drained,
                "dropped": self.generated - self.received - drained}

    def stats(self) -> dict:
        with self.group.lock:
            load, rate = self.group.router.snapshot()
        return {"engine_load": load, "affinity_hit_rate": rate,
                "engine_restarts": self.group.restarts, "samples_requeued": self.requeued}

    # -- threads ------------------------------------------------------------------------
    def _new_request(self) -> dict:
        from .rollout import sample_tasks
        names = sample_tasks(self.mix, self.prompts_per_request, self.gen)
        prompts = [task.make_prompt(self.cfg, n, self.gen) for n in names]
        ids = [f"{self.tag}/{self._next_prompt + i}" for i in range(len(prompts))]
        self._next_prompt += len(prompts)
        self._next_req += 1
        return {"session": f"{self.tag}/r{self._next_req}", "prompts": prompts, "ids": ids,
                "group_size": self.group_size, "seed": self.seed * 1_000_003 + self._next_req}

    def _budget_left(self) -> bool:
        with self._mu:
            expected = sum(len(r["ids"]) for r in list(self.inflight.values()) + self.pending) \
                * self.group_size
            n_inflight = len(self.inflight)
        # The queue's worth of samples buffered or in flight plus one request (the rollout
        # process holds a whole batch beyond its queue), and every engine busy when
        # nothing is buffered.
        return (self.outbox.qsize() + expected < self.queue_size + self.request_samples
                or n_inflight < len(self.group.alive()) and self.outbox.qsize() == 0)

    def _submit(self, req: dict) -> bool:
        """Send ``req`` to its session's engine, unless that engine is busy: one request per
        engine at a time, so a weight update waits behind at most one generation (bounded
        staleness). Returns whether it was sent."""
        with self.group.lock:
            if not len(self.group.router):
                raise EngineError(f"rollout {self.tag}: no engine left")
            eid = self.group.router.lookup(req["session"])
            with self._mu:
                if any(r["engine"] == eid for r in self.inflight.values()):
                    return False
            self.group.router.route(req["session"])
            ref = self.group.actors[eid].generate.remote(req)
        with self._mu:
            self.inflight[ref] = dict(req, engine=eid, t0=time.monotonic())
        return True

    def _pump(self) -> None:
        ray = self.group.ray
        try:
            while not self._stop.is_set():
                with self._mu:                         # re-queued requests first, in order
                    waiting, self.pending = self.pending, []
                held = [req for req in waiting if not self._submit(req)]
                with self._mu:
                    self.pending[:0] = held
                while not held and self._budget_left() and not self._stop.is_set():
                    req = self._new_request()
                    if not self._submit(req):
                        with self._mu:
                            self.pending.append(req)   # its engine is busy: next round
                        break
                with self._mu:
                    refs = list(self.inflight)
                if not refs:
                    time.sleep(0.02)
                    continue
                ready, _ = ray.wait(refs, num_returns=1, timeout=0.1)
                for ref in ready:
                    with self._mu:
                        req = self.inflight.pop(ref, None)
                    if req is None:
                        continue
                    try:
                        res = ray.get(ref)
                    except Exception as err:      # the engine died under it: run it again
                        self._requeue(req, type(err).__name__)
                        self._fail_engine(req["engine"], f"{type(err).__name__} in generate")
                        continue
                    for s in res["samples"]:
                        self.generated += 1
                        self.outbox.put(s)
                    with self.group.lock:
                        actor = self.group.actors.get(req["engine"])
                    if actor is not None:
                        actor.end_session.remote(req["session"])
                        self.group.router.end_session(req["session"])
        except BaseException as err:                # surfaces as alive() False
            self.error = err
            logger.error(f"rollout {self.tag}: pump failed ({type(err).__name__}: {err})")

    def _requeue(self, req: dict, why: str) -> None:
        self.requeued += len(req["ids"]) * self.group_size
        logger.info(f"rollout {self.tag}: request {req['session']} ({len(req['ids'])} prompts) "
                    f"re-queued ({why} on engine {req['engine']})")
        with self._mu:
            self.pending.append({k: v for k, v in req.items() if k not in ("engine", "t0")})

    def _fail_engine(self, eid: str, why: str) -> None:
        """Replace engine ``eid`` (once, whichever thread noticed first); its in-flight
        requests go back to the queue first, so a late result of theirs is ignored."""
        with self._fail_mu:
            with self.group.lock:
                if eid not in self.group.actors:
                    return                          # already replaced
            self.restarts_in_row += 1
            if self.restarts_in_row > self.max_restarts:
                raise EngineError(f"rollout {self.tag}: {self.restarts_in_row} engine failures "
                                  f"in a row with no optimizer step between (last: {eid}, "
                                  f"{why}; max_restarts={self.max_restarts})")
            with self._mu:
                lost = [self.inflight.pop(ref) for ref, r in list(self.inflight.items())
                        if r["engine"] == eid]
            for req in lost:
                self._requeue(req, "engine replaced")
            new = self.group.replace(eid, why)
            self.events.append({"event": "engine_restart", "engine": eid, "replacement": new,
                                "reason": why, "requeued_requests": len(lost)})

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
                    self._fail_engine(eid, why)
        except BaseException as err:
            self.error = err
            logger.error(f"rollout {self.tag}: {err}")

    def step_done(self) -> None:
        """An optimizer step happened: engine failures are no longer 'in a row'."""
        self.restarts_in_row = 0
