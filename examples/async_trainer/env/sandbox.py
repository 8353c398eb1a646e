"""Run an untrusted Python snippet (a ToRA tool call) in an isolated, bounded process.

``run_python(code)`` returns a :class:`SandboxResult` whose :meth:`~SandboxResult.observation`
is what the policy sees next: the snippet's stdout/stderr (or its exception as
``Type: message``, or what stopped it), truncated. Nothing the snippet does raises in the
caller: every exit status, signal, limit and cleanup failure is a result with a ``status``.
The threat model and what each mode guarantees are in ``docs/trainer.md`` (ToRA sandbox).

Isolation is set up by the kernel before the snippet's first line runs, by processes the
snippet never controls. Four processes per call (the first three are ``sandbox_runner.py``)::

    trainer -- runner (own session, own cgroups) -- setup (unshares) -- init (pid 1) -- snippet

*setup* enters fresh mount, PID, network, IPC and UTS namespaces: as root directly
(``rootns``), otherwise in a fresh user namespace (``userns``; as root its uid 0 is mapped to
the run's own unprivileged uid, never to host root). It builds a new root — a read-only tmpfs
with read-only binds of ``/usr``, ``/lib*``, the device nodes ``/dev/{null,zero,random,
urandom}`` and the interpreter's standard library at the neutral path ``/opt/python`` (its
site-packages hidden), and a size-limited tmpfs at ``/sandbox``, the only writable place,
which never reaches the host's disk — ``pivot_root``\\ s into it and detaches the old root.
*init* drops to the run's own uid (``rootns``) or every capability (``userns``), sets the
rlimits, ``no_new_privs`` and a seccomp filter, reports, and waits for the trainer's ``go``
before it forks the *snippet*.

The trainer's side (:mod:`.sandbox_contain`): a cgroup per run where one can be created
(memory and process count per run, ``cgroup.kill``), a pidfd on the namespace's init, and a
host uid per concurrent run as root. After every run it kills the init and the cgroup and waits
(bounded) until every process of the run is gone; only then is the run's directory removed,
by file descriptor only (:mod:`.sandbox_cleanup`). The isolation verdict comes over a pipe the
trainer holds and is read before the snippet starts, so the snippet cannot rewrite it.

Where neither method works, ``run_python`` refuses with :class:`SandboxUnavailable` unless
the caller passes ``unsafe=True`` (or ``TORA_SANDBOX_UNSAFE=1``): then the snippet runs with
the rlimits and a private directory only (as root: as the run's own uid, in the run's
cgroups), and ``result.isolation == ("none",)`` says so.
"""
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Optional, Tuple

from .sandbox_cleanup import remove_tree
from .sandbox_contain import WAIT_S, RunCgroups, RunUid, kill_init, pidfd_for_init, wait_gone

NOBODY = 65534
UNSAFE_ENV = "TORA_SANDBOX_UNSAFE"
NEUTRAL_PYTHON = "/opt/python"
RUNNER_MEMORY = 64 << 20      # the runner, setup and init processes, in the run's memory cgroup


class SandboxUnavailable(RuntimeError):
    """No isolation method works on this machine and ``unsafe`` was not given."""


# The runner: a stdlib-only script (see its docstring), started as ``python -I -S -u RUNNER``.
RUNNER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sandbox_runner.py")
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


@dataclass
class SandboxResult:
    output: str                 # stdout + stderr, at most ``output_limit`` bytes (decoded)
    exit_code: Optional[int]    # the snippet's exit status (1: it raised); None: it did not exit
    timed_out: bool             # stopped by the wall-clock timeout
    killed_by: Optional[str]    # the signal's name when the snippet was killed
    truncated: bool             # output cut at ``output_limit``
    duration_s: float
    isolation: Tuple[str, ...]  # layers in effect (module docstring); ("none", ...): unsafe
    runner_pid: int             # the runner's pid = its process group and session id
    # "exit" (exit_code), "signal" (killed_by), "limit" (limit), "timeout", or "error": the
    # sandbox itself failed (sandbox_error says how; nothing about the snippet is known)
    status: str = "exit"
    limit: Optional[str] = None           # "cpu" or "memory" when a limit killed the snippet
    sandbox_error: Optional[str] = None   # also set when the run's cleanup failed
    # the trainer's side: "cgroup-kill", "cgroup-memory", "cgroup-pids" (the run's cgroups),
    # "pidfd-wait" (the namespace's init watched until the namespace is gone)
    containment: Tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        """The snippet exited 0, within every limit, and the sandbox cleaned up after it."""
        return self.status == "exit" and self.exit_code == 0 and self.sandbox_error is None

    def observation(self, limit: Optional[int] = None) -> str:
        """The text the policy sees: output, then what stopped the snippet (if anything)."""
        text = self.output if limit is None else self.output[:limit]
        if self.truncated or (limit is not None and len(self.output) > limit):
            text += "...[truncated]"
        if self.status == "timeout":
            text += "\nTimeoutError: wall-clock limit exceeded"
        elif self.status == "limit" and self.limit == "cpu":
            text += f"\nKilled: {self.killed_by} (CPU time limit)"
        elif self.status == "limit":
            text += f"\nKilled: {self.killed_by} ({self.limit} limit)"
        elif self.status == "signal":
            text += f"\nKilled: {self.killed_by}"
        elif self.status == "error":
            text += "\nSandboxError: the tool could not run"
        return text.strip("\n")


def _session_members(sid: int):
    """Live (not zombie) pids whose session id is ``sid`` (Linux ``/proc``; empty elsewhere)."""
    out = []
    try:
        names = os.listdir("/proc")
    except OSError:
        return out
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        # state ppid pgrp session; a zombie (killed, not reaped yet) is gone already
        if len(fields) > 4 and int(fields[3]) == sid and fields[0] != b"Z":
            out.append(int(name))
    return out


def kill_all(runner_pid: int) -> None:
    """SIGKILL the runner's process group and every process of its session."""
    try:
        os.killpg(runner_pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    for pid in _session_members(runner_pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


_BINDS: Optional[tuple] = None


def _binds() -> tuple:
    """([host, in the new root] pairs bound read-only, [host stdlib, neutral stdlib])."""
    global _BINDS
    if _BINDS is None:
        system = [[p, p] for p in ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64",
                                   "/libx32") if os.path.lexists(p)]
        devices = [[d, d] for d in ("/dev/null", "/dev/zero", "/dev/random", "/dev/urandom")
                   if os.path.exists(d)]
        stdlib = os.path.realpath(os.path.dirname(os.__file__))
        _BINDS = (system + devices,
                  [stdlib, f"{NEUTRAL_PYTHON}/lib/{os.path.basename(stdlib)}"])
    return _BINDS


def _others_can_read(path: str) -> bool:
    """Whether a uid with no relation to the owners can list ``path`` (every parent
    searchable by others)."""
    path = os.path.realpath(path)
    try:
        if not os.stat(path).st_mode & 0o005 == 0o005:
            return False
        while path != "/":
            path = os.path.dirname(path)
            if not os.stat(path).st_mode & 0o001:
                return False
    except OSError:
        return False
    return True


def _read_line(fd: int, deadline: float, buf: bytearray) -> Optional[str]:
    """One line from the pipe ``fd`` (``buf`` keeps what came after it), or None at EOF or
    the deadline."""
    while b"\n" not in buf:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            return None
        chunk = os.read(fd, 4096)
        if not chunk:
            return None
        buf += chunk
        if len(buf) > 1 << 16:                      # bounded: the runner's lines are short
            return None
    line, _, rest = bytes(buf).partition(b"\n")
    buf[:] = rest
    return line.decode("utf-8", "replace")


def _decode_status(line: Optional[str], cpu_s: int, memory_hit: bool):
    """(status, exit_code, killed_by, limit) from the runner's ``status ...`` line."""
    parts = (line or "").split()
    if len(parts) == 3 and parts[:2] == ["status", "exit"] and parts[2].isdigit():
        return "exit", int(parts[2]), None, None
    if (len(parts) == 4 and parts[:2] == ["status", "signal"] and parts[2].isdigit()
            and parts[3].replace(".", "", 1).isdigit()):
        num, cpu = int(parts[2]), float(parts[3])
        try:
            name = signal.Signals(num).name
        except ValueError:
            name = f"signal {num}"
        if num == signal.SIGXCPU or (num == signal.SIGKILL and cpu >= cpu_s):
            return "limit", None, name, "cpu"
        if num == signal.SIGKILL and memory_hit:
            return "limit", None, name, "memory"
        return "signal", None, name, None
    if memory_hit:
        return "limit", None, "SIGKILL", "memory"
    return "error", None, None, None


def run_python(code: str, *, timeout_s: float = 3.0, cpu_s: int = 2, memory_mb: int = 256,
               output_limit: int = 2048, file_limit_bytes: int = 1 << 20, max_procs: int = 64,
               disk_limit_bytes: int = 16 << 20, unsafe: bool = False,
               methods: Optional[Tuple[str, ...]] = None) -> SandboxResult:
    """Run ``code`` isolated and with the limits above; never raises for anything the snippet
    does.

    Parameters
    ----------
    code : str
        Python source (the body of a ```python block).
    timeout_s : float
        Wall-clock limit, start-up included; the whole run is killed at it.
    cpu_s, memory_mb, file_limit_bytes, max_procs : int
        RLIMIT_CPU (s), RLIMIT_AS (MiB), RLIMIT_FSIZE (bytes), RLIMIT_NPROC; where the run
        has cgroups, ``memory_mb`` and ``max_procs`` also bound the whole run.
    disk_limit_bytes : int
        Size of the run's tmpfs (its only writable directory; isolated modes).
    output_limit : int
        Bytes of output kept.
    unsafe : bool
        Where no isolation method works, run anyway with the rlimits alone (the snippet can
        then reach the network and write wherever its uid can). Also ``TORA_SANDBOX_UNSAFE=1``.
    methods : tuple of str, optional
        Isolation methods tried in order: ``"rootns"`` (root only) and ``"userns"``; default
        both for root, ``("userns",)`` otherwise. ``()`` tries none (with ``unsafe``: no
        isolation, the baseline the tests and measurements compare against).

    Raises
    ------
    SandboxUnavailable
        No method worked and ``unsafe`` is false; the message says why for each.
    """
    if unsafe is not False:      # the project's flag check imports torch; False needs none
        from glm_kernels._checks import check_bool
        check_bool("unsafe", unsafe)
    if not isinstance(code, str):
        raise TypeError(f"run_python: code must be str, got {type(code).__name__}")
    if timeout_s <= 0 or cpu_s < 1 or memory_mb < 64 or output_limit < 1:
        raise ValueError(f"run_python: timeout_s > 0, cpu_s >= 1, memory_mb >= 64 and "
                         f"output_limit >= 1 expected, got {timeout_s}, {cpu_s}, {memory_mb}, "
                         f"{output_limit}")
    if disk_limit_bytes < 4096 or max_procs < 1:
        raise ValueError(f"run_python: disk_limit_bytes >= 4096 and max_procs >= 1 expected, "
                         f"got {disk_limit_bytes}, {max_procs}")
    root_user = hasattr(os, "geteuid") and os.geteuid() == 0
    if methods is None:
        methods = ("rootns", "userns") if root_user else ("userns",)
    methods = tuple(methods)
    if any(m not in ("rootns", "userns") for m in methods):
        raise ValueError(f"run_python: methods must be drawn from ('rootns', 'userns'), "
                         f"got {methods!r}")
    unsafe = unsafe or os.environ.get(UNSAFE_ENV) == "1"
    if not sys.platform.startswith("linux"):
        methods = ()
    run = _Run(root_user)
    try:
        return run.go(code, dict(timeout_s=timeout_s, cpu_s=int(cpu_s), memory_mb=memory_mb,
                                 output_limit=output_limit, fsize=int(file_limit_bytes),
                                 nproc=int(max_procs), disk=int(disk_limit_bytes),
                                 methods=methods, unsafe=unsafe))
    finally:
        run.close()


class _Run:
    """One call's resources on the trainer's side, released by :meth:`close`."""

    def __init__(self, root_user: bool):
        self.fds = []
        self.uid = RunUid() if root_user and sys.platform.startswith("linux") else None
        self.base = tempfile.mkdtemp(prefix="tora-sandbox-")      # 0700, ours
        self.parent_fd = self._fd(os.open(os.path.dirname(self.base), _DIR))
        self.base_fd = self._fd(os.open(os.path.basename(self.base), _DIR,
                                        dir_fd=self.parent_fd))
        self.cgroups = None
        self.started = False
        self.memory_hit = False

    def _fd(self, fd: int) -> int:
        self.fds.append(fd)
        return fd

    def close(self) -> None:
        """Release what is left; a run that never started a process has its directory and
        cgroups removed here (a started one is handled by :meth:`go` once it is gone)."""
        if not self.started:
            remove_tree(self.parent_fd, os.path.basename(self.base))
            if self.cgroups is not None:
                self.cgroups.kill_and_wait(time.monotonic())
        for fd in self.fds:
            try:
                os.close(fd)
            except OSError:
                pass
        if self.uid is not None:
            self.uid.release()

    def go(self, code: str, a: dict) -> SandboxResult:
        run_uid = self.uid.uid if self.uid is not None else None
        # Unsafe mode as root runs the snippet as the run's own uid too, where that uid can
        # read the interpreter's standard library (not under a root-only home, e.g. pyenv's).
        unsafe_uid = run_uid if run_uid is not None and _others_can_read(
            os.path.dirname(os.__file__)) else None
        os.mkdir("root", 0o700, dir_fd=self.base_fd)
        os.mkdir("work", 0o700, dir_fd=self.base_fd)
        if unsafe_uid is not None:
            work = os.open("work", _DIR, dir_fd=self.base_fd)
            os.fchown(work, unsafe_uid, unsafe_uid)
            os.close(work)
        out_fd = self._fd(os.open("output", os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                                  | os.O_CLOEXEC, 0o600, dir_fd=self.base_fd))
        binds, stdlib = _binds() if a["methods"] else ([], None)
        cfg = {"code": code, "mem": a["memory_mb"] << 20, "cpu": a["cpu_s"], "fsize": a["fsize"],
               "nproc": a["nproc"], "disk": a["disk"], "methods": list(a["methods"]),
               "unsafe": a["unsafe"], "uid": run_uid, "unsafe_uid": unsafe_uid,
               "root": os.path.join(self.base, "root"), "work": os.path.join(self.base, "work"),
               "binds": binds, "stdlib": stdlib}
        if sys.platform.startswith("linux"):
            self.cgroups = RunCgroups((a["memory_mb"] << 20) + a["disk"] + RUNNER_MEMORY,
                                      a["nproc"] + 3)
        report_r, report_w = os.pipe()
        self._fd(report_r)
        t0 = time.monotonic()
        deadline = t0 + a["timeout_s"]
        try:
            proc = subprocess.Popen([sys.executable, "-I", "-S", "-u", RUNNER, str(report_w),
                                     str(os.getpid())],
                                    stdin=subprocess.PIPE, stdout=out_fd,
                                    stderr=subprocess.STDOUT, pass_fds=(report_w,),
                                    cwd=self.base, start_new_session=True,
                                    env={"LANG": "C.UTF-8", "PATH": "/usr/bin:/bin"})
        finally:
            os.close(report_w)
        self.started = True
        contained = []
        if self.cgroups is not None and self.cgroups.join(proc.pid):
            contained += self.cgroups.layers
        buf = bytearray()
        init = pidfd = None
        verdict, timed_out, error = None, False, None
        try:
            proc.stdin.write(json.dumps(cfg).encode() + b"\n")
            proc.stdin.flush()
            verdict = _read_line(report_r, deadline, buf)
            if verdict is not None and verdict.startswith("ok "):
                _, pid, _layers = verdict.split(" ", 2)
                init = int(pid)
                pidfd = pidfd_for_init(init)
                if pidfd is not None:
                    self._fd(pidfd)
                    contained.append("pidfd-wait")
            if verdict is not None and (verdict.startswith("ok ") or verdict == "none"):
                proc.stdin.write(b"go\n")
                proc.stdin.flush()
                proc.stdin.close()
                try:
                    proc.wait(timeout=max(deadline - time.monotonic(), 0))
                except subprocess.TimeoutExpired:
                    timed_out = True
            elif verdict is None:
                timed_out = time.monotonic() >= deadline
                # Said apart from a snippet's own timeout: the snippet never started.
                error = ("the sandbox was not set up within the wall timeout (no verdict from "
                         "its runner); the snippet never started") if timed_out else \
                    "the runner ended without a verdict"
        except (OSError, ValueError) as e:            # the runner died early / said nonsense
            error = f"the runner failed: {e}"
        finally:
            gone = self._stop(proc, init, pidfd)
        duration = time.monotonic() - t0
        status_line, until = None, time.monotonic() + 0.5
        while True:                # the last status line (unsafe: the snippet can write here)
            line = _read_line(report_r, until, buf)
            if line is None:
                break
            if line.startswith("status "):
                status_line = line
        raw = os.pread(out_fd, a["output_limit"] + 1, 0)
        if gone:
            left = remove_tree(self.parent_fd, os.path.basename(self.base))
            if left:
                error = error or f"the run's directory could not be removed: {left}"
        else:
            error = error or (f"processes of the run were still alive {WAIT_S:.0f} s after "
                              f"SIGKILL; {self.base} was left in place")
        if verdict is not None and verdict.startswith("refused "):
            raise SandboxUnavailable(
                f"run_python: no isolation available on this machine ({verdict[8:]}); "
                f"refusing to run untrusted code. Pass unsafe=True (or set {UNSAFE_ENV}=1) "
                f"to run it with rlimits alone: no network or filesystem isolation")
        if verdict is not None and verdict.startswith("ok "):
            isolation = tuple(verdict.split(" ", 2)[2].split(","))
        elif verdict == "none":
            isolation = ("none",)
        else:
            isolation = ()
        if timed_out:
            status, exit_code, killed_by, limit = \
                "timeout" if verdict is not None else "error", None, None, None
        else:
            status, exit_code, killed_by, limit = _decode_status(status_line, a["cpu_s"],
                                                                 self.memory_hit)
            if status == "error" and error is None:
                error = f"the run ended without a status ({status_line!r})"
        if self.cgroups is not None and self.cgroups.dirs and not gone:
            error = error or "the run's cgroups did not empty"
        return SandboxResult(output=raw[:a["output_limit"]].decode("utf-8", "replace"),
                             exit_code=exit_code, timed_out=timed_out, killed_by=killed_by,
                             truncated=len(raw) > a["output_limit"], duration_s=duration,
                             isolation=isolation, runner_pid=proc.pid, status=status,
                             limit=limit, sandbox_error=error, containment=tuple(contained))

    def _stop(self, proc, init, pidfd) -> bool:
        """Kill every process of the run and wait (bounded) until they are gone."""
        if pidfd is not None:
            kill_init(pidfd, init)
        if self.cgroups is not None and self.cgroups.v2:
            try:
                with open(os.path.join(self.cgroups.v2, "cgroup.kill"), "w") as f:
                    f.write("1")
            except OSError:
                pass
        kill_all(proc.pid)
        deadline = time.monotonic() + WAIT_S
        gone = pidfd is None or wait_gone(pidfd, deadline)
        try:
            proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            gone = False
        if self.cgroups is not None and self.cgroups.dirs:
            self.memory_hit = self.cgroups.memory_exceeded()      # before the cgroups go
            gone = self.cgroups.kill_and_wait(deadline) and gone
        elif init is not None and pidfd is None:
            gone = False            # an isolated run we cannot watch: leave its files alone
        if proc.stdin and not proc.stdin.closed:
            try:
                proc.stdin.close()
            except OSError:
                pass
        return gone
