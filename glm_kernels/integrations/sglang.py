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

Rollout routing replay (R3): :func:`routed_experts_from_sglang` turns the routed experts
SGLang returns for a request (``return_routed_experts=True`` on a server started with
``--enable-return-routed-experts``) into replay ids for ``moe_route(..., replay_ids=...)``,
and :func:`routing_packet_from_sglang` into a ``glm_kernels.topk.routing_codec`` packet
(8 bytes per token and MoE layer for 256 experts, top-8). The format, from SGLang's source
(python/sglang/srt/layers/moe/routed_experts_capturer.py: ``get_routed_experts`` and
``extract_routed_experts_from_meta_info``; the detokenizer base64-encodes it):
``meta_info["routed_experts"]`` is the base64 text of an int32 array
[seqlen - 1, num_hidden_layers, num_experts_per_tok], C order, little-endian, where seqlen
counts prompt and output tokens (row t: the experts token t was routed to when the engine
ran it; the last token is never run). Every hidden layer has a row, dense ones included
(never written: zeros). The ids are the ones the MoE layer dispatched to: physical ids when
expert-parallel load balancing (EPLB, redundant experts) maps logical experts to physical
slots (``topk_ids_logical_to_physical`` runs before the capture).
"""
from __future__ import annotations

import base64
import binascii
from typing import Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch

from .. import _checks, sync
from ..sync.protocol import DEFAULT_BUCKET_BYTES, Frame, Transport, assemble, pack
from ..topk.routing_codec import MAX_EXPERTS, check_int, encode_routing

LOADER = "glm_kernels.integrations.sglang.load_delta_frames"
_PREFIX = "glm_kernels.sync/"
_ATTR = "_glm_kernels_delta_receiver"

__all__ = ["LOADER", "SGLangDeltaSender", "load_delta_frames", "register_delta_params",
           "delta_version", "frames_to_named_tensors", "named_tensors_to_frames",
           "routed_experts_from_sglang", "routing_packet_from_sglang"]


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


# --------------------------------------------------------------------------- R3: routed experts
_I32_MAX = (1 << 31) - 1


def _routed_experts_text(routed_experts, where: str) -> Union[str, bytes]:
    """The base64 text (or already decoded bytes) out of what the caller has: SGLang's
    generate output, its ``meta_info``, the string itself, or the bytes."""
    if isinstance(routed_experts, dict):
        meta = routed_experts.get("meta_info", routed_experts)
        if not isinstance(meta, dict) or meta.get("routed_experts") is None:
            raise ValueError(f"{where} has no meta_info['routed_experts']: send the request "
                             "with return_routed_experts=True to a server started with "
                             "--enable-return-routed-experts")
        routed_experts = meta["routed_experts"]
    if isinstance(routed_experts, (str, bytes, bytearray, memoryview)):
        return routed_experts if isinstance(routed_experts, str) else bytes(routed_experts)
    raise TypeError(f"{where} must be SGLang's generate output (dict), its meta_info, the "
                    f"base64 string meta_info['routed_experts'] or its decoded bytes, got "
                    f"{type(routed_experts).__name__}")


def routed_experts_from_sglang(routed_experts, *, num_tokens: int, num_layers: int,
                               top_k: int, n_experts: int,
                               moe_layers: Optional[Sequence[int]] = None,
                               physical_to_logical: Optional[torch.Tensor] = None
                               ) -> torch.Tensor:
    """Replay ids from SGLang's ``return_routed_experts`` output (format: module docstring).

    Parameters
    ----------
    routed_experts : dict, str or bytes
        SGLang's generate output for one request (``{"meta_info": {"routed_experts": ...}}``),
        its ``meta_info``, the base64 string ``meta_info["routed_experts"]``, or its decoded
        bytes.
    num_tokens : int
        Tokens of the sequence, prompt and output (what the trainer forwards); SGLang
        returns num_tokens - 1 rows.
    num_layers, top_k : int
        The model's ``num_hidden_layers`` (every layer has a row) and
        ``num_experts_per_tok``.
    n_experts : int
        Routed (logical) experts per MoE layer, 1 ..= 65536.
    moe_layers : sequence of int, optional
        The hidden layers that are MoE, in model order (GLM-5 / DeepSeek-V3: from
        ``first_k_dense_replace`` on); default every layer. Dense layers' rows are dropped.
    physical_to_logical : int Tensor [num_layers, n_physical], optional
        With EPLB / redundant experts SGLang records physical expert slots; this map (SGLang's
        ``ExpertLocationMetadata.physical_to_logical_map``) turns them into logical ids.

    Returns
    -------
    Tensor int64 [len(moe_layers), num_tokens, top_k] on the CPU: ``ids[i]`` replays MoE
    layer ``moe_layers[i]`` (``moe_route(logits, top_k, replay_ids=ids[i])``); slots in
    SGLang's order. The last token (which the engine never ran; its output predicts nothing
    the trainer trains on) gets the placeholder ids 0..top_k-1, as padding does in
    ``decode_routing_batch``.

    The text's length is checked against the shape before anything is decoded or
    allocated; ids outside [0, n_experts) (or [0, n_physical)) and a token whose top_k ids in
    a MoE layer are not distinct raise ValueError naming the layer and the token.
    """
    where = "routed_experts"
    num_tokens = check_int("num_tokens", num_tokens, 1, _I32_MAX)
    num_layers = check_int("num_layers", num_layers, 1, 1 << 16)
    n_experts = check_int("n_experts", n_experts, 1, MAX_EXPERTS)
    top_k = check_int("top_k", top_k, 1, n_experts)
    if moe_layers is None:
        layers = list(range(num_layers))
    else:
        if isinstance(moe_layers, (str, bytes)) or not hasattr(moe_layers, "__iter__"):
            raise TypeError(f"moe_layers must be a sequence of layer indices, got "
                            f"{type(moe_layers).__name__}")
        layers = [check_int(f"moe_layers[{i}]", layer, 0, num_layers - 1)
                  for i, layer in enumerate(moe_layers)]
        if not layers or len(set(layers)) != len(layers):
            raise ValueError(f"moe_layers must list distinct layers in [0, {num_layers}), got "
                             f"{layers}")
    n_ids = n_experts
    if physical_to_logical is not None:
        _checks.check_tensor("physical_to_logical", physical_to_logical,
                               dtypes=(torch.int64, torch.int32, torch.int16), ndim=(2,))
        if physical_to_logical.shape[0] != num_layers or physical_to_logical.shape[1] < 1:
            raise ValueError(f"physical_to_logical must have shape [num_layers={num_layers}, "
                             f"n_physical], got {tuple(physical_to_logical.shape)}")
        n_ids = physical_to_logical.shape[1]
        mapped = physical_to_logical[layers].cpu().long()
        if mapped.numel() and not bool(((mapped >= 0) & (mapped < n_experts)).all()):
            raise ValueError(f"physical_to_logical maps to ids outside [0, {n_experts}) "
                             "(n_experts)")

    rows = num_tokens - 1
    nbytes = rows * num_layers * top_k * 4
    text = _routed_experts_text(routed_experts, where)
    if isinstance(text, str):
        # base64 of nbytes is 4 * ceil(nbytes / 3) characters: checked before decoding
        want = 4 * -(-nbytes // 3)
        if len(text) != want:
            raise ValueError(f"{where}: {len(text)} base64 characters, but {rows} rows x "
                             f"{num_layers} layers x top_k={top_k} int32 ids take {want} "
                             f"(num_tokens={num_tokens}: prompt + output tokens)")
        try:
            raw = base64.b64decode(text, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise ValueError(f"{where} is not valid base64: {exc}") from None
    else:
        raw = text
    if len(raw) != nbytes:
        raise ValueError(f"{where}: {len(raw)} bytes, but {rows} rows x {num_layers} layers x "
                         f"top_k={top_k} int32 ids take {nbytes} (num_tokens={num_tokens})")

    out = torch.arange(top_k, dtype=torch.int64).expand(len(layers), num_tokens, top_k).clone()
    if rows == 0:
        return out
    # little-endian int32 by construction, whatever this host's byte order
    quads = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(rows, num_layers, top_k,
                                                                     4).long()
    ids = quads[..., 0] | (quads[..., 1] << 8) | (quads[..., 2] << 16) | (quads[..., 3] << 24)
    ids = torch.where(ids >= 1 << 31, ids - (1 << 32), ids)[:, layers].transpose(0, 1)
    bad = (ids < 0) | (ids >= n_ids)
    if bool(bad.any()):
        layer, token, _ = bad.nonzero()[0].tolist()
        raise ValueError(f"{where}: layer {layers[layer]} token {token} has ids "
                         f"{ids[layer, token].tolist()}, expected ids in [0, {n_ids}) "
                         f"({'n_physical' if physical_to_logical is not None else 'n_experts'})")
    if physical_to_logical is not None:
        ids = torch.gather(mapped, 1, ids.reshape(len(layers), -1)).view_as(ids)
    ordered = ids.sort(dim=-1).values
    repeated = (ordered[..., 1:] == ordered[..., :-1]).any(dim=-1)
    if bool(repeated.any()):
        layer, token = repeated.nonzero()[0].tolist()
        raise ValueError(f"{where}: layer {layers[layer]} token {token} has ids "
                         f"{ids[layer, token].tolist()}, expected top_k={top_k} distinct experts "
                         f"(a dense layer in moe_layers? SGLang leaves its rows 0)")
    out[:, :rows] = ids
    return out


def routing_packet_from_sglang(routed_experts, *, num_tokens: int, num_layers: int,
                               top_k: int, n_experts: int,
                               moe_layers: Optional[Sequence[int]] = None,
                               physical_to_logical: Optional[torch.Tensor] = None
                               ) -> torch.Tensor:
    """:func:`routed_experts_from_sglang` as one ``routing_codec`` packet (uint8 tensor, CPU):
    what the rollout side ships beside the tokens; the trainer's
    ``decode_routing_batch(packets)`` gives the replay ids of the batch."""
    ids = routed_experts_from_sglang(routed_experts, num_tokens=num_tokens,
                                     num_layers=num_layers, top_k=top_k, n_experts=n_experts,
                                     moe_layers=moe_layers,
                                     physical_to_logical=physical_to_logical)
    return encode_routing(ids, n_experts)
