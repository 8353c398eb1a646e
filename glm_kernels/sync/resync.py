"""What a refusing engine asks the senders to re-send in full, and the disk's request files.

A receiver that refuses a version keeps the previous one. A sharded sender's next publish
then re-sends in full only the pieces cut for the refusing receivers' target boxes; every
other piece stays a delta on the committed base (the other receivers hold it), and the
refusing receivers take that version as a full snapshot of what they hold
(``Receiver``: every entry it takes is a full piece that tiles its boxes). A request that
cannot say what its receiver holds asks for :data:`EVERYTHING` (a full snapshot).

On disk, a receiver that declared its boxes (slices or a group) asks with
``FULL_REQUESTED-<layout id>-<receiver id>.json``: its body is the receiver's layout
document (the bytes of its ``LAYOUT-<layout id>.json``), ``<layout id>`` the BLAKE2b-64 of
that body, ``<receiver id>`` random per receiving transport, so that the ranks of one
engine, which refuse together, never overwrite each other's requests. A request stands
until its receiver has applied a version again (it removes its file), or until a full
snapshot is published (the sender removes the requests it read): the ranks of an engine
can ask before different publishes and still find one version that re-sends every one of
their boxes. The manifest record of a version that re-sent a layout's pieces names its id
in ``"full"``. Every request file is untrusted: listed only under that exact name, at most
:data:`MAX_REQUESTS` of them, opened without following links, regular files only, at most
16 MiB, its body hashing to the id in its name, its boxes inside their full shapes; anything
else is logged, removed (a directory or FIFO moved aside, never deleted) and the next
publish is a full snapshot. The older ``FULL_REQUESTED`` file (a receiver holding whole,
undeclared tensors) still asks for everything.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from typing import Dict, List

from .. import _json
from .. import _safetensors as st
from . import layout
from .protocol import EVERYTHING, NOTHING, Resync, SyncError  # noqa: F401 (re-exported)

logger = logging.getLogger(__name__)

MAX_LAYOUT_BYTES = 16 << 20       # a layout document or a request file
MAX_REQUESTS = 1024               # request files read per publish; more: a full snapshot
ID = re.compile(r"[0-9a-f]{16}")
_REQUEST = re.compile(r"FULL_REQUESTED-([0-9a-f]{16})-[0-9a-f]{16}\.json")


def of_layouts(layouts) -> Resync:
    """The targets of receivers' layouts ``{name: (full shape, box)}``; EVERYTHING when one
    is empty (a receiver that never said what it holds)."""
    targets = set()
    for held in layouts:
        if not held:
            return EVERYTHING
        targets |= {(n, tuple(full), tuple(box)) for n, (full, box) in held.items()}
    return Resync(False, frozenset(targets), frozenset())


# ---------------------------------------------------------------------------- layout documents
def layout_doc(targets: dict) -> bytes:
    """The layout document of a receiver's ``{name: (full shape, box)}`` (canonical bytes:
    equal layouts give equal documents, hence equal ids)."""
    return json.dumps({"format": 1, "targets": {
        n: [list(full), [list(ab) for ab in box]] for n, (full, box) in sorted(
            targets.items())}}, separators=(",", ":")).encode()


def layout_id(doc: bytes) -> str:
    return hashlib.blake2b(doc, digest_size=8).hexdigest()


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def parse_layout(raw: bytes, what: str) -> Dict[str, tuple]:
    """``{name: (full shape, box)}`` of an untrusted layout document; SyncError naming
    ``what`` unless every box lies inside its full shape."""
    doc = _json.json_loads_bounded(raw, what, max_bytes=MAX_LAYOUT_BYTES, error=SyncError)
    if not isinstance(doc, dict) or not isinstance(doc.get("targets"), dict):
        raise SyncError(f"{what}: not an object with a 'targets' object")
    out = {}
    for name, value in doc["targets"].items():
        full, box = value if isinstance(value, list) and len(value) == 2 else (None, None)
        if (not isinstance(full, list) or not isinstance(box, list)
                or len(full) > layout.MAX_DIMS or len(box) != len(full)
                or not all(_is_int(n) and n >= 0 for n in full)
                or not all(isinstance(ab, list) and len(ab) == 2 and _is_int(ab[0])
                           and _is_int(ab[1]) and 0 <= ab[0] <= ab[1] <= n
                           for ab, n in zip(box, full))):
            raise SyncError(f"{what}: {name!r:.80}: box {box!r:.80} outside {full!r:.80}")
        out[name] = (tuple(full), tuple(tuple(ab) for ab in box))
    return out


def read_small(path: str, what: str) -> bytes:
    """The bytes of a regular file of at most MAX_LAYOUT_BYTES (no link followed, a FIFO
    never waited on); SyncError otherwise, FileNotFoundError passes."""
    fd, size = st.open_regular(path, error=SyncError)
    try:
        if size > MAX_LAYOUT_BYTES:
            raise SyncError(f"{what}: {size} bytes, more than the {MAX_LAYOUT_BYTES} allowed")
        return st.read_exact(fd, size, 0, error=SyncError).numpy().tobytes()
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------- disk requests
def request_name(lid: str, receiver_id: str) -> str:
    return f"FULL_REQUESTED-{lid}-{receiver_id}.json"


def standing(directory: str) -> List[str]:
    """The request files of ``directory`` (names of that exact form only)."""
    try:
        return sorted(n for n in os.listdir(directory) if _REQUEST.fullmatch(n))
    except OSError:
        return []


def read_requests(transport, names: List[str]) -> Resync:
    """The requests ``names`` of a DiskTransport's directory as one Resync; EVERYTHING
    (logged, the offending files removed) when one cannot be read or there are too many."""
    if len(names) > MAX_REQUESTS:
        logger.warning("glm_kernels.sync: %d full-snapshot requests in %s (more than %d): "
                       "the next publish is a full snapshot", len(names), transport.path,
                       MAX_REQUESTS)
        return EVERYTHING
    targets, ids, bad = set(), set(), []
    for name in names:
        lid = _REQUEST.fullmatch(name).group(1)
        try:
            raw = read_small(transport._file(name), name)
            if layout_id(raw) != lid:
                raise SyncError(f"{name}: its body is not the layout its name names")
            held = parse_layout(raw, name)
        except FileNotFoundError:
            continue            # its receiver applied a version meanwhile
        except (SyncError, OSError) as exc:
            bad.append((name, exc))
            continue
        if not held:
            bad.append((name, "no tensor named"))
            continue
        ids.add(lid)
        targets |= {(n, full, box) for n, (full, box) in held.items()}
    if bad:
        logger.warning("glm_kernels.sync: full-snapshot request %s refused (%s)%s; the next "
                       "publish is a full snapshot", bad[0][0], bad[0][1],
                       f" and {len(bad) - 1} more" if len(bad) > 1 else "")
        discard(transport, [name for name, _ in bad])
        return EVERYTHING
    return Resync(False, frozenset(targets), frozenset(ids))


def discard(transport, names) -> None:
    """Remove request files of a DiskTransport's directory: a directory, FIFO or device
    planted at such a name is moved aside (``_clear_planted``: someone's data, never
    deleted), anything else (a file, a symlink) unlinked."""
    for name in names:
        if not _REQUEST.fullmatch(name):
            continue
        try:
            transport._clear_planted(name)
            os.remove(transport._file(name))
        except FileNotFoundError:
            pass
        except (SyncError, OSError) as exc:
            logger.warning("glm_kernels.sync: %s", exc)
