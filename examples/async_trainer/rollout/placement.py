"""Placement of the rollout engines: one Ray placement-group bundle per engine.

As slime places its rollout engines (``slime/ray/placement_group.py``, ``slime/ray/rollout.py``):
the resources of every engine are reserved up front as one bundle of a placement group,
the group is waited for before any engine starts, and each engine actor is scheduled into
its own bundle (``PlacementGroupSchedulingStrategy(placement_group_bundle_index=i)``,
child tasks captured). An engine that is replaced goes back into the bundle of the engine it
replaces, so a replacement lands on the same node and can never be starved by another job.
Unlike slime (which waits without bound, for autoscaling clusters), the wait here is bounded:
:class:`EnginePlacement` raises :class:`PlacementError`, naming what was asked and what the
cluster has, at once when the alive nodes can never hold the bundles and after ``timeout``
seconds when they could but the resources are held by others.

* bundle: ``{"CPU": cpus}``, plus ``{"GPU": gpus}`` when the engines ask for GPUs; the
  engine actor asks for exactly its bundle.
* strategy: Ray's ``PACK`` (default: as few nodes as possible), ``SPREAD`` (over as many
  nodes as possible, best effort), ``STRICT_PACK`` (one node), ``STRICT_SPREAD`` (one node
  per bundle).

Ray is passed in (``ray``), never imported here at module import time.
"""
import math
import time
from typing import Dict, List, Optional

from .supervisor import RolloutError

STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")


class PlacementError(RolloutError):
    """The cluster cannot hold the engines' bundles (the message says what was asked and what
    the cluster has). A ``RolloutError``: the CLI logs it and exits 1, no traceback."""


def engine_bundle(cpus: float, gpus: float = 0.0) -> Dict[str, float]:
    """The resources one engine reserves."""
    if cpus <= 0 and gpus <= 0:
        raise ValueError(f"an engine bundle needs CPUs or GPUs, got cpus={cpus}, gpus={gpus}")
    bundle = {"CPU": float(cpus)} if cpus > 0 else {}
    if gpus > 0:
        bundle["GPU"] = float(gpus)
    return bundle


def copies_that_fit(bundle: Dict[str, float], resources: Dict[str, float]) -> int:
    """How many copies of ``bundle`` one node with ``resources`` holds."""
    n = math.inf
    for name, amount in bundle.items():
        if amount > 0:
            n = min(n, math.floor(resources.get(name, 0.0) / amount + 1e-9))
    return 0 if n == math.inf else int(n)


def why_never(bundle: Dict[str, float], n: int, strategy: str,
              nodes: Dict[str, Dict[str, float]]) -> Optional[str]:
    """Why ``n`` copies of ``bundle`` can never be placed with ``strategy`` on ``nodes``
    (node id -> total resources), or None when they can (exact: the bundles are equal)."""
    fit = [copies_that_fit(bundle, r) for r in nodes.values()]
    if strategy == "STRICT_PACK":
        return None if max(fit, default=0) >= n else \
            f"no node holds all {n} bundles (at most {max(fit, default=0)} on one node)"
    if strategy == "STRICT_SPREAD":
        hosts = sum(f > 0 for f in fit)
        return None if hosts >= n else \
            f"{n} bundles need {n} nodes that hold one each, there are {hosts}"
    return None if sum(fit) >= n else \
        f"the nodes hold {sum(fit)} of the {n} bundles at most"


def _fmt(res: Dict[str, float]) -> str:
    return "{" + ", ".join(f"{k}: {res.get(k, 0.0):g}" for k in ("CPU", "GPU")) + "}"


def _nodes(ray) -> Dict[str, Dict[str, float]]:
    return {n["NodeID"]: dict(n.get("Resources", {})) for n in ray.nodes() if n.get("Alive")}


class EnginePlacement:
    """A placement group of ``n`` equal engine bundles, created and ready (or an error).

    ``options(i)`` are the ``.options()`` of the actor that goes into bundle ``i``;
    ``nodes()`` maps each bundle to the node Ray put it on; ``remove()`` releases the group.
    """

    def __init__(self, ray, n: int, *, cpus: float = 1.0, gpus: float = 0.0,
                 strategy: str = "PACK", timeout: float = 60.0, name: str = ""):
        if strategy not in STRATEGIES:
            raise ValueError(f"placement strategy must be one of {STRATEGIES}, got {strategy!r}")
        if n < 1:
            raise ValueError(f"a placement group needs >= 1 bundle, got {n}")
        self.ray, self.n, self.strategy = ray, n, strategy
        self.bundle = engine_bundle(cpus, gpus)
        self.pg = None
        nodes = _nodes(ray)
        asked = f"{n} engine bundle{'s' * (n > 1)} of {_fmt(self.bundle)} ({strategy})"
        reason = why_never(self.bundle, n, strategy, nodes)
        if reason is not None:
            raise PlacementError(f"cannot place {asked} on this Ray cluster: {reason}; "
                                 f"{self._cluster(nodes)} (lower --engine-cpus or --engines, "
                                 f"or add nodes)")
        from ray.util.placement_group import placement_group
        t0 = time.monotonic()
        self.pg = placement_group([dict(self.bundle) for _ in range(n)], strategy=strategy,
                                  name=name)
        ready, _ = ray.wait([self.pg.ready()], timeout=timeout)
        if not ready:
            self.remove()
            raise PlacementError(f"{asked} not placed within {timeout:g} s (--placement-timeout):"
                                 f" the cluster could hold them, but its resources are taken; "
                                 f"{self._cluster(_nodes(ray))}")
        self.ready_s = time.monotonic() - t0

    def _cluster(self, nodes: Dict[str, Dict[str, float]]) -> str:
        try:
            free = self.ray.available_resources()
        except Exception:                       # the answer is about the cluster, not this
            free = {}
        per_node = "; ".join(f"{nid[:8]}: {_fmt(r)}" for nid, r in nodes.items())
        return (f"the cluster has {len(nodes)} alive node{'s' * (len(nodes) != 1)} "
                f"({per_node}), total {_fmt(self.ray.cluster_resources())}, "
                f"available now {_fmt(free)}")

    def options(self, index: int) -> dict:
        """``.options()`` of the actor for bundle ``index``: its whole bundle, in it."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        if not 0 <= index < self.n:
            raise IndexError(f"bundle {index} of a group of {self.n}")
        return {"num_cpus": self.bundle.get("CPU", 0.0), "num_gpus": self.bundle.get("GPU", 0.0),
                "scheduling_strategy": PlacementGroupSchedulingStrategy(
                    placement_group=self.pg, placement_group_bundle_index=index,
                    placement_group_capture_child_tasks=True)}

    def nodes(self) -> List[str]:
        """The node id of every bundle, in bundle order."""
        from ray.util.placement_group import placement_group_table
        where = placement_group_table(self.pg)["bundles_to_node_id"]
        return [where[i] for i in range(self.n)]

    def remove(self) -> None:
        """Release the group (its bundles' resources); idempotent."""
        pg, self.pg = self.pg, None
        if pg is not None:
            from ray.util.placement_group import remove_placement_group
            try:
                remove_placement_group(pg)
            except Exception:                    # Ray already gone: nothing is held
                pass

    def describe(self) -> str:
        return (f"{self.n} bundle{'s' * (self.n > 1)} of {_fmt(self.bundle)}, {self.strategy}, "
                f"on node{'s' * (self.n > 1)} {', '.join(n[:8] for n in self.nodes())}")
