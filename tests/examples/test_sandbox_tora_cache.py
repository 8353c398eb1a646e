"""``ToraEnv`` (the ToRA task's sandbox front) never raises for what a program does and never
caches a failed, limited or errored run as the program's answer (issue 32: a run that failed
because a concurrent run held the shared process limit was cached for the rest of training)."""
import sys

import pytest

from examples.async_trainer.env import tora_task
from examples.async_trainer.env.sandbox import SandboxResult, SandboxUnavailable
from examples.async_trainer.env.tora_task import ToraEnv

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="sandbox: Linux")


def _result(status="exit", exit_code=0, output="42\n", **kw):
    fields = dict(output=output, exit_code=exit_code, timed_out=status == "timeout",
                  killed_by=None, truncated=False, duration_s=0.1, isolation=("rootns",),
                  runner_pid=1, status=status)
    fields.update(kw)
    return SandboxResult(**fields)


def test_only_clean_runs_are_cached(monkeypatch):
    outcomes = {
        "ok": _result(),
        "exit": _result(exit_code=200, output=""),
        "timeout": _result(status="timeout", exit_code=None, output=""),
        "limit": _result(status="limit", exit_code=None, killed_by="SIGKILL", limit="memory"),
        "signal": _result(status="signal", exit_code=None, killed_by="SIGTERM"),
        "error": _result(status="error", exit_code=None, sandbox_error="runner failed"),
        "cleanup": _result(sandbox_error="the run's directory could not be removed"),
        "raises": RuntimeError("a sandbox bug"),
    }
    calls = []

    def fake(code, **kwargs):
        calls.append(code)
        out = outcomes[code]
        if isinstance(out, Exception):
            raise out
        return out

    monkeypatch.setattr(tora_task, "run_python", fake)
    env = ToraEnv(workers=1)
    programs = list(outcomes)
    first = env.run_many(programs)                          # never raises
    assert first[programs.index("raises")] == "SandboxError: RuntimeError"
    assert first[programs.index("error")].endswith("SandboxError: the tool could not run")
    assert first[programs.index("timeout")] == "TimeoutError: wall-clock limit exceeded"
    assert env.errors == len(programs) - 1
    assert list(env.cache) == ["ok"]                        # the only answer kept
    env.run_many(programs)
    assert sorted(calls[len(programs):]) == sorted(set(programs) - {"ok"})   # run again


def test_unavailable_isolation_is_still_an_error_of_the_machine(monkeypatch):
    def fake(code, **kwargs):
        raise SandboxUnavailable("no isolation")
    monkeypatch.setattr(tora_task, "run_python", fake)
    with pytest.raises(SandboxUnavailable):
        ToraEnv().run("print(1)")


def test_real_failures_become_observations_and_are_not_cached():
    env = ToraEnv(timeout_s=2.0)
    try:
        texts = env.run_many(["import sys\nsys.exit(200)", "raise SystemExit(-1)",
                              "import os\nos._exit(137)", "print(6*7)"])
    except SandboxUnavailable as e:
        pytest.skip(str(e))
    assert texts == ["", "", "", "42"]
    assert list(env.cache) == ["print(6*7)"] and env.errors == 3
