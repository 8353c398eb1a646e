"""Rollout engines as Ray actors, a session-affine router in front, a health monitor behind.

* :class:`Engine` (a Ray actor): holds the policy in the rollout dtype (bf16 by default, like
  an inference engine fed by fp32 master weights), applies ``glm_kernels.sync`` updates
  (a full snapshot first, then zstd deltas), and serves turns of sessions token in ->
  token out (``sampler.EngineCore``: fp32 log-probs recorded at sampling time, each live
  session's prefix kept between its turns). ``ping`` runs in its own concurrency group, so a busy
  engine still answers and only a dead or hung one does not. In batch-invariant mode it also
  keeps the weights of its last few versions and runs every turn of a session on the version
  of the session's first turn (the request's ``version``): a session spanning a weight update
  would otherwise mix two versions, which no single-version recompute by the trainer matches.
  A session whose version the engine does not hold (evicted, or a replacement engine) gets
  ``missing_version`` back and starts over on the current weights.
* :class:`EngineGroup` (the driver's side, one per training run): starts the actors
  (``ray.init()``: a local instance, or ``address=`` an existing cluster), each in its own
  bundle of a placement group (``rollout/placement.py``; a replacement reuses its bundle), keeps one
  ``glm_kernels.sync.Sender`` per engine and the :class:`~.router.ConsistentHashRouter`
  that places sessions, and replaces an engine that died or hung: the new actor gets a full
  weight snapshot of the current version (the sessions it held move, their turns re-queued
  by ``ray_rollout.RayRollout``).
* ``ray_rollout.RayRollout`` (one per stage): the trainer's handle on a group: the pump that
  keeps every engine busy, the environment between turns, the health monitor, samples out.

Nothing here imports ray at module import time (``rollout/ray_local.py``): ``ray`` is optional for
the rest of the example (``RayUnavailable`` says what to install).
"""
import itertools
import os
import threading
import time
from collections import OrderedDict
from typing import Dict, List, Optional

import torch

from glm_kernels import sync

from ..log import logger
from ..model import policy
from .placement import EnginePlacement
from .ray_local import import_ray, init_ray
from .router import ConsistentHashRouter
from .sampler import EngineCore


class EngineError(RuntimeError):
    """Engines kept failing: more replacements in a row than allowed."""


class _EngineImpl:
    """The actor's body (plain class: also usable in-process in tests): the policy in the
    rollout dtype, its weight receiver, and an :class:`~.sampler.EngineCore` serving turns."""

    def __init__(self, cfg, engine_id: str, seed: int):
        torch.set_num_threads(1)
        torch.manual_seed(seed)
        self.cfg, self.engine_id = cfg, engine_id
        self.model = policy.new_policy(cfg, cfg.rollout_torch_dtype()).eval()
        self.core = EngineCore(self.model, batch_invariant=cfg.batch_invariant)
        self._new_receiver()
        self._lock = threading.Lock()
        # Batch-invariant mode: the weights of the last versions (sessions pinned to them);
        # a session older than the staleness bound is dropped by the trainer anyway.
        self.kept: Optional["OrderedDict[int, Dict[str, torch.Tensor]]"] = \
            OrderedDict() if cfg.batch_invariant else None
        self.keep_versions = cfg.max_ahead_steps + 2
        self._pinned: Optional[torch.nn.Module] = None
        self._pinned_version = 0

    def _new_receiver(self):
        self.inbox = sync.LocalTransport()
        self.receiver = sync.Receiver(self.inbox, self.model.state_dict())

    def update(self, frames) -> dict:
        """Apply one update (a list of ``(meta, data, last)`` frames); returns the version
        held and whether the update was refused (then a full snapshot must follow)."""
        with self._lock:
            self.inbox.updates.append([sync.protocol.Frame(bytes(m), d, bool(last))
                                       for m, d, last in frames])
            refused = None
            try:
                self.receiver.poll()
            except sync.SyncError as err:
                refused = str(err)
            self._keep_current()
            return {"version": self.receiver.version, "refused": refused,
                    "full_requested": self.inbox.full_requested()}

    def _keep_current(self) -> None:
        """Batch-invariant mode: keep a copy of the weights just received (last
        ``keep_versions``)."""
        version = self.receiver.version
        if self.kept is None or version == 0 or version in self.kept:
            return
        self.kept[version] = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        while len(self.kept) > self.keep_versions:
            self.kept.popitem(last=False)

    def _weights_of(self, version: int) -> torch.nn.Module:
        """A model holding the kept weights of ``version``."""
        if self._pinned is None:
            self._pinned = policy.new_policy(self.cfg, self.cfg.rollout_torch_dtype()).eval()
        if self._pinned_version != version:
            self._pinned.load_state_dict(self.kept[version])
            self._pinned_version = version
        return self._pinned

    def turn(self, req: dict) -> dict:
        """One turn of a session (``EngineCore.turn``; ``req`` also has ``seed``, and
        ``version``: the session's earlier turns' weights, honoured in batch-invariant mode),
        with the weight version it ran on and this engine's id. ``missing_version`` (set,
        ``rows`` None): batch-invariant mode, the session's version is not held here."""
        with self._lock, torch.no_grad():
            version = self.receiver.version
            if version == 0:
                raise RuntimeError(f"engine {self.engine_id}: no weights yet")
            model, want = None, req.get("version")
            if self.kept is not None and want is not None and want != version:
                if want not in self.kept:
                    self.core.forget(req["session"])
                    return {"rows": None, "missing_version": want, "version": version,
                            "engine": self.engine_id, "session_found": False,
                            "reused_tokens": 0}
                model, version = self._weights_of(want), want
            out = self.core.turn(req, torch.Generator().manual_seed(req["seed"]), model)
            out.update(version=version, engine=self.engine_id)
            return out

    def ping(self) -> dict:
        return {"engine": self.engine_id, "pid": os.getpid(), "version": self.receiver.version,
                "turns": self.core.turns, "session_hits": self.core.session_hits}

    def hang(self, seconds: float) -> None:
        """Tests: block the engine's request lane (a hung engine)."""
        with self._lock:
            time.sleep(seconds)


_ENGINE_ACTOR = None


def engine_actor():
    """The Ray actor class (built on first use: ray stays optional)."""
    global _ENGINE_ACTOR
    if _ENGINE_ACTOR is None:
        ray = import_ray()

        @ray.remote(num_cpus=0, max_restarts=0, concurrency_groups={"health": 1, "work": 1})
        class Engine(_EngineImpl):
            @ray.method(concurrency_group="work")
            def update(self, frames):
                return _EngineImpl.update(self, frames)

            @ray.method(concurrency_group="work")
            def turn(self, req):
                return _EngineImpl.turn(self, req)

            @ray.method(concurrency_group="work")
            def hang(self, seconds):
                return _EngineImpl.hang(self, seconds)

            @ray.method(concurrency_group="health")
            def ping(self):
                info = _EngineImpl.ping(self)
                info["node"] = ray.get_runtime_context().get_node_id()   # where it runs
                return info

        _ENGINE_ACTOR = Engine
    return _ENGINE_ACTOR


class _Link:
    """Driver side of one engine's weight channel: a Sender over an in-memory transport whose
    frames are shipped to the actor by ``EngineGroup``."""

    def __init__(self, version: int):
        self.transport = sync.LocalTransport()
        self.sender = sync.Sender(self.transport, delta=True, encoding="zstd", version=version)

    def publish(self, weights, full: bool = False):
        self.sender.publish(weights, full=full)
        frames = self.transport.updates.popleft()
        return [(bytes(f.meta), f.data, bool(f.last)) for f in frames], self.sender.last_stats


class EngineGroup:
    """The engines of a run, their weight channels and the router (see the module doc).

    Thread-safe: the trainer thread publishes, the pump thread submits and collects, the
    monitor thread replaces; all under one lock.
    """

    def __init__(self, cfg, n_engines: int, *, address: str = "", seed: int = 0,
                 ping_timeout: float = 5.0, start_timeout: float = 120.0):
        if n_engines < 1:
            raise ValueError(f"n_engines must be >= 1, got {n_engines}")
        self.ray = init_ray(address, num_cpus=n_engines * cfg.engine_cpus)
        self.cfg, self.seed, self.ping_timeout = cfg, seed, ping_timeout
        self.start_timeout = start_timeout
        self._boot: Dict[str, tuple] = {}   # engine -> (start time, first ping) until it answers
        self.ready_at: Dict[str, float] = {}
        self.lock = threading.RLock()
        self.router = ConsistentHashRouter()
        self.actors: Dict[str, object] = {}
        self.links: Dict[str, _Link] = {}
        self.pids: Dict[str, int] = {}
        self.weights = None               # the last published weights (rollout dtype)
        self.version = 0
        self.restarts = 0
        self._ids = itertools.count()
        self._updates: List[tuple] = []   # (engine, ref) of updates not checked yet
        # On CUDA the engines share the GPUs Ray sees (a fraction each; Ray hides GPUs from
        # an actor that asks for none). Not measured on a GPU.
        self.gpus_per_engine = 0.0
        if cfg.resolved_device() == "cuda":
            total = self.ray.cluster_resources().get("GPU", 0.0)
            self.gpus_per_engine = min(1.0, total / n_engines) if total else 0.0
        # One bundle per engine (rollout/placement.py); an engine and its replacements use
        # its bundle.
        self.placement = EnginePlacement(
            self.ray, n_engines, cpus=cfg.engine_cpus, gpus=self.gpus_per_engine,
            strategy=cfg.placement_strategy, timeout=cfg.placement_timeout)
        self.bundles: Dict[str, int] = {}   # engine -> its bundle index
        logger.info(f"rollout: placement group of {self.placement.describe()}, ready in "
                    f"{self.placement.ready_s:.1f} s")
        try:
            for i in range(n_engines):
                self._start_engine(i)
        except BaseException:
            self.shutdown()
            raise

    # -- engines ------------------------------------------------------------------------
    def _start_engine(self, bundle: int) -> str:
        eid = f"e{next(self._ids)}"
        actor = engine_actor().options(**self.placement.options(bundle)).remote(
            self.cfg, eid, self.seed + 7919 * int(eid[1:]))
        self.actors[eid] = actor
        self.bundles[eid] = bundle
        self._boot[eid] = (time.monotonic(), actor.ping.remote())
        self.links[eid] = _Link(max(self.version - 1, 0))
        self.router.add(eid)
        if self.weights is not None:       # a replacement: the current version, in full
            frames, _ = self.links[eid].publish(self.weights, full=True)
            self._updates.append((eid, actor.update.remote(frames)))
        return eid

    def wait_ready(self, timeout: float = 120.0) -> Dict[str, int]:
        """Block until every engine answers a ping; returns engine -> pid."""
        with self.lock:
            refs = {eid: a.ping.remote() for eid, a in self.actors.items()}
        for eid, ref in refs.items():
            self.pids[eid] = self.ray.get(ref, timeout=timeout)["pid"]
            with self.lock:
                self._boot.pop(eid, None)
                self.ready_at[eid] = time.monotonic()
        return dict(self.pids)

    def replace(self, eid: str, reason: str) -> Optional[str]:
        """Kill engine ``eid`` (if still there) and start a fresh one with the current
        weights; returns the new engine's id (None: ``eid`` was already gone)."""
        with self.lock:
            actor = self.actors.pop(eid, None)
            if actor is None:
                return None
            self.links.pop(eid, None)
            bundle = self.bundles.pop(eid)
            self.pids.pop(eid, None)
            self._boot.pop(eid, None)
            self.ready_at.pop(eid, None)
            self.router.remove(eid)
            try:
                self.ray.kill(actor, no_restart=True)
            except Exception:
                pass
            self.restarts += 1
            new = self._start_engine(bundle)     # the same bundle: its resources, its node
        logger.warning(f"engine {eid} replaced by {new} in its bundle {bundle} ({reason}); "
                       f"full weight snapshot v{self.version}")
        return new

    def kill(self, eid: Optional[str] = None) -> str:
        """Kill one engine actor (``ray.kill``), as a crash would; the monitor notices."""
        with self.lock:
            eid = eid or next(iter(self.actors))
            self.ray.kill(self.actors[eid], no_restart=True)
        return eid

    def alive(self) -> List[str]:
        with self.lock:
            return list(self.actors)

    # -- weights ------------------------------------------------------------------------
    def publish(self, model, dtype: torch.dtype):
        """Publish ``model``'s weights to every engine (each its own delta, or a full
        snapshot where one was asked for); returns (version, PublishStats of one engine)."""
        weights = {k: v.detach().to("cpu", dtype, copy=True) if v.is_floating_point()
                   else v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
        self._check_updates()
        stats = None
        with self.lock:
            for eid, link in self.links.items():
                frames, st = link.publish(weights)
                stats = stats or st
                self._updates.append((eid, self.actors[eid].update.remote(frames)))
            self.weights, self.version = weights, self.version + 1
        return self.version, stats

    def _check_updates(self) -> None:
        """Collect finished update results: a refused one makes that engine's next publish
        a full snapshot."""
        with self.lock:
            pending, self._updates = self._updates, []
        if not pending:
            return
        ready, _ = self.ray.wait([r for _, r in pending], num_returns=len(pending), timeout=0)
        ready = set(ready)
        keep = []
        for eid, ref in pending:
            if ref not in ready:
                keep.append((eid, ref))
                continue
            try:
                res = self.ray.get(ref)
            except Exception:
                continue                       # a dead engine: the monitor replaces it
            with self.lock:
                link = self.links.get(eid)
                if link is not None and (res["refused"] or res["full_requested"]):
                    link.transport.report(res["version"], False)
        with self.lock:
            self._updates = keep + self._updates

    # -- health ---------------------------------------------------------------------------
    def check(self) -> List[str]:
        """Ping every engine; returns the ids of those that are dead or did not answer
        within ``ping_timeout`` (not replaced here). An engine still starting (its first
        ping not answered: importing torch takes seconds) has ``start_timeout``."""
        bad, refs = [], {}
        with self.lock:
            for eid, a in self.actors.items():
                if eid in self._boot:
                    t0, ref = self._boot[eid]
                    done, _ = self.ray.wait([ref], timeout=0)
                    if done:
                        try:
                            self.pids[eid] = self.ray.get(ref)["pid"]
                            del self._boot[eid]
                            self.ready_at[eid] = time.monotonic()
                        except Exception:
                            bad.append(eid)
                    elif time.monotonic() - t0 > self.start_timeout:
                        bad.append(eid)
                    continue
                refs[eid] = a.ping.remote()
        for eid, ref in refs.items():
            try:
                info = self.ray.get(ref, timeout=self.ping_timeout)
                self.pids[eid] = info["pid"]
            except Exception:
                bad.append(eid)
        self._check_updates()
        return bad

    def shutdown(self) -> None:
        """Kill the engine actors and remove their placement group (idempotent)."""
        with self.lock:
            for eid, actor in self.actors.items():
                self.router.remove(eid)
                try:
                    self.ray.kill(actor, no_restart=True)
                except Exception:
                    pass
            self.actors.clear()
            self.bundles.clear()
            self.placement.remove()


def start_engines(cfg) -> "EngineGroup":
    """The run's Ray engine actors, started and answering (logged: where, pids, how long)."""
    t0 = time.perf_counter()
    group = EngineGroup(cfg, cfg.engines, address=cfg.ray_address, seed=cfg.seed)
    try:
        pids = group.wait_ready()
    except BaseException:
        group.shutdown()
        raise
    where = f"Ray cluster at {cfg.ray_address}" if cfg.ray_address else "a local Ray instance"
    logger.info(f"rollout: {len(pids)} engine actors on {where} (pids "
                f"{', '.join(str(p) for p in pids.values())}; node "
                f"{group.ray.get_runtime_context().get_node_id()}), ready in "
                f"{time.perf_counter() - t0:.1f} s")
    return group
