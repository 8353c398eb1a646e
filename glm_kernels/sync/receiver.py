"""Rollout side of weight sync: apply versions in place, all or nothing (DESIGN 3.7)."""
from __future__ import annotations

from typing import Dict, List, Mapping, Optional, Tuple

import torch

from .. import _dispatch
from ..delta import DeltaPacket, apply_
from .protocol import (SyncError, Transport, Update, VersionError, byte_view, digest,
                       dtype_name)


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
    name, dtype and shape, every checksum, and every delta packet applied to a scratch copy
    whose result checksum must match. Only then are all tensors written. Any failure raises
    :class:`SyncError` (or its subclass :class:`VersionError`), leaves every tensor
    unchanged, and asks the sender for a full snapshot.

    Memory: until the commit the receiver holds the whole update (frame data) and, for each
    delta entry, one scratch copy of that tensor.

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
                 version: int = 0):
        if not isinstance(transport, Transport):
            raise TypeError(f"transport must be a glm_kernels.sync transport, got "
                            f"{type(transport).__name__}")
        if not isinstance(params, Mapping) or not params:
            raise TypeError("params must be a non-empty mapping name -> tensor, got "
                            f"{type(params).__name__}")
        for name, t in params.items():
            _dispatch.check_tensor(f"params[{name!r}]", t)
            if not t.is_contiguous():
                raise ValueError(f"params[{name!r}] must be contiguous (written in place), "
                                 f"got strides {t.stride()}")
            try:
                dtype_name(t.dtype)
            except TypeError as exc:
                raise TypeError(f"params[{name!r}]: {exc}") from None
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise ValueError(f"version must be an int >= 0, got {version!r}")
        self.transport = transport
        self.params: Dict[str, torch.Tensor] = dict(params)
        self.version = version

    def receive(self, timeout: Optional[float] = None) -> Optional[int]:
        """Wait up to ``timeout`` s (None: forever) for one update and apply it.

        Returns the new version, or None if nothing arrived. Raises SyncError if the update
        was refused (tensors unchanged; a full snapshot has been requested).
        """
        try:
            update = self.transport.recv(self.version, timeout)
            if update is None:
                return None
            self.apply_update(update)
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
        """
        refusals = []
        while True:
            try:
                got = self.receive(timeout=0)
            except SyncError as exc:
                refusals.append(exc)
                got = -1
            if got is None or getattr(self.transport, "lockstep", False):
                break
        if len(refusals) == 1:
            raise refusals[0]
        if refusals:
            kind = (VersionError if all(isinstance(e, VersionError) for e in refusals)
                    else SyncError)
            raise kind(f"{len(refusals)} updates refused, now holding v{self.version}: "
                       + "; ".join(map(str, refusals))) from refusals[0]
        return self.version

    def apply_update(self, update: Update) -> int:
        """Check ``update`` completely, then write it; returns the new version."""
        self._check_version(update)
        seen = set()
        staged: List[Tuple[torch.Tensor, torch.Tensor]] = []
        for entry in update.entries:
            if entry.name in seen:
                raise SyncError(f"update v{update.version} names tensor {entry.name!r} twice")
            seen.add(entry.name)
            staged.append(self._stage(update.version, entry))
        with torch.no_grad():   # nothing can fail from here on: every check has passed
            for param, data in staged:
                byte_view(param).copy_(data.to(param.device, non_blocking=False))
        self.version = update.version
        return self.version

    def _check_version(self, update: Update) -> None:
        if update.base is None:
            if update.version <= self.version:
                raise VersionError(f"full snapshot v{update.version} is not newer than the "
                                   f"held v{self.version} (out of order)")
        elif update.base != self.version:
            raise VersionError(f"update v{update.version} is a delta on v{update.base}; this "
                               f"receiver holds v{self.version}")
        elif update.version <= update.base:
            raise VersionError(f"update v{update.version} has base v{update.base}: versions "
                               "must increase")

    def _stage(self, version: int, entry) -> Tuple[torch.Tensor, torch.Tensor]:
        """(target tensor, result bytes) for one entry, after all its checks."""
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
            return param, entry.payload
        try:
            packet = DeltaPacket.from_bytes(entry.payload.cpu().numpy().tobytes())
            scratch = param.detach().clone()
            apply_(scratch, packet)
        except (ValueError, TypeError) as exc:   # codec refusals: corrupt, wrong base, ...
            raise SyncError(f"{where}: delta refused: {exc}") from exc
        return param, byte_view(scratch)
