"""A compact, versioned wire encoding of routed expert ids (rollout routing replay, R3).

The rollout engine records, for one sequence, the experts every MoE layer routed each token
to, ships them beside the tokens and log-probs, and the trainer replays them with
``moe_route(..., replay_ids=...)``. One packet holds one sequence, all layers::

    offset  size  field (little-endian)
    0       4     magic b"GLMR"
    4       1     format version (1)
    5       1     id width in bytes: 1 if n_experts <= 256, else 2
    6       2     reserved, 0
    8       4     n_experts (uint32, 1 ..= 65536)
    12      4     n_layers  (uint32)
    16      4     n_tokens  (uint32)
    20      4     k         (uint32, 1 ..= n_experts)
    24      L*T*k*width   ids, layer-major: [layer][token][slot], each id unsigned
    end-4   4     Adler-32 of every byte before it (header and ids)

So a token costs k bytes per layer with <= 256 experts (GLM-5: 8 B; int64 ids: 64 B), 2k
above, plus 28 bytes per sequence. Slot order is kept as recorded (the weights of a replayed
token follow its ids' order).

Encode and decode run as torch ops on the tensor's device (CPU or CUDA; no Triton needed).
A packet that arrives as ``bytes`` is checked on the host (``zlib.adler32``) before any byte
is copied to the device. Every packet is checked whole (magic, version, width, lengths,
checksum, id range) before anything is returned: a truncated or corrupt packet raises
``ValueError`` naming what is wrong.

Example
-------
>>> import torch
>>> from glm_kernels.topk.routing_codec import decode_routing, encode_routing
>>> ids = torch.tensor([[[3, 1], [0, 2], [1, 3]]] * 2)      # 2 layers, 3 tokens, k = 2
>>> packet = encode_routing(ids, n_experts=4)                # uint8 tensor on ids.device
>>> packet.numel()                                           # 24 + 2*3*2 + 4
40
>>> torch.equal(decode_routing(packet), ids)
True
>>> wire = packet.numpy().tobytes()                          # what a queue / socket carries
>>> torch.equal(decode_routing(wire), ids)
True
"""
import struct
import zlib
from typing import List, NamedTuple, Optional, Sequence, Union

import torch

from .. import _checks

MAGIC = b"GLMR"
VERSION = 1
MAX_EXPERTS = 1 << 16
_HEADER = struct.Struct("<4sBBHIIII")
HEADER_BYTES = _HEADER.size          # 24
TRAILER_BYTES = 4
_ADLER_MOD = 65521
_ADLER_CHUNK = 1 << 22             # bytes per pass of the closed form (bounds temporaries)
_U32 = (1 << 32) - 1
_ID_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)

Packet = Union[torch.Tensor, bytes, bytearray, memoryview]


class RoutingHeader(NamedTuple):
    version: int
    id_bytes: int
    n_experts: int
    n_layers: int
    n_tokens: int
    k: int

    @property
    def packet_bytes(self) -> int:
        return (HEADER_BYTES + self.n_layers * self.n_tokens * self.k * self.id_bytes
                + TRAILER_BYTES)


class RoutingBatch(NamedTuple):
    """``decode_routing_batch``: ids int64 [n_layers, B, width, k] (positions past a
    sequence's length hold the placeholder ids 0..k-1, valid for replay) and lengths [B]."""
    ids: torch.Tensor
    lengths: torch.Tensor


def id_bytes_for(n_experts: int) -> int:
    """Bytes per id on the wire: 1 for <= 256 experts, 2 for <= 65536."""
    return 1 if n_experts <= 256 else 2


def packet_bytes(n_layers: int, n_tokens: int, k: int, n_experts: int) -> int:
    """Size of one packet: 28 + n_layers * n_tokens * k * id_bytes_for(n_experts)."""
    return HEADER_BYTES + n_layers * n_tokens * k * id_bytes_for(n_experts) + TRAILER_BYTES


def adler32(data: torch.Tensor) -> int:
    """Adler-32 (zlib's) of a uint8 tensor, on its device, in closed form::

        A = 1 + sum b_i,   B = n + sum (n - i) b_i   (mod 65521, i from 0);   (B << 16) | A

    (B sums the running A after each byte.) Chunked so the int64 temporaries stay small.
    """
    n = data.numel()
    flat = data.reshape(-1)
    a = b = 0
    chunk = _ADLER_CHUNK
    for start in range(0, n, chunk):
        part = flat[start:start + chunk].to(torch.int64)
        weight = (n - start - torch.arange(part.numel(), device=data.device)) % _ADLER_MOD
        sums = torch.stack([part.sum(), (part * weight).sum()]).tolist()
        a, b = (a + sums[0]) % _ADLER_MOD, (b + sums[1]) % _ADLER_MOD
    a = (1 + a) % _ADLER_MOD
    b = (n + b) % _ADLER_MOD
    return (b << 16) | a


def _checksum(data: torch.Tensor) -> int:
    """zlib's C Adler-32 on CPU tensors (no copy), the closed form on other devices."""
    if data.device.type == "cpu":
        return zlib.adler32(data.contiguous().numpy())
    return adler32(data)


def _max_id(body: torch.Tensor, width: int) -> int:
    if width == 1:
        return int(body.max())
    pairs = body.view(-1, 2).to(torch.int32)
    return int((pairs[:, 0] | (pairs[:, 1] << 8)).max())


def check_int(name: str, value, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"{name} must be an int in [{low}, {high}], got {value!r}")
    return value


def encode_routing(ids: torch.Tensor, n_experts: int) -> torch.Tensor:
    """One sequence's routed expert ids, all MoE layers, as a packet.

    Parameters
    ----------
    ids : Tensor [n_layers, n_tokens, k], int64 / int32 / int16 / int8 / uint8
        ``moe_route``'s ids per layer, stacked layer-major (any device).
    n_experts : int
        Routed experts per layer, 1 ..= 65536: ids take 1 byte each up to 256, else 2.

    Returns
    -------
    Tensor, uint8, 1-D, on ``ids.device``: the packet (layout in the module docstring).
    ``packet.cpu().numpy().tobytes()`` gives the wire bytes. Raises ValueError for ids
    outside [0, n_experts) (one host sync).
    """
    _checks.check_tensor("ids", ids, dtypes=_ID_DTYPES, ndim=(3,))
    check_int("n_experts", n_experts, 1, MAX_EXPERTS)
    n_layers, n_tokens, k = ids.shape
    check_int("k (ids.shape[2])", k, 1, n_experts)
    for name, value in (("n_layers", n_layers), ("n_tokens", n_tokens)):
        check_int(f"{name} (ids.shape)", value, 0, _U32)
    if ids.numel():
        low, high = torch.stack([ids.min(), ids.max()]).tolist()
        if low < 0 or high >= n_experts:
            raise ValueError(f"ids must lie in [0, {n_experts}) (n_experts), got values in "
                             f"[{low}, {high}]")
    width = id_bytes_for(n_experts)
    if width == 1:
        body = ids.to(torch.uint8).reshape(-1)
    else:      # little-endian by construction, whatever the host's byte order
        wide = ids.to(torch.int32).reshape(-1)
        body = torch.stack([wide & 0xFF, wide >> 8], dim=1).to(torch.uint8).reshape(-1)
    header = _HEADER.pack(MAGIC, VERSION, width, 0, n_experts, n_layers, n_tokens, k)
    packet = torch.cat([_tensor_of(header).to(ids.device), body])
    trailer = struct.pack("<I", _checksum(packet))
    return torch.cat([packet, _tensor_of(trailer).to(ids.device)])


def _tensor_of(data: bytes) -> torch.Tensor:
    """A writable CPU uint8 tensor holding ``data`` (torch.frombuffer refuses empty buffers)."""
    if not data:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _as_packet(packet: Packet, name: str = "packet"):
    """(uint8 tensor, None) for a tensor, (None, bytes) for a bytes-like packet."""
    if isinstance(packet, torch.Tensor):
        _checks.check_tensor(name, packet, dtypes=(torch.uint8,), ndim=(1,))
        return packet, None
    if isinstance(packet, (bytes, bytearray, memoryview)):
        return None, bytes(packet)
    raise TypeError(f"{name} must be a uint8 torch.Tensor or bytes, got {type(packet).__name__}")


def _parse_header(head: bytes, total: int, name: str) -> RoutingHeader:
    if total < HEADER_BYTES + TRAILER_BYTES:
        raise ValueError(f"{name} is truncated: {total} bytes, shorter than the "
                         f"{HEADER_BYTES + TRAILER_BYTES}-byte header and checksum")
    magic, version, width, reserved, n_experts, n_layers, n_tokens, k = _HEADER.unpack(
        head[:HEADER_BYTES])
    if magic != MAGIC:
        raise ValueError(f"{name} is not a routing packet: magic {magic!r}, expected {MAGIC!r}")
    if version != VERSION:
        raise ValueError(f"{name} has format version {version}; this glm_kernels reads "
                         f"version {VERSION}")
    if not 1 <= n_experts <= MAX_EXPERTS or width != id_bytes_for(n_experts) or reserved \
            or not 1 <= k <= n_experts:
        raise ValueError(f"{name} header is corrupt: n_experts={n_experts}, id width {width}, "
                         f"k={k}, reserved={reserved}")
    header = RoutingHeader(version, width, n_experts, n_layers, n_tokens, k)
    if total != header.packet_bytes:
        what = "truncated" if total < header.packet_bytes else "longer than its header says"
        raise ValueError(f"{name} is {what}: {total} bytes, the header ({n_layers} layers x "
                         f"{n_tokens} tokens x k={k} x {width} B) needs {header.packet_bytes}")
    return header


def routing_header(packet: Packet) -> RoutingHeader:
    """The header fields of a packet (checked for magic, version and length, not checksum)."""
    tensor, data = _as_packet(packet)
    if tensor is not None:
        data = bytes(tensor[:HEADER_BYTES].cpu().numpy().tobytes())
        return _parse_header(data, tensor.numel(), "packet")
    return _parse_header(data, len(data), "packet")


def decode_routing(packet: Packet, *, device: Optional[Union[str, torch.device]] = None,
                   dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """Expert ids [n_layers, n_tokens, k] back from a packet, after checking all of it.

    Parameters
    ----------
    packet : uint8 Tensor (1-D, any device) or bytes / bytearray / memoryview
    device : where the ids go; default the packet tensor's device (CPU for bytes).
    dtype : torch.int64 (default) or torch.int32.

    Raises ValueError (naming the problem) for a packet that is truncated, too long, not a
    routing packet, of another format version, corrupt (checksum) or holding ids >= n_experts.
    """
    _checks.check_choice("dtype", dtype, (torch.int64, torch.int32))
    return _decode(packet, device, dtype, "packet")[1]


def _decode(packet: Packet, device, dtype: torch.dtype, name: str):
    """(header, ids) of a packet checked whole; errors name it ``name``."""
    tensor, data = _as_packet(packet, name)
    if tensor is not None:
        head = bytes(tensor[:HEADER_BYTES].cpu().numpy().tobytes())
        header = _parse_header(head, tensor.numel(), name)
        stored = struct.unpack("<I", tensor[-TRAILER_BYTES:].cpu().numpy().tobytes())[0]
        actual = _checksum(tensor[:-TRAILER_BYTES])
        body = tensor[HEADER_BYTES:-TRAILER_BYTES]
        target = tensor.device if device is None else torch.device(device)
    else:
        header = _parse_header(data, len(data), name)
        stored = struct.unpack("<I", data[-TRAILER_BYTES:])[0]
        actual = zlib.adler32(data[:-TRAILER_BYTES])
        body = _tensor_of(data[HEADER_BYTES:-TRAILER_BYTES])
        target = torch.device("cpu") if device is None else torch.device(device)
    if stored != actual:
        raise ValueError(f"{name} is corrupt: checksum {actual:#010x} of its contents, "
                         f"{stored:#010x} stored")
    if body.numel() and _max_id(body, header.id_bytes) >= header.n_experts:
        raise ValueError(f"{name} is corrupt: an id >= n_experts={header.n_experts}")
    body = body.to(target)
    if header.id_bytes == 1:
        ids = body.to(dtype)
    else:
        pairs = body.view(-1, 2).to(dtype)
        ids = pairs[:, 0] | (pairs[:, 1] << 8)
    return header, ids.view(header.n_layers, header.n_tokens, header.k)


def encode_routing_batch(ids: torch.Tensor, lengths: Sequence[int],
                         n_experts: int) -> List[torch.Tensor]:
    """One packet per sequence from a right-padded batch ``ids`` [n_layers, B, T, k]:
    sequence b keeps its first ``lengths[b]`` tokens (uneven lengths welcome)."""
    _checks.check_tensor("ids", ids, dtypes=_ID_DTYPES, ndim=(4,))
    lengths = [int(n) for n in lengths]
    if len(lengths) != ids.shape[1] or any(not 0 <= n <= ids.shape[2] for n in lengths):
        raise ValueError(f"lengths must give one length in [0, {ids.shape[2]}] per sequence "
                         f"(ids.shape[1]={ids.shape[1]}), got {lengths}")
    return [encode_routing(ids[:, b, :n], n_experts) for b, n in enumerate(lengths)]


def decode_routing_batch(packets: Sequence[Packet], *, width: Optional[int] = None,
                         device: Optional[Union[str, torch.device]] = None) -> RoutingBatch:
    """Decode B packets of one model (same n_experts, k and layer count) into one
    right-padded batch.

    ``width`` (default: the longest sequence) is the padded token count; positions past a
    sequence's length get the placeholder ids 0..k-1 (distinct and in range, so the batch
    can be replayed as is; keep them out of metrics with ``lengths``). Every packet is
    checked whole, and a packet whose ``n_experts``, ``k`` or ``n_layers`` differs from
    packets[0]'s raises ValueError naming its index and the field: ids of two expert counts
    (or two models) would replay as if they were one.
    """
    if isinstance(packets, (bytes, bytearray, memoryview, torch.Tensor, str)) or \
            not hasattr(packets, "__iter__"):
        raise TypeError(f"packets must be a sequence of packets (one per sequence), got "
                        f"{type(packets).__name__}")
    packets = list(packets)
    if not packets:
        raise ValueError("packets must hold at least one packet")
    headers, decoded = [], []
    for i, packet in enumerate(packets):
        header, ids = _decode(packet, device, torch.int64, f"packets[{i}]")
        first = headers[0] if headers else header
        for field in ("n_experts", "k", "n_layers"):
            if getattr(header, field) != getattr(first, field):
                raise ValueError(f"packets[{i}] has {field}={getattr(header, field)}, "
                                 f"packets[0] has {field}={getattr(first, field)}: one batch "
                                 f"holds the routing of one model")
        headers.append(header)
        decoded.append(ids)
    n_layers, k = headers[0].n_layers, headers[0].k
    lengths = [d.shape[1] for d in decoded]
    width = max(lengths) if width is None else width
    if width < max(lengths):
        raise ValueError(f"width={width} is shorter than the longest sequence ({max(lengths)})")
    out = torch.arange(k, device=decoded[0].device).expand(
        n_layers, len(decoded), width, k).clone()
    for b, d in enumerate(decoded):
        out[:, b, :d.shape[1]] = d
    return RoutingBatch(out, torch.tensor(lengths, dtype=torch.int64))
