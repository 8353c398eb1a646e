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

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc, signals")
REPO = Path(__file__).resolve().parents[2]
TINY = dict(tasks="reverse", sft_steps=2, rl_steps=12, opd_steps=0, prompts_per_step=2,
            group_size=2, eval_prompts=4, progress=False, rollout_backend="ray")


def test_kill_engine_at_replaces_it_and_every_sample_is_accounted_for(tmp_path, capsys):
    setup_logging()
    cfg = TrainerConfig(**TINY, kill_engine_at=4, health_interval=0.3, out_dir=str(tmp_path))
    out = trainer.train(cfg)
    assert out["exit_code"] == 0
    err = capsys.readouterr().err
    victim = re.search(r"killed engine actor (e\d+) after global step 4", err).group(1)
    (event,) = [r for r in out["records"] if r.get("event") == "engine_restart"]
    assert event["engine"] == victim and event["stage"] == "rl:reverse"
    assert f"engine {victim} replaced by {event['replacement']}" in err
    rl = [r for r in out["records"] if r.get("stage") == "rl:reverse" and r["kind"] == "train"]
    assert [r["step"] for r in rl] == list(range(1, cfg.rl_steps + 1))     # the run went on
    assert rl[-1]["engine_restarts"] == 1 and rl[0]["engine_restarts"] == 0
    assert rl[-1]["samples_requeued"] >= 0 and event["requeued_requests"] >= 0
    assert sum(rl[-1]["engine_load"].values()) > 0 and event["replacement"] in rl[-1]["engine_load"]
    ids = out["trained_ids"]["rl:reverse"]
    acc = out["accounting"]["rl:reverse"]
    assert len(ids) == len(set(ids)) == cfg.rl_steps * cfg.prompts_per_step * cfg.group_size
    assert acc["generated"] == acc["trained"] + acc["unconsumed"] and acc["dropped"] == 0, acc
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert any(r.get("event") == "engine_restart" for r in lines)


@pytest.mark.parametrize("args, field", [
    (["--engines", "0"], "engines"),
    (["--health-interval", "0"], "health_interval"),
    (["--rollout-backend", "threads"], "rollout_backend"),
    (["--kill-engine-at", "3", "--rollout-backend", "process"], "kill_engine_at"),
    (["--kill-engine-at", "-1"], "kill_engine_at"),
])
def test_engine_flags_are_validated_naming_the_flag(args, field, capsys):
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert f"config.{field}" in err and f"--{field.replace('_', '-')}" in err


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
    # ends them a few seconds after the driver (engines.py). Never left on the machine.
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
    from examples.async_trainer import checkpoint
    ckpt = checkpoint.load(str(tmp_path / "checkpoint.pt"))
    acc = ckpt["accounting"]["rl:reverse"]
    assert acc["generated"] == acc["trained"] + acc["unconsumed"] and acc["dropped"] == 0, acc
