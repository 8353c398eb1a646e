"""Disk transport: each version as safetensors files in a directory, published atomically.

Directory layout::

    MANIFEST.json                         {"format": 2, "latest": v, "versions": [
                                             {"v": 10, "base": null, "e": epoch, "files": [...]},
                                             {"v": 11, "base": 10, "e": epoch, "files": [...]}]}
    v00000010-<epoch>-full-0000.safetensors   a full snapshot: tensors in their own dtype/shape
    v00000011-<epoch>-delta-0000.safetensors  a delta: uint8 tensors holding delta packets
                                          (new names in a delta version are stored full)
    FULL_REQUESTED                        present while a receiver asks for a full snapshot
    FULL_REQUESTED-<layout>-<id>.json     a receiver with declared boxes asks for its pieces
                                          in full (``resync``: only those pieces are re-sent;
                                          that version's record lists <layout> in "full")
    PUBLISHER.lock                        flock'ed by the one publishing transport

Every file is at most about ``bucket_bytes`` of tensor data (one tensor never spans files) and
carries ``__metadata__["glm_sync"]`` = JSON ``{"v", "base", "e", "entries": {name: {"k", "dt",
"sh", "ck"}}}``. ``<epoch>`` is the publishing Sender's epoch (16 hex digits): two
publishers never write the same file name. Manifest format 1 (no epochs) is still read. Files are written under a temporary name, flushed to disk and renamed; the
manifest is rewritten the same way *after* all files of a version exist, so a reader that
follows the manifest never sees a half-written version. Full snapshot files are ordinary
safetensors checkpoints (``safetensors.torch.load_file`` reads them).

Retention: a full snapshot at least every ``full_every`` versions (the sender asks the
transport before each publish); versions older than the ``keep_full``-th newest full snapshot
are removed from the manifest and then deleted. A reader that loses a race with that deletion
re-reads the manifest.

Nothing a manifest says is trusted: it is validated as a whole (one :class:`TransportError`
if anything is off: the receiver's ``poll`` returns at once), file names must have the
form above (no separators, no ``..``, no absolute paths: everything read or deleted is a
file of this directory), every file is opened with ``O_NOFOLLOW`` and ``O_NONBLOCK`` and
must then be a regular file (a symlink is refused, never followed; a FIFO is refused, never
waited on), files are written under random ``O_EXCL`` temporary names and renamed into place
(a pre-planted symlink is replaced, not written through), a directory or FIFO planted at a
control name is moved aside by the sender (one SyncError, the next publish proceeds), JSON is
bounded in size and nesting before it is parsed, versions are at most 2**63 - 1, and a
safetensors header is checked whole (offsets inside the data section, no two tensors
overlapping) before any tensor is read (``glm_kernels._safetensors``).
"""
from __future__ import annotations

import json
import logging
import os
import re
import secrets
import stat
import time
from typing import Dict, Iterable, List, Optional

import torch

from .. import _checks, _dispatch, _json
from .. import _safetensors as st
from ..delta.packet import check_int
from . import resync
from .protocol import (DTYPES, KINDS, MAX_VERSION, Entry, SyncError, Transport, TransportError,
                       Update, check_epoch, check_shape, dtype_name)

logger = logging.getLogger(__name__)

MANIFEST = "MANIFEST.json"
REQUEST = "FULL_REQUESTED"
LOCK = "PUBLISHER.lock"
FORMAT = 2                      # manifest layout written; 1 (before epochs) is still read
assert set(st.NAMES) == set(DTYPES.values())
# 19 digits: every version up to MAX_VERSION (2**63 - 1), nothing longer.
_NAME = re.compile(r"v[0-9]{8,19}-(?:[0-9a-f]{16}-)?(?:r[0-9]{4,6}-)?(?:full|delta)-[0-9]{4,6}"
                   r"\.safetensors")
_LAYOUT = re.compile(r"LAYOUT-[0-9a-f]{16}\.json")
_MAX_LAYOUTS = 1024
_MAX_MANIFEST_BYTES = 64 << 20
_MAX_META_BYTES = 64 << 20
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def check_file_name(name) -> str:
    """A file name a manifest may name: ours, in this directory (no separators, no '..')."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise TransportError(f"manifest names the file {name!r:.120}, which is not a weight "
                             f"file name of this directory (refused: path traversal?)")
    return name


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path or ".", os.O_RDONLY)
    except OSError:   # platforms without directory handles
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _open_regular(path: str):
    """(fd, size) of a regular file: no symlink followed, a FIFO never waited on; SyncError
    otherwise, FileNotFoundError passes (a retention race)."""
    return st.open_regular(path, error=SyncError)


def _read_entries(fd: int, size: int, want=None):
    """(glm_sync metadata, {tensor name: (uint8 tensor of its bytes or None when ``want``
    (name) is false, safetensors dtype, shape)}, bytes read) of a safetensors file. The whole
    header is checked (offsets inside the data section, no overlaps: see
    ``glm_kernels._safetensors``) before the first tensor byte is read."""
    metadata, infos = st.read_header(fd, size, error=SyncError)
    if "glm_sync" not in metadata:
        raise SyncError("no glm_sync metadata: not a file of this transport")
    meta = _json.json_loads_bounded(metadata["glm_sync"], "glm_sync metadata",
                                        max_bytes=_MAX_META_BYTES, error=SyncError)
    read = size - sum(i.nbytes for i in infos.values())        # the header
    tensors = {}
    for name, i in infos.items():
        take = want is None or want(name)
        tensors[name] = (st.read_exact(fd, i.nbytes, i.begin, error=SyncError) if take else None,
                         i.st_dtype, list(i.shape))
        read += i.nbytes if take else 0
    return meta, tensors, read


def _check_manifest(manifest, where: str) -> dict:
    """The manifest if every field is what a publisher writes; TransportError otherwise."""
    def bad(why):
        return TransportError(f"malformed manifest {where}: {why}")
    if not isinstance(manifest, dict) or manifest.get("format") not in (1, FORMAT):
        raise bad(f"unknown layout (format "
                  f"{manifest.get('format') if isinstance(manifest, dict) else manifest!r:.40})")
    latest, versions = manifest.get("latest"), manifest.get("versions")
    if not _is_int(latest) or not 0 <= latest <= MAX_VERSION:
        raise bad(f"latest {latest!r:.40} is not a version (an int in [0, {MAX_VERSION}])")
    if not isinstance(versions, list):
        raise bad(f"versions is {type(versions).__name__}, not a list")
    previous = 0
    for r in versions:
        if not isinstance(r, dict):
            raise bad(f"a version record is {type(r).__name__}")
        v, base, files = r.get("v"), r.get("base", "missing"), r.get("files")
        if not _is_int(v) or not previous < v <= MAX_VERSION:
            raise bad(f"version {v!r:.40} after v{previous} (versions must increase, up to "
                      f"{MAX_VERSION})")
        if not (base is None or (_is_int(base) and 0 <= base < v)):
            raise bad(f"v{v} has base {base!r:.40}")
        if not isinstance(files, list) or not files:
            raise bad(f"v{v} has files {files!r:.80}")
        for name in files:
            check_file_name(name)
        try:
            check_epoch(r.get("e"))
        except SyncError as exc:
            raise bad(f"v{v}: {exc}") from None
        full_for = r.get("full", [])
        if (not isinstance(full_for, list) or len(full_for) > resync.MAX_REQUESTS
                or (full_for and base is None)
                or not all(isinstance(x, str) and resync.ID.fullmatch(x) for x in full_for)):
            raise bad(f"v{v} re-sends in full the layouts {full_for!r:.80}")
        previous = v
    if latest != previous:
        raise bad(f"latest v{latest} is not the newest record v{previous}")
    return manifest


class DiskTransport(Transport):
    """Versions as files in ``path`` (shared storage between trainer and rollout hosts works).

    Parameters
    ----------
    path : str
        Directory (created if missing). The sender's first version must be newer than the
        directory's latest (``latest_version()``; start the Sender with that version).
    full_every : int, default 10
        A full snapshot at least every this many versions (bounds a late reader's chain).
    keep_full : int, default 2
        Full snapshots (and the deltas after them) kept on disk.
    poll_interval : float, default 0.05
        Seconds (> 0) between manifest reads while a receiver waits.

    One publisher per directory: the sending transport holds an exclusive ``flock`` on
    ``PUBLISHER.lock`` from its first publish on; a second publisher's ``send`` raises
    SyncError (where the file system has no working flock, e.g. some NFS setups, a
    publisher that finds a version it did not write at the end of its publish raises
    instead; every file name carries its publisher's epoch, so two publishers never
    overwrite each other's files).

    Sharded publishing (a Sender with a ``group``): every trainer rank opens its own
    DiskTransport on the directory and writes its part's files
    (``v<version>-<epoch>-r<rank>-<kind>-<n>.safetensors``); group rank 0 takes the lock
    and writes the manifest record naming every rank's files once all are out. Receivers
    given ``slices`` (or a ``group``) declare their boxes in ``LAYOUT-<hash>.json`` and read
    only the pieces cut for them (plus every file's header). Files of a rank that was killed
    mid-version are named by no manifest and are not removed.

    Example::

        link = sync.DiskTransport("/shared/weights")
        sync.Sender(link, delta=True).publish(model.state_dict())          # trainer
        sync.Receiver(link, rollout_model.state_dict()).receive(timeout=60) # rollout
    """

    def __init__(self, path: str, *, full_every: int = 10, keep_full: int = 2,
                 poll_interval: float = 0.05):
        self.full_every = check_int("full_every", full_every, 1)
        self.keep_full = check_int("keep_full", keep_full, 1)
        self.poll_interval = _checks.check_finite_number("poll_interval", poll_interval,
                                                           positive=True)
        self.path = os.fspath(path)
        os.makedirs(self.path, exist_ok=True)
        self._delivered: Optional[dict] = None  # record last handed to the receiver
        self._epoch: Optional[str] = None       # epoch of the version the receiver holds
        self._refused: set = set()
        self._lock_fd: Optional[int] = None
        self._want: Optional[set] = None        # target prefixes of the receiver's pieces
        self._layout: Optional[tuple] = None    # (id, document) of declared boxes
        self._asked: Optional[str] = None       # this receiver's standing request file
        self._seen_requests: List[str] = []     # sender: requests read for this publish
        #: receiver side: bytes read from weight files (headers included), all updates
        self.bytes_read = 0

    def close(self) -> None:
        """Release the publisher lock (also released when the process exits)."""
        fd, self._lock_fd = getattr(self, "_lock_fd", None), None
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass

    __del__ = close

    # ------------------------------------------------------------------ manifest
    def _file(self, name: str) -> str:
        return os.path.join(self.path, name)

    def read_manifest(self) -> dict:
        """The validated manifest (empty when there is none); TransportError if malformed."""
        where = self._file(MANIFEST)
        try:
            fd, size = _open_regular(where)
        except FileNotFoundError:
            return {"format": FORMAT, "latest": 0, "versions": []}
        except SyncError as exc:
            raise TransportError(f"unreadable manifest: {exc}") from None
        try:
            if size > _MAX_MANIFEST_BYTES:
                raise TransportError(f"manifest {where} has {size} bytes (more than "
                                     f"{_MAX_MANIFEST_BYTES}): refused")
            manifest = _json.json_loads_bounded(
                st.read_exact(fd, size, 0, error=TransportError).numpy().tobytes(),
                f"manifest {where}", max_bytes=_MAX_MANIFEST_BYTES, error=TransportError)
        except TransportError:
            raise
        except (OSError, ValueError) as exc:
            raise TransportError(f"unreadable manifest {where}: {exc}") from None
        finally:
            os.close(fd)
        return _check_manifest(manifest, where)

    def latest_version(self) -> int:
        return self.read_manifest()["latest"]

    def _atomic_write(self, name: str, write) -> None:
        """``write(f)`` into a fresh file under a random exclusive name, fsync, rename it to
        ``name`` (a symlink at ``name`` is replaced, never written through)."""
        tmp = self._file(f".tmp-{secrets.token_hex(8)}-{name}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC, 0o644)
        try:
            with os.fdopen(fd, "wb") as f:
                write(f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self._file(name))
        except BaseException:
            try:
                os.remove(tmp)
            except FileNotFoundError:
                pass
            raise
        _fsync_dir(self.path)

    # ------------------------------------------------------------------ sender side
    def _clear_planted(self, *names: str) -> None:
        """Sender side: a directory, FIFO, socket or device planted at one of the control
        ``names`` is renamed aside (``.planted-<random>-<name>``, never deleted: it may hold
        someone's data) and SyncError names it: this publish fails clearly, the next one
        finds the name free. (A symlink is fine: it is replaced, never followed.)"""
        for name in names:
            path = self._file(name)
            try:
                mode = os.lstat(path).st_mode
            except FileNotFoundError:
                continue
            if stat.S_ISREG(mode) or stat.S_ISLNK(mode):
                continue
            aside = self._file(f".planted-{secrets.token_hex(8)}-{name}")
            try:
                os.rename(path, aside)
                moved = f"moved aside to {aside}; the next publish proceeds"
            except OSError as exc:
                moved = f"could not move it aside ({exc}): remove it"
            raise SyncError(f"{path} is a {st.file_kind(mode)}, not a file this transport "
                            f"wrote: refused ({moved})")

    def _take_lock(self) -> None:
        if self._lock_fd is not None:
            return
        try:
            import fcntl
        except ImportError:         # no flock on this platform: detection at publish only
            return
        self._clear_planted(LOCK)
        path = self._file(LOCK)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NONBLOCK | _NOFOLLOW | _CLOEXEC,
                         0o644)
        except OSError as exc:
            raise SyncError(f"cannot open the publisher lock {path}: {exc}") from None
        if not stat.S_ISREG(os.fstat(fd).st_mode):    # planted between the check and the open
            os.close(fd)
            raise SyncError(f"the publisher lock {path} is not a regular file: refused")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip()
            os.close(fd)
            raise SyncError(f"another publisher (pid {holder or '?'}) holds {path}: one "
                            f"publisher per directory") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        self._lock_fd = fd

    def _manifest_or_none(self) -> Optional[dict]:
        """Sender side: the manifest, or None (logged) when it is malformed: the sender then
        starts a fresh one with a full snapshot instead of being stuck behind it."""
        try:
            return self.read_manifest()
        except TransportError as exc:
            logger.warning("glm_kernels.sync: %s; the next publish is a full snapshot that "
                           "starts a new manifest", exc)
            return None

    def full_requested(self) -> bool:
        return self.resync_request().asks

    def resync_request(self) -> "resync.Resync":
        """Everything (``FULL_REQUESTED``, the periodic snapshot, a malformed manifest or
        request file), or the boxes of the receivers' standing requests (``resync``)."""
        self._take_lock()
        self._clear_planted(REQUEST, MANIFEST)
        self._seen_requests = resync.standing(self.path)
        try:
            os.remove(self._file(REQUEST))
            return resync.EVERYTHING
        except FileNotFoundError:
            pass
        manifest = self._manifest_or_none()
        if manifest is None:
            return resync.EVERYTHING
        since_full = 0
        for record in reversed(manifest["versions"]):
            if record["base"] is None:
                break
            since_full += 1
        else:
            return resync.EVERYTHING   # nothing full on disk yet
        if since_full + 1 >= self.full_every:
            return resync.EVERYTHING
        return resync.read_requests(self, self._seen_requests)

    def _next_manifest(self, version: int, base: Optional[int], epoch: Optional[str]):
        """(the manifest to extend, whether ``version`` restarts its history). A restarted
        sender (a new epoch, numbering again) starts a new history with its first full
        snapshot, as on every other transport: receivers follow it at once."""
        manifest = self._manifest_or_none()
        if manifest is None:
            if base is not None:
                raise TransportError(f"{self._file(MANIFEST)} is malformed: only a full "
                                     f"snapshot can start a new manifest")
            manifest = {"format": FORMAT, "latest": 0, "versions": []}
        restart = (version <= manifest["latest"] and base is None and epoch is not None
                   and all(r.get("e") != epoch for r in manifest["versions"]))
        if version <= manifest["latest"] and not restart:
            raise ValueError(f"version {version} is not newer than v{manifest['latest']} "
                             f"already in {self.path}; start the Sender with "
                             f"version=DiskTransport.latest_version()")
        return manifest, restart

    def send(self, version: int, base: Optional[int], entries: Iterable[Entry],
             bucket_bytes: int, epoch: Optional[str] = None) -> None:
        self._take_lock()
        self._clear_planted(REQUEST, MANIFEST)
        epoch = check_epoch(epoch)
        manifest, restart = self._next_manifest(version, base, epoch)
        if restart:
            logger.warning("glm_kernels.sync: sender epoch %s restarts %s at v%d (it held up "
                           "to v%d): the older versions are dropped", epoch, self.path,
                           version, manifest["latest"])
        started_from = manifest["latest"]
        files = self._write_files(version, base, entries, bucket_bytes, epoch, None)
        # A second publisher (where flock does not reach, e.g. NFS) moved the manifest on
        # while we wrote: refuse rather than interleave two histories.
        now = self._manifest_or_none()
        if now is not None and now["latest"] != started_from:
            raise SyncError(f"another publisher wrote v{now['latest']} to {self.path} while "
                            f"v{version} was being written: one publisher per directory")
        self._publish_manifest(manifest, {"v": version, "base": base, "e": epoch,
                                          "files": files}, restart)

    def _write_files(self, version, base, entries, bucket_bytes, epoch, part) -> List[str]:
        kind = "full" if base is None else "delta"
        tag = f"{epoch}-" if epoch else ""
        if part is not None:
            tag += f"r{part:04d}-"
        files: List[str] = []
        shard: Dict[str, torch.Tensor] = {}
        described: Dict[str, dict] = {}
        size = 0

        def flush():
            name = f"v{version:08d}-{tag}{kind}-{len(files):04d}.safetensors"
            meta = {"glm_sync": json.dumps({"v": version, "base": base, "e": epoch,
                                            "entries": described})}
            self._atomic_write(name, lambda f: st.write_to(f, shard, meta))
            files.append(name)

        for e in entries:
            n = e.payload.numel()
            if shard and size + n > bucket_bytes:
                flush()
                shard, described, size = {}, {}, 0
            shard[e.name] = e.payload.view(e.dtype).reshape(e.shape) if e.kind == "full" \
                else e.payload
            described[e.name] = {"k": e.kind, "dt": dtype_name(e.dtype), "sh": list(e.shape),
                                 "ck": e.checksum.hex()}
            size += n
        if shard or not files:
            flush()
        return files

    # ------------------------------------------------------------------ sharded publishing
    multi_part = True

    def send_part(self, version, base, entries, bucket_bytes, epoch, part, parts):
        """Rank ``part`` writes its files (names tagged ``r<part>``); nothing is visible to
        receivers until :meth:`commit` on part 0 names every part's files in the manifest."""
        epoch = check_epoch(epoch)
        try:
            return self._write_files(version, base, entries, bucket_bytes, epoch, part)
        except BaseException:
            self._remove_files(self._own_files(version, epoch, part))
            raise

    def _own_files(self, version, epoch, part) -> List[str]:
        prefix = f"v{version:08d}-{epoch}-r{part:04d}-" if epoch else None
        try:
            names = os.listdir(self.path)
        except OSError:
            return []
        return [n for n in names if prefix and n.startswith(prefix) and _NAME.fullmatch(n)]

    def _remove_files(self, names) -> None:
        for name in names:
            if _NAME.fullmatch(name):
                try:
                    os.remove(self._file(name))
                except FileNotFoundError:
                    pass

    def commit(self, version, base, epoch, parts, ok, part, full_for=()) -> bool:
        """Part 0 writes the manifest record naming every part's files once every part is
        out (and ``full_for``: the layout ids whose pieces went full); when some part
        failed, every part deletes its own files (none is named)."""
        if not ok:
            self._remove_files(self._own_files(version, epoch, part))
            return False
        if part != 0:
            return True
        self._take_lock()
        self._clear_planted(REQUEST, MANIFEST)
        files = [name for p in parts for name in (p or [])]
        for name in files:
            check_file_name(name)
        manifest, restart = self._next_manifest(version, base, epoch)
        record = {"v": version, "base": base, "e": epoch, "files": files}
        if full_for and base is not None:
            record["full"] = sorted(full_for)
        self._publish_manifest(manifest, record, restart)
        return True

    # ------------------------------------------------------------------ layouts
    def declare(self, targets: dict, explicit: bool) -> None:
        """Receiver side: read only the pieces cut for these boxes; with ``explicit`` (slices
        or a group given), also write them to ``LAYOUT-<hash>.json`` for the senders."""
        from . import layout
        self._want = {layout.target_prefix(n, full, box) for n, (full, box) in targets.items()}
        if not explicit:
            return
        body = resync.layout_doc(targets)
        self._layout = (resync.layout_id(body), body)
        name = f"LAYOUT-{self._layout[0]}.json"
        if os.path.exists(self._file(name)):
            return
        try:
            self._atomic_write(name, lambda f: f.write(body))
        except OSError as exc:
            _dispatch.warn_once(f"sync.disk.layout:{self.path}",
                                f"glm_kernels.sync: cannot declare this receiver's slices in "
                                f"{self.path} ({exc}); sharded senders will not cut pieces "
                                f"for them")

    def targets(self) -> dict:
        """Sender side: the boxes every receiver declared (``LAYOUT-*.json``), validated."""
        out: Dict[str, set] = {}
        try:
            names = sorted(n for n in os.listdir(self.path) if _LAYOUT.fullmatch(n))
        except OSError:
            return out
        for name in names[:_MAX_LAYOUTS]:
            try:
                held = resync.parse_layout(resync.read_small(self._file(name), name), name)
            except FileNotFoundError:
                continue
            except SyncError as exc:            # damaged: logged, not used
                logger.warning("glm_kernels.sync: layout file %s refused: %s", name, exc)
                continue
            for tname, target in held.items():
                out.setdefault(tname, set()).add(target)
        return out

    def _publish_manifest(self, manifest: dict, record: dict, restart: bool = False) -> None:
        versions = ([] if restart else manifest["versions"]) + [record]
        fulls = [i for i, r in enumerate(versions) if r["base"] is None]
        keep_from = fulls[-self.keep_full] if len(fulls) >= self.keep_full else 0
        dropped, versions = versions[:keep_from], versions[keep_from:]
        if restart:
            dropped = manifest["versions"] + dropped
        body = json.dumps({"format": FORMAT, "latest": record["v"], "versions": versions})
        self._atomic_write(MANIFEST, lambda f: f.write(body.encode()))
        if record["base"] is None:     # answers every request read before it
            resync.discard(self, self._seen_requests)
            self._seen_requests = []
        kept = {name for r in versions for name in r["files"]}
        for r in dropped:   # after the manifest stops naming them; validated names only
            for name in r["files"]:
                if name in kept or not _NAME.fullmatch(name):
                    continue
                try:
                    os.remove(self._file(name))
                except FileNotFoundError:
                    pass

    # ------------------------------------------------------------------ receiver side
    def _next_record(self, held: int) -> Optional[dict]:
        manifest = self.read_manifest()
        listed = {r["v"] for r in manifest["versions"]}
        self._refused &= listed                  # bounded by the manifest
        versions = [r for r in manifest["versions"] if r["v"] not in self._refused]
        for r in versions:
            if (r["base"] is not None and r["base"] == held
                    and (self._epoch is None or r.get("e") == self._epoch)):
                return r   # the delta on top of what the receiver holds
        # manifest behind the held version: the directory was restarted (new epoch). A full
        # snapshot of the current publisher's epoch when that is not the held one: a
        # restarted sender, taken whatever its number (older epochs' records are not offered).
        restarted = manifest["latest"] < held
        current = manifest["versions"][-1].get("e") if manifest["versions"] else None
        new_epoch = self._epoch is not None and current not in (None, self._epoch)
        # or a delta that re-sent this receiver's boxes in full (it asked: ``resync``)
        mine = self._layout[0] if self._layout is not None else None
        fulls = [r for r in versions if (r["base"] is None and (
            r["v"] > held or restarted or (new_epoch and r.get("e") == current))) or (
                mine in r.get("full", ()) and r["v"] > held
                and self._epoch in (None, r.get("e")))]
        return fulls[-1] if fulls else None

    def recv(self, held: int, timeout: Optional[float]) -> Optional[Update]:
        deadline = None if timeout is None else time.monotonic() + timeout
        attempts, self._delivered = 0, None
        while True:
            record = self._next_record(held)
            if record is not None:
                self._delivered = record
                try:
                    return self._load(record)
                except FileNotFoundError:   # deleted by retention after we read the manifest
                    attempts += 1
                    if attempts >= 5:
                        raise SyncError(f"files of v{record['v']} keep disappearing") from None
                    continue
            if deadline is not None and time.monotonic() >= deadline:
                return None
            time.sleep(self.poll_interval if deadline is None
                       else max(0.0, min(self.poll_interval, deadline - time.monotonic())))

    def _load(self, record: dict) -> Update:
        version, base, epoch = record["v"], record["base"], record.get("e")
        entries, skipped = [], False
        for name in record["files"]:
            path = self._file(check_file_name(name))
            fd, size = _open_regular(path)       # FileNotFoundError passes (retention race)
            try:
                meta, tensors, read = _read_entries(fd, size, self._wants)
                self.bytes_read += read
                if not isinstance(meta, dict) or (meta.get("v"), meta.get("base"),
                                                  meta.get("e")) != (version, base, epoch):
                    raise SyncError(f"{name} holds v{meta.get('v')} (base {meta.get('base')}, "
                                    f"epoch {meta.get('e')}), the manifest says v{version} "
                                    f"(base {base}, epoch {epoch})")
                described = meta["entries"]
                if not isinstance(described, dict) or set(described) != set(tensors):
                    raise SyncError(f"{name}: described tensors do not match the stored ones")
                for tname, d in described.items():
                    t, st_dtype, st_shape = tensors[tname]
                    if t is None:
                        skipped = True
                        continue                 # a piece cut for another receiver
                    if d["k"] not in KINDS or d["dt"] not in DTYPES:
                        raise SyncError(f"tensor {tname!r}: kind {d['k']!r}, dtype {d['dt']!r}")
                    if d["k"] == "full" and (st_dtype != st.NAMES[DTYPES[d["dt"]]]
                                             or st_shape != list(check_shape(d["sh"]))):
                        raise SyncError(f"tensor {tname!r}: stored as {st_dtype} {st_shape}, "
                                        f"described as {d['dt']} {d['sh']}")
                    ck = bytes.fromhex(d["ck"])
                    entries.append(Entry(tname, d["k"], DTYPES[d["dt"]], check_shape(d["sh"]),
                                         ck, t))
            except SyncError as exc:
                raise SyncError(f"v{version}: refused file {name}: {exc}") from None
            except Exception as exc:   # JSON/KeyError/TypeError: a damaged file
                raise SyncError(f"v{version}: unreadable file {name}: "
                                f"{type(exc).__name__}: {exc}") from None
            finally:
                os.close(fd)
        return Update(version, base, entries, epoch, skipped_pieces=skipped)

    def _wants(self, name: str) -> bool:
        if self._want is None or "@" not in name:
            return True
        head, _, _ = name.rpartition("/")
        return head + "/" in self._want

    def report(self, version: int, ok: bool) -> None:
        if ok:
            if self._delivered is not None:
                self._epoch = self._delivered.get("e")
            if self._asked is not None:     # answered: the receiver holds a version again
                resync.discard(self, [self._asked])
                self._asked = None
            return
        if self._delivered is not None:
            self._refused.add(self._delivered["v"])
        try:
            if self._layout is None:        # whole tensors, undeclared: everything
                self._atomic_write(REQUEST, lambda f: f.write(str(version).encode()))
            else:
                if self._asked is None:
                    self._asked = resync.request_name(self._layout[0], secrets.token_hex(8))
                self._atomic_write(self._asked, lambda f: f.write(self._layout[1]))
        except OSError as exc:      # e.g. a read-only mount on the rollout host
            _dispatch.warn_once(f"sync.disk.request:{self.path}",
                                f"glm_kernels.sync: cannot ask for a full snapshot in "
                                f"{self.path} ({exc}); the receiver waits for the sender's "
                                f"periodic one (full_every)")
