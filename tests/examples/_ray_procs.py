"""Process and sample helpers shared by the Ray engine tests (Linux /proc)."""
import os
import time


def alive(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def session_processes(driver_pid: int):
    """Live pids holding files of the Ray session that ``driver_pid`` started (its session
    directory ends in ``_<driver pid>``)."""
    mark, out = f"_{driver_pid}/", []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            fds = os.listdir(f"/proc/{name}/fd")
            if any(mark in os.readlink(f"/proc/{name}/fd/{fd}") for fd in fds) \
                    and alive(int(name)):
                out.append(int(name))
        except OSError:
            pass
    return out


def take(rollout, n, timeout=60.0):
    """``n`` samples from a running rollout, failing on its error or after ``timeout`` s."""
    out, deadline = [], time.monotonic() + timeout
    while len(out) < n:
        assert time.monotonic() < deadline, f"only {len(out)} of {n} samples"
        assert rollout.alive(), rollout.error
        s = rollout.get(0.5)
        if s is not None:
            out.append(s)
    return out
