"""The example trainer's recovery: weights-only checkpoints (a crafted pickle is refused),
periodic checkpoints, a step and its bookkeeping as one unit under SIGINT, rollout process
deaths (restart, then a non-zero exit with a checkpoint), exit statuses 130 / 143, rollout
processes stopped on every exit, and a log that claims only files that exist.

The signal tests run the real CLI in a subprocess; the rest call ``train`` in-process with
tiny stages (each test is a few seconds on 2 cores)."""
import functools
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

import examples.async_trainer.__main__ as cli
from examples.async_trainer import trainer
from examples.async_trainer.train import checkpoint, recipe
from examples.async_trainer.config import TrainerConfig
from examples.async_trainer.log import setup_logging

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals and /proc")
REPO = Path(__file__).resolve().parents[2]
TINY = dict(tasks="reverse", sft_steps=2, rl_steps=4, opd_steps=0, prompts_per_step=2,
            group_size=2, eval_prompts=4, progress=False, rollout_backend="process")
TINY_ARGS = ["--tasks", "reverse", "--sft-steps", "1", "--opd-steps", "0",
             "--prompts-per-step", "2", "--group-size", "2", "--eval-prompts", "4",
             "--progress", "false", "--rollout-backend", "process"]


@pytest.fixture(autouse=True)
def _log_to_stderr():
    setup_logging()          # the example's logger writes to stderr, as under the CLI


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:                                    # a zombie nobody reaped yet is gone, too
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


def _wait_gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while _alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _check_accounting(acc, trained_ids, n_trained, dropped_ok=False):
    assert len(trained_ids) == len(set(trained_ids)) == n_trained      # none trained twice
    assert acc["trained"] == n_trained
    assert acc["generated"] == acc["trained"] + acc["unconsumed"] + acc["stale"] + acc["dropped"], acc
    assert dropped_ok or acc["dropped"] == 0, acc                       # none lost


def _adam_steps(ckpt):
    steps = {int(s["step"]) for s in ckpt["optimizer"]["state"].values() if "step" in s}
    assert steps, "no AdamW state in the checkpoint"
    return steps


def _claimed_outputs(log: str, out_dir: Path):
    """The files the final log line claims; each must exist."""
    (line,) = re.findall(r"outputs in .*?: (.*)", log)
    names = [n.strip() for n in line.split(",")]
    for name in names:
        assert (out_dir / name).is_file(), (name, log[-2000:])
    return names


# --- checkpoints hold only tensors and plain data --------------------------------------------

class _RunsCode:
    def __init__(self, canary):
        self.canary = str(canary)

    def __reduce__(self):          # unpickling this calls open(canary, "w"): a file appears
        return (open, (self.canary, "w"))


def test_a_crafted_pickle_checkpoint_is_refused_and_runs_nothing(tmp_path, capsys):
    control, evil = tmp_path / "control.pt", tmp_path / "evil.pt"
    torch.save({"format": checkpoint.FORMAT, "x": _RunsCode(tmp_path / "ran-control")}, control)
    torch.save({"format": checkpoint.FORMAT, "config": {}, "x": _RunsCode(tmp_path / "ran")}, evil)
    torch.load(control, weights_only=False)          # the payload is live when unpickled ...
    assert (tmp_path / "ran-control").exists()
    with pytest.raises(checkpoint.CheckpointError, match=r"config\.resume.*weights_only=True"):
        trainer.train(TrainerConfig(resume=str(evil), out_dir=str(tmp_path / "out")))
    assert cli.main(["--resume", str(evil), "--out-dir", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "config.resume" in err and "--resume" in err
    assert not (tmp_path / "ran").exists()           # ... and the trainer never unpickled it
    # Not a checkpoint at all, or one without this trainer's layout: refused, naming the flag.
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    torch.save({"format": checkpoint.FORMAT, "config": {}}, tmp_path / "partial.pt")
    for name, match in (("junk.pt", "weights_only"), ("partial.pt", "'records'"),
                        ("missing.pt", "no checkpoint")):
        with pytest.raises(checkpoint.CheckpointError, match=match):
            checkpoint.load(str(tmp_path / name))
    # Saving refuses anything but tensors and plain data, and leaves no file behind.
    with pytest.raises(TypeError, match=r"checkpoint\['x'\]\[0\] is a object"):
        checkpoint.save(str(tmp_path / "c.pt"), {"x": [object()]})
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("c.pt")) == []


def test_checkpoint_flags_are_validated_naming_the_flag(capsys):
    for flag in ("--checkpoint-every", "--rollout-restarts"):
        assert cli.main([flag, "-1"]) == 2
        err = capsys.readouterr().err
        assert f"config.{flag[2:].replace('-', '_')} must be >= 0" in err and flag in err, err


# --- SIGINT inside an optimizer step; a second one 50 ms later -------------------------------

def test_sigint_inside_a_step_lands_after_it_and_a_second_one_loses_nothing(
        tmp_path, monkeypatch, capsys):
    cfg = TrainerConfig(**TINY, checkpoint_every=0, out_dir=str(tmp_path))
    real_step, calls = recipe.policy_step, []
    second = threading.Timer(0.05, os.kill, (os.getpid(), signal.SIGINT))

    def step_then_sigint(*args, **kwargs):
        out = real_step(*args, **kwargs)             # the optimizer step has been applied ...
        calls.append(1)
        if len(calls) == 2:                          # ... and the step counter not moved yet
            os.kill(os.getpid(), signal.SIGINT)
            second.start()
        return out

    monkeypatch.setattr(recipe, "policy_step", step_then_sigint)
    late = []                                        # the timer may fire after train returns
    previous = signal.signal(signal.SIGINT, lambda *a: late.append(a))
    try:
        out = trainer.train(cfg)
        second.join()
    finally:
        signal.signal(signal.SIGINT, previous)
    assert out["interrupted"] and out["exit_code"] == 130
    assert "interrupted (SIGINT): checkpoint written to" in capsys.readouterr().err
    ckpt = checkpoint.load(str(tmp_path / "checkpoint.pt"))
    assert (ckpt["stage"], ckpt["step"]) == ("rl:reverse", 2) and len(calls) == 2
    assert _adam_steps(ckpt) == {2}                  # 2 optimizer steps, step counter 2
    per_step = cfg.prompts_per_step * cfg.group_size
    _check_accounting(ckpt["accounting"]["rl:reverse"], ckpt["trained"]["rl:reverse"],
                      2 * per_step)
    monkeypatch.setattr(recipe, "policy_step", real_step)
    resumed = trainer.train(TrainerConfig(resume=str(tmp_path / "checkpoint.pt"),
                                          out_dir=str(tmp_path), progress=False))
    assert resumed["exit_code"] == 0
    _check_accounting(resumed["accounting"]["rl:reverse"], resumed["trained_ids"]["rl:reverse"],
                      cfg.rl_steps * per_step)
    assert [r["step"] for r in resumed["records"]
            if r.get("stage") == "rl:reverse" and r["kind"] == "train"] == [1, 2, 3, 4]


# --- periodic checkpoints; rollout deaths ----------------------------------------------------

def test_periodic_checkpoints_a_dead_rollout_is_restarted_and_a_failure_checkpoints(
        tmp_path, capsys):
    cfg = TrainerConfig(**{**TINY, "rl_steps": 8}, checkpoint_every=2, out_dir=str(tmp_path))
    pids, seen = [], []

    def on_step(stage, step):
        if step % 2 == 0:                            # a checkpoint fell due at this step
            ckpt = checkpoint.load(str(tmp_path / "checkpoint.pt"))
            seen.append((ckpt["stage"], ckpt["step"], ckpt["global_step"]))
        if (stage, step) == ("rl:reverse", 2):
            os.kill(pids[-1], signal.SIGKILL)
        if (stage, step) == ("rl:reverse", 5):       # then the trainer itself fails
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        trainer.train(cfg, on_step=on_step, on_rollout=lambda stage, pid: pids.append(pid))
    assert seen == [("sft", 2, 2), ("rl:reverse", 2, 4), ("rl:reverse", 4, 6)]
    assert len(pids) == 2 and not any(_alive(p) for p in pids)     # both stopped
    ckpt = checkpoint.load(str(tmp_path / "checkpoint.pt"))
    assert (ckpt["stage"], ckpt["step"]) == ("rl:reverse", 5)      # written on the way out
    assert _adam_steps(ckpt) == {5}
    (event,) = [r for r in ckpt["records"] if r["kind"] == "event"]
    # Seen dead after step 2, or a step or two later: a killed process is reaped only once all
    # its threads are gone, and the trainer keeps training on the samples already queued.
    died_at = event["step"]
    assert event["event"] == "rollout_restart" and died_at in (2, 3, 4), event
    err = capsys.readouterr().err
    assert (f"rollout process pid {pids[0]} died (exit code -9) at step {died_at}; "
            f"restarting") in err
    assert "failed (RuntimeError): checkpoint written to" in err
    _claimed_outputs(err, tmp_path)
    _check_accounting(ckpt["accounting"]["rl:reverse"], ckpt["trained"]["rl:reverse"],
                      5 * cfg.prompts_per_step * cfg.group_size, dropped_ok=True)
    rl = [r for r in ckpt["records"] if r.get("stage") == "rl:reverse" and r["kind"] == "train"]
    assert [r["step"] for r in rl] == [1, 2, 3, 4, 5]              # the run went on
    # Version numbers go on across the restart; the one skipped is the new full snapshot.
    assert [r["weight_version"] for r in rl] == \
        [v for v in range(2, 8) if v != died_at + 2], (died_at, rl)
    assert all(r["staleness"] >= 0 for r in rl)


def test_a_rollout_that_keeps_dying_exits_1_with_a_checkpoint(tmp_path, monkeypatch, capsys):
    pids = []

    def kill_at_once(stage, pid):
        pids.append(pid)
        os.kill(pid, signal.SIGKILL)

    monkeypatch.setattr(cli, "train", functools.partial(trainer.train, on_rollout=kill_at_once))
    rc = cli.main(TINY_ARGS + ["--rl-steps", "2", "--rollout-restarts", "1",
                               "--out-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert rc == 1, err
    assert "died 2 times in a row" in err and "config.rollout_restarts=1" in err
    assert "failed (RolloutError): checkpoint written to" in err
    assert len(pids) == 2 and not any(_alive(p) for p in pids)
    ckpt = checkpoint.load(str(tmp_path / "checkpoint.pt"))
    assert (ckpt["stage"], ckpt["step"]) == ("rl:reverse", 0) and "sft" in ckpt["finished"]
    acc = ckpt["accounting"]["rl:reverse"]
    assert acc["trained"] == 0 and acc["generated"] == acc["unconsumed"] + acc["stale"] + acc["dropped"]
    _claimed_outputs(err, tmp_path)


def test_ctrl_c_before_any_plot_exits_130_and_claims_no_plot(tmp_path, monkeypatch, capsys):
    def ctrl_c(stage, step):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "train", functools.partial(trainer.train, on_step=ctrl_c))
    assert cli.main(TINY_ARGS + ["--out-dir", str(tmp_path)]) == 130
    err = capsys.readouterr().err
    assert _claimed_outputs(err, tmp_path) == ["metrics.jsonl", "checkpoint.pt"]
    assert not (tmp_path / "metrics.png").exists()
    assert "exit status 130" in err


# --- the real CLI under signals --------------------------------------------------------------

def _start_cli(out_dir: Path, rl_steps: int):
    log = open(out_dir.parent / f"{out_dir.name}.log", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "examples.async_trainer", *TINY_ARGS,
                             "--rl-steps", str(rl_steps), "--checkpoint-every", "0",
                             "--out-dir", str(out_dir)],
                            cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    return proc, log


def _wait_for_rl_step(proc, log, out_dir: Path, timeout: float = 120.0) -> int:
    """Block until the trainer has logged an RL step; returns its rollout process's pid."""
    deadline = time.monotonic() + timeout
    metrics = out_dir / "metrics.jsonl"
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            log.seek(0)
            pytest.fail(f"trainer exited early ({proc.returncode}):\n{log.read()[-3000:]}")
        if metrics.exists() and '"stage": "rl:reverse"' in metrics.read_text():
            log.seek(0)
            return int(re.search(r"rollout process \S+ \(pid (\d+)\)", log.read()).group(1))
        time.sleep(0.05)
    proc.kill()
    pytest.fail("no RL step within the time limit")


@pytest.mark.parametrize("signals", [(signal.SIGTERM,), (signal.SIGINT, signal.SIGINT)],
                         ids=["sigterm", "two-sigints-50ms-apart"])
def test_cli_signal_checkpoints_stops_the_rollout_and_exits_128_plus_n(tmp_path, signals):
    out_dir = tmp_path / "run"
    proc, log = _start_cli(out_dir, rl_steps=200)
    try:
        child = _wait_for_rl_step(proc, log, out_dir)
        for i, sig in enumerate(signals):
            if i:
                time.sleep(0.05)
            proc.send_signal(sig)
        rc = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    log.seek(0)
    text = log.read()
    assert rc == 128 + signals[0], text[-3000:]
    assert not _alive(child), "the rollout process outlived the trainer"
    assert f"interrupted ({signals[0].name}): checkpoint written to" in text
    assert "Traceback" not in text, text[-3000:]
    _claimed_outputs(text, out_dir)
    ckpt = checkpoint.load(str(out_dir / "checkpoint.pt"))
    assert ckpt["stage"] == "rl:reverse" and 1 <= ckpt["step"] < 200
    assert _adam_steps(ckpt) == {ckpt["step"]}
    _check_accounting(ckpt["accounting"]["rl:reverse"], ckpt["trained"]["rl:reverse"],
                      ckpt["step"] * 4)


def test_cli_killed_with_sigkill_leaves_no_rollout_process_behind(tmp_path):
    out_dir = tmp_path / "run"
    proc, log = _start_cli(out_dir, rl_steps=200)
    try:
        child = _wait_for_rl_step(proc, log, out_dir)
    finally:
        proc.kill()                                  # no handler runs: the child notices
        proc.wait(timeout=30)
    assert _wait_gone(child, timeout=15), "the rollout process outlived a SIGKILLed trainer"
