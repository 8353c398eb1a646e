"""The ToRA tool sandbox against hostile snippets. Every snippet is bounded by itself so the
test machine is never at risk even if the sandbox failed: loops end by the wall timeout
(1-2 s), at most 32 children are spawned (each sleeps 30 s at most), the allocation is 4 GiB
(refused by RLIMIT_AS long before), writes go to a pytest temp path, and the only socket
target is a listener of this test on 127.0.0.1.

Each runs both with the kernel layers root gets (network/PID namespaces, uid nobody) and
with the in-process guard alone (namespaces=False), where the layers allow it."""
import os
import socket
import sys
import time

import pytest

from examples.async_trainer.sandbox import _session_members, run_python

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="process groups via /proc, rlimits: Linux")
def _gone(sid, timeout=3.0):
    """No live process of session ``sid`` left (a killed child may take a moment to be
    reaped by its new parent)."""
    deadline = time.monotonic() + timeout
    while _session_members(sid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return _session_members(sid) == []


MODES = [pytest.param(True, id="namespaces"), pytest.param(False, id="guard-only")]


def test_plain_snippets_run_and_their_errors_become_observations():
    r = run_python("import math\nprint(sum(math.factorial(i) for i in range(6)))")
    assert r.ok and r.observation() == str(sum(__import__("math").factorial(i) for i in range(6)))
    r = run_python("x = 1 / 0")
    assert r.exit_code == 1 and r.observation() == "ZeroDivisionError: division by zero"
    r = run_python("import sys; print('a'); sys.exit(3)")
    assert r.exit_code == 3 and r.observation() == "a"
    r = run_python("open('note.txt', 'w').write('kept'); print(open('note.txt').read())")
    assert r.ok and r.observation() == "kept"                 # its own directory is writable


@pytest.mark.parametrize("namespaces", MODES)
def test_infinite_loop_is_killed_at_the_wall_timeout(namespaces):
    t0 = time.monotonic()
    r = run_python("while True:\n    pass", timeout_s=1.0, cpu_s=5, namespaces=namespaces)
    assert r.timed_out and r.exit_code is None
    assert 1.0 <= time.monotonic() - t0 < 4.0
    assert "TimeoutError" in r.observation()
    assert _gone(r.runner_pid)


def test_cpu_limit_kills_a_busy_snippet_before_the_wall_timeout():
    r = run_python("while True:\n    pass", timeout_s=6.0, cpu_s=1, namespaces=False)
    assert not r.timed_out and r.killed_by in ("SIGXCPU", "SIGKILL"), r
    assert r.duration_s < 4.0 and "Killed" in r.observation()


@pytest.mark.parametrize("namespaces", MODES)
def test_spawned_children_die_with_the_snippet(namespaces):
    code = ("import os, time\n"
            "for i in range(32):\n"
            "    if os.fork() == 0:\n"
            "        time.sleep(30)\n"
            "        os._exit(0)\n"
            "print('spawned', flush=True)\n"
            "time.sleep(30)\n")
    r = run_python(code, timeout_s=2.0, namespaces=namespaces)
    assert r.timed_out and r.observation().startswith("spawned")
    assert _gone(r.runner_pid)                                # none of the 33 is left
    # A snippet that leaves a background child and exits at once: the child goes too.
    r = run_python("import os, time\nif os.fork() == 0:\n    time.sleep(30)\nprint('bye')",
                   timeout_s=2.0, namespaces=namespaces)
    assert r.ok and r.observation() == "bye" and r.duration_s < 2.0
    assert _gone(r.runner_pid)


@pytest.mark.parametrize("namespaces", MODES)
def test_a_4gib_allocation_is_refused(namespaces):
    r = run_python("x = bytearray(4 << 30)\nprint('allocated')", memory_mb=256,
                   namespaces=namespaces)
    assert r.exit_code == 1 and r.observation() == "MemoryError"


@pytest.mark.parametrize("namespaces", MODES)
def test_writes_outside_the_working_directory_are_refused(tmp_path, namespaces):
    target = tmp_path / "escaped.txt"
    for code in (f"open({str(target)!r}, 'w').write('x')",
                 f"import os\nos.close(os.open({str(target)!r}, os.O_CREAT | os.O_WRONLY))",
                 f"import os\nos.mkdir({str(tmp_path / 'd')!r})",
                 "open('../../escaped', 'w').write('x')"):
        r = run_python(code, namespaces=namespaces)
        assert r.exit_code == 1 and "PermissionError" in r.observation(), (code, r)
    assert sorted(os.listdir(tmp_path)) == []


@pytest.mark.parametrize("namespaces", MODES)
def test_no_socket_reaches_a_local_listener(namespaces):
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(1)
        srv.setblocking(False)
        port = srv.getsockname()[1]
        code = (f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=1)\n"
                f"s.sendall(b'hello')\nprint('connected')")
        r = run_python(code, timeout_s=3.0, namespaces=namespaces)
        assert r.exit_code == 1 and "connected" not in r.observation(), r
        with pytest.raises(BlockingIOError):
            srv.accept()                                      # nothing ever connected


def test_the_network_namespace_alone_blocks_a_connect():
    probe = run_python("print(1)")
    if "netns" not in probe.isolation:
        pytest.skip("no network namespace here (needs CAP_SYS_ADMIN)")
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(1)
        srv.setblocking(False)
        port = srv.getsockname()[1]
        r = run_python(f"import socket\ns = socket.socket()\ns.settimeout(1)\n"
                       f"s.connect(('127.0.0.1', {port}))\nprint('connected')", _guard=False)
        assert "audit-guard" not in r.isolation and r.exit_code == 1, r
        assert "OSError" in r.observation() or "unreachable" in r.observation(), r
        with pytest.raises(BlockingIOError):
            srv.accept()


def test_output_is_bounded():
    r = run_python("while True:\n    print('x' * 1000)", timeout_s=5.0, file_limit_bytes=64 << 10,
                   output_limit=500)
    assert not r.timed_out and r.exit_code == 1, r          # EFBIG at the file-size limit
    assert r.duration_s < 4.0
    assert r.truncated and r.observation().endswith("...[truncated]")
    assert len(r.observation()) <= 500 + len("...[truncated]")


def test_limits_cannot_be_raised_and_programs_cannot_be_run():
    for code in ("import resource\nresource.setrlimit(resource.RLIMIT_AS, (-1, -1))",
                 "import os\nos.system('true')",
                 "import os\nos.kill(1, 0)",
                 "import os\nos.setsid()"):
        r = run_python(code, namespaces=False)
        assert r.exit_code == 1 and ("PermissionError" in r.observation()
                                     or "AttributeError" in r.observation()), (code, r)


def test_bad_arguments():
    with pytest.raises(ValueError, match="timeout_s"):
        run_python("print(1)", timeout_s=0)
