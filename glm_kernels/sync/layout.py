"""Layouts of sharded weights: which box of each full parameter a rank holds, and pieces.

A *box* is a tuple of ``(start, stop)`` per dimension of the full parameter. A trainer rank
holds one box of each parameter (its shard: a DTensor ``Shard(d)`` placement or a
``slices={name: (dim, start, stop, full_shape)}`` entry); an engine rank holds another (its
tensor-parallel slice). A sharded :class:`~glm_kernels.sync.Sender` cuts its shard by every
engine *target* box it knows into *pieces* (``shard ∩ target``, cut again into chunks of at
most ``chunk_bytes``), and names each piece::

    <name>@<full shape joined by "x">[<target box>]/[<piece box>]      e.g.
    layer.0.w@300x29[150:300,0:29]/[150:200,0:29]

so that an engine rank takes exactly the pieces cut for its own target box, and checks that
they tile it (disjoint, volumes adding up) before it writes anything.
"""
from __future__ import annotations

import re
from typing import Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

import torch

Box = Tuple[Tuple[int, int], ...]
Slice = Tuple[int, int, int, Tuple[int, ...]]       # (dim, start, stop, full_shape)

_PIECE = re.compile(r"^(.+)@([0-9x]*)\[([0-9:,]*)\]/\[([0-9:,]*)\]$")
MAX_DIMS = 8


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def check_slice(what: str, spec, local_shape: Optional[Sequence[int]] = None) -> Slice:
    """Validate ``(dim, start, stop, full_shape)``; with ``local_shape``, the local tensor must
    have the slice's shape. ValueError/TypeError naming ``what`` otherwise."""
    if not isinstance(spec, (tuple, list)) or len(spec) != 4:
        raise TypeError(f"{what} must be a tuple (dim, start, stop, full_shape), got {spec!r:.80}")
    dim, start, stop, full = spec
    if not isinstance(full, (tuple, list, torch.Size)) or not all(_is_int(s) and s >= 0
                                                                  for s in full):
        raise TypeError(f"{what}: full_shape must be a tuple of ints >= 0, got {full!r:.80}")
    full = tuple(int(s) for s in full)
    if not 1 <= len(full) <= MAX_DIMS:
        raise ValueError(f"{what}: full_shape {full} must have 1 to {MAX_DIMS} dimensions")
    if not all(_is_int(v) for v in (dim, start, stop)):
        raise TypeError(f"{what}: dim, start and stop must be ints, got {spec!r:.80}")
    if not 0 <= dim < len(full) or not 0 <= start <= stop <= full[dim]:
        raise ValueError(f"{what}: slice [{start}, {stop}) of dim {dim} is outside full_shape "
                         f"{full}")
    if local_shape is not None:
        want = full[:dim] + (stop - start,) + full[dim + 1:]
        if tuple(local_shape) != want:
            raise ValueError(f"{what}: the local tensor has shape {tuple(local_shape)}, the "
                             f"slice {tuple(spec[:3])} of {full} has shape {want}")
    return int(dim), int(start), int(stop), full


def slice_box(spec: Slice) -> Box:
    dim, start, stop, full = spec
    return tuple((start, stop) if d == dim else (0, n) for d, n in enumerate(full))


def whole_box(shape: Sequence[int]) -> Box:
    return tuple((0, int(n)) for n in shape)


def box_shape(box: Box) -> Tuple[int, ...]:
    return tuple(b - a for a, b in box)


def volume(box: Box) -> int:
    n = 1
    for a, b in box:
        n *= b - a
    return n


def intersect(a: Box, b: Box) -> Optional[Box]:
    """The common box, or None when it is empty."""
    out = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b))
    return out if all(lo < hi for lo, hi in out) else None


def contains(outer: Box, inner: Box) -> bool:
    return all(o0 <= i0 and i1 <= o1 for (o0, o1), (i0, i1) in zip(outer, inner))


def local_index(holder: Box, box: Box) -> tuple:
    """Index of ``box`` inside a tensor that holds ``holder`` (box ⊆ holder)."""
    return tuple(slice(a - h0, b - h0) for (h0, _), (a, b) in zip(holder, box))


def chunks(box: Box, element_size: int, chunk_bytes: int) -> Iterator[Box]:
    """``box`` cut along its leading dimensions into boxes of at most ``chunk_bytes`` (a box
    whose innermost row alone is larger is cut along that row too)."""
    if volume(box) * element_size <= chunk_bytes or not box:
        yield box
        return
    inner = volume(box[1:]) * element_size
    (a, b) = box[0]
    if inner <= chunk_bytes:
        step = max(1, chunk_bytes // max(inner, 1))
        for s in range(a, b, step):
            yield ((s, min(b, s + step)),) + box[1:]
        return
    for s in range(a, b):
        for sub in chunks(box[1:], element_size, chunk_bytes):
            yield ((s, s + 1),) + sub


def _fmt(box: Box) -> str:
    return ",".join(f"{a}:{b}" for a, b in box)


def piece_name(name: str, full: Sequence[int], target: Box, box: Box) -> str:
    return f"{name}@{'x'.join(map(str, full))}[{_fmt(target)}]/[{_fmt(box)}]"


def target_prefix(name: str, full: Sequence[int], target: Box) -> str:
    """What every piece cut for ``target`` starts with."""
    return f"{name}@{'x'.join(map(str, full))}[{_fmt(target)}]/"


def _parse_box(text: str, ndim: int) -> Optional[Box]:
    if ndim == 0:
        return () if text == "" else None
    parts = text.split(",")
    if len(parts) != ndim:
        return None
    out = []
    for p in parts:
        lo, sep, hi = p.partition(":")
        if not sep or not lo.isdigit() or not hi.isdigit() or len(lo) > 19 or len(hi) > 19:
            return None
        out.append((int(lo), int(hi)))
    return tuple(out)


def parse_piece(entry_name: str):
    """(name, full shape, target box, piece box) of a piece name, or None for a plain name
    (or a malformed piece name: the receiver then refuses it as an unknown name)."""
    m = _PIECE.match(entry_name) if len(entry_name) < 4096 else None
    if m is None:
        return None
    name, full_text, target_text, box_text = m.groups()
    dims = full_text.split("x") if full_text else []
    if len(dims) > MAX_DIMS or not all(d.isdigit() and len(d) <= 19 for d in dims):
        return None
    full = tuple(int(d) for d in dims)
    target, box = _parse_box(target_text, len(full)), _parse_box(box_text, len(full))
    if target is None or box is None:
        return None
    if not all(0 <= a <= b <= n for (a, b), n in zip(target, full)) or not contains(target, box):
        return None
    return name, full, target, box


def dtensor_slice(what: str, t) -> Tuple[torch.Tensor, Optional[Slice]]:
    """(local tensor, slice) of a DTensor on a 1-D mesh: Shard(d) gives the slice of this
    rank, Replicate gives None (a whole tensor). Other placements raise ValueError."""
    try:
        from torch.distributed.tensor import Replicate, Shard
    except ImportError:
        raise TypeError(f"{what}: publishing DTensors needs torch >= 2.5 (public "
                        f"torch.distributed.tensor); on torch {torch.__version__} give "
                        "the local shard with slices= instead") from None
    placements = t.placements
    if len(placements) != 1:
        raise ValueError(f"{what}: a DTensor on a {len(placements)}-D mesh; give its local "
                         f"shard with slices= instead")
    local = t.to_local()
    p = placements[0]
    if isinstance(p, Replicate):
        return local, None
    if not isinstance(p, Shard):
        raise ValueError(f"{what}: placement {p} is neither Shard nor Replicate")
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, placements)
    dim = p.dim % t.dim()
    return local, check_slice(what, (dim, int(offset[dim]), int(offset[dim]) + int(shape[dim]),
                                     tuple(t.shape)), local.shape)


def targets_of(params: Mapping[str, torch.Tensor],
               slices: Optional[Mapping[str, Slice]]) -> Dict[str, Tuple[Tuple[int, ...], Box]]:
    """{name: (full shape, target box)} of a receiver's tensors (absent slice: whole)."""
    out = {}
    for name, t in params.items():
        spec = (slices or {}).get(name)
        if spec is None:
            out[name] = (tuple(t.shape), whole_box(t.shape))
        else:
            out[name] = (spec[3], slice_box(spec))
    return out


def tiles(target: Box, boxes: List[Box]) -> bool:
    """The boxes lie inside ``target``, are pairwise disjoint and cover it."""
    if not all(contains(target, b) for b in boxes):
        return False
    if sum(volume(b) for b in boxes) != volume(target):
        return False
    return all(intersect(boxes[i], boxes[j]) is None
               for i in range(len(boxes)) for j in range(i + 1, len(boxes)))
