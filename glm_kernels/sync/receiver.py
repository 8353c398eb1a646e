"""Rollout side of weight sync: apply versions in place, all or nothing (docs/design.md 3.7)."""
from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Tuple

import torch

from .. import _checks
from ..delta import DeltaPacket, apply_, verify
from . import layout
from .protocol import (MAX_VERSION, SyncError, Transport, TransportError, Update, VersionError,
                       byte_view, check_epoch, check_versions, digest, dtype_name)

@dataclass(frozen=True)
class ReceiveStats:
    """What the last applied update brought to this receiver."""
    version: int
    tensors: int          # entries taken (whole tensors and pieces of this receiver's boxes)
    changed: int          # changed elements over the delta entries taken
    payload_bytes: int    # bytes of tensor data and packets taken (framing not counted)


_KEPT_REFUSALS = 8        # poll() names at most this many refusals (and counts the rest)
_RETIRED_EPOCHS = 16      # sender epochs this receiver has moved away from


class Receiver:
    """Holds named tensors at a version and moves them forward with the updates it receives.

    Parameters
    ----------
    transport : the receiving end of a ``glm_kernels.sync`` transport.
    params : Mapping[str, Tensor]
        The tensors to keep up to date, written in place (e.g. ``model.state_dict()``:
        its tensors share storage with the parameters). Contiguous, any device, any dtype the
        sender uses; names, shapes and dtypes must match the sender's.
    version : int, default 0
        The version ``params`` hold; 0 means "nothing yet" (only a full snapshot applies).

    Every update is checked as a whole before anything is written: the version (a delta
    must be based on exactly ``self.version``; a full snapshot must be newer), every tensor's
    name, dtype and shape, every checksum, and every delta packet verified against the
    tensor it applies to (``glm_kernels.delta.verify``: base and result checksums). Only then
    are all tensors written, in place. Any failure raises :class:`SyncError` (or its
    subclass :class:`VersionError`), leaves every tensor unchanged, and asks the sender for
    a full snapshot (a sharded sender re-sends in full only the pieces of this receiver's
    boxes, declared with ``slices`` or a ``group``; a version that brings this receiver only
    full pieces tiling its boxes applies like a full snapshot). (If the machine fails in the
    middle of the writes -- a device out of memory -- the receiver drops to version 0, which
    only a full snapshot leaves.)

    Sender epochs: the receiver holds the epoch of the sender it last applied. A full snapshot
    from another epoch (a restarted sender, numbering from 1 again) is accepted whatever its
    version; a delta must come from the held epoch; a full snapshot from an epoch this
    receiver has already left is refused (a stale update from the old sender).

    Memory: the receiver holds the update (frame data and parsed packets) until it is
    written; delta packets are applied in place with O(changes) scratch, never a copy of a
    tensor. Names that alias one tensor (tied weights) must carry identical contents: an
    update giving overlapping tensors different bytes is refused.

    Example
    -------
    >>> import torch
    >>> from glm_kernels import sync
    >>> link = sync.LocalTransport()
    >>> sender = sync.Sender(link)
    >>> receiver = sync.Receiver(link, {"b": torch.zeros(3)})
    >>> sender.publish({"b": torch.tensor([1.0, 2.0, 3.0])})
    1
    >>> receiver.poll(), receiver.params["b"].tolist()
    (1, [1.0, 2.0, 3.0])
    """

    def __init__(self, transport: Transport, params: Mapping[str, torch.Tensor], *,
                 version: int = 0, slices: Optional[Mapping] = None, group=None):
        if not isinstance(transport, Transport):
            raise TypeError(f"transport must be a glm_kernels.sync transport, got "
                            f"{type(transport).__name__}")
        if not isinstance(params, Mapping) or not params:
            raise TypeError("params must be a non-empty mapping name -> tensor, got "
                            f"{type(params).__name__}")
        for name, t in params.items():
            _checks.check_tensor(f"params[{name!r}]", t)
            if not t.is_contiguous():
                raise ValueError(f"params[{name!r}] must be contiguous (written in place), "
                                 f"got strides {t.stride()}")
            try:
                dtype_name(t.dtype)
            except TypeError as exc:
                raise TypeError(f"params[{name!r}]: {exc}") from None
        if (isinstance(version, bool) or not isinstance(version, int)
                or not 0 <= version <= MAX_VERSION):
            raise ValueError(f"version must be an int in [0, {MAX_VERSION}], got "
                             f"{version!r:.40}")
        if slices is not None:
            if not isinstance(slices, Mapping):
                raise TypeError(f"slices must be a mapping name -> (dim, start, stop, "
                                f"full_shape), got {type(slices).__name__}")
            unknown = set(slices) - set(params)
            if unknown:
                raise ValueError(f"slices names tensors that are not in params: "
                                 f"{sorted(unknown)[:8]}")
            slices = {n: layout.check_slice(f"slices[{n!r}]", spec, params[n].shape)
                      for n, spec in slices.items()}
        if group is not None and not hasattr(group, "size"):
            raise TypeError(f"group must be a torch.distributed ProcessGroup, got "
                            f"{type(group).__name__}")
        self.slices, self.group = slices, group
        #: {name: (full shape, box this receiver holds)}; pieces cut for these boxes apply
        self.targets = layout.targets_of(params, slices)
        self.last_stats: Optional[ReceiveStats] = None
        self.transport = transport
        self.params: Dict[str, torch.Tensor] = dict(params)
        self.version = version
        self.epoch: Optional[str] = None            # the held version's sender epoch
        self._retired = collections.deque(maxlen=_RETIRED_EPOCHS)
        transport.declare(self.targets, explicit=slices is not None or group is not None)

    def receive(self, timeout: Optional[float] = None) -> Optional[int]:
        """Wait up to ``timeout`` s (None: forever) for one update and apply it.

        Returns the new version, or None if nothing arrived. Raises SyncError if the update
        was refused (tensors unchanged; a full snapshot has been requested).
        """
        if timeout is not None:
            timeout = _checks.check_finite_number("timeout", timeout, nonnegative=True)
        try:
            update, plan, error = None, None, None
            try:
                update = self.transport.recv(self.version, timeout)
                if update is not None:
                    if not isinstance(update, Update):
                        raise SyncError(f"transport returned {type(update).__name__}, not an "
                                        f"Update")
                    plan = self._check(update)
            except SyncError as exc:
                error = exc
            if self.group is not None and not self._vote(update, error):
                return None           # not every rank of the engine has this version yet
            if error is not None:
                raise error
            if update is None:
                return None
            self._write(update, plan)
        except SyncError:
            self.transport.report(self.version, False)
            raise
        self.transport.report(self.version, True)
        return self.version

    def poll(self) -> int:
        """Apply every update available now, in order, without waiting; returns the version.

        A refused update does not stop the drain: later updates (such as the full snapshot
        that the refusal asked for) are still applied. If any was refused, SyncError (or
        VersionError if all refusals were about versions) is raised at the end, naming them.
        On a lock-step transport (``BroadcastTransport``) this receives exactly one update,
        waiting for it: every receiver must match every ``publish``.

        Always returns (or raises) after the updates available now: a transport that cannot
        deliver anything (:class:`~glm_kernels.sync.protocol.TransportError`, e.g. an
        unreadable disk manifest) ends the drain at once. The error names at most
        8 refusals and counts the rest.
        """
        refusals, n_refused, only_versions = [], 0, True
        while True:
            try:
                got = self.receive(timeout=0)
            except SyncError as exc:
                n_refused += 1
                only_versions = only_versions and isinstance(exc, VersionError)
                if len(refusals) < _KEPT_REFUSALS:
                    refusals.append(exc)
                if isinstance(exc, TransportError):
                    break
                got = -1
            if got is None or getattr(self.transport, "lockstep", False):
                break
        if n_refused == 1:
            raise refusals[0]
        if refusals:
            kind = VersionError if only_versions else SyncError
            more = f"; and {n_refused - len(refusals)} more" if n_refused > len(refusals) else ""
            raise kind(f"{n_refused} updates refused, now holding v{self.version}: "
                       + "; ".join(map(str, refusals)) + more) from refusals[0]
        return self.version

    def _vote(self, update: Optional[Update], error: Optional[SyncError]) -> bool:
        """All-or-nothing across the engine group: True when every rank verified the same
        version (write it), False when some rank has nothing yet (nobody writes, no
        refusal); SyncError on every rank when any rank refused."""
        import torch.distributed as dist
        version = update.version if update is not None else -1
        device = "cpu"
        if str(dist.get_backend(self.group)).lower() == "nccl":
            device = torch.device("cuda", torch.cuda.current_device())
        # MIN of [refused?, has an update?, version, -version] over the group (as ints)
        flags = torch.tensor([0 if error is not None else 1, int(update is not None),
                              version, -version], dtype=torch.int64, device=device)
        dist.all_reduce(flags, op=dist.ReduceOp.MIN, group=self.group)
        ok, have, low, high = (int(x) for x in flags.tolist())
        if not ok:
            if error is not None:
                return True       # raised by the caller with this rank's own reason
            raise SyncError(f"update v{version} refused: another rank of the engine group "
                            f"refused it; every rank keeps v{self.version}")
        if not have:
            return False
        if low != -high:
            return False          # ranks see different versions (a disk race): retry
        return True

    def apply_update(self, update: Update) -> int:
        """Check ``update`` completely, then write it in place; returns the new version
        (this rank only: ``receive``/``poll`` vote across a ``group`` in between)."""
        return self._write(update, self._check(update))

    def _check(self, update: Update):
        """Phase 1 (reads only): the version, every entry, and that the pieces of every
        sliced name tile this receiver's box. Returns the writes of phase 2."""
        self._check_version(update, self._only_full_pieces(update))
        seen = set()
        checked: List[Tuple[str, torch.Tensor, object]] = []
        pieces, boxes = [], collections.defaultdict(list)
        skipped = bool(getattr(update, "skipped_pieces", False))
        changed = taken = 0
        for entry in update.entries:
            if entry.name in seen:
                raise SyncError(f"update v{update.version} names tensor {entry.name!r} twice")
            seen.add(entry.name)
            parsed = layout.parse_piece(entry.name)
            if parsed is None:
                checked.append(self._check_entry(update.version, entry))
                data = checked[-1][2]
            else:
                got = self._check_piece(update.version, entry, parsed)
                if got is None:
                    skipped = True
                    continue            # cut for another receiver's box
                pieces.append(got)
                boxes[parsed[0]].append(parsed[3])
                data = got[2]
            taken += entry.payload.numel()
            changed += data.count if isinstance(data, DeltaPacket) else 0
        if boxes or skipped:
            # A sharded sender's version carries every tensor: each box this receiver holds
            # must be tiled by pieces cut for it (a box no sender cut for, e.g. a layout the
            # senders never saw, or a trainer part lost, is refused, not left stale).
            plain = {c[0] for c in checked}
            for name, (_, box) in self.targets.items():
                if name not in boxes and name not in plain and layout.volume(box):
                    raise SyncError(f"update v{update.version}: no piece of tensor {name!r} "
                                    f"was cut for this receiver's box {box} (its slices not "
                                    f"declared to the senders, or a sender part missing)")
        for name, got in boxes.items():
            if not layout.tiles(self.targets[name][1], got):
                raise SyncError(f"update v{update.version}, tensor {name!r}: its pieces "
                                f"{sorted(got)[:4]} do not tile this receiver's box "
                                f"{self.targets[name][1]} (a trainer rank's part is missing)")
        stats = ReceiveStats(update.version, len(checked) + len(pieces), changed, taken)
        return _without_shared_duplicates(update.version, checked), pieces, stats

    def _only_full_pieces(self, update: Update) -> bool:
        """Whether every entry this receiver takes is a full piece cut for its boxes: a
        sharded version that re-sends them after this receiver refused (a delta for the
        others, ``resync``). It applies like a full snapshot, whatever version is held:
        the pieces must still tile every box (:meth:`_check`)."""
        if update.base is None:
            return False
        took = False
        for entry in update.entries:
            parsed = layout.parse_piece(entry.name)
            if parsed is None:
                return False
            name, full, target, _ = parsed
            if self.targets.get(name) != (tuple(full), target):
                continue            # another receiver's (or an unknown name: refused later)
            if entry.kind != "full":
                return False
            took = True
        return took

    def _check_piece(self, version: int, entry, parsed):
        """(region view, box shape, full payload or verified DeltaPacket), or None for a
        piece cut for another box of a tensor this receiver holds."""
        name, full, target, box = parsed
        where = f"update v{version}, tensor {name!r} piece {box}"
        if name not in self.params:
            known = sorted(self.params)
            raise SyncError(f"{where}: unknown name; this receiver holds "
                            f"{known[:8]}{' ...' if len(known) > 8 else ''}")
        mine_full, mine = self.targets[name]
        if (tuple(full), target) != (tuple(mine_full), mine):
            return None
        param = self.params[name]
        if entry.dtype != param.dtype:
            raise SyncError(f"{where}: dtype {entry.dtype}, the receiver's tensor is "
                            f"{param.dtype}")
        shape = layout.box_shape(box)
        if tuple(entry.shape) != shape:
            raise SyncError(f"{where}: shape {tuple(entry.shape)}, the piece is {shape}")
        if digest(entry.payload) != entry.checksum:
            raise SyncError(f"{where}: {entry.kind} payload checksum mismatch (corrupt)")
        region = param[layout.local_index(mine, box)]
        if entry.kind == "full":
            want = layout.volume(box) * param.element_size()
            if entry.payload.numel() != want:
                raise SyncError(f"{where}: {entry.payload.numel()} bytes, expected {want}")
            return region, shape, entry.payload
        try:
            packet = DeltaPacket.from_bytes(entry.payload.cpu().numpy().tobytes())
            verify(region.detach() if region.is_contiguous() else region.contiguous(), packet)
        except (ValueError, TypeError) as exc:
            raise SyncError(f"{where}: delta refused: {exc}") from exc
        except ImportError as exc:
            raise SyncError(f"{where}: delta refused: {exc}") from exc
        return region, shape, packet

    def _write(self, update: Update, plan) -> int:
        """Phase 2 of an update whose every entry passed phase 1 (:meth:`_check`: every
        entry's name, dtype, shape and payload checksum, every delta packet verified against
        the tensor or piece it applies to -- ``glm_kernels.delta.verify``: base and result
        checksums, O(changes) scratch). Full entries are copied in, delta packets applied in
        place -- no tensor-sized scratch copy (a piece that is not contiguous in the local
        tensor goes through a piece-sized one)."""
        writes, pieces, stats = plan
        # Phase 2. Every write below was verified against the bytes it writes onto, so none
        # can fail on the data (apply_ re-checks before its first write all the same: one
        # extra read of each delta tensor, against a tensor changed behind our back).
        # What can still fail is the machine: a device out of memory (the host -> device
        # copy of a full payload, apply_'s O(changes) positions), a CUDA error, an interrupt.
        # Then the tensors written before the failure hold the new version and the others
        # the old one: the receiver drops to version 0, where only a full snapshot applies,
        # and the SyncError asks the sender for one (poll() keeps draining and applies it).
        try:
            with torch.no_grad():
                for _, param, data in writes:
                    if isinstance(data, DeltaPacket):
                        apply_(param, data)
                    else:
                        byte_view(param).copy_(data.to(param.device, non_blocking=False))
                for region, shape, data in pieces:
                    if isinstance(data, DeltaPacket):
                        if region.is_contiguous():
                            apply_(region, data)
                        else:
                            scratch = region.contiguous()
                            apply_(scratch, data)
                            region.copy_(scratch)
                    else:
                        values = torch.empty(shape, dtype=region.dtype, device=data.device)
                        byte_view(values).copy_(data)
                        region.copy_(values.to(region.device))
        except BaseException as exc:
            held, self.version = self.version, 0
            if not isinstance(exc, Exception):      # KeyboardInterrupt & co: let it through
                raise
            raise SyncError(f"update v{update.version} failed while writing after every check "
                            f"had passed ({type(exc).__name__}: {exc}); tensors are part "
                            f"v{held}, part v{update.version}: version reset to 0, a full "
                            f"snapshot is needed") from exc
        epoch = getattr(update, "epoch", None)
        if epoch != self.epoch:
            if self.epoch is not None and self.epoch not in self._retired:
                self._retired.append(self.epoch)
            self.epoch = epoch
        self.version = update.version
        self.last_stats = stats
        return self.version

    def _check_version(self, update: Update, full_here: bool = False) -> None:
        check_versions(update.version, update.base)
        epoch = check_epoch(getattr(update, "epoch", None))
        full = update.base is None or full_here
        if full and epoch is not None and epoch != self.epoch:
            if epoch in self._retired:
                raise VersionError(f"full snapshot v{update.version} comes from sender epoch "
                                   f"{epoch}, which this receiver has left (a stale update "
                                   f"from a sender that was replaced)")
            return          # a new sender (restarted, numbering again): accepted at once
        if (not full and epoch is not None and self.epoch is not None
                and epoch != self.epoch):
            raise VersionError(f"update v{update.version} is a delta from sender epoch "
                               f"{epoch}; this receiver holds v{self.version} of epoch "
                               f"{self.epoch} (a different sender)")
        if full:
            if update.version <= self.version:
                raise VersionError(f"full snapshot v{update.version} is not newer than the "
                                   f"held v{self.version} (out of order)")
        elif update.base != self.version:
            raise VersionError(f"update v{update.version} is a delta on v{update.base}; this "
                               f"receiver holds v{self.version}")
        elif update.version <= update.base:
            raise VersionError(f"update v{update.version} has base v{update.base}: versions "
                               "must increase")

    def _check_entry(self, version: int, entry) -> Tuple[str, torch.Tensor, object]:
        """(name, target tensor, full payload bytes or verified DeltaPacket); reads only."""
        name = entry.name
        where = f"update v{version}, tensor {name!r}"
        param = self.params.get(name)
        if param is None:
            known = sorted(self.params)
            raise SyncError(f"{where}: unknown name; this receiver holds "
                            f"{known[:8]}{' ...' if len(known) > 8 else ''}")
        if entry.dtype != param.dtype:
            raise SyncError(f"{where}: dtype {entry.dtype}, the receiver's tensor is "
                            f"{param.dtype}")
        if tuple(entry.shape) != tuple(param.shape):
            raise SyncError(f"{where}: shape {tuple(entry.shape)} ({entry.numel} elements), the "
                            f"receiver's tensor has {tuple(param.shape)} ({param.numel()})")
        if digest(entry.payload) != entry.checksum:
            raise SyncError(f"{where}: {entry.kind} payload checksum mismatch (corrupt)")
        if entry.kind == "full":
            want = param.numel() * param.element_size()
            if entry.payload.numel() != want:
                raise SyncError(f"{where}: {entry.payload.numel()} bytes, expected {want}")
            return name, param, entry.payload
        try:
            packet = DeltaPacket.from_bytes(entry.payload.cpu().numpy().tobytes())
            verify(param.detach(), packet)
        except (ValueError, TypeError) as exc:   # codec refusals: corrupt, wrong base, ...
            raise SyncError(f"{where}: delta refused: {exc}") from exc
        except ImportError as exc:      # a zstd packet, zstandard not installed here
            raise SyncError(f"{where}: delta refused: {exc} (a full snapshot is requested; "
                            f"or give the Sender encoding='gap16')") from exc
        return name, param, packet


def _span(t: torch.Tensor) -> Tuple[str, int, int]:
    return str(t.device), t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()


def _same_contents(a, b) -> bool:
    if isinstance(a, DeltaPacket) != isinstance(b, DeltaPacket):
        return False
    if isinstance(a, DeltaPacket):
        return a.to_bytes() == b.to_bytes()
    return a.numel() == b.numel() and torch.equal(a, b.to(a.device))


def _overlap_agrees(p_a, data_a, p_b, data_b) -> bool:
    """Full payloads of two overlapping contiguous tensors agree on their shared bytes."""
    (_, a0, a1), (_, b0, b1) = _span(p_a), _span(p_b)
    lo, hi = max(a0, b0), min(a1, b1)
    mine = data_a[lo - a0:hi - a0]
    return torch.equal(mine, data_b[lo - b0:hi - b0].to(mine.device))


def _without_shared_duplicates(version: int, checked):
    """``checked`` minus repeats of tied tensors, after refusing unsafe memory sharing.

    Deltas were verified against the bytes held before the update, so a delta must not land
    on memory another entry of the same update writes first. Names that alias one tensor
    (tied weights: same memory, same size) with identical contents are written once;
    any other overlap that involves a delta entry is refused. Overlapping full entries are
    written in order when they agree on the bytes they share, and refused otherwise.
    """
    spans = sorted((_span(p), i) for i, (_, p, _) in enumerate(checked) if p.numel())
    skip = set()
    reach = None          # (device, end, index) of the span reaching furthest so far
    for (device, begin, end), i in spans:
        if reach is not None and reach[0] == device and begin < reach[1]:
            j = reach[2]
            (name_j, p_j, data_j), (name_i, p_i, data_i) = checked[j], checked[i]
            if _span(p_j) == (device, begin, end) and _same_contents(data_j, data_i):
                skip.add(i)
                continue
            if isinstance(data_i, DeltaPacket) or isinstance(data_j, DeltaPacket):
                raise SyncError(f"update v{version}: tensors {name_j!r} and {name_i!r} share "
                                f"memory on this receiver, and the update gives them "
                                f"different contents (one is a delta)")
            if not _overlap_agrees(p_j, data_j, p_i, data_i):
                raise SyncError(f"update v{version}: tensors {name_j!r} and {name_i!r} share "
                                f"memory on this receiver (tied), and the update gives the "
                                f"shared bytes different contents: refused, one name would "
                                f"silently hold the other's bytes")
        if reach is None or reach[0] != device or end > reach[1]:
            reach = (device, end, i)
    return [c for i, c in enumerate(checked) if i not in skip]
