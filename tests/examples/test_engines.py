"""Rollout engines as Ray actors: samples from every engine, weight versions, and the health
monitor replacing a killed, a hung and a stopped engine with every sample accounted for.
One local Ray instance for the module (a few seconds on 2 cores); skipped without ray."""
import os
import signal
import time

import pytest
import torch

ray = pytest.importorskip("ray")

from examples.async_trainer import task                                    # noqa: E402
from examples.async_trainer.config import TrainerConfig                    # noqa: E402
from examples.async_trainer.engines import EngineGroup                     # noqa: E402
from examples.async_trainer.ray_rollout import RayRollout                  # noqa: E402
from examples.async_trainer.model import TinyLM                            # noqa: E402
from tests.examples._ray_procs import session_processes, take                # noqa: E402

pytestmark = pytest.mark.skipif(os.name != "posix", reason="POSIX signals")


@pytest.fixture(scope="module")
def cfg():
    return TrainerConfig(progress=False).validate()


@pytest.fixture(scope="module")
def group(cfg):
    g = EngineGroup(cfg, 2, ping_timeout=1.0)
    g.wait_ready()
    yield g
    g.shutdown()
    ray.shutdown()


def _model(cfg, seed=0):
    torch.manual_seed(seed)
    return TinyLM(cfg, task.vocab_size(cfg))


def _accounted(rollout, taken):
    acc = rollout.shutdown()
    ids = [s["sample_id"] for s in taken]
    assert len(ids) == len(set(ids))                                   # none twice
    assert acc["generated"] == len(taken) + acc["unconsumed"] and acc["dropped"] == 0, acc
    return acc


def test_engines_generate_with_the_published_weights(cfg, group):
    model = _model(cfg)
    rollout = RayRollout(group, cfg, "t1", 1, {"reverse": 1.0, "tool": 0.0}, 4, 32,
                         health_interval=0.5)
    rollout.start(None, model)
    first = take(rollout, 32)
    v1 = group.version
    assert {s["version"] for s in first} == {v1}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01)
    version, stats = rollout.send(model)                      # a delta to every engine
    assert version == v1 + 1 and not stats.full and stats.changed > 0
    later = take(rollout, 96)
    assert later[-1]["version"] == version                    # the new weights reach the engines
    assert {s["engine"] for s in first + later} == set(group.alive())   # both serve
    assert all(len(s["rollout_logprobs"]) == len(s["loss_mask"]) for s in later)
    # Groups stay whole: G samples per prompt id, one prompt per Data Buffer key.
    per_prompt = {}
    for s in first + later:
        per_prompt.setdefault(s["prompt_id"], []).append(s)
    assert all(len(g) == 4 for g in per_prompt.values())
    _accounted(rollout, first + later)
    infos = [ray.get(group.actors[e].ping.remote()) for e in group.alive()]
    assert {i["version"] for i in infos} == {group.version}


def _replaced(group, rollout, taken, before, timeout=30.0):
    """Keep training-side consumption going (requests keep reaching every engine) until the
    monitor has replaced one engine; returns the replacement's id."""
    deadline = time.monotonic() + timeout
    while set(group.alive()) == set(before):
        assert time.monotonic() < deadline, "the engine was not replaced"
        s = rollout.get(0.1)
        if s is not None:
            taken.append(s)
    return set(group.alive()) - set(before)


@pytest.mark.parametrize("failure", ["ray.kill", "hung request", "SIGSTOP"])
def test_a_failed_engine_is_replaced_and_its_samples_requeued(cfg, group, failure):
    model = _model(cfg, 1)
    restarts = group.restarts
    rollout = RayRollout(group, cfg, f"t-{failure}", 2, {"reverse": 1.0}, 4, 64,
                         health_interval=0.3, request_timeout=2.0)
    rollout.start(None, model)
    taken = take(rollout, 16)
    before = group.alive()
    victim = before[0]
    if failure == "ray.kill":
        group.kill(victim)
    elif failure == "hung request":
        group.actors[victim].hang.remote(30.0)                 # its request lane blocks
    else:
        os.kill(group.pids[victim], signal.SIGSTOP)            # the whole process hangs
    (new,) = _replaced(group, rollout, taken, before)
    assert victim not in group.alive() and group.restarts == restarts + 1
    deadline = time.monotonic() + 30
    while not any(s["engine"] == new for s in taken):         # the replacement serves
        assert time.monotonic() < deadline, "the replacement never served"
        taken += take(rollout, 32)
    info = ray.get(group.actors[new].ping.remote(), timeout=10)
    assert info["version"] == group.version                   # from a full snapshot
    (event,) = rollout.events
    assert event["engine"] == victim and event["replacement"] == new
    assert rollout.stats()["engine_restarts"] == group.restarts
    _accounted(rollout, taken)


_DRIVER = """
import sys, time
from examples.async_trainer.config import TrainerConfig
from examples.async_trainer.engines import EngineGroup
group = EngineGroup(TrainerConfig(progress=False), 1)
print("ready", group.wait_ready(), flush=True)
time.sleep(120)
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="Linux /proc")
def test_a_sigkilled_driver_leaves_no_ray_process_of_its_local_instance():
    # Without the watchdog, Ray's DashboardAgent and RuntimeEnvAgent outlive a SIGKILLed
    # driver by 60 s (blocked publishing the raylet's death to the dead GCS).
    import subprocess
    import sys
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.Popen([sys.executable, "-c", _DRIVER], cwd=repo, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("ready"), line
        assert len(session_processes(proc.pid)) >= 4       # gcs, raylet, 2 agents, engine
    finally:
        proc.kill()
        proc.wait()
    deadline = time.monotonic() + 20
    while session_processes(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = session_processes(proc.pid)
    for pid in left:                                          # never left on the machine
        os.kill(pid, signal.SIGKILL)
    assert left == [], "a process of the SIGKILLed driver's Ray instance outlived it by 20 s"
