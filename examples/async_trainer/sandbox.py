"""Run an untrusted Python snippet (a ToRA tool call) in an isolated, bounded process.

``run_python(code)`` returns a :class:`SandboxResult` whose :meth:`~SandboxResult.observation`
is what the policy sees next: the snippet's stdout/stderr (or its exception as
``Type: message``, or what stopped it), truncated. Nothing the snippet does raises in the
caller: the trainer keeps going.

Isolation is set up by the kernel before the snippet's first line runs, by processes the
snippet never controls, so nothing the snippet does to its interpreter (``sys.modules``,
``ctypes``, ``_posixsubprocess``) undoes it. Four processes per call (the first three are
``sandbox_runner.py``)::

    trainer -- runner (own session) -- setup (unshares) -- init (pid 1 of the new PID ns) -- snippet

The *setup* process enters fresh mount, PID, network, IPC and UTS namespaces: as root directly
(``rootns``), otherwise together with a fresh user namespace mapping the caller's uid to 0
(``userns``: unprivileged user namespaces, no helper binary). It builds a new root — a
read-only tmpfs holding read-only bind mounts of ``/usr``, ``/lib*``, the interpreter's prefix,
``/dev/{null,zero,random,urandom}``, and the snippet's private directory at ``/sandbox`` (the
only writable place) — ``pivot_root``\\ s into it and detaches the old root. The *init*
process starts a new session, drops to uid/gid ``nobody`` (``rootns``) or drops every capability
(``userns``), sets the rlimits (soft = hard), sets ``no_new_privs``, installs a seccomp filter,
and only then forks the *snippet* process, which compiles and runs the snippet.

=====================  =====================================================================
layer                  what it stops
=====================  =====================================================================
mount ns + pivot_root  every path outside ``/sandbox`` is absent or read-only: no writes into
                       ``/tmp``, ``/dev/shm`` or any other world-writable place, whatever
                       path or ``dir_fd`` is used (there is no fd to the old root either)
network ns             no interface but a down loopback: nothing is reachable, not even
                       127.0.0.1 (the trainer's and Ray's ports); abstract unix sockets are
                       per namespace too
PID ns                 the trainer and every other process are invisible (no pid to signal
                       or trace); when the snippet ends or is killed, the namespace's init
                       exits and the kernel kills everything left, ``setsid()`` children too
seccomp (x86_64,       ``execve``/``execveat`` (no shell, no program: ``os.system``,
aarch64)               ``subprocess``, ``_posixsubprocess.fork_exec`` all fail with EPERM),
                       ``ptrace``, ``mount``/``umount``/``pivot_root``/``chroot``, namespace
                       changes (``unshare``, ``setns``, ``clone`` with namespace flags;
                       ``clone3``: ENOSYS, libc falls back to ``clone``), ``bpf``, keyrings,
                       ``perf_event_open``, ``userfaultfd``, ``process_vm_*``, module loading,
                       ``io_uring``, the new mount API, and sockets other than ``AF_UNIX``;
                       any other architecture's syscall ABI (x32, i386) kills the process
creds + rlimits        uid ``nobody`` or no capabilities, ``no_new_privs``; RLIMIT_CPU (soft,
                       then SIGKILL 1 s later), AS (``MemoryError``), FSIZE (``EFBIG``),
                       NOFILE, NPROC (counted in the sandbox's own user/uid), CORE 0
outside the sandbox    wall-clock timeout; SIGKILL to the runner's process group and session
                       after every run (the chain dies with it: parent-death signals); the
                       private directory is removed afterwards
=====================  =====================================================================

Where neither method works (not Linux, an unsupported architecture, a container whose seccomp
profile forbids ``unshare``, unprivileged user namespaces switched off), ``run_python`` refuses
with :class:`SandboxUnavailable` naming why, unless the caller passes ``unsafe=True`` (or the
environment has ``TORA_SANDBOX_UNSAFE=1``): then the snippet runs with the rlimits, the private
directory and the process-group kill only, with full access to the network and every file the
user can write, and ``result.isolation == ("none",)`` says so.

Not enforced: reading files under the bound system directories (they hold no secrets of the
trainer; the trainer's own files, ``/home``, ``/root`` and ``/tmp`` are not mounted); CPU
time beyond RLIMIT_CPU per process (a fork bomb is bounded by RLIMIT_NPROC and the wall
timeout).
"""
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Optional, Tuple

NOBODY = 65534
UNSAFE_ENV = "TORA_SANDBOX_UNSAFE"


class SandboxUnavailable(RuntimeError):
    """No isolation method works on this machine and ``unsafe`` was not given."""


# The runner: a stdlib-only script (see its docstring), started as ``python -I -S -u RUNNER``.
RUNNER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sandbox_runner.py")


@dataclass
class SandboxResult:
    output: str                 # stdout + stderr, at most ``output_limit`` bytes (decoded)
    exit_code: Optional[int]    # the snippet's status (1: it raised); None: killed
    timed_out: bool             # stopped by the wall-clock timeout
    killed_by: Optional[str]    # signal name when the snippet was killed (SIGXCPU: CPU limit)
    truncated: bool             # output cut at ``output_limit``
    duration_s: float
    isolation: Tuple[str, ...]  # layers in effect (see the module docstring); ("none",): unsafe
    runner_pid: int             # the runner's pid = its process group and session id

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out

    def observation(self, limit: Optional[int] = None) -> str:
        """The text the policy sees: output, then what stopped the snippet (if anything)."""
        text = self.output if limit is None else self.output[:limit]
        if self.truncated or (limit is not None and len(self.output) > limit):
            text += "...[truncated]"
        if self.timed_out:
            text += "\nTimeoutError: wall-clock limit exceeded"
        elif self.killed_by == "SIGXCPU" or self.killed_by == "SIGKILL":
            text += f"\nKilled: {self.killed_by} (CPU time limit)"
        elif self.killed_by:
            text += f"\nKilled: {self.killed_by}"
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


def _rmtree(path: str) -> None:
    def unlock(func, p, _):
        if os.path.islink(p):           # chmod follows links: never onto a file outside
            return
        try:
            os.chmod(os.path.dirname(p), 0o700)
            os.chmod(p, 0o700)
            func(p)
        except OSError:
            pass
    shutil.rmtree(path, onerror=unlock)


_BINDS: Optional[list] = None


def _binds() -> list:
    """Host paths the new root gets (read-only): the system's libraries and the interpreter's
    prefix (its own bind when it is not inside one of the others' filesystems)."""
    global _BINDS
    if _BINDS is None:
        system = [p for p in ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
                  if os.path.lexists(p)]
        out = list(system)
        for p in {os.path.realpath(p) for p in (sys.base_prefix, sys.base_exec_prefix)}:
            holder = next((s for s in system if not os.path.islink(s)
                           and (p + "/").startswith(s + "/")), None)
            if holder is None or os.stat(holder).st_dev != os.stat(p).st_dev:
                out.append(p)
        out += [d for d in ("/dev/null", "/dev/zero", "/dev/random", "/dev/urandom")
                if os.path.exists(d)]
        _BINDS = out
    return _BINDS


def run_python(code: str, *, timeout_s: float = 3.0, cpu_s: int = 2, memory_mb: int = 256,
               output_limit: int = 2048, file_limit_bytes: int = 1 << 20, max_procs: int = 64,
               unsafe: bool = False, methods: Optional[Tuple[str, ...]] = None
               ) -> SandboxResult:
    """Run ``code`` isolated and with the limits above; never raises for anything the snippet
    does.

    Parameters
    ----------
    code : str
        Python source (the body of a ```python block).
    timeout_s : float
        Wall-clock limit, start-up included; the whole process group is killed at it.
    cpu_s, memory_mb, file_limit_bytes, max_procs : int
        RLIMIT_CPU (s), RLIMIT_AS (MiB), RLIMIT_FSIZE (bytes), RLIMIT_NPROC.
    output_limit : int
        Bytes of output kept.
    unsafe : bool
        Where no isolation method works, run anyway with the rlimits alone (the snippet can
        then reach the network and write wherever the user can). Also ``TORA_SANDBOX_UNSAFE=1``.
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
    base = tempfile.mkdtemp(prefix="tora-sandbox-")
    work = os.path.join(base, "work")
    os.mkdir(work, 0o700)
    os.mkdir(os.path.join(base, "root"), 0o700)
    with open(os.path.join(work, "snippet.py"), "w", encoding="utf-8") as f:
        f.write(code)
    args = json.dumps({"mem": memory_mb << 20, "cpu": int(cpu_s), "fsize": int(file_limit_bytes),
                       "nproc": int(max_procs), "methods": list(methods), "unsafe": unsafe,
                       "nobody": NOBODY, "root": os.path.join(base, "root"),
                       "binds": _binds() if methods else []})
    out_path = os.path.join(base, "output")
    t0 = time.monotonic()
    timed_out = False
    try:
        with open(out_path, "wb") as out:
            proc = subprocess.Popen([sys.executable, "-I", "-S", "-u", RUNNER, args],
                                    stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                    cwd=work, env={"LANG": "C.UTF-8", "PATH": "/usr/bin:/bin"},
                                    start_new_session=True, close_fds=True)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            kill_all(proc.pid)      # the runner's group and session: the chain dies with it
            proc.wait()
        duration = time.monotonic() - t0
        with open(out_path, "rb") as f:
            raw = f.read(output_limit + 1)
        try:
            with open(os.path.join(base, "isolation")) as f:
                isolation = f.read()
        except OSError:
            isolation = ""
    finally:
        _rmtree(base)
    if not isolation and not timed_out:     # the runner died before choosing: nothing ran
        isolation = "refused: runner failed: " + raw.decode("utf-8", "replace")[-500:]
    if isolation.startswith("refused: "):
        raise SandboxUnavailable(
            f"run_python: no isolation available on this machine ({isolation[9:]}); refusing "
            f"to run untrusted code. Pass unsafe=True (or set {UNSAFE_ENV}=1) to run it with "
            f"rlimits alone: no network or filesystem isolation")
    rc = proc.returncode
    killed = None
    if timed_out:
        exit_code = None
    elif rc < 0 or rc > 128:
        exit_code, killed = None, signal.Signals(-rc if rc < 0 else rc - 128).name
    else:
        exit_code = rc
    return SandboxResult(output=raw[:output_limit].decode("utf-8", "replace"),
                         exit_code=exit_code, timed_out=timed_out, killed_by=killed,
                         truncated=len(raw) > output_limit, duration_s=duration,
                         isolation=tuple(isolation.split(",")) if isolation else (),
                         runner_pid=proc.pid)
