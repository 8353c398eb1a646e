"""The rollout engines on a real two-node Ray cluster on this machine, started the way a user
starts one (``ray start --head``, then ``ray start --address`` for the second node), joined
with ``--ray-address``: SPREAD puts the engines' bundles on both nodes and each engine runs on
its bundle's node; a killed engine's replacement goes back into its bundle; a placement the
cluster cannot hold fails fast naming what was asked and what there is; the trainer CLI runs
a short RL stage on the cluster; and stopping the cluster leaves no process of it behind.

The cluster processes do not get this repository's path; the trainer CLI runs from "/", so
its engines import the repository through the runtime_env ``init_ray`` passes. Skipped
without ray."""
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

ray = pytest.importorskip("ray")

import examples.async_trainer.__main__ as cli                              # noqa: E402
from examples.async_trainer.config import TrainerConfig                    # noqa: E402
from examples.async_trainer.rollout.engines import EngineGroup                    # noqa: E402
from examples.async_trainer.rollout.ray_local import init_ray                   # noqa: E402
from examples.async_trainer.rollout.ray_rollout import RayRollout                  # noqa: E402
from examples.async_trainer.log import setup_logging                       # noqa: E402
from examples.async_trainer.rollout.placement import EnginePlacement, PlacementError  # noqa: E402
from tests.examples._ray_procs import alive, take                           # noqa: E402

pytestmark = [pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc, signals"),
              pytest.mark.xdist_group("ray")]      # see tests/conftest.py
REPO = Path(__file__).resolve().parents[2]
RAY_CLI = [sys.executable, "-c", "import sys; from ray.scripts.scripts import main; "
                                 "sys.argv[0] = 'ray'; main()"]
NODE = ["--block", "--num-cpus", "2", "--num-gpus", "0", "--node-ip-address", "127.0.0.1",
        "--disable-usage-stats"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cluster_processes(temp_dir: str):
    """Live pids of the cluster in ``temp_dir``: its path in their command line (gcs, raylet,
    the ``ray start`` processes) or an open file under it (the agents, which rename
    themselves ``ray::DashboardAgent``; workers)."""
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                hit = temp_dir.encode() in f.read()
            fd_dir = f"/proc/{name}/fd"
            hit = hit or any(os.readlink(f"{fd_dir}/{fd}").startswith(temp_dir)
                             for fd in os.listdir(fd_dir))
        except OSError:
            continue
        if hit and alive(int(name)):
            out.append(int(name))
    return out


def _stop(cluster) -> None:
    if ray.is_initialized():
        ray.shutdown()
    for proc in (cluster.worker, cluster.head):       # `ray start --block` stops its node
        if proc.poll() is None:                       # on SIGTERM
            proc.send_signal(signal.SIGTERM)
    for proc in (cluster.worker, cluster.head):
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.fixture(scope="module")
def cluster():
    if ray.is_initialized():                          # an earlier module's local instance
        ray.shutdown()
    temp_dir = tempfile.mkdtemp(prefix="rc", dir="/tmp")   # short: Ray's socket paths
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "RAY_ADDRESS")}
    # Ray's token auth: the cluster's mode must be this process's. A fresh process joining by
    # address has it off; an earlier local ray.init() here switched it on (RAY_AUTH_MODE=token
    # in os.environ, the token in ~/.ray/auth_token): then the cluster uses that token.
    env["RAY_AUTH_MODE"] = os.environ.get("RAY_AUTH_MODE") or "disabled"
    logs = [open(os.path.join(temp_dir, f"{n}.log"), "w") for n in ("head", "worker")]
    t0 = time.monotonic()
    # Every fixed port a node would take by default (6379, 8265, 52365; 10001 with
    # ray[client]) picked free: other Ray instances may run on this machine.
    from ray._private.utils import get_ray_client_dependency_error
    client = [] if get_ray_client_dependency_error() is not None else \
        ["--ray-client-server-port", str(_free_port())]
    head = subprocess.Popen(RAY_CLI + ["start", "--head", "--port", str(port), "--temp-dir",
                                       temp_dir, "--include-dashboard", "false",
                                       "--dashboard-port", str(_free_port()),
                                       "--dashboard-agent-listen-port", str(_free_port())]
                            + client + NODE,
                            cwd="/", env=env, stdout=logs[0], stderr=subprocess.STDOUT,
                            start_new_session=True)
    worker = subprocess.Popen(RAY_CLI + ["start", "--address", f"127.0.0.1:{port}",
                                         "--dashboard-agent-listen-port", str(_free_port())]
                              + NODE,
                              cwd="/", env=env, stdout=logs[1], stderr=subprocess.STDOUT,
                              start_new_session=True)
    c = SimpleNamespace(address=f"127.0.0.1:{port}", temp_dir=temp_dir, head=head,
                        worker=worker, stopped=False)
    try:
        wait = subprocess.run(
            [sys.executable, "-c", "import sys, time, ray; ray.init(address=sys.argv[1], "
             "logging_level='WARNING'); t = time.monotonic() + 90\n"
             "while sum(n['Alive'] for n in ray.nodes()) < 2 and time.monotonic() < t: "
             "time.sleep(0.2)\nsys.exit(sum(n['Alive'] for n in ray.nodes()) < 2)", c.address],
            cwd="/", env=env, capture_output=True, text=True, timeout=120)
        assert wait.returncode == 0, "the two-node cluster did not come up: " + \
            wait.stderr[-2000:] + "".join(open(f.name).read()[-2000:] for f in logs)
        init_ray(c.address)
        c.start_s = time.monotonic() - t0
        c.node_ids = sorted(n["NodeID"] for n in ray.nodes() if n["Alive"])
        yield c
    finally:
        _stop(c)
        for pid in _cluster_processes(temp_dir):      # never left on the machine
            os.kill(pid, signal.SIGKILL)
        for f in logs:
            f.close()
        shutil.rmtree(temp_dir, ignore_errors=True)


def _placement_states():
    from ray.util.placement_group import placement_group_table
    return sorted(v["state"] for v in placement_group_table().values())


def test_spread_places_engines_on_both_nodes_and_a_replacement_in_its_bundle(cluster):
    cfg = TrainerConfig(progress=False, placement_strategy="SPREAD", engine_cpus=1.0,
                        ray_address=cluster.address).validate()
    group = EngineGroup(cfg, 2, address=cluster.address, ping_timeout=2.0)
    try:
        pids = group.wait_ready()
        nodes = group.placement.nodes()
        assert sorted(nodes) == cluster.node_ids                 # one bundle on each node
        for eid, actor in group.actors.items():                  # each engine in its bundle
            assert ray.get(actor.ping.remote(), timeout=30)["node"] == nodes[group.bundles[eid]]
        # Each engine holds its bundle's CPU: the cluster has 2 of its 4 left.
        deadline = time.monotonic() + 20                        # (reported with a delay)
        while ray.available_resources().get("CPU", 0) != pytest.approx(2.0):
            assert time.monotonic() < deadline, ray.available_resources()
            time.sleep(0.2)

        import torch
        from examples.async_trainer.model import policy
        torch.manual_seed(0)
        model = policy.new_policy(cfg)                           # GLM-5's architecture
        rollout = RayRollout(group, cfg, "c1", 1, {"reverse": 1.0}, 4, 10_000,
                             health_interval=0.3)
        rollout.start(None, model)
        taken = take(rollout, 16)
        victim = "e0"
        bundle = group.bundles[victim]
        group.kill(victim)                                       # as a crash would
        deadline = time.monotonic() + 60
        while victim in group.alive():
            assert time.monotonic() < deadline, "the killed engine was not replaced"
            s = rollout.get(0.1)
            if s is not None:
                taken.append(s)
        (new,) = set(group.alive()) - {"e1"}
        assert group.bundles[new] == bundle                      # back into its bundle ...
        info = ray.get(group.actors[new].ping.remote(), timeout=60)
        assert info["node"] == nodes[bundle]                     # ... on that bundle's node
        while not any(s["engine"] == new for s in taken):       # and it serves
            assert time.monotonic() < deadline, "the replacement never served"
            taken += take(rollout, 8)
        acc = rollout.shutdown()
        assert acc["generated"] == len(taken) + acc["unconsumed"] and acc["dropped"] == 0
        assert len({s["sample_id"] for s in taken}) == len(taken)
        pids = list(pids.values()) + [info["pid"]]
    finally:
        group.shutdown()
    assert _placement_states() == ["REMOVED"]                    # the group is released
    deadline = time.monotonic() + 30
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(alive(p) for p in pids), "an engine outlived its group's shutdown"


def test_a_placement_the_cluster_cannot_hold_fails_fast_naming_the_resources(cluster, capsys):
    # Never: 2 engines of 3 CPUs on two nodes of 2 CPUs. At once, no group left pending.
    t0 = time.monotonic()
    cfg = TrainerConfig(progress=False, engine_cpus=3.0, ray_address=cluster.address)
    with pytest.raises(PlacementError) as err:
        EngineGroup(cfg, 2, address=cluster.address)
    assert time.monotonic() - t0 < 5
    text = str(err.value)
    assert "cannot place 2 engine bundles of {CPU: 3, GPU: 0} (PACK)" in text
    assert "2 alive nodes" in text and "total {CPU: 4, GPU: 0}" in text
    with pytest.raises(PlacementError, match="3 bundles need 3 nodes that hold one each, "
                                             "there are 2"):
        EngineGroup(TrainerConfig(progress=False, placement_strategy="STRICT_SPREAD"), 3,
                    address=cluster.address)
    # The CLI: exit 1 with the message, before any training.
    setup_logging()
    capsys.readouterr()
    assert cli.main(["--ray-address", cluster.address, "--engine-cpus", "3",
                     "--rollout-backend", "ray", "--progress", "false",
                     "--out-dir", os.path.join(cluster.temp_dir, "cli")]) == 1
    assert "cannot place 2 engine bundles of {CPU: 3" in capsys.readouterr().err
    # Possible but taken: another group holds every CPU. Fails after the timeout, naming
    # what is available, and removes its pending group.
    holder = EnginePlacement(ray, 2, cpus=2.0, strategy="STRICT_SPREAD")
    try:
        t0 = time.monotonic()
        cfg = TrainerConfig(progress=False, placement_timeout=1.5)
        with pytest.raises(PlacementError) as err:
            EngineGroup(cfg, 2, address=cluster.address)
        assert 1.5 <= time.monotonic() - t0 < 10
        assert "not placed within 1.5 s (--placement-timeout)" in str(err.value)
        assert "available now {CPU: 0, GPU: 0}" in str(err.value)
    finally:
        holder.remove()
    assert set(_placement_states()) == {"REMOVED"}


def test_the_trainer_joins_the_cluster_with_ray_address(cluster, tmp_path):
    # Run from "/" with the repository on PYTHONPATH: Ray puts the driver's working
    # directory on its workers' sys.path, so here the engines find the repository only
    # through the runtime_env init_ray passes.
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = str(REPO)
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "examples.async_trainer", "--tasks", "reverse", "--sft-steps",
         "2", "--rl-steps", "8", "--opd-steps", "0", "--prompts-per-step", "2", "--group-size",
         "2", "--eval-prompts", "4", "--progress", "false", "--rollout-backend", "ray",
         "--ray-address", cluster.address, "--placement-strategy", "SPREAD",
         "--kill-engine-at", "4", "--health-interval", "0.3", "--out-dir", str(tmp_path)],
        cwd="/", env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        timeout=180)
    log = proc.stdout
    assert proc.returncode == 0, log[-3000:]
    placed = re.search(r"placement group of 2 bundles of \{CPU: 1, GPU: 0\}, SPREAD, on nodes "
                       r"(\w+), (\w+)", log)
    assert placed and placed.group(1) != placed.group(2), log[-3000:]
    assert {placed.group(1), placed.group(2)} == {n[:8] for n in cluster.node_ids}
    assert f"engine actors on Ray cluster at {cluster.address}" in log
    assert re.search(r"engine e[01] replaced by e2 in its bundle [01] ", log), log[-3000:]
    pids = [int(p) for p in re.search(r"\(pids ([\d, ]+);", log).group(1).split(", ")]
    deadline = time.monotonic() + 30
    while (any(alive(p) for p in pids) or "CREATED" in _placement_states()) \
            and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(alive(p) for p in pids), "an engine outlived the trainer"
    assert "CREATED" not in _placement_states(), "the trainer left its placement group"
    print(f"trainer on the cluster: {time.monotonic() - t0:.1f} s")


def test_stopping_the_cluster_leaves_no_process(cluster):
    print(f"two-node cluster up in {cluster.start_s:.1f} s")
    assert _cluster_processes(cluster.temp_dir)              # the check sees the cluster
    _stop(cluster)
    deadline = time.monotonic() + 30
    while _cluster_processes(cluster.temp_dir) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _cluster_processes(cluster.temp_dir) == [], "a process of the cluster outlived it"
