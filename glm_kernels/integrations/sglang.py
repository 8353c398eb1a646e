"""Delta weight updates into a running SGLang engine, applied in place on its parameters.

SGLang's ``update_weights_from_tensor(named_tensors, load_format=...)`` hands the tensors to a
*custom weight loader* when ``load_format`` is an import path listed in the server argument
``--custom-weight-loader`` (``--sglang-custom-weight-loader`` through slime): the engine calls
``loader(model, named_tensors)`` on every TP rank (sgl-project/sglang,
python/sglang/srt/model_executor/model_runner.py, ``ModelRunner.update_weights_from_tensor``).

Here the named tensors are ``glm_kernels.sync`` frames (sealed meta + uint8 payload, a delta
or full snapshot of named tensors), and :func:`load_delta_frames` is the loader: a
``sync.Receiver`` kept on the model checks the whole update (version order, names, dtypes,
shapes, checksums, each delta applied to a scratch copy) and only then writes every tensor in
place; anything wrong raises ``sync.SyncError`` with the weights unchanged.

Trainer side::

    sender = SGLangDeltaSender()                           # one per engine
    version, named = sender.publish(weights)               # {engine param name: tensor}
    engine.update_weights_from_tensor(named_tensors=named, load_format=LOADER)
    # if the request failed: sender.request_full()  -> the next publish is a full snapshot

Engine side: start SGLang with ``--custom-weight-loader glm_kernels.integrations.sglang.
load_delta_frames``. Tensor names and shapes are the engine's own parameters on that rank
(``model.named_parameters()``); :func:`register_delta_params` adds other names, e.g. views
of row blocks of a fused ``qkv_proj`` / ``gate_up_proj`` weight under their unfused names.
"""
from __future__ import annotations

from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from .. import sync
from ..sync.protocol import DEFAULT_BUCKET_BYTES, Frame, Transport, assemble, pack

LOADER = "glm_kernels.integrations.sglang.load_delta_frames"
_PREFIX = "glm_kernels.sync/"
_ATTR = "_glm_kernels_delta_receiver"

__all__ = ["LOADER", "SGLangDeltaSender", "load_delta_frames", "register_delta_params",
           "delta_version", "frames_to_named_tensors", "named_tensors_to_frames"]


def frames_to_named_tensors(frames: Sequence[Frame]) -> List[Tuple[str, torch.Tensor]]:
    """One update's frames as SGLang named tensors: ``glm_kernels.sync/<i>/meta`` (uint8
    sealed meta) and ``glm_kernels.sync/<i>/data`` (uint8 payload) per frame."""
    out = []
    for i, f in enumerate(frames):
        meta = torch.frombuffer(bytearray(f.meta), dtype=torch.uint8)
        out += [(f"{_PREFIX}{i}/meta", meta.to(f.data.device)), (f"{_PREFIX}{i}/data", f.data)]
    return out


def named_tensors_to_frames(named_tensors) -> List[Frame]:
    """Inverse of :func:`frames_to_named_tensors`; raises SyncError on anything else."""
    parts: Dict[int, Dict[str, torch.Tensor]] = {}
    for item in named_tensors:
        if not (isinstance(item, (tuple, list)) and len(item) == 2 and isinstance(item[0], str)
                and isinstance(item[1], torch.Tensor)):
            raise sync.SyncError(f"a delta update is a list of (name, uint8 tensor) pairs, "
                                 f"got an item of type {type(item).__name__}")
        name, t = item
        if not name.startswith(_PREFIX):
            raise sync.SyncError(f"unexpected tensor {name!r} in a delta update (expected "
                                 f"{_PREFIX}<i>/meta and /data)")
        index, _, kind = name[len(_PREFIX):].partition("/")
        if not index.isdigit() or kind not in ("meta", "data") or t.dtype != torch.uint8:
            raise sync.SyncError(f"malformed delta-update tensor {name!r} ({t.dtype})")
        parts.setdefault(int(index), {})[kind] = t.reshape(-1)
    if sorted(parts) != list(range(len(parts))) or any(len(p) != 2 for p in parts.values()):
        raise sync.SyncError(f"delta update frames incomplete: got {sorted(parts)}")
    frames = []
    for i in range(len(parts)):
        meta = bytes(parts[i]["meta"].cpu().numpy().tobytes())
        frames.append(Frame(meta, parts[i]["data"], i == len(parts) - 1))
    return frames


class _Outbox(Transport):
    """Sender-side transport that keeps the frames of the last update for the caller."""

    def __init__(self, device=None):
        self.device = device
        self.frames: List[Frame] = []
        self._full = False

    def send(self, version, base, entries, bucket_bytes, epoch=None):
        self.frames = list(pack(version, base, entries, bucket_bytes, self.device, epoch))

    def full_requested(self) -> bool:
        asked, self._full = self._full, False
        return asked

    def request_full(self) -> None:
        self._full = True

    def recv(self, held, timeout):   # pragma: no cover - sender side only
        raise RuntimeError("the SGLang outbox only sends")

    def report(self, version, ok):   # pragma: no cover - sender side only
        raise RuntimeError("the SGLang outbox only sends")


class SGLangDeltaSender:
    """Training side for one engine: named tensors in, SGLang ``named_tensors`` out.

    ``publish(weights)`` returns ``(version, named_tensors)`` to pass to the engine's
    ``update_weights_from_tensor`` with ``load_format=LOADER``; the first publish (and the one
    after :meth:`request_full`) is a full snapshot, later ones are ``glm_kernels.delta``
    packets against what was last published. Keeps one copy of the published tensors.
    """

    def __init__(self, *, encoding: Optional[str] = None,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 device=None):
        self._outbox = _Outbox(device)
        self._sender = sync.Sender(self._outbox, delta=True, encoding=encoding,
                                   bucket_bytes=bucket_bytes)

    @property
    def last_stats(self):
        return self._sender.last_stats

    def publish(self, weights: Mapping[str, torch.Tensor], *, full: bool = False
                ) -> Tuple[int, List[Tuple[str, torch.Tensor]]]:
        version = self._sender.publish(weights, full=full)
        return version, frames_to_named_tensors(self._outbox.frames)

    def request_full(self) -> None:
        """Call when the engine refused an update: the next publish is a full snapshot."""
        self._outbox.request_full()


class _Inbox(Transport):
    """Engine-side transport fed one update at a time by the loader."""

    def __init__(self):
        self.pending: Optional[List[Frame]] = None

    def send(self, version, base, entries, bucket_bytes, epoch=None):   # pragma: no cover
        raise RuntimeError("the SGLang inbox only receives")

    def full_requested(self) -> bool:   # pragma: no cover - receive only
        return False

    def recv(self, held, timeout):
        frames, self.pending = self.pending, None
        return None if frames is None else assemble(frames)

    def report(self, version, ok):
        pass   # the trainer learns of a refusal from the failed request


def register_delta_params(model: torch.nn.Module, params: Mapping[str, torch.Tensor]) -> None:
    """Let delta updates address ``params`` (name -> contiguous tensor or view, written in
    place) in addition to ``model.named_parameters()``; e.g. ``{"...q_proj.weight":
    qkv.weight[:q_rows], ...}`` for a fused weight. Call before the first update."""
    if getattr(model, _ATTR, None) is not None:
        raise RuntimeError("register_delta_params must be called before the first delta update")
    extra = dict(getattr(model, "_glm_kernels_delta_extra", {}))
    extra.update(params)
    model._glm_kernels_delta_extra = extra


def load_delta_frames(model: torch.nn.Module, named_tensors) -> None:
    """SGLang custom weight loader: apply one ``glm_kernels.sync`` update in place.

    ``named_tensors``: list of (name, uint8 tensor) from :class:`SGLangDeltaSender`. Raises
    ``glm_kernels.sync.SyncError`` (weights unchanged) when the update does not apply: wrong
    base version, unknown name, dtype/shape mismatch, corrupt bytes.
    """
    receiver = getattr(model, _ATTR, None)
    if receiver is None:
        params = {n: p.data for n, p in model.named_parameters()}
        params.update(getattr(model, "_glm_kernels_delta_extra", {}))
        receiver = sync.Receiver(_Inbox(), params)
        setattr(model, _ATTR, receiver)
    receiver.transport.pending = named_tensors_to_frames(named_tensors)
    with torch.no_grad():
        receiver.receive(timeout=0)


def delta_version(model: torch.nn.Module) -> int:
    """The weight version the engine's parameters hold (0: no delta update applied yet)."""
    receiver = getattr(model, _ATTR, None)
    return 0 if receiver is None else receiver.version
