"""Remove a sandbox run's directory by file descriptor only.

:func:`remove_tree` never resolves a path twice and never follows a link: every directory is
opened relative to its parent's descriptor with ``O_NOFOLLOW | O_DIRECTORY`` and every entry
removed with ``unlinkat`` / ``rmdir`` relative to that descriptor, so a directory swapped for a
symlink (to a host directory) is removed as the symlink it is. It is iterative (a chain
thousands of directories deep is removed with a bounded number of open descriptors: past
``KEEP_OPEN`` levels it climbs back through ``..`` and checks that it reached the directory it
came from, by device and inode), stays on one filesystem, never changes the mode of a parent,
and changes the mode of a directory only through that directory's own descriptor and only
when it belongs to the caller (an unprivileged caller cannot list a ``000`` directory it
owns otherwise). Run it only once every process that could write there is gone.
"""
import os
import stat
from typing import List, Optional

KEEP_OPEN = 64           # directory descriptors held at once (the rest: reopened via "..")
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_PATH = getattr(os, "O_PATH", 0)


def _open_dir(parent_fd: int, name: str) -> int:
    """``name`` in ``parent_fd`` as a directory descriptor (never through a link)."""
    try:
        return os.open(name, _DIR, dir_fd=parent_fd)
    except PermissionError:
        if not _PATH or not os.path.isdir("/proc/self/fd"):
            raise
    # An unreadable directory: make it ours to read only if it is ours, through its own fd.
    fd = os.open(name, _PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent_fd)
    try:
        st = os.fstat(fd)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
            raise PermissionError(f"{name!r}: not readable and not ours")
        os.chmod(f"/proc/self/fd/{fd}", 0o700)       # the inode fd names: no path lookup
        return os.open(f"/proc/self/fd/{fd}", _DIR)
    finally:
        os.close(fd)


def remove_tree(parent_fd: int, name: str, max_entries: int = 1 << 20) -> Optional[str]:
    """Remove ``name`` (a directory, a file or a link) inside the directory ``parent_fd``.

    Returns None when it is gone, else a short description of what is left (never raises
    for what it finds: entries that cannot be removed are skipped and reported)."""
    errors: List[str] = []
    try:
        top = _open_dir(parent_fd, name)
    except FileNotFoundError:
        return None
    except OSError as e:
        if e.errno not in (20, 40):                  # ENOTDIR, ELOOP: a file or a link
            return f"{name}: {e.strerror}"
        try:
            os.unlink(name, dir_fd=parent_fd)
            return None
        except OSError as e2:
            return f"{name}: {e2.strerror}"
    dev = os.fstat(top).st_dev
    # Per level: [fd or None, (dev, ino), name in its parent, names that could not go]
    stack = [[top, (dev, os.fstat(top).st_ino), name, set()]]
    seen = 0
    try:
        while stack and seen < max_entries:
            level = stack[-1]
            fd, skip, sub = level[0], level[3], None
            with os.scandir(fd) as it:
                for entry in it:
                    seen += 1
                    if entry.name in skip:
                        continue
                    try:
                        is_dir = entry.is_dir(follow_symlinks=False)
                    except OSError:
                        is_dir = False
                    if is_dir:
                        sub = entry.name
                        break
                    try:
                        os.unlink(entry.name, dir_fd=fd)
                    except FileNotFoundError:
                        pass
                    except OSError as e:
                        skip.add(entry.name)
                        errors.append(f"{entry.name}: {e.strerror}")
            if sub is not None:
                try:
                    child = _open_dir(fd, sub)
                    st = os.fstat(child)
                    if st.st_dev != dev:                 # a mount point: not ours to empty
                        os.close(child)
                        raise OSError(18, "another filesystem")
                except FileNotFoundError:
                    continue
                except OSError as e:
                    if e.errno in (20, 40):              # swapped for a file or a link
                        continue                         # (the next scan unlinks it)
                    skip.add(sub)
                    errors.append(f"{sub}: {e.strerror}")
                    continue
                if len(stack) >= KEEP_OPEN and stack[-KEEP_OPEN][0] is not None:
                    os.close(stack[-KEEP_OPEN][0])
                    stack[-KEEP_OPEN][0] = None
                stack.append([child, (st.st_dev, st.st_ino), sub, set()])
                continue
            # This level is empty (but for what could not go): climb, then remove it.
            stack.pop()
            if stack and stack[-1][0] is None:
                up = os.open("..", _DIR, dir_fd=fd)
                st = os.fstat(up)
                if (st.st_dev, st.st_ino) != stack[-1][1]:   # moved away meanwhile: stop
                    os.close(up)
                    os.close(fd)
                    errors.append(f"{level[2]}: moved during removal")
                    return "; ".join(errors[:5])
                stack[-1][0] = up
            os.close(fd)
            parent = stack[-1][0] if stack else parent_fd
            try:
                os.rmdir(level[2], dir_fd=parent)
            except FileNotFoundError:
                pass
            except OSError as e:
                if stack:
                    stack[-1][3].add(level[2])
                errors.append(f"{level[2]}: {e.strerror}")
        if stack:
            errors.append(f"gave up after {seen} entries")
    finally:
        for level in stack:
            if level[0] is not None:
                os.close(level[0])
    return "; ".join(errors[:5]) if errors else None
