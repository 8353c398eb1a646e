"""The trainer's side of a sandbox run's containment: things the snippet cannot influence.

- :class:`RunCgroups`: a cgroup per run where this process may create one (root, or a
  delegated cgroup v2 subtree): cgroup v2 (``cgroup.kill``, ``cgroup.events``) for killing and
  waiting, cgroup v1 ``memory`` and ``pids`` (or the v2 controllers, where enabled) for the
  run's total memory and process count. The runner joins them before it forks anything, and
  nothing in the run can leave them (the cgroup filesystem is not mounted in its root and its
  processes have no capability).
- :func:`pidfd_for_init` / :func:`kill_and_wait`: a pidfd on the PID namespace's init; when
  the init exits, the kernel has killed and reaped every other process of the namespace, so a
  readable pidfd means the run is gone.
- :class:`RunUid`: as root, a host uid of its own per concurrent run (from ``UID_BASE``), so
  RLIMIT_NPROC and every other per-uid count is never shared between runs. Taken by binding an
  abstract unix socket named after it (released by the kernel when this process ends).
"""
import os
import random
import select
import signal
import socket
import time
import uuid
from typing import List, Optional

UID_BASE, UID_COUNT = 0x70000000, 1 << 16    # far above login users and /etc/subuid ranges
WAIT_S = 10.0                                 # bound on waiting for a killed run to be gone


class RunUid:
    """A host uid no other live run holds (root only)."""

    def __init__(self):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        start = random.randrange(UID_COUNT)
        for i in range(UID_COUNT):
            n = (start + i) % UID_COUNT
            try:
                self.sock.bind(f"\0tora-sandbox-uid-{UID_BASE + n}")
            except OSError:
                continue
            self.uid = UID_BASE + n
            return
        self.sock.close()
        raise RuntimeError("no free sandbox uid")

    def release(self) -> None:
        self.sock.close()


def _own_cgroups():
    """{controller or "": (mount point, this process's cgroup path under it)}."""
    own = {}
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, ctrls, path = line.rstrip("\n").split(":", 2)
            for c in (ctrls.split(",") if ctrls else [""]):
                own[c] = path
    out = {}
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, right = line.split(" - ", 1)
            fields, (fstype, _src, opts) = left.split(), right.split()[:3]
            root, mnt = fields[3], fields[4]
            if fstype == "cgroup2":
                keys = [""]
            elif fstype == "cgroup":
                keys = [o for o in opts.split(",") if o in ("memory", "pids")]
            else:
                continue
            for k in keys:
                path = own.get(k)
                if path is not None and k not in out and (path + "/").startswith(
                        root.rstrip("/") + "/"):
                    out[k] = (mnt, path[len(root.rstrip("/")):])
    return out


def _write(path: str, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


_SWEPT = set()     # cgroup directories this process has swept of dead trainers' run cgroups


def _remove_stale(parent: str) -> None:
    """Remove the (empty) run cgroups a killed trainer left: named after a pid that is gone
    (one that is alive, or reused, keeps them; a cgroup with processes cannot be removed)."""
    try:
        names = os.listdir(parent)
    except OSError:
        return
    for n in names:
        parts = n.split("-")
        if len(parts) != 4 or parts[:2] != ["tora", "sandbox"] or not parts[2].isdigit():
            continue
        try:
            os.kill(int(parts[2]), 0)
            continue
        except ProcessLookupError:
            pass
        except OSError:
            continue
        try:
            os.rmdir(os.path.join(parent, n))
        except OSError:
            pass


class RunCgroups:
    """The run's cgroups: whatever of v2 (kill) / memory / pids could be created here."""

    def __init__(self, memory_bytes: int, max_procs: int):
        self.v2: Optional[str] = None
        self.dirs: List[str] = []
        self.memory: Optional[str] = None
        self.layers: List[str] = []
        if not os.path.isdir("/sys/fs/cgroup"):
            return
        try:
            own = _own_cgroups()
        except (OSError, ValueError):
            return
        name = f"tora-sandbox-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        for key in ("", "memory", "pids"):
            if key not in own:
                continue
            mnt, path = own[key]
            if (mnt, path) not in _SWEPT:
                _SWEPT.add((mnt, path))
                _remove_stale(mnt + path)
            d = os.path.join(mnt + path, name)
            try:
                os.mkdir(d, 0o700)
            except OSError:
                continue
            self.dirs.append(d)
            if key == "":
                self.v2 = d
                self.layers.append("cgroup-kill")
                ctrls = _read(os.path.join(d, "cgroup.controllers")).split()
                if "memory" in ctrls and "memory" not in own:
                    self._limit(d, "memory.max", memory_bytes, "cgroup-memory")
                    self._limit(d, "memory.swap.max", 0, None)
                    self.memory = d
                if "pids" in ctrls and "pids" not in own:
                    self._limit(d, "pids.max", max_procs, "cgroup-pids")
            elif key == "memory":
                if self._limit(d, "memory.limit_in_bytes", memory_bytes, "cgroup-memory"):
                    self.memory = d
                    self._limit(d, "memory.memsw.limit_in_bytes", memory_bytes, None)
            else:
                self._limit(d, "pids.max", max_procs, "cgroup-pids")

    def _limit(self, d, name, value, layer) -> bool:
        try:
            _write(os.path.join(d, name), str(value))
        except OSError:
            return False
        if layer:
            self.layers.append(layer)
        return True

    def join(self, pid: int) -> bool:
        """Put ``pid`` (the runner, before it forks) in every cgroup; False if one failed."""
        ok = True
        for d in self.dirs:
            try:
                _write(os.path.join(d, "cgroup.procs"), str(pid))
            except OSError:
                ok = False
        return ok

    def memory_exceeded(self) -> bool:
        if self.memory is None:
            return False
        try:
            if self.memory == self.v2:
                events = _read(os.path.join(self.memory, "memory.events")).split()
                return int(events[events.index("oom_kill") + 1]) > 0
            for line in _read(os.path.join(self.memory, "memory.oom_control")).splitlines():
                if line.startswith("oom_kill "):
                    return int(line.split()[1]) > 0
            return int(_read(os.path.join(self.memory, "memory.failcnt"))) > 0
        except (OSError, ValueError, IndexError):
            return False

    def _pids(self, d: str) -> List[int]:
        try:
            return [int(x) for x in _read(os.path.join(d, "cgroup.procs")).split()]
        except (OSError, ValueError):
            return []

    def kill_and_wait(self, deadline: float) -> bool:
        """SIGKILL every process in the run's cgroups, wait (until ``deadline``) until they
        are empty, remove them. True when empty."""
        if self.v2:
            try:
                _write(os.path.join(self.v2, "cgroup.kill"), "1")
            except OSError:
                pass
        empty = False
        while True:
            left = [p for d in self.dirs for p in self._pids(d)]
            if not left:
                empty = True
                break
            for p in left:                        # v1 only: no cgroup.kill
                try:
                    os.kill(p, signal.SIGKILL)
                except OSError:
                    pass
            if time.monotonic() > deadline:
                break
            time.sleep(0.01)
        if empty:
            for d in self.dirs:
                try:
                    os.rmdir(d)
                except OSError:
                    pass
        return empty


def pidfd_for_init(pid: int) -> Optional[int]:
    """A pidfd on ``pid`` if it is the init (pid 1) of a PID namespace below ours, else None.
    The init waits for the trainer's ``go`` before it starts the snippet, so it is alive and
    its pid cannot have been reused here."""
    if not hasattr(os, "pidfd_open"):
        return None
    try:
        fd = os.pidfd_open(pid)
    except OSError:
        return None
    try:
        with open(f"/proc/{pid}/status") as f:
            nspid = next((line.split()[1:] for line in f if line.startswith("NSpid:")), [])
    except OSError:
        nspid = []
    if len(nspid) < 2 or nspid[-1] != "1":
        os.close(fd)
        return None
    return fd


def kill_init(pidfd: int, pid: int) -> None:
    """SIGKILL the namespace's init (the kernel then kills the rest); back to the normal
    scheduling class first, so that a lowered priority does not stretch the teardown."""
    try:
        os.sched_setscheduler(pid, os.SCHED_OTHER, os.sched_param(0))
    except (OSError, AttributeError):
        pass
    try:
        signal.pidfd_send_signal(pidfd, signal.SIGKILL)
    except OSError:
        pass


def wait_gone(pidfd: int, deadline: float) -> bool:
    """True once the init has exited: the kernel reaped the namespace's other processes
    before letting it exit."""
    while True:
        left = deadline - time.monotonic()
        if select.select([pidfd], [], [], max(left, 0))[0]:
            return True
        if left <= 0:
            return False
