"""Triton path of the delta codec (CUDA tensors, or CPU tensors under the interpreter): the
launch sequence around ``_kernels`` and the small torch scans between passes."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from . import _reference as ref
from .packet import raw_layout


def _triton():
    # Imported on first use: `import glm_kernels` works where Triton is missing (torch backend).
    from . import _kernels
    return _kernels


@dataclass(frozen=True)
class DeltaKernelConfig:
    """Tile sizes of the delta kernels; ``default_config`` picks them per device.

    block: elements per encode / checksum program, a power of two in [32, 65536] (a gap
    inside one program then stays below the gap16 escape). apply_block: changes per decode /
    apply program. The wire format does not depend on either.
    """
    block: int = 4096
    apply_block: int = 4096
    num_warps: int = 8

    def __post_init__(self):
        for name in ("block", "apply_block"):
            v = getattr(self, name)
            if not (isinstance(v, int) and 32 <= v <= 65536 and v & (v - 1) == 0):
                raise ValueError(f"{name} must be a power of two in [32, 65536], got {v!r}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"num_warps must be 1, 2, 4, 8 or 16, got {self.num_warps!r}")


def default_config(device: torch.device, element_size: int = 2) -> DeltaKernelConfig:
    """GPU: 4096 elements x 8 warps (16 per thread: the per-program reductions amortized, at
    most ~140 registers at sm_90 and no spills), 2048 for 8-byte elements (their two-hash
    scan reaches 200 registers at 4096). The interpreter uses the same tiles (fewer, larger
    programs are also what makes it fast). See benchmarks/notes/delta.md."""
    if element_size == 8:
        return DeltaKernelConfig(block=2048, apply_block=4096)
    return DeltaKernelConfig()


def _sums64(halves: torch.Tensor) -> list:
    """Column sums (mod 2^64) of uint64 values stored as int64 halves [rows, 2k] (each half
    below 2^32, so torch adds them without overflow); one host sync."""
    cols = [int(v) for v in halves.sum(0).tolist()] if halves.shape[0] else \
        [0] * halves.shape[1]
    return [(cols[i] + (cols[i + 1] << 32)) & ref.MASK64 for i in range(0, len(cols), 2)]


def checksum_sum(x: torch.Tensor, cfg: DeltaKernelConfig) -> int:
    """S of a flat signed-int view (see _reference) with the checksum kernel."""
    partials = torch.empty((-(-x.numel() // cfg.block), 2), dtype=torch.int64, device=x.device)
    _triton().checksum_partials(x, partials, block=cfg.block, num_warps=cfg.num_warps)
    return _sums64(partials)[0]


@dataclass
class DeviceStreams:
    count: int
    n_escapes: int
    s_new: int
    s_old: int
    payload: Optional[torch.Tensor]      # int32 / gap16: the finished payload (uint8)
    escapes: torch.Tensor                # int64 [e]
    planes: Optional[torch.Tensor]       # zstd: [gap lo | gap hi | value planes] uint8


def _empty(n: int, dtype, device) -> torch.Tensor:
    """Output allocation (tests replace this to poison outputs before the kernels write)."""
    return torch.empty(n, dtype=dtype, device=device)


def encode(nb: torch.Tensor, ob: torch.Tensor, spec: ref.StreamSpec, encoding: str,
           cfg: DeltaKernelConfig, old_sum: Optional[int] = None) -> DeviceStreams:
    """Streams turning ``ob`` into ``nb`` (flat signed-int views on one device).
    ``old_sum``: S(old) when known; then nothing is hashed in pass 1 and S(new) comes from
    S(old) plus the changes' term differences, summed in pass 2."""
    n, size, device = nb.numel(), nb.element_size(), nb.device
    programs = -(-n // cfg.block)
    local = torch.empty(n, dtype=torch.int16, device=device)      # compacted change offsets
    stats = torch.zeros((programs, _triton().STATS), dtype=torch.int64, device=device)
    _triton().encode_scan(nb, ob, local, stats, hash_new=old_sum is None,
                          hash_old=old_sum is None and spec.diff, block=cfg.block,
                          num_warps=cfg.num_warps)
    counts = stats[:, 0].contiguous()          # kernels index it by program: no strides
    offsets = torch.cumsum(counts, 0) - counts
    count, s_new, s_old = 0, 0, 0
    if programs:
        count = int(counts.sum())
        s_new, s_old = _sums64(stats[:, 1:5])
    # First and last change of each program from its compacted offsets; the last change
    # before each program (-1: none). A gap inside one program is shorter than the escape,
    # so only a program's first gap can need one.
    starts = torch.arange(programs, dtype=torch.int64, device=device) * cfg.block
    has = counts > 0
    first_at = torch.where(has, starts, 0)
    last_at = torch.where(has, starts + counts - 1, 0)
    first = starts + (local[first_at].to(torch.int64) & 0xFFFF) if n else starts
    last = torch.where(has, starts + (local[last_at].to(torch.int64) & 0xFFFF), -1) if n \
        else starts
    seen_last = torch.cummax(last, 0).values if programs else last
    prev_last = torch.cat([last.new_full((1,), -1), seen_last[:-1]]) if programs else last
    first_gap = first - prev_last - 1
    gap16 = spec.positions == "gap16"
    escapes = first_gap[has & (first_gap >= ref.ESCAPE)] if gap16 else first_gap[:0]
    e = escapes.numel()
    if spec.planar:
        payload = None
        planes = _empty((2 + size) * count, torch.uint8, device)
        positions, values = planes[:2 * count], planes[2 * count:]
    else:
        layout = raw_layout(encoding, count, e, size)
        payload = _empty(layout["total"][1], torch.uint8, device)
        payload[sum(layout["positions"]):layout["values"][0]].zero_()      # padding
        payload[:8 * e].view(torch.int64).copy_(escapes)
        planes = None

        def section(name, dtype):
            at, length = layout[name]
            return payload[at:at + length].view(dtype)
        positions = section("positions", torch.int16 if gap16 else torch.int32)
        values = section("values", nb.dtype)
    deltas = None if old_sum is None else \
        torch.zeros((programs, 2), dtype=torch.int64, device=device)
    _triton().encode_write(nb, ob, local, counts, offsets, prev_last, positions, values, deltas,
                           count, gap16=gap16, diff=spec.diff, planar=spec.planar,
                           block=cfg.block)
    if old_sum is not None:
        s_new, s_old = (old_sum + _sums64(deltas)[0]) & ref.MASK64, old_sum
    return DeviceStreams(count, e, s_new, s_old, payload, escapes, planes)


def to_device_u8(buf, device) -> torch.Tensor:
    """A host bytes-like object (or numpy array) as a uint8 tensor on ``device``."""
    arr = np.frombuffer(buf, dtype=np.uint8) if not isinstance(buf, np.ndarray) else \
        buf.view(np.uint8).reshape(-1)
    out = torch.empty(arr.size, dtype=torch.uint8)
    out.numpy()[:] = arr
    return out.to(device)


def _decode_gap16(gaps, escapes, count, numel, planar, cfg) -> torch.Tensor:
    """Validated int64 positions from gaps (int16 view or byte planes) and int64 escapes."""
    device = gaps.device
    if count == 0:
        if escapes.numel():
            raise ValueError(f"corrupt gap16 stream: 0 gaps, {escapes.numel()} escape values")
        return torch.empty(0, dtype=torch.int64, device=device)
    programs = -(-count // cfg.apply_block)
    sums = torch.empty((programs, 2), dtype=torch.int64, device=device)
    _triton().gap_sums(gaps, sums, count, planar=planar, block=cfg.apply_block,
                       num_warps=cfg.num_warps)
    marks = sums[:, 1]
    n_marks = int(marks.sum())
    if n_marks != escapes.numel():
        raise ValueError(f"corrupt gap16 stream: {n_marks} escape markers, "
                         f"{escapes.numel()} escape values")
    if escapes.numel() and bool((escapes < ref.ESCAPE).any() | (escapes >= numel).any()):
        raise ValueError(f"corrupt gap16 stream: escape values must lie in [{ref.ESCAPE}, "
                         f"{numel})")
    esc_start = torch.cumsum(marks, 0) - marks
    esc_steps = torch.cat([escapes.new_zeros(1), torch.cumsum(escapes + 1, 0)])
    block_span = sums[:, 0] + esc_steps[esc_start + marks] - esc_steps[esc_start]
    ends = torch.cumsum(block_span, 0)
    # Every step is below numel + 1 and the sums only grow, so a wrapped (negative) partial
    # sum or one past numel marks a corrupt stream; no int64 overflow goes unseen.
    if bool((esc_steps < 0).any() | (ends < 0).any() | (ends[-1] > numel)):
        raise ValueError(f"corrupt delta packet: positions run past numel {numel}")
    positions = torch.empty(count, dtype=torch.int64, device=device)
    _triton().gap_positions(gaps, escapes, ends - block_span - 1, esc_start, positions, count,
                            planar=planar, block=cfg.apply_block, num_warps=cfg.num_warps)
    return positions


def _decode_int32(pos32: torch.Tensor, numel: int) -> torch.Tensor:
    pos = pos32.to(torch.int64)
    bad = torch.stack([(pos < 0).any() | (pos >= numel).any(),
                       (pos[1:] <= pos[:-1]).any()]).tolist()
    if bad[0]:
        raise ValueError(f"corrupt delta packet: position out of range [0, {numel})")
    if bad[1]:
        raise ValueError("corrupt delta packet: positions not strictly increasing")
    return pos


def device_streams(packet, host_streams, device):
    """(positions-or-gaps, escapes int64, values) tensors on ``device`` for ``packet``."""
    size = torch.empty(0, dtype=packet.dtype).element_size()
    c = packet.count
    if packet.encoding == "zstd":
        gaps = to_device_u8(np.concatenate([host_streams.positions, host_streams.values]),
                            device)
        escapes = to_device_u8(host_streams.escapes, device).view(torch.int64)
        return gaps[:2 * c], escapes, gaps[2 * c:]
    payload = packet.payload
    if isinstance(payload, torch.Tensor):
        payload = payload.to(device)
    else:
        payload = to_device_u8(payload, device)
    layout = raw_layout(packet.encoding, c, packet.n_escapes, size)
    if payload[sum(layout["positions"]):layout["values"][0]].any():
        raise ValueError("corrupt delta packet: nonzero padding between payload sections")

    def section(name, dtype):
        at, length = layout[name]
        return payload[at:at + length].view(dtype)
    positions = section("positions", torch.int32 if packet.encoding == "int32" else torch.int16)
    return positions, section("escapes", torch.int64), section("values", ref._INT_VIEW[size])


def apply(tb: torch.Tensor, packet, spec: ref.StreamSpec, host_streams,
          cfg: DeltaKernelConfig, write: bool = True) -> None:
    """Verify, then (``write``) apply ``packet`` to the flat signed-int view ``tb`` in place.
    ``write=False`` runs every check and only reads ``tb`` (delta.verify)."""
    numel, c = tb.numel(), packet.count
    positions, escapes, values = device_streams(packet, host_streams, tb.device)
    if spec.positions == "int32":
        pos = _decode_int32(positions, numel)
    else:
        pos = _decode_gap16(positions, escapes, c, numel, spec.planar, cfg)
    # One fused pass: the target's checksum sum and the change of it the packet makes.
    programs = -(-numel // cfg.block)
    starts = torch.arange(programs + 1, dtype=torch.int64, device=tb.device) * cfg.block
    seg = torch.searchsorted(pos, starts.clamp_(max=numel))
    partials = torch.zeros((programs, 4), dtype=torch.int64, device=tb.device)
    kwargs = dict(diff=spec.diff, planar=spec.planar, num_warps=cfg.num_warps)
    _triton().verify(tb, pos, values, seg, partials, c, block=cfg.block,
                     chunk=_triton().VERIFY_CHUNK, **kwargs)
    s_target, delta = _sums64(partials)
    n_words = numel * ref.words_per_element(tb.element_size())
    if packet.base_checksum and ref.finalize(s_target, n_words) != packet.base_checksum:
        raise ValueError("target is not the packet's base: base checksum mismatch (the packet "
                         "codes values relative to one exact base version)")
    if ref.finalize(s_target + delta, n_words) != packet.result_checksum:
        raise ValueError("delta result checksum mismatch: the target differs from the packet's "
                         "base at unchanged elements, or the packet is corrupt")
    if write:
        _triton().scatter(pos, tb, values, c, block=cfg.apply_block, **kwargs)
