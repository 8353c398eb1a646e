"""The sandbox's runner: ``python -I -S -u sandbox_runner.py <report fd> <trainer pid>``,
started by :func:`examples.async_trainer.env.sandbox.run_python` in its own session; it dies
with the trainer. Not imported: it runs as a script and imports the standard library only
(the snippet runs in its interpreter: nothing here is a barrier until the kernel enforces it).

Protocol with the trainer (who holds the other ends):

- stdin, line 1: the config (JSON, below), written once the trainer has put this process in
  the run's cgroups; nothing is forked before it arrives.
- report fd, line 1: the verdict, ``ok <init pid> <layers>``, ``none`` (unsafe) or
  ``refused <reasons>``; written before the snippet's first line runs, so the snippet cannot
  forge it (the trainer reads it, then stops trusting this pipe's isolation claims).
- stdin, line 2: ``go`` once the trainer holds a pidfd on the namespace's init; only then does
  the init fork the snippet.
- report fd, last line: ``status exit <code>`` or ``status signal <n> <cpu seconds>``, the
  snippet's wait status as the init (or, unsafe, the runner) saw it.

For each isolation method in turn it forks a *setup* process that enters the namespaces and
builds the new root, whose child (the new PID namespace's *init*) drops privileges, sets the
limits and the seccomp filter and tells the setup process, which writes the ``ok`` line (one
writer, one write), before the init forks the *snippet* process. A step that fails is reported
instead (``fail <method>: <why>``), the setup process is killed (its init dies with it) and the
next method is tried, so a snippet never runs half-isolated.

The config (JSON): ``code``, ``methods`` (``"rootns"``, ``"userns"``), ``unsafe``, ``binds``
(``[host path, path in the new root]``, read-only), ``stdlib`` (``[host, neutral]``: the
interpreter's standard library and where the snippet sees it), ``root`` (an empty directory,
the new root's mount point), ``work`` (the unsafe mode's directory), ``uid`` (the run's own
host uid as root, else null), ``unsafe_uid`` (the uid an unsafe run drops to, or null),
``disk`` (bytes of the run's tmpfs), ``mem``/``cpu``/``fsize``/``nproc`` (the rlimits).
"""
import ctypes
import json
import os
import resource
import select
import signal
import sys

NS = 0x00020000 | 0x20000000 | 0x40000000 | 0x08000000 | 0x04000000  # mount pid net ipc uts
NEWUSER, NEWCGROUP = 0x10000000, 0x02000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_PRIVATE, MS_REC = 1024, 2048, 4096, 1 << 18, 16384
MS_RELATIME = 1 << 21
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 1, 38, 22, 2
NEUTRAL_PYTHON = "/opt/python"       # the interpreter's files as the snippet sees them
# Per architecture: the audit arch, whether the x32 ABI exists, the syscall numbers used here,
# and those the filter denies: execve execveat ptrace mount umount2 pivot_root chroot unshare
# setns bpf add_key request_key keyctl perf_event_open userfaultfd process_vm_readv/writev
# name_to_handle_at open_by_handle_at kexec_load kexec_file_load init/finit/delete_module
# reboot swapon swapoff io_uring_setup/enter/register open_tree move_mount fsopen fsconfig
# fsmount fspick mount_setattr; then sched_setparam sched_setscheduler sched_setattr
# setpriority (a SCHED_IDLE init would stretch the teardown) and statmount listmount (they
# name the host paths of the bind mounts).
ARCH = {"x86_64": dict(audit=0xC000003E, x32=True, pivot_root=155, capset=126, socket=41,
                       clone=56, clone3=435,
                       deny=(59, 322, 101, 165, 166, 155, 161, 272, 308, 321, 248, 249, 250,
                             298, 323, 310, 311, 303, 304, 246, 320, 175, 313, 176, 169, 167,
                             168, 425, 426, 427, 428, 429, 430, 431, 432, 433, 442,
                             142, 144, 314, 141, 457, 458)),
        "aarch64": dict(audit=0xC00000B7, x32=False, pivot_root=41, capset=91, socket=198,
                        clone=220, clone3=435,
                        deny=(221, 281, 117, 40, 39, 41, 51, 97, 268, 280, 217, 218, 219, 241,
                              282, 270, 271, 264, 265, 104, 294, 105, 273, 106, 142, 224, 225,
                              425, 426, 427, 428, 429, 430, 431, 432, 433, 442,
                              118, 119, 274, 140, 457, 458))}
libc = ctypes.CDLL(None, use_errno=True)


def check(ret, what):
    if ret != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"{what}: {os.strerror(e)}")


def mount(src, dst, fstype, flags, data=None):
    check(libc.mount(src and src.encode(), dst.encode(), fstype and fstype.encode(),
                     ctypes.c_ulong(flags), data and data.encode()), f"mount {src} on {dst}")


def locked_flags(path):
    """Flags a bind remount must keep: a user namespace may not clear them."""
    f, out = os.statvfs(path).f_flag, 0
    for st, ms in ((os.ST_NOSUID, MS_NOSUID), (os.ST_NODEV, MS_NODEV), (os.ST_NOEXEC, MS_NOEXEC),
                   (os.ST_NOATIME, MS_NOATIME), (os.ST_NODIRATIME, MS_NODIRATIME),
                   (os.ST_RELATIME, MS_RELATIME)):
        out |= ms if f & st else 0
    return out


O_PATH = getattr(os, "O_PATH", 0o10000000)


def source(path):
    """What a bind needs of a host path, taken while the setup process can still reach it
    (as root in a user namespace it then becomes the run's uid, which may not traverse the
    path's parents, e.g. a root-only home): ("link", target) or (fd, is a directory, flags)."""
    if os.path.islink(path):                          # /bin -> usr/bin on merged-/usr
        return ("link", os.readlink(path))
    fd = os.open(path, O_PATH | os.O_CLOEXEC)
    return (fd, os.path.isdir(path), locked_flags(path))


def bind_ro(src, dst, device=False):
    """Bind ``src`` (from :func:`source`) read-only at ``dst`` (relative to the new root, the
    working directory). A device node keeps working: writes to a device do not need a
    writable mount, but chmod / chown / utimes fail with EROFS."""
    parent = os.path.dirname(dst)
    if parent:
        os.makedirs(parent, 0o755, exist_ok=True)
    if src[0] == "link":
        os.symlink(src[1], dst)
        return
    fd, is_dir, flags = src
    if is_dir:
        os.makedirs(dst, 0o755, exist_ok=True)
    else:
        open(dst, "w").close()
    mount(f"/proc/self/fd/{fd}", dst, None, MS_BIND)
    os.close(fd)
    mount(None, dst, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID
          | (0 if device else MS_NODEV) | flags)


def new_root(cfg, arch, owner, become=None):
    """A read-only tmpfs with read-only binds of what the interpreter needs (its standard
    library at a neutral path, its own site-packages hidden), a size-limited tmpfs at /sandbox
    owned by ``owner`` (the run's directory: nothing of it reaches the host's disk); then
    pivot_root into it and detach the old root. ``become()`` runs once the host paths are
    open and the new root is the working directory (the switch to the run's uid)."""
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    host_lib, lib = cfg["stdlib"]
    binds = [(source(src), dst) for src, dst in cfg["binds"]] + [(source(host_lib), lib)]
    hide_site = os.path.isdir(host_lib + "/site-packages")
    mount("tmpfs", cfg["root"], "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=0755,uid=0,gid=0")
    os.chdir(cfg["root"])
    if become:
        become()
    for src, dst in binds:
        bind_ro(src, dst.lstrip("/"), device=dst.startswith("/dev/"))
    if hide_site:                                     # third-party packages: not the snippet's
        mount("tmpfs", lib.lstrip("/") + "/site-packages", "tmpfs",
              MS_RDONLY | MS_NOSUID | MS_NODEV, "size=4k,mode=0755")
    os.mkdir("sandbox", 0o755)
    mount("tmpfs", "sandbox", "tmpfs", MS_NOSUID | MS_NODEV,
          f"size={cfg['disk']},nr_inodes=4096,mode=0700,uid={owner},gid={owner}")
    os.mkdir(".old", 0o700)
    check(libc.syscall(arch["pivot_root"], b".", b".old"), "pivot_root")
    os.chdir("/")
    check(libc.umount2(b"/.old", 2), "umount old root")   # MNT_DETACH
    os.rmdir("/.old")
    mount(None, "/", None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)


def seccomp(arch):
    """EPERM for the denied syscalls, sockets other than AF_UNIX and clone with namespace
    flags; ENOSYS for clone3 (its flags are in memory a filter cannot read; libc falls back to
    clone); kill on a foreign syscall ABI. Classic BPF over struct seccomp_data
    {int nr; u32 arch; u64 ip; u64 args[6]} (args[0]'s low half at offset 16)."""
    LD, JEQ, JGE, JSET, RET = 0x20, 0x15, 0x35, 0x45, 0x06          # (code, jt, jf, k)
    KILL, ALLOW, EPERM, ENOSYS = 0x80000000, 0x7FFF0000, 0x50000 | 1, 0x50000 | 38
    prog = [(LD, 0, 0, 4), (JEQ, 1, 0, arch["audit"]), (RET, 0, 0, KILL), (LD, 0, 0, 0)]
    if arch["x32"]:
        prog += [(JGE, 0, 1, 0x40000000), (RET, 0, 0, KILL)]
    for nr in arch["deny"]:
        prog += [(JEQ, 0, 1, nr), (RET, 0, 0, EPERM)]
    prog += [(JEQ, 0, 1, arch["clone3"]), (RET, 0, 0, ENOSYS),
             (JEQ, 0, 4, arch["socket"]), (LD, 0, 0, 16), (JEQ, 0, 1, 1),   # AF_UNIX = 1
             (RET, 0, 0, ALLOW), (RET, 0, 0, EPERM),
             (JEQ, 0, 4, arch["clone"]), (LD, 0, 0, 16), (JSET, 0, 1, NS | NEWUSER | NEWCGROUP),
             (RET, 0, 0, EPERM), (RET, 0, 0, ALLOW),
             (RET, 0, 0, ALLOW)]

    class Filter(ctypes.Structure):
        _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8),
                    ("k", ctypes.c_uint32)]

    class Prog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_uint16), ("filter", ctypes.POINTER(Filter))]

    table = (Filter * len(prog))(*[Filter(*i) for i in prog])
    check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
    check(libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(Prog(len(prog), table)),
                     0, 0), "seccomp")


def drop_caps(arch):
    hdr = (ctypes.c_uint32 * 2)(0x20080522, 0)                       # _LINUX_CAPABILITY_VERSION_3
    data = (ctypes.c_uint32 * 6)()                                   # all sets empty
    check(libc.syscall(arch["capset"], hdr, data), "capset")


def set_limits(cfg):
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)      # past RLIMIT_FSIZE a write fails
    for what, soft, hard in ((resource.RLIMIT_AS, cfg["mem"], cfg["mem"]),
                             (resource.RLIMIT_CPU, cfg["cpu"], cfg["cpu"] + 1),
                             (resource.RLIMIT_FSIZE, cfg["fsize"], cfg["fsize"]),
                             (resource.RLIMIT_NOFILE, 64, 64), (resource.RLIMIT_CORE, 0, 0),
                             (resource.RLIMIT_NPROC, cfg["nproc"], cfg["nproc"])):
        resource.setrlimit(what, (soft, hard))


def neutral_interpreter(cfg):
    """Point the interpreter at the neutral copy of its standard library: ``sys.path``, the
    prefixes and the loaded modules' files name no host path."""
    host, neutral = cfg["stdlib"]
    sys.path[:] = [neutral, neutral + "/lib-dynload"]
    for name in ("prefix", "exec_prefix", "base_prefix", "base_exec_prefix"):
        setattr(sys, name, NEUTRAL_PYTHON)
    sys.executable = NEUTRAL_PYTHON + "/bin/python3"
    sys.path_importer_cache.clear()
    for mod in list(sys.modules.values()):
        for attr in ("__file__", "__cached__"):
            value = getattr(mod, attr, None)
            if isinstance(value, str) and value.startswith(host + "/"):
                try:
                    setattr(mod, attr, neutral + value[len(host):])
                except (AttributeError, TypeError):
                    pass
        path = getattr(mod, "__path__", None)           # a package's submodules
        if isinstance(path, list):
            path[:] = [neutral + p[len(host):] if isinstance(p, str) and p.startswith(host + "/")
                       else p for p in path]
        spec = getattr(mod, "__spec__", None)
        origin = getattr(spec, "origin", None)
        if isinstance(origin, str) and origin.startswith(host + "/"):
            try:
                spec.origin = neutral + origin[len(host):]
            except (AttributeError, TypeError):
                pass


def run_snippet(src, close=()):
    """Run the snippet; its exception becomes one ``Type: message`` line. Never returns."""
    for fd in close:
        os.close(fd)
    try:                                # stdin: nothing (not the trainer's pipe)
        null = os.open("/dev/null", os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
    except OSError:
        os.close(0)
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
    except BaseException:
        pass
    os._exit(code & 0xFF)


def describe(status, rusage):
    """The wait status as a report line: ``exit <code>`` or ``signal <n> <cpu seconds>``."""
    if os.WIFSIGNALED(status):
        return f"signal {os.WTERMSIG(status)} {rusage.ru_utime + rusage.ru_stime:.3f}"
    return f"exit {os.waitstatus_to_exitcode(status)}"


def wait_and_report(pid, status_w):
    """Wait for the snippet, write its status on ``status_w``, exit. Never returns."""
    _, status, rusage = os.wait4(pid, 0)
    try:
        os.write(status_w, describe(status, rusage).encode())
    finally:
        os._exit(0)


def map_to(uid, method_pipe):
    """As root: a helper that writes the setup process's uid / gid maps once it has entered
    its user namespace (ns uid 0 -> the run's uid; writing another uid's map needs
    CAP_SETUID in the parent namespace, which the setup process no longer has)."""
    (r, w), (r2, w2) = method_pipe
    if os.fork() == 0:
        os.close(w)
        os.close(r2)
        ok = b"n"
        try:
            if os.read(r, 1) == b"x":
                ppid = os.getppid()
                for name, text in (("setgroups", "deny"), ("uid_map", f"0 {uid} 1"),
                                   ("gid_map", f"0 {uid} 1")):
                    with open(f"/proc/{ppid}/{name}", "w") as f:
                        f.write(text)
                ok = b"x"
        finally:
            os.write(w2, ok)
            os._exit(0)


def isolated(cfg, method, report, status_w, go_r):
    """The setup process: namespaces and new root, then pid 1 of the new PID namespace, then
    the snippet as its child. Never returns."""
    arch = ARCH.get(os.uname().machine)
    if arch is None:
        raise OSError(f"no seccomp filter for architecture {os.uname().machine}")
    uid, gid, root_user = os.getuid(), os.getgid(), os.geteuid() == 0
    run_uid = cfg["uid"]
    if root_user:
        os.setgroups([])                 # root's supplementary groups stay on the host side
    if method == "rootns":
        if not root_user:
            raise OSError("rootns needs root")
        check(libc.unshare(NS), "unshare")
        owner = run_uid
    elif root_user:
        # Never uid 0 mapped to host root: the namespace's uid 0 is the run's own uid.
        pipes = (os.pipe(), os.pipe())
        map_to(run_uid, pipes)
        (r, w), (r2, w2) = pipes
        os.close(r)
        os.close(w2)
        check(libc.unshare(NS | NEWUSER), "unshare")
        os.write(w, b"x")
        if os.read(r2, 1) != b"x":
            raise OSError("could not map the user namespace to the run's uid")
        os.waitpid(-1, 0)
        owner = 0
    else:
        check(libc.unshare(NS | NEWUSER), "unshare")
        for name, text in (("setgroups", "deny"), ("uid_map", f"0 {uid} 1"),
                           ("gid_map", f"0 {gid} 1")):
            with open(f"/proc/self/{name}", "w") as f:
                f.write(text)
        owner = 0

    def become_run_uid():
        os.setresgid(0, 0, 0)            # kernel ids: the run's uid / gid from now on
        os.setresuid(0, 0, 0)

    new_root(cfg, arch, owner, become_run_uid if method == "userns" and root_user else None)
    check(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL), "pdeathsig")     # dies with the runner
    alive_r, alive_w = os.pipe()       # EOF on alive_r: this setup process is gone
    # The init tells this process (not the runner) its layers or its failure: the "ok" line
    # has one writer and one write. (The init once wrote its half straight to the runner;
    # when this process was descheduled after the fork, the init's half came first, the
    # runner read a malformed line as a failure and waited for this process, which waited
    # for the init, which waited for "go": a run hung until the trainer's timeout.)
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid:
        for fd in (alive_r, ready_w, status_w, go_r):
            os.close(fd)
        said = read_all(ready_r)
        if said.startswith("layers "):
            said = f"ok {pid} {said[7:]}"           # the init's pid (in the runner's ns)
        os.write(report, (said or f"fail {method}: the init ended without a report").encode())
        os.close(report)
        os.waitpid(pid, 0)
        os._exit(0)
    try:
        os.close(alive_w)
        os.close(ready_r)
        os.close(report)
        os.setsid()                    # kill(0, ...) reaches this namespace's processes only
        if method == "rootns":
            os.setresgid(run_uid, run_uid, run_uid)
            os.setresuid(run_uid, run_uid, run_uid)
        os.chdir("/sandbox")
        set_limits(cfg)
        drop_caps(arch)
        seccomp(arch)
        # A credential change clears the parent-death signal: set it last, then make sure the
        # setup process did not die before (no one would kill this process at the timeout).
        check(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL), "pdeathsig")
        if select.select([alive_r], [], [], 0)[0]:
            raise OSError("setup process gone")
        os.close(alive_r)
        uid_layer = "uid-per-run" if method == "rootns" or root_user else "no-capabilities"
        os.write(ready_w, ("layers " + ",".join((method, "mountns", "pidns", "netns", "ipcns",
                                                 uid_layer, "tmpfs-quota", "seccomp",
                                                 "rlimits"))).encode())
        os.close(ready_w)
    except BaseException as e:
        os.write(ready_w, f"fail {method}: {e}".encode())
        os._exit(126)
    # The namespace's init ignores signals it has no handler for (RLIMIT_CPU's SIGXCPU too):
    # the snippet runs as its child, and when it ends init exits and the kernel kills the rest.
    signal.signal(signal.SIGINT, signal.SIG_DFL)    # no KeyboardInterrupt for the snippet to
    if os.read(go_r, 2) != b"go":                   # raise in init (it would end the run)
        os._exit(0)                                 # the trainer gave up: never start it
    neutral_interpreter(cfg)
    child = os.fork()
    if child:
        os.close(go_r)
        wait_and_report(child, status_w)
    run_snippet(cfg["code"], close=(go_r, status_w))


def try_method(cfg, method, status_w, go_r):
    """Fork the setup process: (the init's pid, the layers) once the snippet is about to
    start, else (None, why)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            isolated(cfg, method, w, status_w, go_r)
        except BaseException as e:
            try:
                os.write(w, f"fail {method}: {e}".encode())
            finally:
                os._exit(126)
    os.close(w)
    msg = read_all(r)
    parts = msg.split(" ", 2)
    if (len(parts) == 3 and parts[0] == "ok" and parts[1].isdigit()
            and parts[2].startswith(method + ",")):
        return int(parts[1]), parts[2]
    if msg and not msg.startswith(f"fail {method}: "):
        msg = f"fail {method}: malformed report {msg[:200]!r}"
    # Not started: the setup process goes (and its init with it, by the parent-death
    # signal) before the next method, whatever state it is in.
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return None, msg or f"fail {method}: setup ended without a report"


def read_all(fd):
    """Everything written to the pipe ``fd`` until its last writer closes it; closes it."""
    chunks = []
    while True:
        b = os.read(fd, 4096)
        if not b:
            break
        chunks.append(b)
    os.close(fd)
    return b"".join(chunks).decode("utf-8", "replace")


def main(report, trainer):
    # Die with the trainer (a killed trainer must not leave a run behind; the setup and init
    # processes die with this one in turn), unless it is gone already.
    check(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL), "pdeathsig")
    if os.getppid() != trainer:
        os._exit(1)
    cfg = json.loads(sys.stdin.readline())

    def send(line):
        os.write(report, (line.replace("\n", " ") + "\n").encode())

    status_r, status_w = os.pipe()
    go_r, go_w = os.pipe()
    reasons = []
    for method in cfg["methods"]:
        init, msg = try_method(cfg, method, status_w, go_r)
        if init:
            os.close(status_w)
            os.close(go_r)
            send(f"ok {init} {msg}")
            if sys.stdin.readline().strip() == "go":
                os.write(go_w, b"go")
            os.close(go_w)
            status = read_all(status_r)        # EOF: the init and the snippet are gone
            os.waitpid(-1, 0)                     # the setup process (its CPU time counts)
            send("status " + status if status else "status none")
            os._exit(0)
        reasons.append(msg)
    if not cfg["unsafe"]:
        send("refused " + "; ".join(reasons))
        os._exit(0)
    send("none")
    if sys.stdin.readline().strip() != "go":
        os._exit(0)
    os.chdir(cfg["work"])
    pid = os.fork()
    if pid == 0:
        os.close(report)
        uid = cfg["unsafe_uid"]
        if uid is not None:                       # root: the run's own uid where it can
            os.setgroups([])
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)
        set_limits(cfg)
        run_snippet(cfg["code"], close=(status_r, status_w, go_r, go_w))
    _, status, rusage = os.wait4(pid, 0)
    send("status " + describe(status, rusage))
    os._exit(0)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
