"""Training side of weight sync: publish named tensors as numbered versions
(docs/design.md 3.7)."""
from __future__ import annotations

from typing import Dict, Iterator, Mapping, Optional

import torch

from .. import _checks, _dispatch
from ..delta import ENCODINGS, encode
from ..delta.packet import check_zstd_level, require_zstd
from . import sharded
from .fp8 import FP8Blocks
from .resync import NOTHING
from .sharded import ShardState
from .protocol import PublishStats  # noqa: F401  (re-exported: sync.PublishStats)
from .protocol import (DEFAULT_BUCKET_BYTES, MAX_VERSION, Entry, Transport, delta_entry,
                       dtype_name, full_entry, new_epoch)


def _default_encoding() -> str:
    try:
        require_zstd()
    except ImportError as exc:
        _dispatch.warn_once("sync:no_zstandard", f"glm_kernels.sync: {exc}; delta updates use "
                            f"encoding='gap16' instead (larger packets)")
        return "gap16"
    return "zstd"


class Sender:
    """Publishes versions of a set of named tensors through a transport.

    Parameters
    ----------
    transport : a ``glm_kernels.sync`` transport (``IpcTransport``, ``BroadcastTransport``,
        ``DiskTransport``, ``LocalTransport``).
    delta : bool, default True
        Send only the changed elements (a ``glm_kernels.delta`` packet per tensor) on top of
        the previous version. The first publish of a name, a shape/dtype change, a full
        resync asked for by a receiver (or by the transport, e.g. the disk's periodic
        snapshot) and ``publish(..., full=True)`` send full tensors. Keeps one copy of every
        published tensor (on its device) as the base of the next delta.
    encoding : {"zstd", "gap16", "int32"}, default None
        Delta packet encoding (docs/design.md 3.5). None: "zstd" when the optional ``zstandard``
        package is installed, otherwise "gap16" (logged once). An explicit "zstd" without
        ``zstandard`` raises ImportError here, naming the package.
    bucket_bytes : int, default 64 MiB
        Payload bytes per frame (streaming transports) or per file (disk).
    zstd_level : int, default 3
        zstd's level, an int in [-131072, 22] (checked here, not at the first delta).
    version : int, default 0
        The last version already published (e.g. ``DiskTransport.latest_version()`` when a
        trainer restarts on an existing directory); the first publish is ``version + 1``.
    group : torch.distributed ProcessGroup, default None
        The trainer ranks publishing together: ``publish`` is then collective over the group,
        each rank passing its local shards (DTensors, or tensors with ``slices``); a version
        is published when every rank's part is out. Every rank opens its own transport on the
        same endpoint (``DiskTransport(dir)`` on one directory, or a ``P2PTransport``).
    base : {"host", "device"}, default "host"
        Sharded mode: where the base of the next delta (this rank's shards as last
        published) is kept: host memory (pinned for CUDA shards) or the shards' device.
    fp8 : sync.FP8Blocks, optional
        Publish the named 2-D weights as float8_e4m3fn with 128 x 128 block scales
        (``<name>_scale_inv``, fp32, ``amax / 448``), quantized here.
    slices : {name: (dim, start, stop, full_shape)}, optional
        The part of each full parameter a plain local tensor holds (absent: the whole tensor,
        published by group rank 0 only).

    Sharded mode (``group``, ``slices`` or ``fp8`` given) cuts every shard by the boxes the
    receivers declared (``Receiver(slices=...)``) into pieces of at most ``bucket_bytes // 4``
    bytes, encodes one piece at a time against the base and sends it: the extra device memory
    of a publish is one piece, its new values and base, and the codec's scratch (at most one
    bucket); nothing holds a copy of the full model. The base moves only once the version
    is published: a version that fails on any rank leaves every engine and every base on the
    previous version, and the next publish is a delta on it. After an engine rank refused a
    version, the next publish re-sends in full only the pieces cut for the refusing ranks'
    boxes (disk and P2P; ``sync.resync``), every other piece a delta.

    Every update carries the sender's ``epoch`` (random per Sender): a receiver accepts a full
    snapshot from a new epoch (a restarted trainer) whatever its version number, and refuses
    deltas from any epoch but the one it holds.

    Example
    -------
    >>> import torch
    >>> from glm_kernels import sync
    >>> link = sync.LocalTransport()
    >>> w = {"w": torch.zeros(1000, dtype=torch.bfloat16)}
    >>> sender = sync.Sender(link, delta=True)
    >>> receiver = sync.Receiver(link, {"w": torch.empty(1000, dtype=torch.bfloat16)})
    >>> sender.publish(w), receiver.receive(timeout=0)
    (1, 1)
    >>> w["w"][7] = 1.0
    >>> sender.publish(w), receiver.receive(timeout=0), sender.last_stats.changed
    (2, 2, 1)
    >>> bool(torch.equal(receiver.params["w"], w["w"]))
    True
    """

    def __init__(self, transport: Transport, *, delta: bool = True,
                 encoding: Optional[str] = None,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, zstd_level: int = 3,
                 version: int = 0, group=None, base: str = "host", fp8=None,
                 slices: Optional[Mapping] = None):
        if not isinstance(transport, Transport):
            raise TypeError(f"transport must be a glm_kernels.sync transport, got "
                            f"{type(transport).__name__}")
        delta = _checks.check_bool("delta", delta)
        if encoding is None:
            encoding = _default_encoding() if delta else "zstd"
        _checks.check_choice("encoding", encoding, ENCODINGS)
        check_zstd_level(zstd_level)
        if delta and encoding == "zstd":
            require_zstd()      # ImportError naming the package now, not at the first delta
        if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be a positive int, got {bucket_bytes!r}")
        self.transport = transport
        self.delta = delta
        self.encoding = encoding
        self.bucket_bytes = bucket_bytes
        self.zstd_level = zstd_level
        if (isinstance(version, bool) or not isinstance(version, int)
                or not 0 <= version < MAX_VERSION):
            raise ValueError(f"version must be an int in [0, {MAX_VERSION}), got {version!r:.40}")
        self.version = version
        self.epoch = new_epoch()
        _checks.check_choice("base", base, ("host", "device"))
        if fp8 is not None and not isinstance(fp8, FP8Blocks):
            raise TypeError(f"fp8 must be a sync.FP8Blocks or None, got {type(fp8).__name__}")
        if slices is not None and not isinstance(slices, Mapping):
            raise TypeError(f"slices must be a mapping name -> (dim, start, stop, full_shape), "
                            f"got {type(slices).__name__}")
        if group is not None and not hasattr(group, "size"):
            raise TypeError(f"group must be a torch.distributed ProcessGroup, got "
                            f"{type(group).__name__}")
        if group is not None and group.size() > 1 and not transport.multi_part:
            raise TypeError(f"a Sender group of {group.size()} ranks needs a transport that "
                            f"takes several publishing ranks (DiskTransport, P2PTransport, "
                            f"IpcTransport.sharded), "
                            f"got {type(transport).__name__}")
        self.group, self.fp8, self.slices, self.base_where = group, fp8, slices, base
        #: sharded mode: a group, slices or FP8 weights (pieces cut by the receivers' boxes)
        self.sharded = group is not None or slices is not None or fp8 is not None
        if self.sharded and not delta:
            raise ValueError("a sharded Sender (group, slices or fp8) always sends deltas: "
                             "delta must be True")
        # Work per piece: the new values, the base moved next to them and the codec's scratch
        # (2 bytes per element on the GPU) stay within one bucket.
        self.chunk_bytes = max(1, bucket_bytes // 4)
        self.committed: Optional[int] = None     # the last version every receiver can hold
        self._state = ShardState(base)
        self.last_stats: Optional[PublishStats] = None
        self._base: Dict[str, torch.Tensor] = {}   # what the receivers hold (delta mode)
        self._force_full = False
        self._resync = NOTHING      # sharded: boxes asked for in full, not yet published

    def publish(self, named_tensors: Mapping[str, torch.Tensor], *, full: bool = False) -> int:
        """Send ``named_tensors`` as the next version and return that version number.

        A delta update names only the tensors passed; the others keep their last published
        value. A full snapshot in delta mode also re-sends every earlier published name, so a
        receiver that resyncs from it holds the complete state. If the transport raises, the
        version number is spent and the next publish is a full snapshot.
        """
        _checks.check_bool("full", full)
        if self.sharded:
            return sharded.publish(self, named_tensors, full)
        tensors = self._validate(named_tensors)
        full = (full or not self.delta or self._force_full or not self._base
                or self.transport.full_requested())
        if full and self.delta:
            tensors = {**{n: b for n, b in self._base.items() if n not in tensors}, **tensors}
        self.version += 1
        base = None if full else self.version - 1
        counts = {"delta": 0, "changed": 0, "bytes": 0}
        try:
            self.transport.send(self.version, base, self._entries(tensors, full, counts),
                                self.bucket_bytes, epoch=self.epoch)
        except BaseException:
            self._force_full = True
            raise
        self._force_full = False
        if self.delta:
            with torch.no_grad():
                for name, t in tensors.items():
                    kept = self._base.get(name)
                    if kept is None or kept.shape != t.shape or kept.dtype != t.dtype:
                        self._base[name] = t.detach().clone()
                    elif kept.data_ptr() != t.data_ptr():
                        kept.copy_(t)
        self.last_stats = PublishStats(self.version, full, len(tensors), counts["delta"],
                                       counts["changed"], counts["bytes"])
        return self.version

    def _entries(self, tensors: Dict[str, torch.Tensor], full: bool, counts) -> Iterator[Entry]:
        # Lazy: each packet is encoded only when the transport is ready for it.
        for name, t in tensors.items():
            old = None if full else self._base.get(name)
            if old is None or old.shape != t.shape or old.dtype != t.dtype:
                entry = full_entry(name, t)
            else:
                packet = encode(t.detach(), old, encoding=self.encoding,
                                zstd_level=self.zstd_level)
                entry = delta_entry(name, t.shape, packet)
                counts["delta"] += 1
                counts["changed"] += packet.count
            counts["bytes"] += entry.payload.numel()
            yield entry

    @staticmethod
    def _validate(named_tensors) -> Dict[str, torch.Tensor]:
        if not isinstance(named_tensors, Mapping):
            raise TypeError(f"named_tensors must be a mapping name -> tensor, got "
                            f"{type(named_tensors).__name__}")
        if not named_tensors:
            raise ValueError("named_tensors is empty: nothing to publish")
        out = {}
        for name, t in named_tensors.items():
            if not isinstance(name, str):
                raise TypeError(f"tensor names must be str, got {name!r}")
            _checks.check_tensor(f"named_tensors[{name!r}]", t)
            try:
                dtype_name(t.dtype)
            except TypeError as exc:
                raise TypeError(f"named_tensors[{name!r}]: {exc}") from None
            out[name] = t.detach() if t.is_contiguous() else t.detach().contiguous()
        return out
