"""Run an untrusted Python snippet (a ToRA tool call) in a bounded subprocess.

``run_python(code)`` returns a :class:`SandboxResult` whose :meth:`~SandboxResult.observation`
is what the policy sees next: the snippet's stdout/stderr (or its exception as
``Type: message``, or what stopped it), truncated. Nothing the snippet does raises in the
caller: the trainer keeps going.

What is enforced, and by whom (Linux; POSIX elsewhere gets the rows marked "POSIX"):

=========================  =================================================================
kernel, always (POSIX)     own session and process group (``start_new_session``); on the
                           wall-clock timeout, and after every run, SIGKILL to that group and
                           to every process of its session (found in ``/proc``), so background
                           children die with it; RLIMIT_CPU (soft, then SIGKILL 1 s later),
                           RLIMIT_AS (an allocation over it fails: ``MemoryError``),
                           RLIMIT_FSIZE (stdout/stderr and any file: ``EFBIG`` past it),
                           RLIMIT_NOFILE, RLIMIT_CORE 0, RLIMIT_NPROC (binds for a non-root
                           uid only), soft = hard so they cannot be raised back; working
                           directory a fresh private temporary directory (0700), removed
                           after the run; stdin ``/dev/null``; an empty environment
kernel, when permitted     ``unshare(CLONE_NEWNET | CLONE_NEWPID)`` (needs CAP_SYS_ADMIN: root,
(root on Linux)            as in CI): a network namespace with no usable interface (even
                           127.0.0.1 is unreachable) and a PID namespace whose init is the
                           snippet (when it ends or is killed, the kernel kills every process
                           it left, also one that left the process group; PDEATHSIG ties it
                           to the runner); then the snippet drops to uid/gid ``nobody``
                           (65534, no supplementary groups): it cannot write anything but its
                           directory and world-writable places, cannot signal other users'
                           processes, cannot raise its limits, and RLIMIT_NPROC binds
in-process guard           a Python audit hook installed before the snippet runs refuses:
(always)                   socket creation and use, ``subprocess``/``exec``/``spawn``/
                           ``system``, ``os.kill``/``killpg``, ``resource.setrlimit``/
                           ``prlimit``, ``ctypes``, and opening for write, creating, removing,
                           renaming or changing the mode of any path outside the working
                           directory; ``os.setsid``/``setpgid``/``setpgrp`` are removed
=========================  =================================================================

Not enforced: the in-process guard is a tripwire, not a boundary (Python code that digs into
the interpreter can get past an audit hook); where the namespaces are not available (a
non-root user, another OS) it is the only network and write barrier, and a snippet that gets
past it could open sockets and write wherever the user can, though it still dies with its
process group and its limits. Reading files is allowed. With the namespaces, ``/tmp`` and
``/dev/shm`` stay writable for ``nobody`` at the kernel level (the guard refuses them);
RLIMIT_FSIZE bounds any such file. Threads count against RLIMIT_NPROC. ``result.isolation``
names the layers that were in effect for the run.
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

# Runs as ``python -I -S -u -c _RUNNER <json>`` in the sandbox's working directory.
_RUNNER = r'''
import json, os, resource, signal, sys
a = json.loads(sys.argv[1])
work = a["work"]
iso = ["pgroup-kill", "rlimits", "private-cwd"] + (["audit-guard"] if a["guard"] else [])
libc = None
try:
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    if a["namespaces"] and libc.unshare(0x40000000 | 0x20000000) == 0:  # NEWNET | NEWPID
        iso += ["netns", "pidns"]
except Exception:
    pass
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)          # past RLIMIT_FSIZE a write fails
for what, soft, hard in ((resource.RLIMIT_AS, a["mem"], a["mem"]),
                         (resource.RLIMIT_CPU, a["cpu"], a["cpu"] + 1),
                         (resource.RLIMIT_FSIZE, a["fsize"], a["fsize"]),
                         (resource.RLIMIT_NOFILE, 64, 64), (resource.RLIMIT_CORE, 0, 0),
                         (resource.RLIMIT_NPROC, a["nproc"], a["nproc"])):
    resource.setrlimit(what, (soft, hard))
with open(os.path.join(work, "snippet.py"), encoding="utf-8") as f:
    src = f.read()
# What a math snippet imports, loaded before the uid drop (the stdlib may be unreadable then).
for m in ("math", "cmath", "fractions", "decimal", "itertools", "functools", "collections",
          "statistics", "random", "re", "string", "heapq", "bisect", "operator", "time",
          "socket", "encodings.idna"):
    try:
        __import__(m)
    except Exception:
        pass
if "pidns" in iso and os.geteuid() == 0:
    iso.append("uid-nobody")
with open(os.path.join(os.path.dirname(work), "isolation"), "w") as f:
    f.write(",".join(iso))
pid = os.fork()
if pid:
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    os._exit(code if code >= 0 else 128 - code)
try:
    if libc is not None:
        libc.prctl(1, signal.SIGKILL)                   # PR_SET_PDEATHSIG: dies with the runner
    if "uid-nobody" in iso:
        os.setgroups([])
        os.setgid(a["uid"])
        os.setuid(a["uid"])
    del libc
    for m in [m for m in sys.modules if m == "ctypes" or m.startswith(("ctypes.", "_ctypes"))]:
        del sys.modules[m]
    for name in ("setsid", "setpgid", "setpgrp"):
        for mod in (os, sys.modules.get("posix")):
            if mod is not None and hasattr(mod, name):
                delattr(mod, name)
    W = os.path.realpath(work)
    WRITE = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
    BANNED = {"socket.__new__", "socket.connect", "socket.bind", "socket.getaddrinfo",
              "socket.gethostbyname", "socket.sendto", "socket.sendmsg", "subprocess.Popen",
              "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.startfile", "os.kill",
              "os.killpg", "signal.pthread_kill", "resource.setrlimit", "resource.prlimit",
              "ctypes.dlopen", "ctypes.dlsym", "ctypes.cdata", "os.chroot", "os.setuid",
              "os.setgid", "os.mknod", "os.mkfifo"}
    PATHS = {"os.remove": (0,), "os.rmdir": (0,), "os.mkdir": (0,), "os.chmod": (0,),
             "os.chown": (0,), "os.truncate": (0,), "os.utime": (0,), "os.rename": (0, 1),
             "os.link": (0, 1), "os.symlink": (1,), "os.chflags": (0,), "os.lchflags": (0,),
             "shutil.rmtree": (0,), "shutil.move": (0, 1), "shutil.copyfile": (1,)}
    realpath, fsdecode, getcwd, join, sep = (os.path.realpath, os.fsdecode, os.getcwd,
                                             os.path.join, os.sep)

    def inside(p):
        if isinstance(p, int):
            return False
        full = realpath(join(getcwd(), fsdecode(p)))
        return full == W or full.startswith(W + sep)

    def guard(event, args):
        if event in BANNED:
            raise PermissionError(f"sandbox: {event} is not allowed")
        if event == "import" and args[0].split(".")[0] in ("ctypes", "_ctypes"):
            raise PermissionError("sandbox: ctypes is not allowed")
        if event == "open":
            path, mode, flags = args
            if isinstance(path, int):
                return
            if ((mode is not None and any(c in mode for c in "wax+"))
                    or (isinstance(flags, int) and flags & WRITE)) and not inside(path):
                raise PermissionError(f"sandbox: no writes outside the working directory "
                                      f"({fsdecode(path)!r})")
        elif event in PATHS:
            if event != "shutil.rmtree" and len(args) > 2 and args[-1] not in (None, -1) \
                    and event not in ("os.rename", "os.link", "os.symlink"):
                raise PermissionError(f"sandbox: {event} with dir_fd is not allowed")
            for i in PATHS[event]:
                if i < len(args) and not inside(args[i]):
                    raise PermissionError(f"sandbox: {event} outside the working directory "
                                          f"({fsdecode(args[i])!r})")

    if a["guard"]:
        sys.addaudithook(guard)
    g = {"__name__": "__main__", "__builtins__": __builtins__}
    code = 0
    try:
        exec(compile(src, "<snippet>", "exec"), g)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException as e:
        code = 1
        msg = str(e)
        try:
            print(f"{type(e).__name__}: {msg}" if msg else type(e).__name__)
        except BaseException:           # e.g. stdout past RLIMIT_FSIZE
            pass
    try:
        sys.stdout.flush()
    except Exception:
        pass
    os._exit(code & 0xFF)
except BaseException:
    os._exit(125)
'''


@dataclass
class SandboxResult:
    output: str                 # stdout + stderr, at most ``output_limit`` bytes (decoded)
    exit_code: Optional[int]    # the snippet's status (1: it raised); None: killed
    timed_out: bool             # stopped by the wall-clock timeout
    killed_by: Optional[str]    # signal name when the snippet was killed (SIGXCPU: CPU limit)
    truncated: bool             # output cut at ``output_limit``
    duration_s: float
    isolation: Tuple[str, ...]  # layers in effect (see the module docstring)
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
        try:
            os.chmod(os.path.dirname(p), 0o700)
            os.chmod(p, 0o700)
            func(p)
        except OSError:
            pass
    shutil.rmtree(path, onerror=unlock)


def run_python(code: str, *, timeout_s: float = 3.0, cpu_s: int = 2, memory_mb: int = 256,
               output_limit: int = 2048, file_limit_bytes: int = 1 << 20, max_procs: int = 64,
               namespaces: bool = True, _guard: bool = True) -> SandboxResult:
    """Run ``code`` with the limits above; never raises for anything the snippet does.

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
    namespaces : bool
        Try the network/PID namespaces and the uid drop (root on Linux).
    _guard : bool
        Tests only: False leaves the in-process guard out, to test the kernel layers alone.
    """
    if timeout_s <= 0 or cpu_s < 1 or memory_mb < 64 or output_limit < 1:
        raise ValueError(f"run_python: timeout_s > 0, cpu_s >= 1, memory_mb >= 64 and "
                         f"output_limit >= 1 expected, got {timeout_s}, {cpu_s}, {memory_mb}, "
                         f"{output_limit}")
    base = tempfile.mkdtemp(prefix="tora-sandbox-")
    work = os.path.join(base, "work")
    os.mkdir(work, 0o700)
    with open(os.path.join(work, "snippet.py"), "w", encoding="utf-8") as f:
        f.write(code)
    drop = namespaces and hasattr(os, "geteuid") and os.geteuid() == 0
    if drop:                        # the snippet may drop to nobody: its directory, its files
        os.chmod(base, 0o711)
        for p in (work, os.path.join(work, "snippet.py")):
            os.chown(p, NOBODY, NOBODY)
    args = json.dumps({"work": work, "mem": memory_mb << 20, "cpu": int(cpu_s),
                       "fsize": int(file_limit_bytes), "nproc": int(max_procs),
                       "namespaces": bool(namespaces), "uid": NOBODY, "guard": bool(_guard)})
    out_path = os.path.join(base, "output")
    t0 = time.monotonic()
    timed_out = False
    try:
        with open(out_path, "wb") as out:
            proc = subprocess.Popen([sys.executable, "-I", "-S", "-u", "-c", _RUNNER, args],
                                    stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                    cwd=work, env={"LANG": "C.UTF-8", "PATH": "/usr/bin:/bin"},
                                    start_new_session=True, close_fds=True)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            kill_all(proc.pid)      # the runner's group and session: leftovers die too
            proc.wait()
        duration = time.monotonic() - t0
        with open(out_path, "rb") as f:
            raw = f.read(output_limit + 1)
        try:
            with open(os.path.join(base, "isolation")) as f:
                isolation = tuple(f.read().split(","))
        except OSError:
            isolation = ()
    finally:
        _rmtree(base)
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
                         isolation=isolation, runner_pid=proc.pid)
