"""Versioned weight-update messages: entries, buckets (frames) and their checks
(docs/design.md 3.7).

An *update* moves a receiver from ``base`` to ``version``. ``base is None`` marks a full
snapshot (accepted by a receiver holding any older version); otherwise the update is a delta and
applies only onto exactly version ``base``. An update is a list of *entries*, one per named
tensor:

* ``kind="full"``:  the tensor's bytes; ``checksum`` is :func:`digest` of those bytes.
* ``kind="delta"``: a ``glm_kernels.delta`` packet (``DeltaPacket.to_bytes()``, which carries
  its own packet and result checksums); ``checksum`` is :func:`digest` of the packet bytes.

:func:`digest` is BLAKE2b-64 for up to 4 MiB, and a one-level tree of BLAKE2b-64 over 4 MiB
chunks above (so large tensors hash on several cores).

Streaming transports (IPC queue, torch.distributed, in-process) cut the entries into *frames*
of at most ``bucket_bytes`` of payload (a tensor larger than a bucket spans several frames).
A frame is ``(meta, data, last)``: ``data`` is a 1-D uint8 tensor (on any device) holding the
fragments back to back; ``meta`` is sealed bytes::

    b"GLMS" | u16 format version | u32 JSON length | 8B BLAKE2b-64 of the JSON | JSON

and the JSON is ``{"v": version, "base": base, "e": sender epoch, "i": frame index, "last": bool,
"parts":
[{"n": name, "k": kind, "dt": dtype, "sh": shape, "ck": digest hex, "size": entry bytes,
"at": fragment offset in the entry, "len": fragment bytes}, ...]}``. ``last`` is repeated
outside the seal so a transport can find the end of an update even when the meta is corrupt.
The sender epoch (16 hex digits, random per :class:`~glm_kernels.sync.Sender`) tells a
receiver that a sender restarted: its full snapshot is accepted whatever its version number.
(epoch, version, frame index) identify every frame, so a streaming transport can drop the
frames of an update whose sender died half-way instead of gluing them to the next update.
Format version 2 added the epoch; version 1 frames are refused with a message that says so.
:func:`assemble` checks every frame and rebuilds the entries; the receiver then checks every
entry against its own tensors before writing any of them.
"""
from __future__ import annotations

import abc
import concurrent.futures
import hashlib
import json
import os
import struct
from dataclasses import dataclass
from typing import FrozenSet, Iterable, Iterator, List, NamedTuple, Optional, Tuple

import torch

from .. import _json

MAGIC = b"GLMS"
FORMAT_VERSION = 2
_SEAL = struct.Struct("<4sHI8s")
KINDS = ("full", "delta")
# Every dtype the delta codec handles (1, 2, 4 or 8 bytes per element); full entries use the same
# table so that any published tensor can later be sent as a delta.
DTYPES = {str(d).replace("torch.", ""): d for d in (
    torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.uint8, torch.int8,
    torch.int16, torch.int32, torch.int64, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2)}
DEFAULT_BUCKET_BYTES = 64 << 20
# The largest version number (int64): a forged longer one would make every later update look
# old to a receiver that took it (and, on disk, every later publish look stale to the sender).
MAX_VERSION = (1 << 63) - 1
# Frame metadata: bounded in size and nesting before its JSON is parsed.
MAX_META_BYTES = 64 << 20
MAX_META_DEPTH = 32


class SyncError(ValueError):
    """An update was refused (corrupt, truncated, mismatched); the receiver's tensors are
    unchanged."""


class VersionError(SyncError):
    """An update does not apply on top of the version the receiver holds."""


class TransportError(SyncError):
    """The transport could not deliver an update (e.g. an unreadable disk manifest): nothing
    was consumed, so ``Receiver.poll`` stops draining and returns this error at once."""


def new_epoch() -> str:
    """A random sender epoch: 16 hex digits."""
    return os.urandom(8).hex()


def check_epoch(epoch) -> Optional[str]:
    if epoch is not None and not (isinstance(epoch, str) and 0 < len(epoch) <= 64
                                  and epoch.isalnum() and epoch.isascii()):
        raise SyncError(f"malformed sender epoch {epoch!r:.80}")
    return epoch


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """Flat uint8 view of a contiguous tensor's bytes (no copy)."""
    return t.detach().reshape(-1).view(torch.uint8)


_CHUNK = 4 << 20
_pool = None   # (pid, executor)


def digest(data) -> bytes:
    """Checksum of a uint8 tensor (any device) or bytes-like object: BLAKE2b-64 of the bytes
    up to 4 MiB; above, BLAKE2b-64 of the concatenated BLAKE2b-64 digests of the 4 MiB chunks
    (hashed in parallel threads: hashlib releases the GIL; the value does not depend on the
    thread count)."""
    global _pool
    if isinstance(data, torch.Tensor):
        data = data.cpu().numpy()
    view = memoryview(data).cast("B")
    if len(view) <= _CHUNK:
        return hashlib.blake2b(view, digest_size=8).digest()
    if _pool is None or _pool[0] != os.getpid():   # a forked child has no pool threads
        _pool = (os.getpid(), concurrent.futures.ThreadPoolExecutor(
            max_workers=min(8, os.cpu_count() or 1), thread_name_prefix="glm_sync_digest"))
    chunks = [view[i:i + _CHUNK] for i in range(0, len(view), _CHUNK)]
    parts = _pool[1].map(lambda c: hashlib.blake2b(c, digest_size=8).digest(), chunks)
    return hashlib.blake2b(b"".join(parts), digest_size=8).digest()


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).replace("torch.", "")
    if name not in DTYPES:
        raise TypeError(f"dtype {dtype} cannot be synced; expected one of {list(DTYPES)}")
    return name


@dataclass
class Entry:
    """One named tensor of an update; ``payload`` is a 1-D uint8 tensor (see module doc)."""
    name: str
    kind: str
    dtype: torch.dtype
    shape: tuple
    checksum: bytes
    payload: torch.Tensor

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


@dataclass
class Update:
    version: int
    base: Optional[int]
    entries: List[Entry]
    epoch: Optional[str] = None       # the sender's epoch (None: unknown, an old sender)
    #: the transport left out pieces cut for other receivers' boxes (disk reads only this
    #: receiver's): the update came from a sharded sender
    skipped_pieces: bool = False

    @property
    def is_full(self) -> bool:
        return self.base is None


@dataclass(frozen=True)
class PublishStats:
    """What the last :meth:`Sender.publish` sent."""
    version: int
    full: bool            # a full snapshot (base None) rather than a delta
    tensors: int          # entries in the update
    delta_tensors: int    # of which sent as delta packets
    changed: int          # changed elements over the delta entries
    payload_bytes: int    # bytes of tensor data and packets (frame metadata not counted)


class Frame(NamedTuple):
    meta: bytes
    data: torch.Tensor
    last: bool


def full_entry(name: str, t: torch.Tensor) -> Entry:
    """Entry carrying ``t``'s bytes (a view of ``t``; copied when packed into a frame)."""
    data = byte_view(t.contiguous())
    return Entry(name, "full", t.dtype, tuple(t.shape), digest(data), data)


def delta_entry(name: str, shape: tuple, packet) -> Entry:
    """Entry carrying a ``glm_kernels.delta.DeltaPacket`` (its wire bytes)."""
    wire = packet.to_bytes()
    return Entry(name, "delta", packet.dtype, tuple(shape), digest(wire),
                 torch.frombuffer(bytearray(wire), dtype=torch.uint8))


def seal_meta(meta: dict) -> bytes:
    body = json.dumps(meta, separators=(",", ":")).encode()
    return _SEAL.pack(MAGIC, FORMAT_VERSION, len(body), digest(body)) + body


def open_meta(sealed: bytes) -> dict:
    """Inverse of :func:`seal_meta`; raises SyncError on a corrupt or truncated seal."""
    sealed = bytes(sealed)
    if len(sealed) < _SEAL.size:
        raise SyncError(f"truncated frame meta: {len(sealed)} bytes, the seal needs {_SEAL.size}")
    magic, version, length, check = _SEAL.unpack_from(sealed)
    body = sealed[_SEAL.size:]
    if magic != MAGIC:
        raise SyncError(f"not a sync frame: magic {magic!r}, expected {MAGIC!r}")
    if version != FORMAT_VERSION:
        raise SyncError(f"sync frame format version {version}, this glm_kernels reads "
                        f"{FORMAT_VERSION}" + (" (version 1: a sender from before sender "
                                               "epochs; upgrade it)" if version == 1 else ""))
    if len(body) != length or digest(body) != check:
        raise SyncError("corrupt frame meta: length or checksum mismatch")
    meta = _json.json_loads_bounded(body, "frame meta", max_bytes=MAX_META_BYTES,
                                        max_depth=MAX_META_DEPTH, error=SyncError)
    if not isinstance(meta, dict):
        raise SyncError(f"malformed frame meta: {type(meta).__name__}, expected an object")
    return meta


def frame_key(meta: bytes):
    """(epoch, version, frame index) of a sealed frame meta, or None if it cannot be read."""
    try:
        m = open_meta(meta)
    except SyncError:
        return None
    key = (m.get("e"), m.get("v"), m.get("i"))
    return key if isinstance(key[2], int) and not isinstance(key[2], bool) else None


def part_of(e: Entry, at: int, take: int) -> dict:
    """The meta of bytes [at, at + take) of entry ``e`` inside a frame."""
    return {"n": e.name, "k": e.kind, "dt": dtype_name(e.dtype), "sh": list(e.shape),
            "ck": e.checksum.hex(), "size": e.payload.numel(), "at": at, "len": take}


def make_frame(version: int, base: Optional[int], epoch: Optional[str], index: int, last: bool,
               parts: list, chunks: list, device=None) -> Frame:
    """One frame: ``parts`` (from :func:`part_of`) and their bytes ``chunks``, back to back."""
    dev = device if device is not None else (chunks[0].device if chunks else "cpu")
    data = (torch.cat([c.to(dev) for c in chunks]) if chunks
            else torch.empty(0, dtype=torch.uint8, device=dev))
    meta = {"v": version, "base": base, "e": epoch, "i": index, "last": last, "parts": parts}
    return Frame(seal_meta(meta), data, last)


def pack(version: int, base: Optional[int], entries: Iterable[Entry], bucket_bytes: int,
         device=None, epoch: Optional[str] = None) -> Iterator[Frame]:
    """Frames of at most ``bucket_bytes`` payload each, produced lazily (a large model streams:
    at most two buckets are alive at once). ``device``: where frame data lives (default: the
    device of the first fragment of each frame). ``epoch``: the sender's epoch."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")

    def frame(bucket, index, last):
        return make_frame(version, base, epoch, index, last, bucket[0], bucket[1], device)

    current, used, index = ([], []), 0, 0
    full = None   # a filled bucket, held back until we know whether it is the last one
    for e in entries:
        size, at = e.payload.numel(), 0
        while True:
            take = min(size - at, bucket_bytes - used)
            current[0].append(part_of(e, at, take))
            if take:
                current[1].append(e.payload[at:at + take])
            at, used = at + take, used + take
            if used == bucket_bytes:
                if full is not None:
                    yield frame(full, index - 1, False)
                full, current, used, index = current, ([], []), 0, index + 1
            if at == size:
                break
    if full is not None and not current[0]:
        yield frame(full, index - 1, True)
        return
    if full is not None:
        yield frame(full, index - 1, False)
    yield frame(current, index, True)


def assemble(frames: List[Frame]) -> Update:
    """Rebuild the update from its frames; raises SyncError if anything does not add up."""
    if not frames:
        raise SyncError("empty update: no frames")
    try:
        return _assemble(frames)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        if isinstance(exc, SyncError):
            raise
        # a meta that passed its seal but lacks or mistypes a field: a broken sender
        raise SyncError(f"malformed frame meta: {type(exc).__name__}: {exc}") from exc


def _assemble(frames: List[Frame]) -> Update:
    metas = [open_meta(f.meta) for f in frames]
    head = metas[0]
    version, base, epoch = head.get("v"), head.get("base"), check_epoch(head.get("e"))
    pieces = {}   # name -> [first part, list of fragment tensors, bytes so far]
    order = []
    for i, (meta, frame) in enumerate(zip(metas, frames)):
        if (meta.get("i") != i or meta.get("v") != version or meta.get("base") != base
                or meta.get("e") != epoch):
            raise SyncError(f"frame {i} of update v{version} is out of sequence: index "
                            f"{meta.get('i')}, version {meta.get('v')}, base {meta.get('base')}")
        if meta.get("last") != (i == len(frames) - 1):
            raise SyncError(f"update v{version}: frame {i} of {len(frames)} has last="
                            f"{meta.get('last')} (frames missing or out of sequence)")
        offset = 0
        if not isinstance(meta["parts"], list):
            raise SyncError(f"update v{version}: frame {i} has parts {meta['parts']!r:.80}")
        for p in meta["parts"]:
            if not isinstance(p, dict) or not isinstance(p.get("n"), str):
                raise SyncError(f"update v{version}: frame {i} has a malformed part {p!r:.80}")
            name = p["n"]
            if not all(isinstance(p[k], int) and p[k] >= 0 for k in ("at", "len", "size")):
                raise SyncError(f"update v{version}: tensor {name!r} has a bad fragment {p}")
            if name not in pieces:
                if p["at"] != 0:
                    raise SyncError(f"update v{version}: tensor {name!r} starts at byte {p['at']}")
                pieces[name] = [p, [], 0]
                order.append(name)
            first, chunks, got = pieces[name]
            if p["at"] != got or any(p[k] != first[k] for k in ("k", "dt", "sh", "ck", "size")):
                raise SyncError(f"update v{version}: fragments of tensor {name!r} do not line up")
            chunks.append(frame.data[offset:offset + p["len"]])
            pieces[name][2] = got + p["len"]
            offset += p["len"]
        if offset != frame.data.numel():
            raise SyncError(f"update v{version}: frame {i} holds {frame.data.numel()} bytes, "
                            f"its parts add up to {offset} (truncated or padded)")
    entries = []
    for name in order:
        p, chunks, got = pieces[name]
        if got != p["size"]:
            raise SyncError(f"update v{version}: tensor {name!r} has {got} of {p['size']} bytes")
        if p["k"] not in KINDS or p["dt"] not in DTYPES:
            raise SyncError(f"update v{version}: tensor {name!r} has kind {p['k']!r}, "
                            f"dtype {p['dt']!r}")
        payload = chunks[0] if len(chunks) == 1 else torch.cat([c.to(chunks[0].device)
                                                                for c in chunks])
        entries.append(Entry(name, p["k"], DTYPES[p["dt"]], check_shape(p["sh"]),
                             bytes.fromhex(p["ck"]), payload))
    check_versions(version, base)
    return Update(version, base, entries, epoch)


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def check_versions(version, base) -> None:
    """A version is an int in [1, MAX_VERSION]; a base is None (full snapshot) or an int in
    [0, version)."""
    if not (_is_int(version) and 1 <= version <= MAX_VERSION
            and (base is None or (_is_int(base) and 0 <= base < version))):
        raise SyncError(f"update has version {version!r:.40}, base {base!r:.40} (versions are "
                        f"ints in [1, {MAX_VERSION}])")


def check_shape(shape) -> tuple:
    if not isinstance(shape, list) or not all(_is_int(s) and s >= 0 for s in shape):
        raise SyncError(f"malformed tensor shape {shape!r:.80}")
    return tuple(shape)


#: (name, full shape, target box) of a receiver's tensor
Target = Tuple[str, Tuple[int, ...], Tuple[Tuple[int, int], ...]]


class Resync(NamedTuple):
    """What the next publish re-sends in full: everything (a full snapshot), or the pieces
    cut for ``targets``. ``ids``: the disk layouts whose requests these targets answer."""
    everything: bool
    targets: FrozenSet[Target]
    ids: FrozenSet[str]

    @property
    def asks(self) -> bool:
        return self.everything or bool(self.targets)

    def __or__(self, other: "Resync") -> "Resync":
        if self.everything or other.everything:
            return EVERYTHING
        return Resync(False, self.targets | other.targets, self.ids | other.ids)


EVERYTHING = Resync(True, frozenset(), frozenset())
NOTHING = Resync(False, frozenset(), frozenset())


class Transport(abc.ABC):
    """What Sender and Receiver need from a transport (subclasses implement all four).

    Sender side: ``send(version, base, entries, bucket_bytes, epoch=None)`` delivers one
    update (``entries`` is a lazy iterator; ``base is None`` for a full snapshot; ``epoch`` the
    sender's epoch, carried with the update so a receiver can tell a restarted sender) and
    ``full_requested()`` says whether the next update must be a full snapshot.
    Receiver side: ``recv(held, timeout)`` returns the next :class:`Update` for a receiver
    holding version ``held`` (or None when nothing came within ``timeout`` seconds; None waits
    forever) and ``report(version, ok)`` tells the sender side the outcome (``ok=False`` asks
    for a full snapshot).
    """
    #: where frame data is placed (None: the device of the tensors being sent)
    device = None

    @abc.abstractmethod
    def send(self, version: int, base: Optional[int], entries: Iterable[Entry],
             bucket_bytes: int, epoch: Optional[str] = None) -> None:
        """Deliver one update (sender side)."""

    @abc.abstractmethod
    def full_requested(self) -> bool:
        """True when the next update must be a full snapshot (sender side)."""

    @abc.abstractmethod
    def recv(self, held: int, timeout: Optional[float]) -> Optional[Update]:
        """The next update, or None if none came within ``timeout`` s (receiver side)."""

    @abc.abstractmethod
    def report(self, version: int, ok: bool) -> None:
        """Tell the sender side how the last update went (receiver side)."""

    # ---- sharded publishing (a Sender with a group, or with slices); see sync/sharded.py
    #: True when several publishing ranks may send parts of one version (send_part/commit)
    multi_part = False

    def targets(self) -> dict:
        """Sender side: {name: {(full shape, target box), ...}} the receivers declared
        (``layout`` module); {} when none did (every piece is then cut for the whole tensor)."""
        return {}

    def declare(self, targets: dict, explicit: bool) -> None:
        """Receiver side: the boxes this receiver holds, {name: (full shape, box)}.
        ``explicit``: the receiver was given slices or a group (else: whole tensors)."""

    def resync_request(self):
        """Sender side (sharded): what the next publish re-sends in full, a
        :class:`~glm_kernels.sync.resync.Resync`: everything, or the pieces cut for the
        boxes of the receivers that refused. Default: everything when
        :meth:`full_requested`."""
        return EVERYTHING if self.full_requested() else NOTHING

    def send_part(self, version: int, base: Optional[int], entries: Iterable[Entry],
                  bucket_bytes: int, epoch: Optional[str], part: int, parts: int):
        """Sender side: deliver rank ``part``'s entries of a version made of ``parts`` parts;
        returns what :meth:`commit` needs from this part (JSON-able)."""
        if parts != 1:
            raise TypeError(f"{type(self).__name__} takes one publisher per version; a sender "
                            f"group of {parts} ranks needs DiskTransport, P2PTransport or "
                            f"IpcTransport.sharded")
        self.send(version, base, entries, bucket_bytes, epoch=epoch)
        return None

    def commit(self, version: int, base: Optional[int], epoch: Optional[str], parts: list,
               ok: bool, part: int, full_for=()) -> bool:
        """Sender side, every part, after every part's send_part: ``ok`` says whether every
        part is out (``parts``: what each part's send_part returned; ``full_for``: the
        ``Resync.ids`` whose pieces this version re-sent in full). Returns whether the
        version was published (and, where the transport can tell, applied)."""
        return ok
