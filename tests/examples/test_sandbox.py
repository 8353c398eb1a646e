"""The ToRA tool sandbox against hostile snippets, run the way an attacker would.

Every escape of issue 24 (point 7) is tried twice: from the test process itself (root in CI:
the ``rootns`` method, snippet as the run's own uid) and from a stand-in trainer process running
as an unprivileged uid (``nobody``: the ``userns`` method, snippet and trainer the same uid;
issue 32's findings are in test_sandbox_contain.py and test_sandbox_cleanup.py). Each
check looks at the host afterwards (the target directory, a listener's accept queue, the
trainer's signal count, the process table), not only at what the snippet printed.

Every snippet is bounded by itself so the machine is never at risk even if the sandbox failed
(checked by running them with isolation off): loops end by the wall timeout (1-3 s), children
sleep 20 s at most (200 at most, for 5 s, in the fork bomb), the allocation is 4 GiB (refused by
RLIMIT_AS long before), writes go to a directory of this test or to uniquely named files that
it removes, the only socket target is a listener of this test on 127.0.0.1, and signals go to
the trainer (which counts them), the snippet's parent and its own group only: never
``kill(-1)``, which without isolation, as root, reaches every process of the machine."""
import functools
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid

import pytest

from examples.async_trainer.env import sandbox
from examples.async_trainer.env.sandbox import (SandboxResult, SandboxUnavailable, _session_members,
                                                run_python)

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="namespaces, seccomp, /proc: Linux")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# The stand-in trainer for the unprivileged runs: counts the signals it gets, runs one snippet
# (TRAINER_PID replaced by its pid) and prints the result as JSON.
_TRAINER = r'''
import json, os, signal, sys, time
got = []
signal.signal(signal.SIGUSR1, lambda *_: got.append(1))
from examples.async_trainer.env.sandbox import SandboxUnavailable, run_python
req = json.loads(sys.stdin.read())
try:
    r = run_python(req["code"].replace("TRAINER_PID", str(os.getpid())), **req["kwargs"])
except SandboxUnavailable as e:
    print(json.dumps({"unavailable": str(e)}))
    sys.exit(0)
time.sleep(0.3)                                        # a late signal still arrives
print(json.dumps({"result": r.__dict__, "signals": len(got), "uid": os.getuid()}))
'''


@functools.lru_cache(None)
def _unprivileged_python():
    """An interpreter uid nobody can run with this checkout importable, or (None, why)."""
    if os.geteuid() != 0:
        return None, "switching to another uid needs root"
    for exe in dict.fromkeys([sys.executable, "/usr/bin/python3"]):
        try:
            p = subprocess.run([exe, "-c", "import examples.async_trainer.env.sandbox"],
                               user=sandbox.NOBODY, group=sandbox.NOBODY, extra_groups=[],
                               cwd=ROOT, env={"PYTHONPATH": ROOT}, capture_output=True,
                               timeout=60)
        except (OSError, subprocess.SubprocessError):
            continue
        if p.returncode == 0:
            return exe, None
    return None, "no interpreter that uid nobody can run imports this checkout"


def _as_caller(code, **kwargs):
    got = []
    old = signal.signal(signal.SIGUSR1, lambda *_: got.append(1))
    try:
        r = run_python(code.replace("TRAINER_PID", str(os.getpid())), **kwargs)
        time.sleep(0.3)
    finally:
        signal.signal(signal.SIGUSR1, old)
    return r, len(got)


def _as_unprivileged(code, refused=False, **kwargs):
    """The result and the signal count; with ``refused``, the SandboxUnavailable message."""
    exe, why = _unprivileged_python()
    if exe is None:
        pytest.skip(why)
    p = subprocess.run([exe, "-c", _TRAINER], input=json.dumps({"code": code, "kwargs": kwargs}),
                       user=sandbox.NOBODY, group=sandbox.NOBODY, extra_groups=[], cwd=ROOT,
                       env={"PYTHONPATH": ROOT}, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    if refused:
        return out.get("unavailable")
    if "unavailable" in out:
        pytest.skip(out["unavailable"])
    assert out["uid"] == sandbox.NOBODY
    res = out["result"]
    res["isolation"] = tuple(res["isolation"])
    return SandboxResult(**res), out["signals"]


@pytest.fixture(params=["caller", "unprivileged"])
def run(request):
    """Runs a snippet from this process (root in CI) or from an unprivileged stand-in trainer;
    returns (result, SIGUSR1 signals the trainer got). Skips where no isolation exists here
    (test_no_isolation_is_refused_unless_unsafe covers that case)."""
    def go(code, **kwargs):
        if request.param == "unprivileged":
            return _as_unprivileged(code, **kwargs)
        try:
            return _as_caller(code, **kwargs)
        except SandboxUnavailable as e:
            pytest.skip(str(e))
    return go


@pytest.fixture
def open_dir():
    """A world-writable (1777) directory outside the sandbox, as /tmp is."""
    d = tempfile.mkdtemp(prefix="sandbox-target-")
    os.chmod(d, 0o1777)
    yield d
    for name in os.listdir(d):
        os.unlink(os.path.join(d, name))
    os.rmdir(d)


def _isolated(r):
    assert {"mountns", "pidns", "netns", "seccomp"} <= set(r.isolation), r


def _gone(sid, timeout=3.0):
    """No live process of session ``sid`` left (a killed child may take a moment to be
    reaped by its new parent)."""
    deadline = time.monotonic() + timeout
    while _session_members(sid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return _session_members(sid) == []


def _named(marker):
    """Pids whose command name (``/proc/<pid>/comm``) is ``marker``."""
    out = []
    for name in os.listdir("/proc"):
        try:
            with open(f"/proc/{name}/comm") as f:
                if f.read().strip() == marker:
                    out.append(int(name))
        except (OSError, ValueError):
            continue
    return out


def _none_named(marker, timeout=3.0):
    """No process named ``marker`` is left (within ``timeout``: the kernel tears a PID
    namespace down asynchronously); any found are killed so the test leaves none."""
    deadline = time.monotonic() + timeout
    while _named(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = _named(marker)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    return left == []


def _marker():
    return "esc" + uuid.uuid4().hex[:10]


# Put before a snippet: name_me() names its process MARKER (PR_SET_NAME; the test replaces
# MARKER) so that the test can look for it in /proc afterwards.
NAME_ME = """
def name_me():
    import ctypes
    ctypes.CDLL(None).prctl(15, b'MARKER')
"""


def test_plain_snippets_run_and_their_errors_become_observations(run):
    r, _ = run("import math, fractions\n"
               "print(sum(math.factorial(i) for i in range(6)), fractions.Fraction(2, 6))")
    _isolated(r)
    assert r.ok and r.observation() == "154 1/3"
    r, _ = run("x = 1 / 0")
    assert r.exit_code == 1 and r.observation() == "ZeroDivisionError: division by zero"
    r, _ = run("import sys; print('a'); sys.exit(3)")
    assert r.exit_code == 3 and r.observation() == "a"
    r, _ = run("open('note.txt', 'w').write('kept'); print(open('note.txt').read())")
    assert r.ok and r.observation() == "kept"                 # its own directory is writable


# Put before each escape snippet: try one way out, print "<name> done" or "<name> <error>".
ATTEMPT = """
def attempt(name, fn):
    try:
        fn()
        print(name, 'done', flush=True)
    except OSError as e:
        print(name, type(e).__name__, flush=True)
"""


def _blocked(r, n):
    """All ``n`` attempts ran and each failed."""
    lines = r.output.splitlines()[:n]
    assert len(lines) == n and not any(line.endswith(" done") for line in lines), r


def test_writes_outside_its_directory_fail_by_path_and_by_dir_fd(run, open_dir):
    rel = open_dir.lstrip("/")
    tag = uuid.uuid4().hex
    elsewhere = [f"/tmp/sandbox-escape-{tag}", f"/dev/shm/sandbox-escape-{tag}"]
    code = ATTEMPT + f"""
import os
attempt('path', lambda: open({open_dir + '/a'!r}, 'w').write('x'))
attempt('dir_fd /', lambda: os.open({rel + '/b'!r}, os.O_CREAT | os.O_WRONLY,
                                    dir_fd=os.open('/', os.O_RDONLY | os.O_DIRECTORY)))
attempt('dir_fd ..', lambda: os.open('c', os.O_CREAT | os.O_WRONLY,
                                     dir_fd=os.open('..', os.O_RDONLY)))
attempt('mkdir dir_fd', lambda: os.mkdir('d', dir_fd=os.open('/', os.O_RDONLY)))
attempt('/tmp', lambda: open({elsewhere[0]!r}, 'w'))
attempt('/dev/shm', lambda: open({elsewhere[1]!r}, 'w'))
attempt('symlink', lambda: os.symlink({open_dir!r}, 'up') or open('up/e', 'w'))
"""
    try:
        r, _ = run(code)
        _isolated(r)
        assert r.ok, r
        _blocked(r, 7)
        assert os.listdir(open_dir) == []                     # nothing landed outside
        assert not any(os.path.exists(p) for p in elsewhere)
    finally:
        for p in elsewhere:
            if os.path.exists(p):
                os.unlink(p)


def test_no_program_runs_not_even_through_posixsubprocess(run):
    """A shell that ran would print RAN-SHELL into the same output (its stdout is ours);
    ``subprocess.Popen`` is ``_posixsubprocess.fork_exec`` underneath."""
    code = ATTEMPT + """
import os, subprocess
sh = ['/bin/sh', '-c', 'echo RAN-SHELL']
print('system', os.system('echo RAN-SHELL'))
attempt('Popen', lambda: subprocess.Popen(sh))
attempt('posix_spawn', lambda: os.posix_spawn(sh[0], sh, {}))
attempt('execv', lambda: os.execv(sh[0], sh))
"""
    r, _ = run(code)
    _isolated(r)
    assert r.ok and "RAN-SHELL" not in r.output, r
    assert r.output.splitlines()[1:] == ["Popen PermissionError", "posix_spawn PermissionError",
                                         "execv PermissionError"], r


def test_no_connection_reaches_a_local_listener(run):
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(8)
        srv.setblocking(False)
        port = srv.getsockname()[1]
        code = ATTEMPT + f"""
import socket
for host in ('127.0.0.1', 'localhost', '::1'):
    attempt(host, lambda: socket.create_connection((host, {port}), timeout=0.5).sendall(b'hi'))
"""
        r, _ = run(code)
        _isolated(r)
        assert r.ok, r
        _blocked(r, 3)
        with pytest.raises(BlockingIOError):
            srv.accept()                                      # nothing ever connected


def test_the_trainer_cannot_be_signalled(run):
    code = ATTEMPT + """
import os, signal
signal.signal(signal.SIGUSR1, signal.SIG_IGN)
attempt('pid', lambda: os.kill(TRAINER_PID, signal.SIGUSR1))
attempt('ppid', lambda: os.kill(os.getppid(), signal.SIGUSR1))
attempt('own group', lambda: os.kill(0, signal.SIGUSR1))
print('end')
"""
    r, signals = run(code)
    _isolated(r)
    assert r.ok and r.output.splitlines()[-1] == "end", r
    assert signals == 0, r                                    # the trainer got none


def test_a_setsid_child_does_not_outlive_the_call(run):
    marker = _marker()
    code = NAME_ME.replace("MARKER", marker) + """
import os, time
for i in range(2):
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:                                    # double fork: an orphan
            name_me()
            time.sleep(20)
        os._exit(0)
time.sleep(0.3)
print('left them')
"""
    try:
        r, _ = run(code, timeout_s=3.0)
        _isolated(r)
        assert r.ok and r.observation() == "left them", r
    finally:
        assert _none_named(marker)


def test_clearing_the_interpreter_changes_nothing(run, open_dir):
    """The old guard's tables lived in the runner's ``__main__``; nothing in the interpreter
    matters now: empty that module and sys.modules, then try the escapes again."""
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(8)
        srv.setblocking(False)
        code = ATTEMPT + f"""
import sys
vars(sys.modules['__main__']).clear()         # the runner's module, where the old guard lived
for name in list(sys.modules):
    if name not in ('sys', 'builtins'):
        del sys.modules[name]
import os, socket
attempt('write', lambda: open({open_dir + '/x'!r}, 'w'))
attempt('exec', lambda: os.execv('/bin/sh', ['sh', '-c', 'echo RAN-SHELL']))
attempt('net', lambda: socket.create_connection(('127.0.0.1', {srv.getsockname()[1]}),
                                                timeout=0.5))
"""
        r, _ = run(code)                          # the runner's epilogue may fail afterwards
        _isolated(r)
        _blocked(r, 3)
        assert "RAN-SHELL" not in r.output and os.listdir(open_dir) == [], r
        with pytest.raises(BlockingIOError):
            srv.accept()


def test_infinite_loop_is_killed_at_the_wall_timeout(run):
    marker = _marker()
    t0 = time.monotonic()
    try:
        r, _ = run(NAME_ME.replace("MARKER", marker) + "name_me()\nwhile True:\n    pass",
                   timeout_s=1.0, cpu_s=5)
        assert r.timed_out and r.exit_code is None
        assert 1.0 <= time.monotonic() - t0 < 6.0
        assert "TimeoutError" in r.observation()
        assert _gone(r.runner_pid)
    finally:
        assert _none_named(marker)                            # the snippet itself is gone


def test_a_sandbox_not_set_up_within_the_wall_timeout_is_an_error_not_a_timeout(run):
    # 1 ms: the runner's interpreter cannot even start, so no verdict arrives in time.
    r, _ = run("print('never')", timeout_s=0.001)
    assert (r.status, r.timed_out, r.exit_code, r.output) == ("error", True, None, ""), r
    assert "never started" in r.sandbox_error and not r.ok, r
    assert "SandboxError" in r.observation() and "TimeoutError" not in r.observation()
    assert _gone(r.runner_pid)


# The runner's try_method with a setup process that misreports: the init's half of the "ok"
# line before the setup's (the race that hung concurrent runs), then an init that waits.
_MISORDERED_SETUP = r'''
import os, sys, time
sys.path.insert(0, sys.argv[1])
import sandbox_runner
def isolated(cfg, method, report, status_w, go_r):
    os.write(report, f"{method},mountns,pidns ok {os.getpid()} ".encode())
    os.close(report)
    time.sleep(60)                               # an init waiting for "go" never ends
sandbox_runner.isolated = isolated
status_r, status_w = os.pipe()
go_r, go_w = os.pipe()
t0 = time.monotonic()
init, why = sandbox_runner.try_method({}, "rootns", status_w, go_r)
print(init, f"{time.monotonic() - t0:.1f}", why)
'''


def test_a_misordered_setup_report_fails_the_method_and_kills_the_setup():
    runner_dir = os.path.dirname(sandbox.RUNNER)
    out = subprocess.run([sys.executable, "-I", "-S", "-c", _MISORDERED_SETUP, runner_dir],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    init, seconds, why = out.stdout.split(" ", 2)
    assert init == "None" and float(seconds) < 10, out.stdout   # not the setup's 60 s
    assert why.startswith("fail rootns: malformed report"), out.stdout


def test_cpu_limit_kills_a_busy_snippet_before_the_wall_timeout(run):
    r, _ = run("while True:\n    pass", timeout_s=15.0, cpu_s=1)   # 1 CPU-s: 1-6 s wall here
    assert not r.timed_out and r.killed_by in ("SIGXCPU", "SIGKILL"), r
    assert "Killed" in r.observation()


def test_spawned_children_die_with_the_snippet(run):
    code = ("import os, time\n"
            "for i in range(32):\n"
            "    if os.fork() == 0:\n"
            "        time.sleep(20)\n"
            "        os._exit(0)\n"
            "print('spawned', flush=True)\n"
            "time.sleep(20)\n")
    r, _ = run(code, timeout_s=2.0)
    assert r.timed_out and r.observation().startswith("spawned")
    assert _gone(r.runner_pid)
    r, _ = run("import os, time\nif os.fork() == 0:\n    time.sleep(20)\nprint('bye')",
               timeout_s=2.0)
    assert r.ok and r.observation() == "bye" and r.duration_s < 2.0
    assert _gone(r.runner_pid)


def test_a_fork_bomb_is_bounded_by_max_procs(run):
    code = ("import os, time\nn = 0\n"
            "try:\n"
            "    for i in range(200):\n"
            "        if os.fork() == 0:\n"
            "            time.sleep(5)\n"
            "            os._exit(0)\n"
            "        n += 1\n"
            "except OSError as e:\n"
            "    print(n, type(e).__name__)\n")
    r, _ = run(code, timeout_s=3.0, max_procs=16)
    assert r.ok, r
    n, err = r.output.split()
    assert int(n) < 16 and err == "BlockingIOError", r


def test_a_4gib_allocation_is_refused(run):
    r, _ = run("x = bytearray(4 << 30)\nprint('allocated')", memory_mb=256)
    assert r.exit_code == 1 and r.observation() == "MemoryError"


def test_output_is_bounded(run):
    r, _ = run("while True:\n    print('x' * 1000)", timeout_s=5.0, file_limit_bytes=64 << 10,
               output_limit=500)
    assert not r.timed_out and r.exit_code == 1, r           # EFBIG at the file-size limit
    assert r.duration_s < 4.0
    assert r.truncated and r.observation().endswith("...[truncated]")
    assert len(r.observation()) <= 500 + len("...[truncated]")


def test_limits_cannot_be_raised(run):
    r, _ = run("import resource\nresource.setrlimit(resource.RLIMIT_AS, (-1, -1))")
    assert r.exit_code == 1 and r.observation().startswith("ValueError"), r


def test_no_isolation_is_refused_unless_unsafe(monkeypatch):
    monkeypatch.delenv(sandbox.UNSAFE_ENV, raising=False)
    with pytest.raises(SandboxUnavailable, match="unsafe=True"):
        run_python("print(1)", methods=())
    r = run_python("print(1)", methods=(), unsafe=True)
    assert r.ok and r.observation() == "1" and r.isolation == ("none",)
    monkeypatch.setenv(sandbox.UNSAFE_ENV, "1")
    assert run_python("print(2)", methods=()).isolation == ("none",)


def test_rootns_is_refused_to_a_non_root_uid_and_userns_takes_over():
    """From an unprivileged uid: the stand-in trainer, or this process when it is not root."""
    if os.geteuid() == 0:
        assert "rootns needs root" in _as_unprivileged("print(1)", refused=True,
                                                       methods=("rootns",))
        r, _ = _as_unprivileged("print(1)", methods=("rootns", "userns"))
    else:
        with pytest.raises(SandboxUnavailable, match="rootns needs root"):
            run_python("print(1)", methods=("rootns",))
        r = run_python("print(1)", methods=("rootns", "userns"))
    assert r.ok and r.isolation[0] == "userns", r


def test_bad_arguments():
    with pytest.raises(ValueError, match="timeout_s"):
        run_python("print(1)", timeout_s=0)
    with pytest.raises(TypeError, match="unsafe"):
        run_python("print(1)", unsafe="yes")
    with pytest.raises(ValueError, match="methods"):
        run_python("print(1)", methods=("bwrap",))
    with pytest.raises(TypeError, match="code"):
        run_python(b"print(1)")
