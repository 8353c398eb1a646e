"""MuonSplit on row-sharded parameters (FSDP2 / DTensor ``Shard(0)``): local heads, owner-compute.

A Muon group whose parameters are DTensors sharded by rows (``fully_shard``: ``Shard(0)`` on a
1-D mesh, torch.chunk sizes, uneven shards and empty ranks allowed) or replicated is stepped on
the local shards with explicit collectives, never through DTensor's implicit redistribution.
On a 2-D mesh (HSDP: ``Replicate()`` on one dim, ``Shard(0)`` on the other) the shard dim is
the world below: each replica group runs the same plan within its shard group, on gradients
FSDP has already averaged over the replicas, so the replicas stay identical.
Every rank builds the same plan from shapes alone (no communication), once per group shape:

* **local heads** -- a head of a head-split matrix whose rows all lie in one rank's shard is
  orthogonalized by that rank, in its batched call: zero bytes (64 heads over 8 ranks: all of
  them). Replicated parameters (``Replicate()``, plain tensors) are computed locally too.
* **local experts** -- a 3-D parameter is a stack of expert matrices [E, rows, cols]
  (transformers' ``gate_up_proj`` / ``down_proj``); ``Shard(0)`` hands every rank whole
  experts, which it orthogonalizes itself: zero bytes.
* **owner-compute** -- a head straddling a shard boundary, or a whole plain Muon matrix, gets
  ONE owner rank: greedy longest-first on Newton-Schulz FLOPs (4 m^2 n + 2 m^3 per step and
  block, m <= n) after the local work; a straddling head's owner is one of the ranks holding
  part of it, ties go to the rank holding most rows. The other holders' rows of the momentum
  update U go to owners in ONE ``all_to_all_single`` per group (bytes, so any dtype mix rides
  in one buffer); owners run NS in the same batched call as their local heads; the rows of O go
  back in a second one. Each matrix moves once in, once out: (M - M_owner) bytes each way,
  at most 2 (W-1)/W M for a W-way even shard, where gathering it on every rank moves (W-1) M.

Bitwise equality with one process (same device, same thread count): the elementwise steps
(momentum, decay, p - lr * scale * O) round once per element (Nesterov in fp32,
``momentum.py``), so shards compute them as the whole tensor does, bf16 included; NS is per
block, and torch's CPU path computes each block of a batch of two or more with its own
single-threaded gemm -- but a batch of ONE goes to a threaded gemm (other bits with 2+
threads), so a lone head is paired with a copy of itself where one process batches heads.
On the Triton path each block is computed by its own programs; the row tile of the left
products is pinned to the one-process choice (it depends on the batch): bitwise under the
interpreter (tested), expected on GPU (not measured there).
"""
import functools
import math
import sys
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Dict, List, Optional, Tuple

import torch

from .. import _dispatch
from .coefficients import resolve_coefficients
from .momentum import momentum_update
from .ns import _LARGE_M, _PAD, NSConfig, head_block_views, orthogonalize
from .split import HeadSplit


# --------------------------------------------------------------------------- torch versions
@functools.lru_cache(maxsize=None)
def dtensor_api() -> SimpleNamespace:
    """DTensor, Shard, Replicate, distribute_tensor, init_device_mesh, fully_shard (None if absent).

    DTensor is public as ``torch.distributed.tensor`` from torch 2.5 (``_tensor`` in 2.4);
    ``fully_shard`` is ``torch.distributed.fsdp.fully_shard`` from 2.6 and
    ``torch.distributed._composable.fsdp.fully_shard`` before.
    """
    api = dict(DTensor=None, Shard=None, Replicate=None, distribute_tensor=None,
               init_device_mesh=None, fully_shard=None)
    if not torch.distributed.is_available():
        return SimpleNamespace(**api)
    try:
        from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
    except ImportError:
        from torch.distributed._tensor import DTensor, Replicate, Shard, distribute_tensor
    from torch.distributed.device_mesh import init_device_mesh
    api.update(DTensor=DTensor, Shard=Shard, Replicate=Replicate,
               distribute_tensor=distribute_tensor, init_device_mesh=init_device_mesh)
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:
        try:
            from torch.distributed._composable.fsdp import fully_shard
        except ImportError:
            fully_shard = None
    api["fully_shard"] = fully_shard
    return SimpleNamespace(**api)


def is_dtensor(t) -> bool:
    # No DTensor module imported means no DTensor exists: plain users never import it.
    if not any(m in sys.modules for m in ("torch.distributed.tensor",
                                          "torch.distributed._tensor")):
        return False
    return isinstance(t, dtensor_api().DTensor)


def local(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (shares storage: in-place ops update the DTensor)."""
    return t.to_local() if is_dtensor(t) else t


# --------------------------------------------------------------------------- layouts
def chunk_ranges(rows: int, world: int) -> Tuple[Tuple[int, int], ...]:
    """Rows [start, stop) of each rank under Shard(0) / FSDP2 / torch.chunk: ceil(rows / world)
    per rank, the last ranks fewer or none.

    >>> chunk_ranges(10, 4)
    ((0, 3), (3, 6), (6, 9), (9, 10))
    >>> chunk_ranges(2, 3)
    ((0, 1), (1, 2), (2, 2))
    """
    size = -(-rows // world)
    return tuple((min(r * size, rows), min((r + 1) * size, rows)) for r in range(world))


@dataclass(frozen=True)
class RowLayout:
    """A parameter seen as [rows, cols] (cols = prod(shape[1:])); ranges[r]: rows rank r of the
    shard group holds (empty until the group's world is known, for a replicated parameter)."""
    rows: int
    cols: int
    ranges: Tuple[Tuple[int, int], ...]
    mesh: object          # DeviceMesh of a DTensor, None for a plain tensor
    shard_dim: Optional[int] = None     # the mesh dim holding Shard(0); None: replicated


def row_layout(p: torch.Tensor, where: str) -> RowLayout:
    rows, cols = p.shape[0], math.prod(p.shape[1:])
    if not is_dtensor(p):
        return RowLayout(rows, cols, (), None)
    api, mesh, placements = dtensor_api(), p.device_mesh, tuple(p.placements)
    shard_dims = []
    for dim, placement in enumerate(placements):
        if type(placement) is api.Shard and placement.dim in (0, -p.dim()):
            shard_dims.append(dim)
        elif not isinstance(placement, api.Replicate):
            raise ValueError(f"{where}: MuonSplit takes DTensors with placements Shard(0) or "
                             f"Replicate(), got {placements}")
    if len(shard_dims) > 1:
        raise ValueError(f"{where}: MuonSplit takes rows sharded over one mesh dim (FSDP2, or "
                         f"HSDP on a 2-D mesh), got placements {placements}")
    if not shard_dims:
        return RowLayout(rows, cols, (), mesh)
    dim = shard_dims[0]
    ranges = chunk_ranges(rows, mesh.size(dim))
    start, stop = ranges[mesh.get_local_rank(dim)]
    shard = p.to_local()
    if tuple(shard.shape) != (stop - start, *p.shape[1:]):
        raise ValueError(f"{where}: local shard has shape {tuple(shard.shape)}, expected "
                         f"{(stop - start, *p.shape[1:])} (rows {start}:{stop} of "
                         f"{tuple(p.shape)} by torch.chunk sizes)")
    return RowLayout(rows, cols, ranges, mesh, dim)


# --------------------------------------------------------------------------- the plan
def ns_flops(rows: int, cols: int, steps: int) -> int:
    """FLOPs of `steps` standard NS steps on one rows x cols block: 4 m^2 n + 2 m^3 each."""
    m, n = sorted((rows, cols))
    return steps * (4 * m * m * n + 2 * m ** 3)


@dataclass(frozen=True)
class Item:
    """Rows [start, stop) of parameter ``index`` (a whole matrix or one head), orthogonalized
    by ``owner``. ``parts``: rows of each NS block in order; ``pieces``: (rank, start, stop)
    rows held by the other ranks, which move to the owner and back."""
    index: int
    start: int
    stop: int
    parts: Tuple[int, ...]
    owner: int
    pieces: Tuple[Tuple[int, int, int], ...]


@dataclass(frozen=True)
class GroupPlan:
    """``local[i]``: units (heads, or 0 = the whole matrix) [u0, u1) of parameter i that this
    rank computes from its own rows; ``items``: owner-compute work in parameter order;
    ``loads``: NS FLOPs per rank; ``heads[i]``: units of parameter i in one process."""
    local: Tuple[Tuple[int, int], ...]
    items: Tuple[Item, ...]
    loads: Tuple[int, ...]
    heads: Tuple[int, ...]

    @property
    def moves(self) -> bool:
        return any(item.pieces for item in self.items)


def _units(rows: int, split: Optional[HeadSplit]) -> Tuple[int, Tuple[int, ...]]:
    """(units, rows of each block of a unit): heads of a head-split matrix, else the matrix."""
    if split is None:
        return 1, (rows,)
    local_split = split.for_rows(rows)
    return local_split.num_heads, local_split.block_rows


@functools.lru_cache(maxsize=256)
def plan_group(matrices: Tuple[Tuple[int, int, Tuple[Tuple[int, int], ...]], ...],
               split: Optional[HeadSplit], steps: int, rank: int, world: int) -> GroupPlan:
    """The plan of one Muon group: ``matrices`` = (rows, cols, ranges) per parameter.

    GLM-5 q_b (64 heads of [192, 64] rows, 2048 columns) over 8 ranks: each rank's 8 heads
    are local, nothing moves. Over 6 ranks, the heads cut by a shard boundary get an owner:

    >>> q_b = HeadSplit(64, [192, 64])
    >>> plan = plan_group(((16384, 2048, chunk_ranges(16384, 8)),), q_b, 5, rank=3, world=8)
    >>> plan.local, plan.items, plan.moves
    (((24, 32),), (), False)
    >>> plan = plan_group(((16384, 2048, chunk_ranges(16384, 6)),), q_b, 5, rank=0, world=6)
    >>> [(item.start // 256, item.owner, item.pieces) for item in plan.items][:2]
    [(10, 0, ((1, 2731, 2816),)), (21, 2, ((1, 5376, 5462),))]
    """
    loads = [0] * world
    local, pending, heads = [], [], []
    for index, (rows, cols, ranges) in enumerate(matrices):
        count, parts = _units(rows, split)
        unit_rows = sum(parts)
        cost = sum(ns_flops(r, cols, max(steps, 1)) for r in parts)
        mine = []
        for unit in range(count):
            start, stop = unit * unit_rows, (unit + 1) * unit_rows
            held = [(r, max(start, a), min(stop, b)) for r, (a, b) in enumerate(ranges)
                    if min(stop, b) > max(start, a)]
            whole = [r for r, a, b in held if (a, b) == (start, stop)]
            for r in whole:
                loads[r] += cost
            if rank in whole:
                mine.append(unit)
            elif not whole:
                pending.append((cost, index, start, stop, parts, held))
        # complete heads inside a row range are contiguous
        local.append((mine[0], mine[-1] + 1) if mine else (0, 0))
        heads.append(count)
    items = []
    for cost, index, start, stop, parts, held in sorted(pending, key=lambda u: (-u[0], u[1],
                                                                                 u[2])):
        rows_held = {r: b - a for r, a, b in held}
        candidates = sorted(rows_held) if split is not None else range(world)
        owner = min(candidates, key=lambda r: (loads[r], -rows_held.get(r, 0), r))
        loads[owner] += cost
        items.append(Item(index, start, stop, parts, owner,
                          tuple(piece for piece in held if piece[0] != owner)))
    items.sort(key=lambda item: (item.index, item.start))
    return GroupPlan(tuple(local), tuple(items), tuple(loads), tuple(heads))


def _segments(item: Item, start: int, stop: int):
    """(part, first row, last row + 1 within that part's block) of item rows [start, stop)."""
    offset = item.start
    for part, rows in enumerate(item.parts):
        lo, hi = max(start, offset), min(stop, offset + rows)
        if hi > lo:
            yield part, lo - offset, hi - offset
        offset += rows


# --------------------------------------------------------------------------- the step
def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


def _exchange(send: List[List[torch.Tensor]], recv_sizes: List[int], group, device,
              stats: dict) -> torch.Tensor:
    """One all_to_all_single of byte buffers: send[r] goes to rank r; returns what arrived,
    rank by rank. Every rank calls it (or none: the plan says whether anything moves)."""
    import torch.distributed as dist
    parts = [t for chunks in send for t in chunks]
    inp = torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8, device=device)
    out = torch.empty(sum(recv_sizes), dtype=torch.uint8, device=device)
    send_sizes = [sum(t.numel() for t in chunks) for chunks in send]
    dist.all_to_all_single(out, inp, recv_sizes, send_sizes, group=group)
    rank = dist.get_rank(group)
    stats["bytes_sent"] += sum(send_sizes) - send_sizes[rank]
    stats["bytes_received"] += sum(recv_sizes) - recv_sizes[rank]
    stats["collectives"] += 1
    return out


def _result_dtype(backend: str, method: str) -> torch.dtype:
    """Dtype of orthogonalize's results: fp32 on the torch path, the operand dtype on Triton."""
    if backend == "torch":
        return torch.float32
    return torch.float16 if method == "gram" else torch.bfloat16


def _run_ns(sources, reference_ms, schedule, method, backend) -> List[torch.Tensor]:
    """orthogonalize, with the Triton row tile pinned per size class to what one process picks
    for the whole group (the heuristic reads the batch's smallest block)."""
    if backend != "triton":
        return orthogonalize(sources, schedule, method=method, eps=1e-7, config=NSConfig(),
                             backend=backend)
    results: List[Optional[torch.Tensor]] = [None] * len(sources)
    for large in (False, True):
        members = [i for i, s in enumerate(sources) if (min(s.shape[-2:]) > _LARGE_M) == large]
        if not members:
            continue
        smallest = min(-(-m // _PAD) * _PAD for m in reference_ms if (m > _LARGE_M) == large)
        config = NSConfig(block_m=128 if smallest >= 128 else 64)
        outs = orthogonalize([sources[i] for i in members], schedule, method=method, eps=1e-7,
                             config=config, backend=backend)
        for i, out in zip(members, outs):
            results[i] = out
    return results


def sharded_muon_step(group: dict, params: List[torch.Tensor], state, stats: dict) -> None:
    """One Muon step of ``group`` over ``params`` (those with gradients), some of them DTensors.

    Same arithmetic as ``MuonSplit._muon_step`` on the local rows; see the module docstring
    for who computes what. ``stats`` accumulates bytes sent / received and collectives.
    """
    import torch.distributed as dist
    split = group["head_split"]
    names = dict(zip(map(id, group["params"]), group.get("param_names", ())))
    layouts = [row_layout(p, f"parameter {names.get(id(p), i)!r} of a Muon group")
               for i, p in enumerate(params)]
    meshes = {id(l.mesh): l.mesh for l in layouts if l.mesh is not None}
    if len(meshes) != 1:
        raise ValueError(f"a Muon group's DTensor parameters must share one device mesh, got "
                         f"{len(meshes)}: put parameters of different meshes in different "
                         "param groups")
    mesh = next(iter(meshes.values()))
    shard_dims = {l.shard_dim for l in layouts if l.shard_dim is not None}
    if len(shard_dims) > 1:
        raise ValueError(f"a Muon group's DTensor parameters must be sharded over one mesh dim, "
                         f"got dims {sorted(shard_dims)}: put them in different param groups")
    # Only replicated parameters: any dim's group will do (every item is computed locally).
    dim = shard_dims.pop() if shard_dims else 0
    pg, rank, world = mesh.get_group(dim), mesh.get_local_rank(dim), mesh.size(dim)
    if dist.get_rank(pg) != rank:
        raise ValueError(f"device mesh coordinate {rank} differs from the rank in its process "
                         f"group {dist.get_rank(pg)}")
    layouts = [l if l.ranges else RowLayout(l.rows, l.cols, ((0, l.rows),) * world, l.mesh)
               for l in layouts]
    # A 3-D parameter is a stack of expert matrices and Shard(0) hands out whole experts: each
    # rank orthogonalizes its own, nothing moves. The plan covers the 2-D matrices.
    experts = [(p, l) for p, l in zip(params, layouts) if p.dim() == 3]
    layouts = [l for p, l in zip(params, layouts) if p.dim() != 3]
    params = [p for p in params if p.dim() != 3]
    plan = plan_group(tuple((l.rows, l.cols, l.ranges) for l in layouts), split,
                      group["ns_steps"], rank, world)
    schedule = resolve_coefficients(group["ns_coefficients"], group["ns_steps"])
    lr, method = group["lr"], group["ns_method"]
    first_rows = [l.ranges[rank][0] for l in layouts]

    # 1. momentum and the update, on local rows (elementwise: as on the whole tensor)
    updates = []
    for p, l in zip(params, layouts):
        update = _momentum(p, state, group)
        updates.append(update.reshape(update.shape[0], l.cols))
    stack_updates = [_momentum(p, state, group) for p, _ in experts]
    first = (updates + stack_updates)[0]
    device = first.device
    backend = _dispatch.select_backend("muon_split", first)

    # 2. rows of U to their owners
    owned: Dict[int, torch.Tensor] = {}
    if plan.moves:
        send: List[List[torch.Tensor]] = [[] for _ in range(world)]
        recv_sizes = [0] * world
        for item in plan.items:
            for r, a, b in item.pieces:
                nbytes = (b - a) * layouts[item.index].cols * updates[item.index].element_size()
                if r == rank:
                    lo = first_rows[item.index]
                    send[item.owner].append(_bytes(updates[item.index][a - lo:b - lo]))
                if item.owner == rank:
                    recv_sizes[r] += nbytes
        arrived = _exchange(send, recv_sizes, pg, device, stats)
        offsets = [sum(recv_sizes[:r]) for r in range(world)]
    for item in plan.items:
        if item.owner != rank:
            continue
        u = updates[item.index]
        full = torch.empty(item.stop - item.start, u.shape[1], dtype=u.dtype, device=device)
        a, b = layouts[item.index].ranges[rank]
        lo, hi = max(a, item.start), min(b, item.stop)
        if hi > lo:
            full[lo - item.start:hi - item.start] = u[lo - a:hi - a]
        for r, a, b in item.pieces:
            nbytes = (b - a) * full.shape[1] * full.element_size()
            _bytes_view(full[a - item.start:b - item.start]).copy_(
                arrived[offsets[r]:offsets[r] + nbytes])
            offsets[r] += nbytes
        owned[id(item)] = full

    # 3. NS sources: local heads (or matrices), then owned items; a lone head is doubled
    sources, reference_ms, uses = [], [], []
    for i, (u0, u1) in enumerate(plan.local):
        if u1 > u0:
            unit_rows = layouts[i].rows // plan.heads[i]
            lo = u0 * unit_rows - first_rows[i]
            rows = updates[i][lo:lo + (u1 - u0) * unit_rows]
            views = (head_block_views(rows, u1 - u0, _units(layouts[i].rows, split)[1])
                     if split is not None else [rows[None]])
            for part, view in enumerate(views):
                uses.append(("local", i, part, len(sources), u0, u1))
                sources.append(torch.cat([view, view]) if view.shape[0] < min(2, plan.heads[i])
                               else view)
    stacks: Dict[tuple, List[Tuple[Item, torch.Tensor]]] = {}
    for item in plan.items:
        if item.owner == rank:
            full, offset = owned[id(item)], 0
            for part, rows in enumerate(item.parts):
                # heads of one shape batch together; whole matrices stay batches of one
                key = (part, full.shape[1], full.dtype) if split is not None else (part, id(item))
                stacks.setdefault(key, []).append((item, full[offset:offset + rows]))
                offset += rows
    for key, members in stacks.items():
        blocks = torch.stack([block for _, block in members])
        lone = blocks.shape[0] == 1 and plan.heads[members[0][0].index] > 1
        uses.append(("owned", key, members, len(sources)))
        sources.append(torch.cat([blocks, blocks]) if lone else blocks)
    for j, ((p, _), update) in enumerate(zip(experts, stack_updates)):
        if update.shape[0]:     # a lone local expert is paired with itself, as a lone head
            uses.append(("stack", j, len(sources)))
            sources.append(torch.cat([update, update]) if update.shape[0] < min(2, p.shape[0])
                           else update)
    for l in layouts:           # the blocks one process would batch (Triton tile choice)
        reference_ms += [min(r, l.cols) for r in _units(l.rows, split)[1]]
    reference_ms += [min(p.shape[-2:]) for p, _ in experts]
    results = _run_ns(sources, reference_ms, schedule, method, backend) if sources else []
    out_dtype = _result_dtype(backend, method)
    for result in results:
        if result.dtype != out_dtype:
            raise RuntimeError(f"orthogonalize returned {result.dtype}, expected {out_dtype}")

    # 4. p <- p (1 - lr wd) - lr * rms_scale * sqrt(max(block rows, cols)) * O
    decay = 1.0 - lr * group["weight_decay"]
    works = []
    for p, l in zip(params, layouts):
        shard = local(p)
        matrix = shard.view(shard.shape[0], l.cols) if shard.is_contiguous() else None
        work = matrix if matrix is not None else shard.reshape(shard.shape[0], l.cols).clone()
        works.append(work.mul_(decay))

    def alpha(part_rows: int, cols: int) -> float:
        return -lr * group["rms_scale"] * math.sqrt(max(part_rows, cols))

    item_results: Dict[int, List[torch.Tensor]] = {}
    for use in uses:
        if use[0] == "stack":
            p, position = experts[use[1]][0], use[2]
            shard = local(p)
            work = shard if shard.is_contiguous() else shard.clone()
            work.mul_(decay).add_(results[position][:shard.shape[0]],
                                  alpha=alpha(*p.shape[-2:]))
            if work is not shard:
                shard.copy_(work)
        elif use[0] == "local":
            _, i, part, position, u0, u1 = use
            unit_rows = layouts[i].rows // plan.heads[i]
            lo = u0 * unit_rows - first_rows[i]
            rows = works[i][lo:lo + (u1 - u0) * unit_rows]
            target = (head_block_views(rows, u1 - u0, _units(layouts[i].rows, split)[1])[part]
                      if split is not None else rows[None])
            target.add_(results[position][:u1 - u0],
                        alpha=alpha(target.shape[-2], layouts[i].cols))
        else:
            _, (part, *_), members, position = use
            for k, (item, _) in enumerate(members):
                item_results.setdefault(id(item), [None] * len(item.parts))[part] = \
                    results[position][k]
    send = [[] for _ in range(world)]
    recv_sizes = [0] * world
    out_size = torch.empty((), dtype=out_dtype).element_size()
    for item in plan.items:
        cols = layouts[item.index].cols
        if item.owner == rank:
            blocks = item_results[id(item)]
            a, b = layouts[item.index].ranges[rank]
            for part, lo, hi in _segments(item, a, b):
                row = item.start + sum(item.parts[:part]) + lo - a
                works[item.index][row:row + hi - lo].add_(
                    blocks[part][lo:hi], alpha=alpha(item.parts[part], cols))
            for r, a, b in item.pieces:
                send[r] += [_bytes(blocks[part][lo:hi]) for part, lo, hi in _segments(item, a, b)]
        for r, a, b in item.pieces:
            if r == rank:
                recv_sizes[item.owner] += (b - a) * cols * out_size

    # 5. rows of O back to their holders
    if plan.moves:
        arrived = _exchange(send, recv_sizes, pg, device, stats)
        offsets = [sum(recv_sizes[:r]) for r in range(world)]
        for item in plan.items:
            cols = layouts[item.index].cols
            for r, a, b in item.pieces:
                if r != rank:
                    continue
                for part, lo, hi in _segments(item, a, b):
                    nbytes = (hi - lo) * cols * out_size
                    block = torch.empty(hi - lo, cols, dtype=out_dtype, device=device)
                    _bytes_view(block).copy_(arrived[offsets[item.owner]:
                                                     offsets[item.owner] + nbytes])
                    offsets[item.owner] += nbytes
                    row = item.start + sum(item.parts[:part]) + lo - first_rows[item.index]
                    works[item.index][row:row + hi - lo].add_(
                        block, alpha=alpha(item.parts[part], cols))
    for p, work in zip(params, works):
        shard = local(p)
        if not shard.is_contiguous():
            shard.copy_(work.view_as(shard))


def _momentum(p: torch.Tensor, state, group: dict) -> torch.Tensor:
    """The momentum update of ``p``'s local shard (its buffer created on first use)."""
    if p.grad.is_sparse:
        raise RuntimeError("MuonSplit does not support sparse gradients")
    st = state[p]
    if "momentum_buffer" not in st:
        st["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    return momentum_update(local(st["momentum_buffer"]), local(p.grad), group["momentum"],
                           group["nesterov"])


def _bytes_view(t: torch.Tensor) -> torch.Tensor:
    """A writable byte view of a contiguous tensor."""
    return t.view(-1).view(torch.uint8)


# --------------------------------------------------------------------------- checkpoints
def shard_like(full: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """This rank's rows of an unsharded state tensor ``full`` as a DTensor laid out like the
    DTensor parameter ``p`` (no communication: every rank holds ``full``)."""
    layout = row_layout(p, "parameter")
    start, stop = (layout.ranges[p.device_mesh.get_local_rank(layout.shard_dim)]
                   if layout.ranges else (0, layout.rows))
    shard = local(p)
    # a copy: torch's load_state_dict keeps the caller's tensors, and slices would alias them
    piece = full[start:stop].to(device=shard.device, copy=True).contiguous()
    return dtensor_api().DTensor.from_local(piece, p.device_mesh, p.placements,
                                            run_check=False, shape=p.shape, stride=p.stride())


def full_state_dict(state_dict: dict) -> dict:
    """An optimizer state_dict with every DTensor gathered to a full tensor (a collective: call
    it on every rank), loadable by an unsharded MuonSplit; the inverse of what
    ``MuonSplit.load_state_dict`` does with a full checkpoint on sharded parameters."""
    def full(value):
        return value.full_tensor() if is_dtensor(value) else value
    return {**state_dict, "state": {key: {name: full(value) for name, value in entry.items()}
                                    for key, entry in state_dict["state"].items()}}
