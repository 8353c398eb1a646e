"""The sandbox's runner: ``python -I -S -u sandbox_runner.py <json>``, started by
:func:`examples.async_trainer.sandbox.run_python` in its own session with the snippet's
private directory as working directory (``snippet.py`` in it). Not imported: it runs as a
script and imports the standard library only (the snippet runs in its interpreter: nothing
here is a barrier until the kernel enforces it).

For each isolation method in turn it forks a *setup* process that enters the namespaces and
builds the new root, whose child (the new PID namespace's *init*) drops privileges, sets the
limits and the seccomp filter and reports ``ok <layers>`` on a pipe before forking the
*snippet* process. A step that fails is reported instead (``fail <method>: <why>``) and the
next method is tried, so a snippet never runs half-isolated. The runner writes the layers (or
``refused: <reasons>``, or ``none`` with ``unsafe``) to ``../isolation`` and exits with the
snippet's status (128 + signal when it was killed).

The config (JSON): ``methods`` (``"rootns"``, ``"userns"``), ``unsafe``, ``binds`` (host paths
mounted read-only), ``root`` (an empty directory, the new root's mount point), ``nobody``,
``mem``/``cpu``/``fsize``/``nproc`` (the rlimits).
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
# Per architecture: the audit arch, whether the x32 ABI exists, the syscall numbers used here,
# and those the filter denies: execve execveat ptrace mount umount2 pivot_root chroot unshare
# setns bpf add_key request_key keyctl perf_event_open userfaultfd process_vm_readv/writev
# name_to_handle_at open_by_handle_at kexec_load kexec_file_load init/finit/delete_module
# reboot swapon swapoff io_uring_setup/enter/register open_tree move_mount fsopen fsconfig
# fsmount fspick mount_setattr.
ARCH = {"x86_64": dict(audit=0xC000003E, x32=True, pivot_root=155, capset=126, socket=41,
                       clone=56, clone3=435,
                       deny=(59, 322, 101, 165, 166, 155, 161, 272, 308, 321, 248, 249, 250,
                             298, 323, 310, 311, 303, 304, 246, 320, 175, 313, 176, 169, 167,
                             168, 425, 426, 427, 428, 429, 430, 431, 432, 433, 442)),
        "aarch64": dict(audit=0xC00000B7, x32=False, pivot_root=41, capset=91, socket=198,
                        clone=220, clone3=435,
                        deny=(221, 281, 117, 40, 39, 41, 51, 97, 268, 280, 217, 218, 219, 241,
                              282, 270, 271, 264, 265, 104, 294, 105, 273, 106, 142, 224, 225,
                              425, 426, 427, 428, 429, 430, 431, 432, 433, 442))}
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


def new_root(cfg, arch, work):
    """A read-only tmpfs with read-only binds of what the interpreter needs and the private
    directory at /sandbox; pivot_root into it and detach the old root."""
    root = cfg["root"]
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=0755")
    for src in cfg["binds"]:
        dst = root + src
        os.makedirs(os.path.dirname(dst), 0o755, exist_ok=True)
        if os.path.islink(src):                           # /bin -> usr/bin on merged-/usr
            os.symlink(os.readlink(src), dst)
            continue
        if os.path.isdir(src):
            os.makedirs(dst, 0o755, exist_ok=True)
        else:
            open(dst, "w").close()
        mount(src, dst, None, MS_BIND)
        if not src.startswith("/dev/"):                   # device nodes stay as they are
            mount(None, dst, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV
                  | locked_flags(src))
    os.mkdir(root + "/sandbox", 0o755)
    mount(work, root + "/sandbox", None, MS_BIND)
    mount(None, root + "/sandbox", None, MS_BIND | MS_REMOUNT | MS_NOSUID | MS_NODEV
          | locked_flags(work))
    os.mkdir(root + "/.old", 0o700)
    check(libc.syscall(arch["pivot_root"], root.encode(), (root + "/.old").encode()), "pivot_root")
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


def run_snippet(src):
    """Run the snippet; its exception becomes one ``Type: message`` line. Never returns."""
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


def wait_exit(pid):
    """Wait for ``pid`` and exit with its status (128 + signal when killed)."""
    code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    os._exit(code if code >= 0 else 128 - code)


def isolated(cfg, method, report, src, work):
    """The setup process: namespaces and new root, then pid 1 of the new PID namespace, then
    the snippet as its child. Never returns."""
    arch = ARCH.get(os.uname().machine)
    if arch is None:
        raise OSError(f"no seccomp filter for architecture {os.uname().machine}")
    uid, gid = os.getuid(), os.getgid()
    if method == "rootns":
        if os.geteuid() != 0:
            raise OSError("rootns needs root")
        check(libc.unshare(NS), "unshare")
    else:
        check(libc.unshare(NS | NEWUSER), "unshare")
        for name, text in (("setgroups", "deny"), ("uid_map", f"0 {uid} 1"),
                           ("gid_map", f"0 {gid} 1")):
            with open(f"/proc/self/{name}", "w") as f:
                f.write(text)
    new_root(cfg, arch, work)
    check(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL), "pdeathsig")     # dies with the runner
    alive_r, alive_w = os.pipe()       # EOF on alive_r: this setup process is gone
    pid = os.fork()
    if pid:
        os.close(report)
        os.close(alive_r)
        wait_exit(pid)
    try:
        os.close(alive_w)
        os.setsid()                    # kill(0, ...) reaches this namespace's processes only
        if method == "rootns":
            nobody = cfg["nobody"]
            os.setgroups([])
            os.setresgid(nobody, nobody, nobody)
            os.setresuid(nobody, nobody, nobody)
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
        uid_layer = "uid-nobody" if method == "rootns" else "no-capabilities"
        os.write(report, ("ok " + ",".join((method, "mountns", "pidns", "netns", "ipcns",
                                            uid_layer, "seccomp", "rlimits"))).encode())
        os.close(report)
    except BaseException as e:
        os.write(report, f"fail {method}: {e}".encode())
        os._exit(126)
    # The namespace's init ignores signals it has no handler for (RLIMIT_CPU's SIGXCPU too):
    # the snippet runs as its child, and when it ends init exits and the kernel kills the rest.
    signal.signal(signal.SIGINT, signal.SIG_DFL)    # no KeyboardInterrupt for the snippet to
    child = os.fork()                               # raise in init (it would end the run)
    if child:
        wait_exit(child)
    run_snippet(src)


def try_method(cfg, method, src, work):
    """Fork the setup process: (its pid, the layers) once the snippet is starting, else
    (None, why)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            isolated(cfg, method, w, src, work)
        except BaseException as e:
            try:
                os.write(w, f"fail {method}: {e}".encode())
            finally:
                os._exit(126)
    os.close(w)
    chunks = []
    while True:
        b = os.read(r, 4096)
        if not b:
            break
        chunks.append(b)
    os.close(r)
    msg = b"".join(chunks).decode("utf-8", "replace")
    if msg.startswith("ok "):
        return pid, msg[3:]
    os.waitpid(pid, 0)
    return None, msg or f"fail {method}: setup ended without a report"


def main(cfg):
    work = os.getcwd()
    with open("snippet.py", encoding="utf-8") as f:
        src = f.read()

    def record(text):
        with open(os.path.join(os.path.dirname(work), "isolation"), "w") as f:
            f.write(text)

    reasons = []
    for method in cfg["methods"]:
        if os.geteuid() == 0:      # the snippet's own directory: nobody's (rootns) or ours
            owner = cfg["nobody"] if method == "rootns" else 0
            os.chown(work, owner, owner)
        pid, msg = try_method(cfg, method, src, work)
        if pid:
            record(msg)
            wait_exit(pid)
        reasons.append(msg)
    if not cfg["unsafe"]:
        record("refused: " + "; ".join(reasons))
        os._exit(126)
    record("none")
    pid = os.fork()
    if pid:
        wait_exit(pid)
    set_limits(cfg)
    run_snippet(src)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
