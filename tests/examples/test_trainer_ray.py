"""The example trainer on Ray engine actors: --kill-engine-at (the run finishes, logs the
replacement, accounts for every sample), the engine metrics, the flags' validation, and no
engine process left behind a SIGKILLed trainer. Skipped without ray."""
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("ray")

import examples.async_trainer.__main__ as cli                              # noqa: E402
from examples.async_trainer import trainer                                 # noqa: E402
from examples.async_trainer.config import TrainerConfig                    # noqa: E402
from examples.async_trainer.log import setup_logging                       # noqa: E402
from tests.examples._ray_procs import alive, session_processes              # noqa: E402

pytestmark = [pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc, signals"),
              pytest.mark.xdist_group("ray")]      # see tests/conftest.py
REPO = Path(__file__).resolve().parents[2]
TINY = dict(tasks="reverse", sft_steps=2, rl_steps=12, opd_steps=0, prompts_per_step=2,
            group_size=2, eval_prompts=4, progress=False, rollout_backend="ray")


def test_kill_engine_at_replaces_it_and_every_sample_is_accounted_for(tmp_path, capsys):
    # The tool task: two-turn sessions through the router (enough SFT steps that the policy
    # calls the tool), one engine killed in the RL stage.
    setup_logging()
    cfg = TrainerConfig(**dict(TINY, tasks="tool", sft_steps=20), kill_engine_at=24,
                        health_interval=0.3, out_dir=str(tmp_path))
    out = trainer.train(cfg)
    assert out["exit_code"] == 0
    err = capsys.readouterr().err
    victim = re.search(r"killed engine actor (e\d+) after global step 24", err).group(1)
    (event,) = [r for r in out["records"] if r.get("event") == "engine_restart"]
    assert event["engine"] == victim and event["stage"] == "rl:tool"
    assert f"engine {victim} replaced by {event['replacement']}" in err
    rl = [r for r in out["records"] if r.get("stage") == "rl:tool" and r["kind"] == "train"]
    assert [r["step"] for r in rl] == list(range(1, cfg.rl_steps + 1))     # the run went on
    assert rl[-1]["engine_restarts"] == 1 and rl[0]["engine_restarts"] == 0
    # The event carries exactly the re-queued turns' samples the metrics count.
    assert event["requeued_samples"] == rl[-1]["samples_requeued"]
    assert (event["requeued_requests"] > 0) == (event["requeued_samples"] > 0)
    assert sum(rl[-1]["engine_load"].values()) > 0 and event["replacement"] in rl[-1]["engine_load"]
    # Session affinity: a number (the answer turn found its session's prefix), and a turn
    # moved off the killed engine is not a miss.
    rates = [r["affinity_hit_rate"] for r in rl if r["affinity_hit_rate"] is not None]
    assert rates and min(rates) >= 0.9, rates
    assert all("queue_wait_s" in r and set(r["engine_idle_s"]) for r in rl)
    ids = out["trained_ids"]["rl:tool"]
    acc = out["accounting"]["rl:tool"]
    assert len(ids) == len(set(ids)) == cfg.rl_steps * cfg.prompts_per_step * cfg.group_size
    assert acc["generated"] == acc["trained"] + acc["unconsumed"] + acc["stale"], acc
    assert acc["dropped"] == 0, acc
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert any(r.get("event") == "engine_restart" for r in lines)


@pytest.mark.parametrize("args, field", [
    (["--engines", "0"], "engines"),
    (["--health-interval", "0"], "health_interval"),
    (["--rollout-backend", "threads"], "rollout_backend"),
    (["--kill-engine-at", "3", "--rollout-backend", "process"], "kill_engine_at"),
    (["--kill-engine-at", "-1"], "kill_engine_at"),
    (["--kill-engine-at", "5", "--sft-steps", "10"], "kill_engine_at"),       # an SFT step
    (["--kill-engine-at", "10", "--sft-steps", "4", "--rl-steps", "2", "--opd-steps", "1",
      "--tasks", "reverse"], "kill_engine_at"),                   # past the end of the run
    (["--kill-engine-at", "7", "--sft-steps", "4", "--rl-steps", "2", "--opd-steps", "1",
      "--tasks", "reverse"], "kill_engine_at"),                   # the run's last step
])
def test_engine_flags_are_validated_naming_the_flag(args, field, capsys):
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert f"config.{field}" in err and f"--{field.replace('_', '-')}" in err


def _listening(pids):
    """(address, pid) of every TCP socket the processes ``pids`` listen on, read from /proc
    (what ``ss -ltnp`` shows): IPv4 as ``a.b.c.d:port``, IPv6 as ``[hex]:port``."""
    inodes = {}
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
                if link.startswith("socket:["):
                    inodes[link[8:-1]] = pid
        except OSError:
            pass
    found = []
    for name in ("tcp", "tcp6"):
        with open(f"/proc/net/{name}") as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[3] != "0A" or fields[9] not in inodes:          # 0A: LISTEN
                    continue
                addr, port = fields[1].split(":")
                if name == "tcp":
                    addr = ".".join(str(b) for b in reversed(bytes.fromhex(addr)))
                else:
                    addr = "[" + addr + "]"
                found.append((f"{addr}:{int(port, 16)}", inodes[fields[9]]))
    return found


# 127.0.0.1 and ::ffff:127.0.0.1 as /proc/net/tcp6 prints them (host-order words).
_LOOPBACK = re.compile(r"(127\.0\.0\.1|\[0000000000000000FFFF00000100007F\]|"
                       r"\[00000000000000000000000001000000\]):\d+$")


def _cli_until_step_3(tmp_path):
    """The CLI on Ray in a subprocess, returned once it has logged RL step 3, with its
    engine pids."""
    log = tmp_path / "log.txt"
    args = [sys.executable, "-m", "examples.async_trainer", "--tasks", "reverse",
            "--sft-steps", "1", "--rl-steps", "200", "--opd-steps", "0", "--prompts-per-step",
            "2", "--group-size", "2", "--eval-prompts", "4", "--progress", "false",
            "--rollout-backend", "ray", "--out-dir", str(tmp_path)]
    with open(log, "w") as f:
        proc = subprocess.Popen(args, cwd=REPO, stdout=f, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while not re.search(r"step=3 ", log.read_text()):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(log.read_text()[-3000:])
        time.sleep(0.2)
    found = re.search(r"engine actors on a local Ray instance \(pids ([\d, ]+);",
                      log.read_text())
    return proc, log, [int(p) for p in found.group(1).split(", ")]


def test_sigterm_on_ray_checkpoints_exits_143_and_stops_every_ray_process(tmp_path):
    proc, log, pids = _cli_until_step_3(tmp_path)
    try:
        assert all(alive(p) for p in pids)
        # Ray listens on the loopback interface only: GCS, raylet, driver, engines, agents
        # (an attacker elsewhere on the network reaches none of them).
        ours = set(session_processes(proc.pid)) | {proc.pid} | set(pids)
        sockets = _listening(ours)
        assert len(sockets) >= 4, sockets              # gcs, raylet, driver, engines at least
        assert all(_LOOPBACK.match(a) for a, _ in sockets), sockets
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 143, log.read_text()[-3000:]
    finally:
        proc.kill()
    assert "interrupted (SIGTERM): checkpoint written to" in log.read_text()
    assert (tmp_path / "checkpoint.pt").is_file()
    deadline = time.monotonic() + 30
    while (any(alive(p) for p in pids) or session_processes(proc.pid)) \
            and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(alive(p) for p in pids), "an engine actor outlived its trainer"
    assert session_processes(proc.pid) == [], "a Ray process outlived its trainer"


def test_a_sigkilled_trainer_leaves_no_engine_behind(tmp_path):
    proc, log, pids = _cli_until_step_3(tmp_path)
    try:
        assert all(alive(p) for p in pids)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    deadline = time.monotonic() + 30
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(alive(p) for p in pids), "an engine actor outlived its SIGKILLed trainer"
    # The agents (DashboardAgent, RuntimeEnvAgent) go too: the local instance's watchdog
    # ends them a few seconds after the driver (rollout/engines.py). Never left on the machine.
    while session_processes(proc.pid) and time.monotonic() < deadline + 20:
        time.sleep(0.2)
    left = session_processes(proc.pid)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert left == [], "a Ray process outlived its SIGKILLed trainer by 20 s"


def test_engines_that_keep_failing_stop_the_run_with_exit_1_and_a_checkpoint(tmp_path, capsys):
    setup_logging()
    rc = cli.main(["--tasks", "reverse", "--sft-steps", "2", "--rl-steps", "30",
                   "--opd-steps", "0", "--prompts-per-step", "2", "--group-size", "2",
                   "--eval-prompts", "4", "--progress", "false", "--rollout-backend", "ray",
                   "--kill-engine-at", "3", "--rollout-restarts", "0", "--health-interval",
                   "0.3", "--out-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert rc == 1, err[-3000:]
    assert "1 engine failures in a row" in err and "config.rollout_restarts=0" in err
    assert "failed (RolloutError): checkpoint written to" in err
    from examples.async_trainer.train import checkpoint
    ckpt = checkpoint.load(str(tmp_path / "checkpoint.pt"))
    acc = ckpt["accounting"]["rl:reverse"]
    assert acc["generated"] == acc["trained"] + acc["unconsumed"] + acc["stale"], acc
    assert acc["dropped"] == 0, acc
