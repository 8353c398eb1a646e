"""The Ray instance the engines run on: imported lazily (``ray`` is optional for the rest of
the example), started locally on the loopback interface only, or joined (``--ray-address``),
and never left behind by a driver that dies.
"""
import contextlib
import math
import os
import subprocess
import sys
from typing import List, Optional

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))
_LOCAL_ONLY_VAR = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


class RayUnavailable(ImportError):
    """``ray`` is not installed (``pip install ray``)."""


def import_ray():
    try:
        import ray
    except ImportError as err:
        raise RayUnavailable(f"rollout engines run as Ray actors: pip install ray ({err})") \
            from None
    return ray


def init_ray(address: str = "", num_cpus: Optional[float] = None):
    """``ray.init`` once: a local instance (``address=""``, cheap: no dashboard, worker logs
    not forwarded, this repository on the workers' ``PYTHONPATH``; never a cluster that
    ``ray start`` left on this machine; every server of it listening on 127.0.0.1 only,
    :func:`_loopback_only`) with ``num_cpus`` logical CPUs (at least the cores), or an
    existing cluster (this checkout's path put on its workers' ``PYTHONPATH``: a
    cluster whose nodes have the repository at the same path needs nothing else)."""
    ray = import_ray()
    if ray.is_initialized():
        return ray
    path = os.environ.get("PYTHONPATH", "")
    if REPO_ROOT not in path.split(os.pathsep):
        os.environ["PYTHONPATH"] = REPO_ROOT + (os.pathsep + path if path else "")
    kwargs = dict(include_dashboard=False, log_to_driver=False, logging_level="WARNING",
                  configure_logging=True)
    if address:
        ray.init(address=address, runtime_env={"env_vars": {
            "PYTHONPATH": REPO_ROOT + os.pathsep + "${PYTHONPATH}"}}, **kwargs)
    else:
        with _loopback_only():
            ray.init(address="local", num_cpus=max(2, os.cpu_count() or 2,
                                                   math.ceil(num_cpus or 0)),
                     _node_ip_address="127.0.0.1", **kwargs)
        _watch_local_instance(ray)
    return ray


@contextlib.contextmanager
def _loopback_only():
    """A local instance whose GCS, raylet, workers and agents listen on 127.0.0.1 only.

    Ray's servers bind to every interface unless the node's address is the loopback one,
    and ``ray.init`` turns ``_node_ip_address="127.0.0.1"`` into the machine's external
    address unless Ray runs in its single-machine mode (the default on macOS / Windows,
    chosen by ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``; read when ray is imported, so the
    flag is also set on the imported module: not public API). The variable is inherited
    by the processes ``ray.init`` starts (their workers too) and restored here after."""
    from ray._private import ray_constants
    saved_env, saved = os.environ.get(_LOCAL_ONLY_VAR), ray_constants.ENABLE_RAY_CLUSTER
    os.environ[_LOCAL_ONLY_VAR] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = saved
        if saved_env is None:
            os.environ.pop(_LOCAL_ONLY_VAR, None)
        else:
            os.environ[_LOCAL_ONLY_VAR] = saved_env


# Run by _watch_local_instance: waits for EOF on stdin (the driver is gone, however it went),
# gives Ray's own shutdown 2 s, then SIGKILLs every process with a file open in the session
# directory (argv[1]).
_WATCHDOG = r"""
import os, signal, sys, time
sys.stdin.buffer.read()
time.sleep(2.0)
for pid in os.listdir("/proc"):
    if not pid.isdigit() or int(pid) == os.getpid():
        continue
    try:
        fds = "/proc/%s/fd" % pid
        if any(os.readlink(os.path.join(fds, fd)).startswith(sys.argv[1])
               for fd in os.listdir(fds)):
            os.kill(int(pid), signal.SIGKILL)
    except OSError:
        pass
"""
_WATCHDOGS: List[tuple] = []


def _watch_local_instance(ray) -> None:
    """Linux: a watchdog process for the local instance just started. When the driver dies
    without shutting Ray down (SIGKILL), its gcs and raylet go with it, but Ray's per-node
    agents (DashboardAgent, RuntimeEnvAgent) block for 60 s publishing the raylet's death to
    the dead GCS before they exit; the watchdog ends them 2 s after the driver. It holds the
    read end of a pipe whose write end only the driver has (not inherited), started in its
    own session (a Ctrl-C to the terminal's process group does not reach it)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        session = ray._private.worker._global_node.get_session_dir_path()   # not public API
    except Exception:
        return
    read, write = os.pipe()
    try:
        proc = subprocess.Popen([sys.executable, "-c", _WATCHDOG, session.rstrip(os.sep) + os.sep],
                                stdin=read, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                cwd="/", start_new_session=True, close_fds=True)
    except OSError:
        os.close(write)
        return
    finally:
        os.close(read)
    _WATCHDOGS.append((proc, write))            # the write end stays open while we live
