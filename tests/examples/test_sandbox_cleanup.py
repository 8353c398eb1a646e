"""The sandbox's directory removal (``sandbox_cleanup.remove_tree``) against the trees and the
races a hostile snippet can leave behind, run as root and as an unprivileged uid (``nobody``,
in a subprocess), each in a private temporary directory.

Issue 32: the old ``shutil.rmtree`` error handler re-resolved paths, chmodded the parent and
recursed; a swapped symlink made it delete and chmod host files, a 3000-deep chain raised
RecursionError, a ``000`` directory raised TypeError (unprivileged)."""
import json
import os
import pathlib
import stat
import subprocess
import sys
import tempfile

import pytest

from examples.async_trainer.env.sandbox_cleanup import remove_tree
from tests.examples import test_sandbox as base

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux only")

# Runs one scenario (SCENARIO below, by name) in a fresh process, as whichever uid starts it,
# and prints its findings as JSON: nothing here runs as root when started as nobody.
SCENARIOS = r'''
import json, os, stat, sys, time
from examples.async_trainer.env.sandbox_cleanup import remove_tree

def tree_fd(d):
    return os.open(d, os.O_RDONLY | os.O_DIRECTORY)

def deep(top, n):
    fd = tree_fd(top)
    os.mkdir("t", dir_fd=fd)
    cur = os.open("t", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
    for i in range(n):
        os.mkdir("d", dir_fd=cur)
        with open(os.open("f", os.O_WRONLY | os.O_CREAT, dir_fd=cur), "w") as f:
            f.write("x")
        nxt = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=cur)
        os.close(cur)
        cur = nxt
    os.close(cur)
    return fd

def locked(top):
    """Nested 000 directories with files, and a 000 file."""
    t = os.path.join(top, "t")
    os.makedirs(t + "/a/b/c")
    for d in ("/a", "/a/b", "/a/b/c"):
        open(t + d + "/f", "w").close()
    os.chmod(t + "/a/b/f", 0)
    for d in ("/a/b/c", "/a/b", "/a"):
        os.chmod(t + d, 0)
    return tree_fd(top)

def race(top, tries):
    """As the removal starts emptying t/s (a directory of 1000 files), a process swaps t/s
    for a symlink to victim/ (holding files of the same names) and deletes t/s's files under
    the remover (so that it meets errors); victim/ must keep every file and its mode."""
    victim = os.path.join(top, "victim")
    os.mkdir(victim, 0o755)
    for i in range(1000):
        open(f"{victim}/f{i}", "w").close()      # the names the tree has
    lost = 0
    for k in range(tries):
        t = os.path.join(top, "t")
        os.makedirs(t + "/s")
        for i in range(1000):
            open(f"{t}/s/f{i}", "w").close()
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.write(w, b"x")
            end = time.monotonic() + 2
            while time.monotonic() < end:        # wait for the first file to go
                try:
                    if len(os.listdir(t + "/s")) < 1000:
                        break
                except OSError:
                    break
            try:
                os.rename(t + "/s", t + "/s.old")
                os.symlink(victim, t + "/s")
            except OSError:
                pass
            for i in range(1000):
                try:
                    os.unlink(f"{t}/s.old/f{i}")
                except OSError:
                    pass
            os._exit(0)
        os.read(r, 1)
        fd = tree_fd(top)
        remove_tree(fd, "t")
        os.close(fd)
        os.waitpid(pid, 0)
        lost = max(lost, 1000 - len(os.listdir(victim)))
        if os.path.lexists(t):       # the racer recreated pieces after: remove them now
            fd = tree_fd(top)
            remove_tree(fd, "t")
            os.close(fd)
    return {"lost": lost, "victim_mode": stat.S_IMODE(os.stat(victim).st_mode)}

top, what = sys.argv[1], sys.argv[2]
out = {}
if what == "deep":
    fd = deep(top, 3000)
    out["left"] = remove_tree(fd, "t")
elif what == "locked":
    fd = locked(top)
    out["left"] = remove_tree(fd, "t")
elif what == "race":
    out.update(race(top, 5))
    out["left"] = None
out["exists"] = os.path.lexists(os.path.join(top, "t"))
out["top_mode"] = stat.S_IMODE(os.stat(top).st_mode)
print(json.dumps(out))
'''


@pytest.fixture
def private_dir():
    """A private directory every uid can traverse (pytest's own is root-only), on tmpfs where
    there is one (the removal's cost there is the algorithm's, not a loaded disk's)."""
    shm = "/dev/shm" if os.access("/dev/shm", os.W_OK | os.X_OK) else None
    d = tempfile.mkdtemp(prefix="sandbox-cleanup-test-", dir=shm)
    os.chmod(d, 0o755)
    yield d
    fd = os.open(os.path.dirname(d), os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert remove_tree(fd, os.path.basename(d)) is None
    finally:
        os.close(fd)


@pytest.fixture(params=["root", "unprivileged"])
def as_uid(request, private_dir):
    """Runs a scenario in a private directory as this process's uid or as ``nobody``."""
    def go(what):
        top = os.path.join(private_dir, "top")
        os.mkdir(top, 0o750)
        os.chmod(top, 0o750)
        kw = {}
        exe = sys.executable
        if request.param == "root" and os.geteuid() != 0:
            pytest.skip("this process is not root")
        if request.param == "unprivileged" and os.geteuid() == 0:   # else: this process is
            exe, why = base._unprivileged_python()
            if exe is None:
                pytest.skip(why)
            os.chown(top, base.sandbox.NOBODY, base.sandbox.NOBODY)
            kw = dict(user=base.sandbox.NOBODY, group=base.sandbox.NOBODY, extra_groups=[])
        p = subprocess.run([exe, "-c", SCENARIOS, str(top), what], cwd=base.ROOT,
                           env={"PYTHONPATH": base.ROOT}, capture_output=True, text=True,
                           timeout=120, **kw)
        assert p.returncode == 0, p.stderr[-2000:]
        return json.loads(p.stdout)
    return go


def test_a_3000_deep_chain_is_removed_without_recursion(as_uid):
    out = as_uid("deep")
    assert out["left"] is None and not out["exists"], out
    assert out["top_mode"] == 0o750                       # the parent's mode is untouched


def test_000_directories_and_files_are_removed(as_uid):
    out = as_uid("locked")
    assert out["left"] is None and not out["exists"], out
    assert out["top_mode"] == 0o750


def test_a_directory_swapped_for_a_symlink_never_reaches_its_target(as_uid):
    out = as_uid("race")
    assert out["lost"] == 0 and out["victim_mode"] == 0o755, out
    assert not out["exists"] and out["top_mode"] == 0o750, out


def test_what_cannot_be_removed_is_reported_not_raised(private_dir):
    """A directory that is not ours and unreadable (as nobody) stays; the removal says what
    is left, never chmods anything but its own directories, never raises."""
    tmp_path = pathlib.Path(private_dir)
    t = tmp_path / "t"
    (t / "foreign").mkdir(parents=True)
    (t / "foreign" / "f").write_text("x")
    (t / "mine").mkdir()
    os.chmod(t / "foreign", 0)
    if os.geteuid() == 0:
        exe, why = base._unprivileged_python()
        if exe is None:
            pytest.skip(why)
        for p in (t, t / "mine"):
            os.chown(p, base.sandbox.NOBODY, base.sandbox.NOBODY)
        code = ("import json, os, sys\nfrom examples.async_trainer.env.sandbox_cleanup import "
                "remove_tree\nfd = os.open(sys.argv[1], os.O_RDONLY | os.O_DIRECTORY)\n"
                "print(json.dumps(remove_tree(fd, 't')))")
        p = subprocess.run([exe, "-c", code, str(tmp_path)], cwd=base.ROOT,
                           env={"PYTHONPATH": base.ROOT}, capture_output=True, text=True,
                           timeout=60, user=base.sandbox.NOBODY, group=base.sandbox.NOBODY,
                           extra_groups=[])
        assert p.returncode == 0, p.stderr
        left = json.loads(p.stdout)
        assert left and "foreign" in left, left
        assert stat.S_IMODE(os.stat(t / "foreign").st_mode) == 0     # not ours: untouched
        assert (t / "foreign" / "f").exists() and not (t / "mine").exists()
        assert stat.S_IMODE(os.stat(tmp_path).st_mode) == 0o755
        os.chmod(t / "foreign", 0o700)                         # for the fixture's removal
    else:
        pytest.skip("a directory of another uid needs root to create")


def test_a_file_or_a_link_in_place_of_the_tree_is_unlinked_not_followed(tmp_path):
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "v").write_text("x")
    os.symlink(victim, tmp_path / "t")
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert remove_tree(fd, "t") is None
        assert remove_tree(fd, "t") is None                    # already gone: fine
    finally:
        os.close(fd)
    assert not os.path.lexists(tmp_path / "t") and (victim / "v").exists()
